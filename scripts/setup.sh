#!/usr/bin/env bash
# Installs what graphshard needs, idempotently: torch (>= 2.11; 2.13.0 CPU build here),
# graphshard itself (editable), the test tools (pytest, expecttest, transformers) and, on torch 2.13
# CPU builds, TorchRec with fbgemm's CPU build (optional). Safe to run on every invocation.
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
# TorchRec, optional (the sparse frontend, graphshard.model_parallel): on torch 2.13 CPU builds,
# fbgemm-gpu-cpu 1.8.0 (the fbgemm build that loads with it) and torchrec 1.9.2 installed without
# pip's resolver (torchrec requires the CUDA fbgemm-gpu), then what torchrec imports.
if "$PY" - <<'NEEDS_TORCHREC' 2>/dev/null; then
import importlib.metadata as m, sys
want = {"torchrec": "1.9.2", "fbgemm-gpu-cpu": "1.8.0", "tensordict": "0.15.3", "torchmetrics": "1.0.3",
        "pyre-extensions": "0.0.32"}
def version(p):
    try:
        return m.version(p)
    except m.PackageNotFoundError:
        return None
torch = version("torch") or ""
sys.exit(not (torch.startswith("2.13.") and "+cpu" in torch and any(version(p) != v for p, v in want.items())))
NEEDS_TORCHREC
  echo "setup: installing torchrec==1.9.2 and fbgemm-gpu-cpu==1.8.0 (optional, CPU)" >&2
  "$PY" -m pip install -q --no-deps "fbgemm-gpu-cpu==1.8.0" "torchrec==1.9.2"
  "$PY" -m pip install -q "tensordict==0.15.3" "torchmetrics==1.0.3" "pyre-extensions==0.0.32"
fi
# Triton, optional (graphshard's own TBE kernels, kernels/triton_tbe.py; on CPU they run under
# TRITON_INTERPRET=1): 3.6, the version the GPU machine has preinstalled (a local build such as
# 3.6.0+git... counts). Optional, so a failed install (no registry) is reported, not fatal.
"$PY" -c 'import triton, sys; sys.exit(triton.__version__.split("+")[0].split(".")[:2] != ["3", "6"])' 2>/dev/null || {
  echo "setup: installing triton==3.6.0 (optional)" >&2
  "$PY" -m pip install -q "triton==3.6.0" || echo "setup: could not install triton==3.6.0; the Triton TBE tests will be skipped" >&2
}
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
