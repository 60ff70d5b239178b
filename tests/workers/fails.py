"""Cases of which some take the job down: ``torchrun tests/workers/fails.py ok:a raise:b ok:c``.

A ``raise`` case raises on every rank, as a compile error would; a ``sleep`` case outlasts any
launch limit a test gives (10 min, every rank); an ``abort`` case kills rank 1 with SIGABRT (as
gloo's C++ does on a malformed message) while rank 0, like the sweeps' workers, records the error
of its collective as the case's result and goes on; an ``ok`` case all-reduces and returns. What
`_launch.run_cases` must make of that: the raising, stopped or aborted case fails alone.
"""

from __future__ import annotations

import os
import signal
import sys
import time

import torch
import torch.distributed as dist

from _runner import run_cases


def run(case: str) -> dict:
    if case.startswith("raise:"):
        raise RuntimeError(f"case {case} raised")
    if case.startswith("sleep:"):
        time.sleep(600)
    if case.startswith("abort:"):
        if dist.get_rank() == 1:
            os.kill(os.getpid(), signal.SIGABRT)
        try:
            dist.all_reduce(torch.ones(1))
        except RuntimeError as e:  # the lost peer: rank 0 records it and goes on, as tp_layouts.py does
            return {"case": case, "refused": f"{type(e).__name__}: {e}"}
    t = torch.ones(1)
    dist.all_reduce(t)
    return {"case": case, "sum": float(t)}


if __name__ == "__main__":
    run_cases(sys.argv[1:], run)
