"""Ranks that would issue different collectives: ``torchrun --nproc-per-node 2 tests/workers/divergence.py CASE ...``.

Each case builds a model that differs between the ranks in one way, runs one training step and
reports what each rank raised (rank 1's message reaches rank 0 through the store):

- ``branch``: the forward takes a rank-dependent branch (rank 1 runs an extra FSDP unit, so it
  has an extra all-gather: of one weight, where the other units gather a weight and a bias);
- ``plan``: rank 1 shards with another plan (every layer its own unit, rank 0 one unit);
- ``shape``: tensor parallelism with an input of another batch size on rank 1 (the row-parallel
  layer's all-reduce has another size);
- ``same``: every rank alike, the check passes and ``explain`` prints what it compared;
- ``break``: a graph break in the forward (two frames: ``forward`` and dynamo's resume function)
  and a second step with another batch size (each frame compiles again): every rank alike, each
  graph is compared with the same frame's same compile on the peer, and the check passes;
- ``break_branch``: the same graph break, with rank 1's extra unit after it: caught in the
  resume function's program, which the error names;
- ``shape_later``: tensor parallelism, three steps alike, then rank 1 fed 6 rows where rank 0 is fed
  4: rank 1 alone recompiles, rank 0 has nothing new to compile (caught by the per-call input check,
  on every rank);
- ``shape_dynamic``: tensor parallelism, two steps of 4 then 6 rows on every rank (dynamo compiles a
  program whose batch size is symbolic), then 5 rows on rank 0 and 7 on rank 1: one program, sizes
  that differ by rank (before the per-call check, gloo aborted the job in the all-reduce);
- ``late``: tensor parallelism, a second step with a batch of 1 on every rank (dynamo specializes
  size 1, so the new graph's sizes are static), rank 0 3 s
  after rank 1: rank 1's recompile first meets rank 0's first compile (another all-reduce size),
  waits for rank 0's recompile and passes.

The process group's collective timeout is 60 s: were a case to reach a mismatched collective, the
job would fail there, and the test's time bound would show it.
"""

from __future__ import annotations

import datetime
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard

import graphshard
from _runner import run_cases


class Net(nn.Module):
    def __init__(self, extra: bool, dim: int = 8):
        super().__init__()
        self.a = nn.Linear(dim, dim)
        self.b = nn.Linear(dim, dim, bias=False)  # its gather differs from the others' in more than its name
        self.c = nn.Linear(dim, dim)
        self.extra = extra
        self.graph_break = False

    def forward(self, x):
        x = torch.relu(self.a(x))
        if self.graph_break:
            torch._dynamo.graph_break()
        if self.extra:  # the rank-dependent branch
            x = torch.relu(self.b(x))
        return self.c(x)


def _mesh():
    return init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp",))


def build(case: str, rank: int):
    torch.manual_seed(0)
    if case in ("shape", "late", "shape_later", "shape_dynamic"):
        model = Net(False)
        plan = graphshard.Plan(init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",)), {
            "a": graphshard.ShardParams("tp", weight=Shard(0), bias=Shard(0)),
            "c": graphshard.ShardParams("tp", weight=Shard(1)),
        })
        return model, plan, torch.randn(6 if rank == 1 and case == "shape" else 4, 8)
    model = Net(extra=case in ("branch", "break_branch") and rank == 1)
    model.graph_break = case.startswith("break")
    per_layer = case in ("branch", "break_branch") or case == "plan" and rank == 1
    units = {"a": graphshard.FullyShard(), "b": graphshard.FullyShard(), "c": graphshard.FullyShard()} if per_layer else {}
    return model, graphshard.Plan(_mesh(), {**units, "": graphshard.FullyShard()}), torch.randn(4, 8)


def run(case: str) -> dict:
    rank = dist.get_rank()
    model, plan, x = build(case, rank)
    model = graphshard.compile(model, plan, lower="eager")  # the check is on by default
    t0 = time.perf_counter()
    error = ""
    try:
        if case in ("shape_later", "shape_dynamic"):  # the steps before the mismatch: every rank alike
            for rows in ((4, 4, 4) if case == "shape_later" else (4, 6)):
                model(torch.randn(rows, 8)).sum().backward()
            t0 = time.perf_counter()
            rows = 4 + 2 * rank if case == "shape_later" else 5 + 2 * rank
            x = torch.randn(rows, 8)
        model(x).sum().backward()
        if case in ("break", "late"):  # another batch size: every frame compiles again, on every rank
            if case == "late" and rank == 0:
                time.sleep(3)
            model(torch.randn(1 if case == "late" else 6, 8)).sum().backward()  # 1: a static size (0/1 specialization)
    except graphshard.CollectiveMismatch as e:
        error = str(e)
    except Exception as e:  # dynamo wraps a backend's errors: find ours in the chain
        cause = e
        while cause is not None and not isinstance(cause, graphshard.CollectiveMismatch):
            cause = cause.__cause__ or cause.__context__
        if cause is None:
            raise
        error = str(cause)
    seconds = time.perf_counter() - t0
    store = dist.distributed_c10d._get_default_store()
    store.set(f"divergence/{case}/{rank}", error)
    errors = [store.get(f"divergence/{case}/{r}").decode() for r in range(dist.get_world_size())]
    # rank 0's report only: explain also prints, and another rank's print could split the RESULT line
    # rank 0 prints (over 4 KiB, not one atomic write to the shared pipe), losing the case's result
    explain = "" if error or rank != 0 else graphshard.explain(model)
    return {"case": case, "errors": errors, "seconds": seconds, "explain": explain}


if __name__ == "__main__":
    run_cases(sys.argv[1:], run, timeout=datetime.timedelta(seconds=60))
