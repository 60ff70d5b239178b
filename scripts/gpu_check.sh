#!/usr/bin/env bash
# The project's one prepared GPU check (issue 27): about 8 minutes on one H100/H200, no package
# registry needed, report in OUTDIR/gpu_check.md and OUTDIR/gpu_check.json (+ gpu_check.log).
#
#   bash scripts/gpu_check.sh OUTDIR                  # on the GPU machine (says so and exits 0 elsewhere)
#   bash scripts/gpu_check.sh --cpu-dry-run OUTDIR    # every section on the CPU, tiny sizes, figures meaningless
#   bash scripts/gpu_check.sh --budget 600 --sections tbe,llama OUTDIR
#
# graphshard is imported from this checkout (scripts/gpu_check/check_common.py maps passes/ and
# kernels/ as an install would); nothing is installed. See scripts/gpu_check.py for the sections.
set -uo pipefail
PY=${PYTHON:-python3}
exec "$PY" "$(dirname "$0")/gpu_check.py" "$@"   # OUTDIR is taken relative to the caller's directory
