"""``clip_grad_norm_`` over a graphshard.fsdp model: the total norm across every rank's shards."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


def clip_grad_norm(root, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """torch's FSDP ``clip_grad_norm_``: the norm of all gradients as if unsharded (a sharded
    parameter's shards are summed over its shard group; a replicated one counts once), then
    every gradient scaled by ``max_norm / (total + 1e-6)`` when that is below 1."""
    norm_type = float(norm_type)
    model = root._fsdp_wrapped_module
    state = root._graphshard
    grads = []
    sharded, replicated = [], []
    for info in state.params.values():
        g = info.local_grad()
        if g is None:
            continue
        grads.append(g)
        (sharded if info.shard is not None else replicated).append(g)
    managed = {id(p) for p in model.parameters() if isinstance(p, DTensor)} | {id(u.flat.param) for u in state.units.values() if u.flat is not None}
    for p in model.parameters():  # ignored parameters: local, counted once per rank (as torch's FSDP)
        if id(p) not in managed and p.grad is not None:
            grads.append(p.grad)
            replicated.append(p.grad)
    group = root.process_group
    if norm_type == float("inf"):
        total = _norm(sharded + replicated, norm_type)
        dist.all_reduce(total, op=dist.ReduceOp.MAX, group=group)
    else:
        total = _norm(sharded, norm_type) ** norm_type
        dist.all_reduce(total, group=group)
        if replicated:
            total += _norm(replicated, norm_type) ** norm_type
        total = total ** (1.0 / norm_type)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    with torch.no_grad():
        for g in grads:  # views of a flat gradient scale it in place
            g.mul_(coef.to(g.dtype))
    dtypes = {g.dtype for g in grads}
    return total.to(dtypes.pop()) if len(dtypes) == 1 else total


def _norm(grads: list[torch.Tensor], norm_type: float) -> torch.Tensor:
    """The ``norm_type``-norm of ``grads`` as one vector, in fp32: the norm of the per-tensor
    norms (torch's order of summation, so both wrappers round alike)."""
    if not grads:
        return torch.zeros((), dtype=torch.float32)
    return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.detach(), norm_type, dtype=torch.float32)
                                                 for g in grads]), norm_type, dtype=torch.float32)
