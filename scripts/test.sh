#!/usr/bin/env bash
# The test suite: set up, then run every test (golden graphs on a fake process
# group, API tests, and multi-rank numerics under torchrun with gloo).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
PY=${PYTHON:-python3}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
exec "$PY" -m pytest tests -q "$@"
