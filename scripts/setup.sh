#!/usr/bin/env bash
# Installs what graphshard needs, idempotently: torch (>= 2.11; 2.13.0 CPU build here),
# graphshard itself (editable) and the test tools (pytest, expecttest, transformers). Safe to run on every invocation.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! "$PY" -c 'import sys, torch; v = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]); sys.exit(v < (2, 11))' 2>/dev/null; then
  echo "setup: installing torch==2.13.0" >&2
  "$PY" -m pip install -q "torch==2.13.0"
fi
"$PY" -c 'import expecttest, pytest' 2>/dev/null || "$PY" -m pip install -q "expecttest>=0.2" "pytest>=8"
# The model-coverage suite builds HF transformers architectures from tiny configs (no downloads).
"$PY" -c 'import transformers, sys; sys.exit(transformers.__version__ != "5.24.0")' 2>/dev/null \
  || "$PY" -m pip install -q "transformers==5.24.0"
# (Re)install unless graphshard is already importable from THIS checkout with its backend entry point.
if ! "$PY" - "$PWD" <<'CHECK' 2>/dev/null; then
import os, sys, importlib.metadata as m
import graphshard, graphshard.passes
here = os.path.realpath(sys.argv[1])
assert os.path.realpath(os.path.dirname(graphshard.__file__)) == os.path.join(here, "graphshard")
assert os.path.realpath(os.path.dirname(graphshard.passes.__file__)) == os.path.join(here, "passes")
assert any(e.name == "graphshard" for e in m.entry_points(group="torch_dynamo_backends"))
CHECK
  echo "setup: installing graphshard (editable)" >&2
  "$PY" -m pip install -q --no-deps --no-build-isolation -e . 2>/dev/null || "$PY" -m pip install -q --no-deps -e .
fi
