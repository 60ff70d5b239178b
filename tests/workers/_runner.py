"""What every numerics worker does around its cases: a gloo process group, one JSON line per case."""

from __future__ import annotations

import datetime
import json
from typing import Callable

import torch.distributed as dist


def run_cases(cases: list[str], run: Callable[[str], dict], timeout: datetime.timedelta | None = None) -> None:
    """Runs each case on every rank; rank 0 prints ``RESULT <json>`` (what tests/_launch.py reads).
    ``timeout`` bounds every collective (a rank that never joins one fails the job instead of hanging)."""
    dist.init_process_group("gloo", timeout=timeout)
    for case in cases:
        result = run(case)
        if dist.get_rank() == 0:
            print("RESULT " + json.dumps(result), flush=True)
    dist.barrier()
    dist.destroy_process_group()
