"""``clip_grad_norm_`` over a graphshard.fsdp model: the total norm across every rank's shards."""

from __future__ import annotations

import torch
import torch.distributed as dist

from graphshard.fsdp._wrapper import _local_grad


def clip_grad_norm(root, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """torch's FSDP ``clip_grad_norm_``: the norm of all gradients as if unsharded (a sharded
    parameter's shards are summed over its shard group; a replicated one counts once), then
    every gradient scaled by ``max_norm / (total + 1e-6)`` when that is below 1."""
    norm_type = float(norm_type)
    model = root._fsdp_wrapped_module
    state = root._graphshard
    grads = []
    sharded, replicated = [], []
    for info in state.infos.values():
        g = _local_grad(model, info)
        if g is None:
            continue
        grads.append(g)
        (sharded if info.shard is not None else replicated).append(g.float())
    group = root.process_group
    if norm_type == float("inf"):
        local = torch.stack([g.abs().max() for g in sharded]).max() if sharded else torch.zeros(())
        if sharded:
            dist.all_reduce(local, op=dist.ReduceOp.MAX, group=group)
        total = torch.stack([local, *(g.abs().max() for g in replicated)]).max()
    else:
        local = sum((g.abs() ** norm_type).sum() for g in sharded) if sharded else torch.zeros(())
        local = torch.as_tensor(local, dtype=torch.float32)
        dist.all_reduce(local, group=group)
        rep = sum((g.abs() ** norm_type).sum() for g in replicated) if replicated else 0.0
        total = (local + rep) ** (1.0 / norm_type)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    with torch.no_grad():
        for g in grads:  # views of a flat gradient scale it in place
            g.mul_(coef.to(g.dtype))
    dtypes = {g.dtype for g in grads}
    return total.to(dtypes.pop()) if len(dtypes) == 1 else total
