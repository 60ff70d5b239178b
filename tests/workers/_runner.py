"""What every numerics worker does around its cases: a gloo process group, one JSON line per case."""

from __future__ import annotations

import json
from typing import Callable

import torch.distributed as dist


def run_cases(cases: list[str], run: Callable[[str], dict]) -> None:
    """Runs each case on every rank; rank 0 prints ``RESULT <json>`` (what tests/_launch.py reads)."""
    dist.init_process_group("gloo")
    for case in cases:
        result = run(case)
        if dist.get_rank() == 0:
            print("RESULT " + json.dumps(result), flush=True)
    dist.barrier()
    dist.destroy_process_group()
