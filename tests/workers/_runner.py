"""What every numerics worker does around its cases: a gloo process group, one JSON line per case."""

from __future__ import annotations

import datetime
import json
import os
import sys
from typing import Callable

import torch.distributed as dist


COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=5)
"""How long a rank waits in one collective by default: a rank that never joins one (a hang, a
crash on another rank) fails the job with gloo's error naming the collective within minutes,
instead of at the launcher's 15-minute limit. Longer than any compile a peer may be doing."""


def lowering() -> str:
    """The lowering this launch's graphshard programs take: ``inductor`` unless the launch set
    ``GS_TEST_LOWER=eager`` (tests/_coverage_share.py's ``launch_groups``)."""
    return os.environ.get("GS_TEST_LOWER", "inductor")


def run_cases(cases: list[str], run: Callable[[str], dict],
              timeout: datetime.timedelta = COLLECTIVE_TIMEOUT) -> None:
    """Runs each case on every rank; rank 0 prints ``RESULT <json>`` (what tests/_launch.py reads).
    ``timeout`` bounds every collective (a rank that never joins one fails the job instead of hanging)."""
    dist.init_process_group("gloo", timeout=timeout)
    for case in cases:
        result = run(case)
        if dist.get_rank() == 0:
            print("RESULT " + json.dumps(result), flush=True)
    dist.barrier()
    dist.destroy_process_group()
    _exit_without_finalizing()


def _exit_without_finalizing() -> None:
    """Ends a rank whose cases all ran without Python's finalization, which races gloo.

    ``destroy_process_group`` does not join gloo's worker threads: a group stays alive while torch's
    DTensor caches hold a mesh of it. A worker thread releases each collective's tensors a moment
    after the collective completes; if that moment falls after the main thread has begun
    finalizing, the thread must take the GIL to free a tensor Python let go of, CPython ends it
    with ``pthread_exit``, and the unwinding C++ aborts the process ("terminate called without an
    active exception", exit -6), after every result was printed. A 2-rank script with a late
    async all-reduce reproduces it (docs/design/testing.md).
    A case that raises never gets here: its exception fails the job as before."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
