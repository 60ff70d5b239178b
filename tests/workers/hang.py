"""A rank that never joins a collective: ``torchrun --nproc-per-node 2 tests/workers/hang.py SECONDS``.

Rank 0 all-reduces; rank 1 sleeps far past ``SECONDS`` instead. ``run_cases``' collective timeout
(``SECONDS`` here, ``_runner.COLLECTIVE_TIMEOUT`` in the real workers) must end the job.
"""

from __future__ import annotations

import datetime
import sys
import time

import torch
import torch.distributed as dist

from _runner import run_cases


def run(case: str) -> dict:
    if dist.get_rank() == 1:
        time.sleep(600)
    t = torch.ones(1)
    dist.all_reduce(t)
    return {"case": case, "sum": float(t)}


if __name__ == "__main__":
    run_cases(["hang"], run, timeout=datetime.timedelta(seconds=float(sys.argv[1])))
