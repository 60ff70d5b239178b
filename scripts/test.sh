#!/usr/bin/env bash
# The test suite: set up, then run every test (golden graphs on a fake process
# group, API tests, and multi-rank numerics under torchrun with gloo).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
PY=${PYTHON:-python3}
# setup.sh skips the test tools where no package index is reachable (one "setup: skipped" line): say
# so here too rather than fail on an import error.
"$PY" -c 'import pytest, expecttest' 2>/dev/null || {
  echo "test: the suite needs pytest and expecttest, which $PY's environment lacks (see setup's line above);" \
    "install them (pip install 'pytest>=8' 'expecttest>=0.2') and run again" >&2
  exit 1
}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
exec "$PY" -m pytest tests -q --durations=15 "$@"   # the 15 slowest: where CI time goes
