"""What every numerics worker does around its cases: a gloo process group, one JSON line per case."""

from __future__ import annotations

import datetime
import json
import os
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
