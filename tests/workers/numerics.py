"""Multi-rank numerics worker: ``torchrun --nproc-per-node N tests/workers/numerics.py CASE [CASE ...]``.

Each CASE is ``model:strategy:lower[:flag ...]`` (e.g. ``transformer:full_shard:inductor``);
flag ``dynamic`` varies the per-rank batch size from step to step (2, 1, 3, ...), which makes
dynamo recompile with a symbolic batch dim; ``nccl_forms`` builds the plan with
``collectives="nccl"``, so gloo runs the collectives a NCCL run issues; ``rank1_shape`` gives
rank 1 alone 3 samples instead of 2 at step 2 (with static shapes), so rank 1 alone compiles a
second graph; the reference then averages the ranks' mean losses.
``lower`` is ``inductor`` or ``eager`` (graphshard.compile), ``whole`` (Inductor on each
whole graph, ``regional=False``), ``backend`` (graphshard.shard,
then ``torch.compile(model, backend="graphshard")`` by name) or ``uncompiled``
(graphshard.shard only: the eager debugging path).
For each, every rank trains the sharded model for 5 steps of SGD with momentum
on its slice of the global batch, and compares the loss (averaged over ranks)
and every gathered parameter with a single-process run of the same model on
the whole global batch. Rank 0 prints one JSON line per case.
"""

from __future__ import annotations

import contextlib
import dataclasses
import copy
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

import graphshard
from _compare import scalar_err, tensor_err, worst
from _runner import run_cases
from graphshard.testing.models import MLP, SharedBlockMLP, Transformer, TransformerConfig, lm_loss, token_batch

STEPS = 5
SMALL = TransformerConfig(vocab_size=96, dim=32, n_layers=2, n_heads=4, max_seq_len=16)


def build(model_name: str):
    torch.manual_seed(0)
    if model_name == "transformer":
        return Transformer(SMALL)
    if model_name == "transformer4":  # two repeated blocks between the first and the last
        return Transformer(dataclasses.replace(SMALL, n_layers=4))
    if model_name == "shared":
        return SharedBlockMLP()
    if model_name == "odd":  # every parameter's shard a size that is no multiple of 4, 8 or 16
        return MLP(7, 13, 5)
    return MLP(10, 30, 7)


def batch(model_name: str, step: int, n: int):
    if model_name.startswith("transformer"):
        return token_batch(step, n, SMALL.max_seq_len, SMALL.vocab_size, seed=1)
    g = torch.Generator().manual_seed(step + 11)
    d_in, d_out = (7, 5) if model_name == "odd" else (10, 7)
    return torch.randn(n, d_in, generator=g), torch.randn(n, d_out, generator=g)


def loss_fn(model_name: str, out, y):
    return lm_loss(out, y) if model_name.startswith("transformer") else torch.nn.functional.mse_loss(out, y)


def plan_for(strategy: str, world: int):
    if strategy == "hybrid":
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
        return graphshard.Plan(mesh, {"layers.*": graphshard.FullyShard(), "": graphshard.FullyShard()}), world
    if strategy == "tp":
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
        return graphshard.Plan(mesh, {
            "fc1": graphshard.ShardParams("tp", weight=Shard(0), bias=Shard(0)),
            "fc2": graphshard.ShardParams("tp", weight=Shard(1)),
        }), 1
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    spec = {
        "full_shard": graphshard.FullyShard(),
        "shard_grad_op": graphshard.FullyShard(reshard_after_forward=False),
        "replicate": graphshard.Replicate(),
    }[strategy]
    return graphshard.Plan(mesh, {"layers.*": spec, "": spec}), world


def per_rank_sizes(flags: list[str], step: int, world: int) -> list[int]:
    if "dynamic" in flags:
        return [(2, 1, 3)[step % 3]] * world
    if "rank1_shape" in flags and step == 2 and world > 1:
        return [2, 3] + [2] * (world - 2)
    return [2] * world


def run_case(case: str) -> dict:
    model_name, strategy, lower, *flags = case.split(":")
    if "rank1_shape" in flags:  # the recompile on rank 1 keeps static shapes
        with torch._dynamo.config.patch(automatic_dynamic_shapes=False):
            return _run_case(case, model_name, strategy, lower, flags)
    return _run_case(case, model_name, strategy, lower, flags)


def _run_case(case: str, model_name: str, strategy: str, lower: str, flags: list[str]) -> dict:
    from graphshard._compat import dynamo_counters

    rank, world = dist.get_rank(), dist.get_world_size()
    torch._dynamo.reset()
    dynamo_counters().clear()
    ref = build(model_name)
    model = copy.deepcopy(ref)
    plan, dp_world = plan_for(strategy, world)
    rules = {k: v for k, v in plan.rules.items() if model_name.startswith("transformer") or k in ("", "fc1", "fc2")}
    if model_name == "shared":
        rules = {"first": rules[""], "": rules[""]}
    if "flat" in flags:  # FSDP1's flat parameters (use_orig_params=False): one 1-D parameter per unit
        rules = {k: dataclasses.replace(v, flat_params=True) for k, v in rules.items()}
    plan = graphshard.Plan(plan.mesh, rules, collectives="nccl" if "nccl_forms" in flags else "auto")
    if lower in ("inductor", "eager"):
        graphshard.compile(model, plan, lower=lower)
    elif lower == "whole":
        graphshard.compile(model, plan, lower="inductor", regional=False)
    else:
        graphshard.shard(model, plan)
        if lower == "backend":
            model = torch.compile(model, backend="graphshard")
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    dp_rank = rank if dp_world > 1 else 0
    loss_err = 0.0
    for step in range(STEPS):
        sizes = per_rank_sizes(flags, step, dp_world)
        x, y = batch(model_name, step, sum(sizes))
        start = sum(sizes[:dp_rank])
        sl = slice(start, start + sizes[dp_rank])
        with (_op_log() if step == STEPS - 1 else contextlib.nullcontext(set())) as log:
            loss = loss_fn(model_name, model(x[sl]), y[sl])
            loss.backward()
        opt.step()
        opt.zero_grad()
        if len(set(sizes)) == 1:
            ref_loss = loss_fn(model_name, ref(x), y)
        else:  # ranks of unequal batches: gradients average the ranks' mean losses
            bounds = [sum(sizes[:r]) for r in range(dp_world + 1)]
            ref_loss = sum(loss_fn(model_name, ref(x[a:b]), y[a:b]) for a, b in zip(bounds, bounds[1:])) / dp_world
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        mean /= world
        loss_err = worst([loss_err, scalar_err(mean.item(), ref_loss.item())])
    param_err, names = 0.0, []
    ref_params = dict(ref.named_parameters())
    sharded = getattr(model, "_orig_mod", model)
    for name in ref_params:
        owner, _, attr = name.rpartition(".")
        p = getattr(sharded.get_submodule(owner), attr)  # a view of the flat parameter under "flat"
        assert isinstance(p, DTensor), f"{name} is not a DTensor"
        full = p.full_tensor()
        param_err = worst([param_err, tensor_err(full, ref_params[name])])
        names.append(name)
    counters = dynamo_counters()
    frames = [None] * world
    dist.all_gather_object(frames, int(counters["stats"]["unique_graphs"]))
    return {
        "case": case, "loss_err": loss_err, "param_err": param_err, "params": names,
        "named_parameters": [n for n, _ in sharded.named_parameters()],
        "ref_names": list(ref_params), "state_dict": list(getattr(model, "_orig_mod", model).state_dict()),
        "ref_state_dict": list(ref.state_dict()), "graph_breaks": sum(counters["graph_break"].values()),
        "frames": int(counters["stats"]["unique_graphs"]), "ops": sorted(log), "frames_per_rank": frames,
        "notes": [n for r in graphshard.storage.state_of(sharded).explain for n in r.notes] if lower != "backend" else [],
        "distinct_units": ([line.strip() for r in graphshard.storage.state_of(sharded).explain
                            for line in r.per_distinct_unit()] if lower != "backend" else []),
    }


@contextlib.contextmanager
def _op_log():
    """Yields the set that gets, when the block ends, the names of the collectives and graphshard
    ops it ran (``_c10d_functional``, the process group's ``c10d`` ops, ``graphshard``): which
    collective forms actually ran. The profiler sees the compiled code's calls too (a
    TorchDispatchMode would make dynamo run the model eagerly)."""
    ops: set[str] = set()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        yield ops
    ops.update(e.name for e in prof.events() if e.name.split("::")[0] in ("_c10d_functional", "c10d", "graphshard"))


if __name__ == "__main__":
    run_cases(sys.argv[1:], run_case)
