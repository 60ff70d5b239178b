"""Programs kept in torch's AOTAutogradCache: ``torchrun --nproc-per-node 2 tests/workers/program_cache.py CASE ...``.

Each case compiles with the program cache on (the default) and trains 4 SGD steps, the second inside
``graphshard.no_sync`` (the third then reduces both micro-batches' gradients), against a
single-process run of the same model on the whole batch (which accumulates the same way). The
test runs the job twice on one Inductor cache directory: the first process compiles and stores
each program, the second loads it, and both must match the reference, and each other exactly.

- ``fsdp``: a 4-layer transformer, every layer FULL_SHARD (trace once outlines the repeated
  blocks), regional lowering;
- ``whole``: the same, each graph lowered whole by Inductor (``regional=False``);
- ``tp``: an MLP with tensor parallelism (column then row parallel: the all-reduce in place);
- ``ac``: the transformer with torch's ``apply_activation_checkpointing`` on its blocks (the
  reference runs the same checkpointing): the stored backward recomputes what the checkpoint says;
- ``off``: ``fsdp`` with ``program_cache=False``, after ``fsdp`` stored the same program: it is
  neither loaded nor stored, and compiled again.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import hashlib
import sys

import torch
import torch.distributed as dist
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl, apply_activation_checkpointing, checkpoint_wrapper)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard

import graphshard
from _compare import scalar_err, tensor_err, worst
from _runner import run_cases
from graphshard._compat import autograd_cache_counts
from graphshard.testing.models import MLP, Block, Transformer, TransformerConfig, lm_loss, token_batch

CONFIG = TransformerConfig(vocab_size=96, dim=32, n_layers=4, n_heads=4, max_seq_len=16)
STEPS = 4
NO_SYNC_STEP = 1  # accumulated without communication; the next step reduces both


def build(case: str):
    torch.manual_seed(0)
    world = dist.get_world_size()
    if case == "tp":
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
        plan = graphshard.Plan(mesh, {"fc1": graphshard.ShardParams("tp", weight=Shard(0), bias=Shard(0)),
                                      "fc2": graphshard.ShardParams("tp", weight=Shard(1))})
        return MLP(10, 32, 7), plan, 1
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    model = Transformer(CONFIG)
    if case == "ac":
        apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, Block), checkpoint_wrapper_fn=functools.partial(
            checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT))
    return model, graphshard.Plan(mesh, {"layers.*": graphshard.FullyShard(),
                                                       "": graphshard.FullyShard()}), world


def batch(case: str, step: int, n: int):
    if case == "tp":
        g = torch.Generator().manual_seed(step + 11)
        return torch.randn(n, 10, generator=g), torch.randn(n, 7, generator=g)
    return token_batch(step, n, CONFIG.max_seq_len, CONFIG.vocab_size, seed=1)


def loss_of(case: str, out, y):
    return torch.nn.functional.mse_loss(out, y) if case == "tp" else lm_loss(out, y)


def run(case: str) -> dict:
    torch._dynamo.reset()
    rank = dist.get_rank()
    ref, plan, dp_world = build(case)
    model = copy.deepcopy(ref)
    graphshard.compile(model, plan, regional=case != "whole", **({"program_cache": False} if case == "off" else {}))
    before = autograd_cache_counts()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05)
    dp_rank = rank if dp_world > 1 else 0
    losses, loss_err = [], 0.0
    for step in range(STEPS):
        x, y = batch(case, step, 2 * dp_world)
        sl = slice(2 * dp_rank, 2 * dp_rank + 2)
        accumulate = step == NO_SYNC_STEP and case != "tp"  # no_sync is a data-parallel notion
        with graphshard.no_sync(model) if accumulate else contextlib.nullcontext():
            loss = loss_of(case, model(x[sl]), y[sl])
            loss.backward()
        ref_loss = loss_of(case, ref(x), y)
        ref_loss.backward()
        if not accumulate:
            opt.step()
            opt.zero_grad()
            ref_opt.step()
            ref_opt.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        mean /= dist.get_world_size()
        losses.append(mean.item())
        loss_err = worst([loss_err, scalar_err(mean.item(), ref_loss.item())])
    digest = hashlib.sha256()
    param_err = 0.0
    for name, want in ref.named_parameters():
        got = model.get_parameter(name).full_tensor().detach()
        param_err = worst([param_err, tensor_err(got, want)])
        digest.update(got.numpy().tobytes())
    after = autograd_cache_counts()
    reports = graphshard.storage.state_of(model).explain
    return {
        "case": case, "loss_err": loss_err, "param_err": param_err, "losses": losses, "params": digest.hexdigest(),
        "cache": {k: after[k] - before[k] for k in after},
        "notes": [n for r in reports for n in r.notes if n.startswith(("program cache", "no_sync"))],
        "phases": sorted({k for r in reports for k in r.compile_seconds}),
        # rank 0's only: explain also prints, and another rank's print could split the RESULT line rank 0 prints
        "explain": graphshard.explain(model) if rank == 0 else "",
    }


if __name__ == "__main__":
    run_cases(sys.argv[1:], run)
