"""Test set-up: one fake process group (world size 4) for golden-graph tests in this process.

Multi-rank numerics run in torchrun subprocesses with gloo (see tests/_launch.py).
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from graphshard import _compat

WORLD = 4


@pytest.fixture(scope="session", autouse=True)
def fake_process_group():
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
    if not dist.is_initialized():
        dist.init_process_group("fake", store=_compat.fake_process_group_store(), rank=0, world_size=WORLD)
    yield


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
