"""One fault in a graphshard training job: ``torchrun --nproc-per-node 2 tests/workers/faults.py CASE``.

A 2-rank job trains a graphshard-compiled model (FSDP, or tensor parallelism for ``shape``) for a
few steps; at step `FAULT_STEP` rank 1 misbehaves:

- ``raise``: raises an exception in its step (a bug in the user's loss, a data error);
- ``killed``: is killed (SIGKILL: the OOM killer, a preempted node);
- ``stall``: stops for longer than the process group's timeout (``GS_PG_TIMEOUT`` seconds; a stuck
  data loader, a deadlock in user code);
- ``shape``: is fed another batch size under tensor parallelism;
- ``plan``: runs another plan (compiled differently from the start).

Each rank prints ``OUTCOME {"rank": r, "error": "...", "after": seconds}`` when it ends its part
(``after``: wall-clock seconds from the moment rank 1 reached the fault, which rank 1 posts to the
store; the ranks share the host's clock), then re-raises, so the job fails as a user's job would.
A rank that is stopped from outside (torchrun ends the job when one rank has failed) prints nothing:
the test reads torchrun's own summary for it. Ranks that all raise `CollectiveMismatch` wait for one
another to print before they exit.
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard

import graphshard

FAULT_STEP = 2
STEPS = 4


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a = torch.nn.Linear(8, 16)
        self.b = torch.nn.Linear(16, 8)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def plan(case: str, rank: int):
    world = dist.get_world_size()
    if case == "shape":
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
        return graphshard.Plan(mesh, {"a": graphshard.ShardParams("tp", weight=Shard(0), bias=Shard(0)),
                                      "b": graphshard.ShardParams("tp", weight=Shard(1))})
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    units = {"a": graphshard.FullyShard(), "b": graphshard.FullyShard()} if case == "plan" and rank == 1 else {}
    return graphshard.Plan(mesh, {**units, "": graphshard.FullyShard()})


def step(model, opt, case: str, rank: int, n: int, store) -> None:
    rows = 4
    if n == FAULT_STEP and rank == 1:
        store.set("faults/at", repr(time.time()))
        if case == "raise":
            raise RuntimeError("injected fault: rank 1 raised in its training step")
        if case == "killed":
            sys.stdout.flush()
            os.kill(os.getpid(), signal.SIGKILL)
        if case == "stall":
            time.sleep(float(os.environ["GS_PG_TIMEOUT"]) + 120)
        if case == "shape":
            rows = 6
    if n == 0 and case == "plan" and rank == 1:
        store.set("faults/at", repr(time.time()))  # another plan: the very first step differs
    model(torch.randn(rows, 8)).sum().backward()
    opt.step()
    opt.zero_grad()


def main() -> None:
    case = sys.argv[1]
    timeout = datetime.timedelta(seconds=float(os.environ.get("GS_PG_TIMEOUT", "60")))
    dist.init_process_group("gloo", timeout=timeout)
    rank, store = dist.get_rank(), dist.distributed_c10d._get_default_store()
    model = graphshard.compile(Net(), plan(case, rank), lower="eager")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    try:
        for n in range(STEPS):
            step(model, opt, case, rank, n, store)
    except BaseException as e:
        at = float(store.get("faults/at")) if store.check(["faults/at"]) else time.time()
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        print("OUTCOME " + json.dumps({"rank": rank, "error": f"{type(e).__name__}: {first}"[:600],
                                       "message": str(e)[:2000], "after": time.time() - at}), flush=True)
        if isinstance(e, graphshard.CollectiveMismatch):
            # every rank ends on its own here; the first to exit would have torchrun stop the others before
            # they print what they raised, so each waits (bounded) until all have printed
            store.add("faults/printed", 1)
            deadline = time.time() + 30
            while store.add("faults/printed", 0) < dist.get_world_size() and time.time() < deadline:
                time.sleep(0.01)
        raise
    print("OUTCOME " + json.dumps({"rank": rank, "error": "", "after": 0.0}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
