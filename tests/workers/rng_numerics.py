"""Random ops under model parallelism: ``torchrun --nproc-per-node 4 tests/workers/rng_numerics.py CASE ...``.

Each CASE is ``strategy:lower`` with strategy ``tp`` (tensor parallelism over 2 ranks: the 4
ranks run two independent 2-rank jobs, ranks {0, 1} and {2, 3}) or ``fsdp_tp`` (FullyShard
on "dp" and tensor parallelism on "tp", one 2x2 mesh), and lower ``eager`` or ``inductor``.

Every rank is seeded differently (``manual_seed(100 + rank)``), as data-parallel training
seeds them, and trains ``DropoutMLP`` (a dropout on the sharded hidden units and one on the
replicated output) for a few steps. Reported:

- ``replicated_diff``: the largest difference, over the parameters replicated on "tp",
  between the local tensors of the ranks of a tp group (the rule: 0);
- ``loss_diff_tp``: the same for the losses;
- ``loss_err`` / ``param_err``: the run against a reference that draws the same logical
  random values: the model compiled on a 1-rank "tp" mesh (eager), seeded as the tp group's
  first rank was (for ``fsdp_tp``, one such model per data-parallel rank, each on its part of
  the batch, gradients averaged, as FullyShard averages them);
- the mask probe (``probe_*``): a column-parallel layer followed by dropout of ones, so the
  (gathered) output is the dropout mask of a sharded value, and dropout of ones on a
  replicated value. For ``tp`` every rank is seeded the SAME there (the case where per-rank
  draws repeat one shard's values in the others); for ``fsdp_tp`` differently per rank.
  ``probe_halves_equal``: whether the two tp shards of the sharded mask are equal;
  ``probe_replicated_diff``: the replicated mask across the tp group; ``probe_drop_rate``;
  ``probe_dp_equal`` (fsdp_tp): whether the two data-parallel ranks drew the same mask.
  The probe runs in the ``eager`` cases only (Inductor computes the same bits: its cases match
  the same reference), and the reference is computed once per strategy.

Rank 0 prints one JSON line per case.
"""

from __future__ import annotations

import copy
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate

import graphshard
from _compare import dict_err, seq_err, tensor_err, worst
from _runner import run_cases
from graphshard.tensor_parallel import ColwiseParallel, RowwiseParallel
from graphshard.testing.models import DropoutMLP

STEPS = 3
P = 0.25
BATCH, SEQ, DIM, HIDDEN = 4, 6, 16, 32


class MaskProbe(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(DIM, HIDDEN)

    def forward(self, x):
        sharded = F.dropout(torch.ones_like(self.fc(x)), P, True)   # column-parallel output: sharded on "tp"
        replicated = F.dropout(torch.ones_like(x), P, True)
        return sharded, replicated


def batch(step: int):
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(BATCH, SEQ, DIM, generator=g), torch.randn(BATCH, SEQ, DIM, generator=g)


def train(model, batches, seed: int):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.manual_seed(seed)  # right before the first call: the compile draws the graph's stream seed
    losses = []
    for x, y in batches:
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def local(p) -> torch.Tensor:
    return (p.to_local() if isinstance(p, DTensor) else p).detach()


def full(p) -> torch.Tensor:
    return (p.full_tensor() if isinstance(p, DTensor) else p).detach()


def spread(t: torch.Tensor, group) -> float:
    """The largest difference between the ranks of ``group`` in ``t``."""
    ts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(ts, t.contiguous(), group=group)
    return worst(tensor_err(a, ts[0]) for a in ts)


def tp_replicated(p, tp_dim: int) -> bool:
    return not isinstance(p, DTensor) or isinstance(p.placements[tp_dim], Replicate)


def reference(init: nn.Module, solo, parts: list[tuple[int, list]]) -> tuple[list[float], dict]:
    """One model per (seed, batches) part on a 1-rank "tp" mesh, trained together with averaged
    gradients (one part: plain training). Returns the mean losses and the parameters."""
    models = []
    for _ in parts:
        m = copy.deepcopy(init)
        graphshard.compile(m, graphshard.Plan(solo, styles()), lower="eager")
        models.append(m)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in models]
    losses = []
    for step in range(STEPS):
        total = 0.0
        for m, (seed, batches) in zip(models, parts):
            if step == 0:
                torch.manual_seed(seed)
            x, y = batches[step]
            loss = F.mse_loss(m(x), y)
            loss.backward()
            total += loss.item() / len(parts)
        for ps in zip(*(m.parameters() for m in models)):
            g = sum(p.grad for p in ps) / len(ps)
            for p in ps:
                p.grad = g.clone()
        for o in opts:
            o.step()
            o.zero_grad()
        losses.append(total)
    return losses, {n: full(p) for n, p in models[0].named_parameters()}


_REFERENCES: dict = {}  # (strategy, leader rank) -> (losses, params): the same for both lowerings


def styles() -> dict:
    return {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()}


def run(case: str) -> dict:
    strategy, lower = case.split(":")
    torch._dynamo.reset()
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp" if strategy == "fsdp_tp" else "pair", "tp"))
    solo = init_device_mesh("cpu", (4, 1), mesh_dim_names=("solo", "tp"))["tp"]
    tp_group = mesh.get_group("tp")
    outer = mesh.get_local_rank(0)  # the dp rank (fsdp_tp) or the 2-rank job (tp)
    leader = dist.get_process_group_ranks(tp_group)[0]

    torch.manual_seed(0)
    init = DropoutMLP(DIM, HIDDEN, P)
    model = copy.deepcopy(init)
    batches = [batch(s) for s in range(STEPS)]
    if strategy == "fsdp_tp":
        graphshard.compile(model, graphshard.Plan(mesh, {**styles(), "": graphshard.FullyShard()}), lower=lower)
        half = BATCH // 2
        mine = [(x[outer * half:(outer + 1) * half], y[outer * half:(outer + 1) * half]) for x, y in batches]
    else:
        graphshard.compile(model, graphshard.Plan(mesh["tp"], styles()), lower=lower)
        mine = batches
    losses = train(model, mine, seed=100 + rank)
    tp_dim = 1 if strategy == "fsdp_tp" else 0
    out = {
        "case": case,
        "replicated_diff": max(spread(local(p), tp_group) for p in model.parameters() if tp_replicated(p, tp_dim)),
        "loss_diff_tp": spread(torch.tensor(losses), tp_group),
        "replicated_params": sorted(n for n, p in model.named_parameters() if tp_replicated(p, tp_dim)),
    }
    params = {n: full(p) for n, p in model.named_parameters()}
    if strategy == "fsdp_tp":
        t = torch.tensor(losses)
        dist.all_reduce(t)
        losses = (t / dist.get_world_size()).tolist()
    if lower == "eager":
        out.update(_probe(strategy, lower, mesh, tp_group))
    # "tp": each 2-rank job's first rank checks its own job (ranks 0 and 2); "fsdp_tp": rank 0 the one job
    if rank == leader and (strategy == "tp" or rank == 0):
        if (strategy, leader) not in _REFERENCES:
            if strategy == "fsdp_tp":  # dp rank d's stream is its tp group's first rank's: ranks 0 and 2
                parts = [(100 + 2 * d, [(x[2 * d:2 * d + 2], y[2 * d:2 * d + 2]) for x, y in batches])
                         for d in range(2)]
            else:
                parts = [(100 + leader, batches)]
            _REFERENCES[(strategy, leader)] = reference(init, solo, parts)
        ref_losses, ref_params = _REFERENCES[(strategy, leader)]
        out["loss_err"] = seq_err(losses, ref_losses)
        out["param_err"], _ = dict_err(params, ref_params)  # every reference parameter, a missing one inf
    gathered = [None] * dist.get_world_size() if rank == 0 else None
    dist.gather_object(out, gathered, dst=0)
    if rank == 0 and strategy == "tp":  # the second job's own report (run_cases prints rank 0's only)
        out["second_job"] = gathered[2]
    return out


def _probe(strategy: str, lower: str, mesh, tp_group) -> dict:
    torch.manual_seed(0)
    probe = MaskProbe()
    rules = {"fc": ColwiseParallel()}
    if strategy == "fsdp_tp":
        graphshard.compile(probe, graphshard.Plan(mesh, {**rules, "": graphshard.FullyShard()}), lower=lower)
        torch.manual_seed(100 + dist.get_rank())
    else:
        graphshard.compile(probe, graphshard.Plan(mesh["tp"], rules), lower=lower)
        torch.manual_seed(7)  # the same seed on every rank
    x = torch.randn(BATCH, SEQ, DIM, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        sharded, replicated = probe(x)
    half = HIDDEN // 2
    res = {
        "probe_shape": list(sharded.shape),  # the gathered mask, not a local shard
        "probe_halves_equal": bool(torch.equal(sharded[..., :half], sharded[..., half:])),
        "probe_replicated_diff": spread(replicated, tp_group),
        "probe_sharded_diff": spread(sharded, tp_group),
        "probe_drop_rate": (sharded == 0).float().mean().item(),
        # torch's dropout of ones: every value 0 or 1 / (1 - p), nothing else
        "probe_values": sorted({round(v, 6) for v in torch.cat([sharded.flatten(), replicated.flatten()]).tolist()}),
    }
    if strategy == "fsdp_tp":
        dp_group = mesh.get_group("dp")
        res["probe_dp_equal"] = spread(sharded, dp_group) == 0 or spread(replicated, dp_group) == 0
    return res


if __name__ == "__main__":
    run_cases(sys.argv[1:], run)
