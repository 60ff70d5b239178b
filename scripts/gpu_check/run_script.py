"""``python scripts/gpu_check/run_script.py SCRIPT ARGS...``: runs SCRIPT as ``__main__`` with this
checkout's graphshard importable (``check_common.bootstrap``), e.g. under ``torchrun`` on the GPU
machine, where graphshard is not installed."""

import os
import runpy
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from check_common import bootstrap  # noqa: E402

if __name__ == "__main__":
    bootstrap()
    script = sys.argv[1]
    sys.argv = sys.argv[1:]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    runpy.run_path(script, run_name="__main__")
