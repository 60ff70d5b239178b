"""Issue 74's multi-rank halves: ``torchrun --nproc-per-node 2 tests/workers/misuse.py CASE ...``.

- ``state_dict``: a model trained by graphshard.compile gives its full state dict through torch's
  ``get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))``
  (rank 0: the single-process model's, trained the same; other ranks: empty, as torch documents for
  cpu_offload) and takes one back through ``set_model_state_dict`` and through plain
  ``load_state_dict``; ``model.state_dict()`` itself holds DTensors (this rank's shards).
- ``meta``: a model built on the meta device, compiled, ``to_empty``'d and loaded from the full
  state dict, trains as the single process.
- ``mixed_precision``: ``FullyShard(param_dtype=torch.bfloat16)`` units fed fp32 inputs against
  FSDP2 (``fully_shard`` with ``MixedPrecisionPolicy(param_dtype=torch.bfloat16)``, which casts the
  floating inputs of each module it wraps) and the single process in fp32.
Rank 0 prints one JSON line per case.
"""

from __future__ import annotations

import copy
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import graphshard
from _compare import dict_err, seq_err, worst, tensor_err
from _runner import lowering, run_cases

STEPS = 3
BATCH = 4  # per rank


class Block(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(dim, 2 * dim), nn.Linear(2 * dim, dim)

    def forward(self, x):
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(x)))


class Net(nn.Module):
    """Float inputs (no embedding): what a root's input cast matters for."""

    def __init__(self, dim: int = 16, n: int = 2):
        super().__init__()
        self.inp = nn.Linear(dim, dim)
        self.layers = nn.ModuleList(Block(dim) for _ in range(n))
        self.out = nn.Linear(dim, 4)

    def forward(self, x):
        h = self.inp(x)
        for layer in self.layers:
            h = layer(h)
        return self.out(h)


def build(device: str = "cpu") -> Net:
    torch.manual_seed(0)
    with torch.device(device):
        return Net()


def data(step: int, n: int):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(n, 16, generator=g), torch.randn(n, 4, generator=g)


def loss_fn(out, y):
    return (out.float() - y).pow(2).mean()


def plan(mesh, **spec):
    return graphshard.Plan(mesh, {"layers.*": graphshard.FullyShard(**spec), "": graphshard.FullyShard(**spec)})


def train(model, steps: int, rank: int, world: int, lr: float = 0.1) -> list[float]:
    """SGD on this rank's slice of each global batch of ``BATCH * WORLD`` samples (``world`` 1: the
    whole batch, the single process); the loss averaged over the ranks."""
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    per_rank = BATCH * dist.get_world_size() // world
    for step in range(steps):
        x, y = data(step, BATCH * dist.get_world_size())
        x, y = x[rank * per_rank:(rank + 1) * per_rank], y[rank * per_rank:(rank + 1) * per_rank]
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        t = loss.detach().clone()
        if world > 1:
            dist.all_reduce(t)
            t /= world
        losses.append(float(t))
    return losses


def reference(steps: int, world: int):
    model = build()
    return model, train(model, steps, 0, 1)


def full_params(model) -> dict[str, torch.Tensor]:
    return {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone() for n, p in model.named_parameters()}


def case_state_dict(rank: int, world: int, mesh) -> dict:
    ref, ref_losses = reference(STEPS, world)
    model = graphshard.compile(build(), plan(mesh), lower=lowering())
    losses = train(model, STEPS, rank, world)
    sd = model.state_dict()
    local_kinds = sorted({type(v).__name__ for v in sd.values()})
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    out = {"case": "state_dict", "loss_err": seq_err(losses, ref_losses), "state_dict_types": local_kinds}
    if rank == 0:
        err, key = dict_err(full, ref.state_dict())
        out.update(full_err=err, full_worst_key=key, full_keys=sorted(full) == sorted(ref.state_dict()),
                   full_plain=all(type(v) is torch.Tensor and v.device.type == "cpu" for v in full.values()))
    else:
        out["other_rank_empty"] = full == {}
    # back in, two ways, into fresh compiled models
    whole = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))  # every rank
    fresh = graphshard.compile(build(), plan(mesh), lower=lowering())
    with torch.no_grad():
        for p in fresh.parameters():
            p.zero_()
    set_model_state_dict(fresh, whole, options=StateDictOptions(full_state_dict=True))
    out["set_model_state_dict_err"] = dict_err(full_params(fresh), ref.state_dict())[0]
    loaded = graphshard.compile(build(), plan(mesh), lower=lowering())
    result = loaded.load_state_dict({k: v.clone() for k, v in ref.state_dict().items()})
    out["load_state_dict_err"] = dict_err(full_params(loaded), ref.state_dict())[0]
    out["load_state_dict_missing"] = list(result.missing_keys) + list(result.unexpected_keys)
    return out


def case_meta(rank: int, world: int, mesh) -> dict:
    start = build().state_dict()
    model = graphshard.compile(build("meta"), plan(mesh), lower=lowering())
    was_meta = all(p.to_local().is_meta for p in model.parameters())
    model.to_empty(device="cpu")
    model.load_state_dict(start)
    losses = train(model, STEPS, rank, world)
    ref, ref_losses = reference(STEPS, world)
    return {"case": "meta", "was_meta": was_meta, "loss_err": seq_err(losses, ref_losses),
            "param_err": dict_err(full_params(model), ref.state_dict())[0]}


def case_mixed_precision(rank: int, world: int, mesh) -> dict:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    gs = graphshard.compile(build(), plan(mesh, param_dtype=torch.bfloat16), lower=lowering())
    gs_losses = train(gs, STEPS, rank, world)
    peer = build()
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    for layer in peer.layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(peer, mesh=mesh, mp_policy=policy)
    peer_losses = train(peer, STEPS, rank, world)
    x = data(0, BATCH)[0]
    out_dtypes = [str(gs(x).dtype), str(peer(x).dtype)]
    ref, ref_losses = reference(STEPS, world)
    gs_p, peer_p = full_params(gs), full_params(peer)
    return {"case": "mixed_precision", "out_dtypes": out_dtypes,
            "loss_err_peer": seq_err(gs_losses, peer_losses), "loss_err_single": seq_err(gs_losses, ref_losses),
            "peer_loss_err_single": seq_err(peer_losses, ref_losses),
            "param_err_peer": worst(tensor_err(gs_p[n], peer_p[n]) for n in gs_p),
            "param_err_single": dict_err(gs_p, ref.state_dict())[0],
            "peer_param_err_single": dict_err(peer_p, ref.state_dict())[0]}


def run(case: str) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    torch._dynamo.reset()
    return {"state_dict": case_state_dict, "meta": case_meta, "mixed_precision": case_mixed_precision}[case](
        rank, world, mesh)


if __name__ == "__main__":
    run_cases(sys.argv[1:], run)
