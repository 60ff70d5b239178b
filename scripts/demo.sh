#!/usr/bin/env bash
# The demo: set up, then train the small transformer with graphshard FULL_SHARD on
# NPROC ranks (default 2; gloo on the CPU, NCCL where GPUs are present).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
PY=${PYTHON:-python3}
NPROC=${NPROC:-$("$PY" -c 'import torch; print(torch.cuda.device_count() or 2)')}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
exec "$PY" -m torch.distributed.run --nproc-per-node "$NPROC" examples/train_transformer.py "$@"
