"""Cases of which some take the job down: ``torchrun tests/workers/fails.py ok:a raise:b ok:c``.

A ``raise`` case raises on every rank, as a compile error would; a ``sleep`` case outlasts any
launch limit a test gives (10 min, every rank); an ``ok`` case all-reduces and returns. What
`_launch.run_cases` must make of that: the raising or stopped case fails alone.
"""

from __future__ import annotations

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
    t = torch.ones(1)
    dist.all_reduce(t)
    return {"case": case, "sum": float(t)}


if __name__ == "__main__":
    run_cases(sys.argv[1:], run)
