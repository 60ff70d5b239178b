"""``ShardEmbedding`` plan specs: TorchRec's sharding types for plain ``nn.EmbeddingBag`` modules.

``shard()`` calls `shard_plan_embeddings` before it resolves the plan: each module a
``ShardEmbedding`` key matches becomes a one-table collection (one feature, ``"input"``) over
the spec's mesh axis; its forward becomes the logical lookup on the bag's ids, which the
``shard_embeddings`` pass expands like a TorchRec collection's. A fused table's parameter moves
into the TBE (the plan's unit specs then no longer see it); state-dict hooks keep
``<fqn>.weight`` readable and loadable as a DTensor. A data-parallel table keeps its parameter,
which the plan's unit specs lay out like any dense one.
"""

from __future__ import annotations

import logging
import types

import torch
import torch.nn as nn

from graphshard.sparse.fused_tbe import choose_kernel
from graphshard.plan import Plan, ShardEmbedding, fqn_match
from graphshard.sparse.collection import SparseCollection, new_key
from graphshard.sparse.layout import CollectionLayout, TableLayout, TableShard
from graphshard.ops.sparse import ops as sparse_ops
from graphshard.sparse.program import group_state

log = logging.getLogger("graphshard.sparse")

_OPTIMIZERS = ("sgd", "adagrad", "rowwise_adagrad")
"""``ShardEmbedding.optimizer``: fbgemm's EXACT_SGD, EXACT_ADAGRAD, EXACT_ROWWISE_ADAGRAD."""


def shard_plan_embeddings(model: nn.Module, plan: Plan) -> list[SparseCollection]:
    out, done = [], set()
    for key, spec in plan.rules.items():
        if not isinstance(spec, ShardEmbedding):
            continue
        hits = [(fqn, m) for fqn, m in model.named_modules(remove_duplicate=False) if fqn_match(fqn, key)]
        if not hits:
            raise ValueError(f"plan key {key!r} (ShardEmbedding) matches no module of {type(model).__name__}")
        for fqn, mod in hits:
            if id(mod) in done:
                continue  # a shared module: sharded once
            done.add(id(mod))
            out.append(_shard_module(fqn, mod, spec, plan))
    return out


def _axis(plan: Plan, spec: ShardEmbedding, fqn: str) -> str:
    if spec.mesh_axis is not None:
        if spec.mesh_axis not in plan.axis_names:
            raise ValueError(f"{fqn}: ShardEmbedding mesh_axis {spec.mesh_axis!r} is not an axis of the mesh {plan.axis_names}")
        return spec.mesh_axis
    if not plan.data_parallel_axes:
        raise ValueError(f"{fqn}: ShardEmbedding needs a data-parallel mesh axis (each rank its own batch), or mesh_axis=")
    return plan.data_parallel_axes[-1]


def _axis_groups(plan: Plan, axis: str) -> tuple[tuple[int, ...], ...] | None:
    """Every group of global ranks along ``axis`` (None on a 1-D mesh: one group, the world's)."""
    mesh = plan.mesh
    if mesh.ndim == 1:
        return None
    dim = list(mesh.mesh_dim_names).index(axis)
    ranks = mesh.mesh.movedim(dim, -1).reshape(-1, mesh.mesh.shape[dim])
    return tuple(tuple(int(r) for r in row) for row in ranks)


def _shards(spec: ShardEmbedding, rows: int, dim: int, world: int, fqn: str) -> tuple[TableShard, ...]:
    kind = spec.sharding_type
    if kind == "table_wise":
        rank = spec.ranks[0] if spec.ranks else 0
        return (TableShard(rank, 0, rows, 0, dim),)
    if kind == "row_wise":
        block = -(-rows // world)
        return tuple(TableShard(r, r * block, min(block, rows - r * block), 0, dim) for r in range(world))
    if kind == "column_wise":
        ranks = list(spec.ranks) if spec.ranks else list(range(world))
        if dim % len(ranks):
            raise ValueError(
                f"{fqn}: column-wise sharding over {len(ranks)} ranks needs the embedding dim ({dim}) to divide "
                f"into {len(ranks)} equal blocks; choose ranks that divide it"
            )
        cols = dim // len(ranks)
        return tuple(TableShard(r, 0, rows, i * cols, cols) for i, r in enumerate(ranks))
    if kind == "data_parallel":
        return tuple(TableShard(r, 0, rows, 0, dim) for r in range(world))
    raise NotImplementedError(
        f"{fqn}: ShardEmbedding({kind!r}); plain modules take table_wise, row_wise, column_wise or data_parallel "
        "(table-row-wise needs hosts: use TorchRec's DistributedModelParallel)"
    )


def _shard_module(fqn: str, mod: nn.Module, spec: ShardEmbedding, plan: Plan) -> SparseCollection:
    if not isinstance(mod, nn.EmbeddingBag):
        raise NotImplementedError(
            f"{fqn} is a {type(mod).__name__}; ShardEmbedding shards nn.EmbeddingBag (for a vocabulary-parallel "
            "nn.Embedding use RowwiseParallel)"
        )
    if mod.mode not in ("sum", "mean"):
        raise NotImplementedError(f"{fqn}: nn.EmbeddingBag(mode={mod.mode!r}); sharded bags pool by 'sum' or 'mean'")
    for attr in ("padding_idx", "max_norm"):
        if getattr(mod, attr) is not None:
            fix = ("drop the padding id from the bags (or give it weight 0 in per_sample_weights)"
                   if attr == "padding_idx" else "renormalize the rows outside the model, or leave this table unsharded")
            raise NotImplementedError(f"{fqn}: nn.EmbeddingBag({attr}={getattr(mod, attr)}) is not supported sharded: "
                                      f"{fix}")
    if spec.optimizer not in _OPTIMIZERS:
        raise ValueError(f"{fqn}: ShardEmbedding optimizer {spec.optimizer!r}; expected one of {_OPTIMIZERS}")
    if spec.kernel not in ("auto", "fbgemm", "triton"):
        raise ValueError(f"{fqn}: ShardEmbedding kernel {spec.kernel!r}; expected 'auto', 'fbgemm' or 'triton'")
    device = plan.mesh.device_type
    kernel, _ = choose_kernel(spec.kernel, device, fqn)  # 'auto' needs no note; 'fbgemm' is refused where it cannot run
    axis = _axis(plan, spec, fqn)
    group = plan.group(axis)
    import torch.distributed as dist

    world, rank = dist.get_world_size(group), dist.get_rank(group)
    rows, dim = mod.weight.shape
    shards = _shards(spec, rows, dim, world, fqn)
    table = TableLayout(name=fqn or "weight", num_embeddings=rows, embedding_dim=dim, features=("input",),
                        pooling=mod.mode, sharding_type=spec.sharding_type, shards=shards)
    layout = CollectionLayout(key=new_key(fqn), fqns=(fqn,), tables=(table,), weighted=False, world=world,
                              rank=rank, group=group.group_name,
                              global_ranks=tuple(dist.get_process_group_ranks(group)),
                              all_groups=_axis_groups(plan, axis), kernel=kernel, device=device)
    if table.fused and kernel != spec.kernel:
        log.info("%s: ShardEmbedding kernel %r runs the %s TBE on %s", fqn, spec.kernel, kernel, device)
    fused = {"optimizer": spec.optimizer, "learning_rate": spec.learning_rate, "eps": spec.eps}
    dp = {table.name: mod.weight} if not table.fused else {}
    coll = SparseCollection(layout, {table.name: mod.weight.detach()}, dp, fused)
    if table.fused:
        del mod._parameters["weight"]
        mod.register_state_dict_post_hook(_state_dict_hook)
        mod.register_load_state_dict_pre_hook(_load_hook)
    mod._graphshard_tbes = coll.tbes
    mod._graphshard_sparse = coll
    mod.forward = types.MethodType(_forward, mod)
    return coll


def _forward(self, input, offsets=None, per_sample_weights=None):
    coll: SparseCollection = self._graphshard_sparse
    if input.dim() == 2:
        if offsets is not None:
            raise ValueError(f"{coll.layout.fqns[0]}: offsets must be None for a 2-D input (one bag per row)")
        values = input.reshape(-1)
        lengths = torch.full((input.shape[0],), input.shape[1], dtype=input.dtype, device=input.device)
        if per_sample_weights is not None:
            per_sample_weights = per_sample_weights.reshape(-1)
    else:
        if offsets is None:
            raise ValueError(f"{coll.layout.fqns[0]}: a 1-D input needs offsets")
        ends = offsets[1:] if self.include_last_offset else torch.cat([offsets[1:], offsets.new_full((1,), input.numel())])
        starts = offsets[:-1] if self.include_last_offset else offsets
        values, lengths = input, (ends - starts).to(input.dtype)
    if per_sample_weights is not None and self.mode != "sum":
        raise ValueError(f"{coll.layout.fqns[0]}: per_sample_weights need mode='sum' (as nn.EmbeddingBag)")
    state = group_state(self._graphshard_tbes) + [self.weight for _ in coll.plan.dp_tables]
    return sparse_ops.embedding_bags(values, lengths, per_sample_weights, state, coll.layout.key, ["input"],
                                     coll.layout.total_dim)


def _state_dict_hook(module, state_dict, prefix, local_metadata):
    from graphshard.sparse.state import table_dtensor

    coll = module._graphshard_sparse
    for name in [k for k in state_dict if k.startswith(prefix + "_graphshard_tbes.")]:
        del state_dict[name]
    state_dict[prefix + "weight"] = table_dtensor(coll, coll.layout.tables[0].name)


def _load_hook(module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
    from graphshard.sparse.state import load_table

    coll = module._graphshard_sparse
    key = prefix + "weight"
    if key in state_dict:
        load_table(coll, coll.layout.tables[0], state_dict.pop(key), key)
    for name in [k for k in state_dict if k.startswith(prefix + "_graphshard_tbes.")]:
        del state_dict[name]
