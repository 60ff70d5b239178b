"""Sharded tables in the state dict: each fused table as a DTensor over the ranks that hold it.

- row-wise: ``Shard(0)`` over the whole mesh (TorchRec's row blocks are torch.chunk's pieces);
- table-row-wise: ``Shard(0)`` over the mesh of its host's ranks;
- column-wise (and table-column-wise): ``Shard(1)`` over the mesh of the ranks that hold the column
  blocks, in column order, where the blocks are equal and a rank holds one; otherwise (several
  blocks on a rank, as TorchRec's planner makes with ``min_partition``, or blocks of unequal width)
  there is no DTensor placement for the layout, and the table is TorchRec's own form, a
  ``ShardedTensor`` of the blocks (each rank's pieces views of its TBE, like the DTensors');
- table-wise: ``Replicate()`` over a one-rank mesh: the owner's whole table.

The local tensor of each DTensor is a view of the TBE's weights, so a state dict reads the live
values and loading writes into the TBE. Ranks outside a table's mesh hold an empty piece;
``torch.distributed.checkpoint`` saves and loads each piece by its global offset, so a
checkpoint reloads under another plan or world size.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from graphshard import _compat
from graphshard.sparse.layout import COLUMN_WISE


def _mesh(coll, ranks: tuple[int, ...]) -> DeviceMesh:
    """The collection's mesh of ``ranks`` (global), created on first use and kept with the collection:
    its process groups live as long as the sharded model that reads them, not the process."""
    mesh = coll.table_meshes.get(ranks)
    if mesh is None:
        mesh = coll.table_meshes[ranks] = DeviceMesh(coll.layout.device, list(ranks))
    return mesh


def _no_dtensor_form(t) -> bool:
    """A column-wise table with several blocks on one rank or blocks of unequal width: no DTensor
    placement lays it out (``Shard(1)`` is one block per rank, torch.chunk's widths)."""
    if t.sharding_type not in COLUMN_WISE:
        return False
    ranks = [s.rank for s in t.shards]
    return len(set(ranks)) != len(ranks) or len({s.cols for s in t.shards}) != 1


def _meshes(coll):
    """Per table: (mesh, placements) of its DTensor; None for a table shown as a ShardedTensor
    (`_no_dtensor_form`)."""
    out = {}
    world = coll.layout.world
    for t in coll.layout.tables:
        if t.sharding_type == "row_wise":
            out[t.name] = (tuple(range(world)), [Shard(0)])
        elif t.sharding_type == "table_row_wise":
            out[t.name] = (tuple(s.rank for s in sorted(t.shards, key=lambda s: s.row_offset)), [Shard(0)])
        elif t.sharding_type == "table_wise":
            out[t.name] = ((t.shards[0].rank,), [Replicate()])
        elif _no_dtensor_form(t):
            out[t.name] = None
        elif t.sharding_type in COLUMN_WISE:
            shards = sorted(t.shards, key=lambda s: s.col_offset)
            out[t.name] = (tuple(s.rank for s in shards), [Shard(1)])
    return out


def _global(coll, ranks) -> tuple[int, ...]:
    g = coll.layout.global_ranks
    return tuple(ranks) if g is None else tuple(g[r] for r in ranks)


def _table_mesh(coll, ranks) -> DeviceMesh:
    """The mesh of the ranks (along the collection's axis) that hold a table. On an N-D mesh every
    group along the axis has its own such mesh; each rank creates all of them, in the same order
    (creating a mesh creates process groups, which every rank must do together), and uses its own."""
    groups = coll.layout.all_groups
    if groups is None:
        return _mesh(coll, _global(coll, ranks))
    mine = None
    for g in groups:
        mesh = _mesh(coll, tuple(g[r] for r in ranks))
        if tuple(g) == tuple(coll.layout.global_ranks):
            mine = mesh
    return mine


def _dtensor(coll, table: str, ranks, placements) -> DTensor:
    t = coll.table(table)
    mesh = _table_mesh(coll, ranks)
    pieces = coll.local_pieces(table)
    local = pieces[0][1] if pieces else torch.empty(0, t.embedding_dim, device=coll.layout.device)
    return DTensor.from_local(local, mesh, placements, run_check=False,
                              shape=torch.Size((t.num_embeddings, t.embedding_dim)),
                              stride=(t.embedding_dim, 1))


def _gather_sharded_tensor(value) -> torch.Tensor:
    """A TorchRec ``ShardedTensor`` (its state dict's table) as the full table on every rank."""
    import torch.distributed as dist

    shards = value.local_shards()
    full = torch.zeros(value.size(), dtype=value.dtype, device=shards[0].tensor.device if shards else None)
    for s in shards:
        (r, c), (nr, nc) = s.metadata.shard_offsets, s.metadata.shard_sizes
        full[r:r + nr, c:c + nc] = s.tensor
    dist.all_reduce(full)  # every element is in exactly one rank's shard
    return full


def _sharded_tensor(coll, table: str):
    """A table without a DTensor form as TorchRec's ShardedTensor: one shard per column block."""
    t = coll.table(table)
    layout = coll.layout
    return _compat.sharded_tensor(
        [((s.row_offset, s.col_offset), piece) for s, piece in coll.local_pieces(table)],
        [(s.rank, (s.row_offset, s.col_offset), (s.rows, s.cols)) for s in t.shards],
        (t.num_embeddings, t.embedding_dim), layout.group, layout.device)


def table_dtensor(coll, table: str):
    """A fused table of ``coll`` as a DTensor over the ranks that hold it (a view of the TBE), or, for
    a layout DTensor cannot place, TorchRec's ShardedTensor of its blocks."""
    placed = _meshes(coll)[table]
    if placed is None:
        return _sharded_tensor(coll, table)
    return _dtensor(coll, table, *placed)


def weight_key(coll, fqn: str, table: str) -> str:
    """A table's weight in the state dict of the module under ``fqn``: TorchRec's name."""
    return f"{fqn + '.' if fqn else ''}{coll.layout.attr}.{table}.weight"


class _FusedInBackward:
    """What ``_in_backward_optimizers`` holds on a fused table's parameter: TorchRec's
    ``in_backward_optimizer_filter`` only asks whether the attribute is there (the table's update is
    ``fused_optimizer``'s, applied in the backward)."""

    def __repr__(self) -> str:
        return "graphshard fused TBE optimizer"


def table_parameter(coll, table: str):
    """A fused table as ``named_parameters`` lists it: one object per table and collection (so
    duplicates drop by identity), a view of the TBE like the state dict's (a DTensor parameter; a
    ShardedTensor where no DTensor placement fits), without a gradient of its own (the fused
    optimizer updates it in the backward) and marked as TorchRec marks its fused tables."""
    cache = coll.table_params
    if table not in cache:
        value = table_dtensor(coll, table)
        if isinstance(value, DTensor):
            value = torch.nn.Parameter(value, requires_grad=False)
        value._in_backward_optimizers = [_FusedInBackward()]
        cache[table] = value
    return cache[table]


def table_entries(coll, prefix: str) -> dict:
    return {f"{prefix}{coll.layout.attr}.{name}.weight": table_dtensor(coll, name) for name in _meshes(coll)}


def load_table(coll, t, value, key: str) -> None:
    """Copies ``value`` (a DTensor of any layout, a TorchRec ShardedTensor or a full tensor) into this
    rank's pieces of table ``t``."""
    if _compat.is_sharded_tensor(value):
        value = _gather_sharded_tensor(value)
    elif isinstance(value, DTensor):
        if value.device_mesh.get_coordinate() is None:
            if coll.local_pieces(t.name):
                raise ValueError(
                    f"{key}: the DTensor lives on ranks {value.device_mesh.mesh.flatten().tolist()}, without this rank, "
                    "which holds a piece of the table under this plan; load across plans through "
                    "torch.distributed.checkpoint (it reshards), or pass full tensors"
                )
            return  # this rank holds none of it, nor of the table
        value = _full_tensor(value)
    if tuple(value.shape) != (t.num_embeddings, t.embedding_dim):
        raise ValueError(f"{key}: shape {tuple(value.shape)} does not match the table's "
                         f"({t.num_embeddings}, {t.embedding_dim})")
    with torch.no_grad():
        for s, piece in coll.local_pieces(t.name):
            piece.copy_(value[s.row_offset:s.row_offset + s.rows, s.col_offset:s.col_offset + s.cols])


def _full_tensor(value: DTensor) -> torch.Tensor:
    """``value.full_tensor()`` for a mesh in any rank order. torch gathers in the process group's
    rank order, which is ascending global ranks; a mesh whose ranks are not ascending (a
    column-wise table whose blocks sit on ranks [1, 0]) would come back with its blocks swapped.
    Such meshes are one-dimensional with equal blocks (``_meshes``): gathered here and put in the
    mesh's order."""
    ranks = value.device_mesh.mesh.flatten().tolist()
    if ranks == sorted(ranks):
        return value.full_tensor()
    local = value.to_local().contiguous()
    parts = [torch.empty_like(local) for _ in ranks]
    dist.all_gather(parts, local, group=value.device_mesh.get_group())  # in ascending global rank order
    by_rank = dict(zip(sorted(ranks), parts))
    (placement,) = value.placements
    if isinstance(placement, Replicate):
        return by_rank[ranks[0]]
    return torch.cat([by_rank[r] for r in ranks], dim=placement.dim)


def load_tables(coll, state: dict, prefix: str, missing: list) -> None:
    """Copies each fused table's entry (a DTensor of any layout, or a full tensor) into this
    rank's pieces; removes the entries it used from ``state``."""
    for fqn in coll.layout.fqns:
        for t in coll.layout.tables:
            if not t.fused:
                continue
            key = prefix + weight_key(coll, fqn, t.name)
            if key not in state:
                if fqn == coll.layout.fqns[0] and not any(
                        prefix + weight_key(coll, f, t.name) in state for f in coll.layout.fqns):
                    missing.append(key)
                continue
            load_table(coll, t, state.pop(key), key)


def optimizer_state(coll, table: str) -> DTensor:
    """A fused table's optimizer state as a DTensor over the ranks that hold the table, a view of the
    TBE's state: row-wise Adagrad keeps one value per row (per row and column block for a
    column-wise table: ``[rows, blocks]``, ``Shard(1)``), Adagrad one per element (the table's
    layout). The kind is the collection's (``fused_params``), the same on every rank."""
    from graphshard.sparse.fused_tbe import optimizer_name

    placed = _meshes(coll)[table]
    t = coll.table(table)
    kind = optimizer_name(coll.fused_params.get("optimizer", "sgd"))
    if placed is None:
        return _sharded_state(coll, t, kind)
    ranks, placements = placed
    pieces = coll.local_state(table)
    local = pieces[0][1] if pieces else None
    device = coll.layout.device
    if kind == "rowwise_adagrad":
        if t.sharding_type == "column_wise":
            blocks = len(t.shards)
            shape = (t.num_embeddings, blocks)
            local = local.view(-1, 1) if local is not None else torch.empty(0, 0, device=device)
        else:
            shape, local = (t.num_embeddings,), (local if local is not None else torch.empty(0, device=device))
    else:
        shape = (t.num_embeddings, t.embedding_dim)
        local = local if local is not None else torch.empty(0, t.embedding_dim, device=device)
    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(local, _table_mesh(coll, ranks), placements, run_check=False, shape=torch.Size(shape),
                              stride=stride)


def _sharded_state(coll, t, kind: str):
    """The optimizer state of a table without a DTensor form, as a ShardedTensor: row-wise Adagrad's
    ``[rows, blocks]`` (block j, in column order, is column j), Adagrad's in the table's layout."""
    blocks = sorted(t.shards, key=lambda s: s.col_offset)
    layout = coll.layout
    if kind == "rowwise_adagrad":
        index = {s: j for j, s in enumerate(blocks)}
        return _compat.sharded_tensor(
            [((0, index[s]), state.view(-1, 1)) for s, state in coll.local_state(t.name)],
            [(s.rank, (0, j), (s.rows, 1)) for j, s in enumerate(blocks)],
            (t.num_embeddings, len(blocks)), layout.group, layout.device)
    return _compat.sharded_tensor(
        [((s.row_offset, s.col_offset), state) for s, state in coll.local_state(t.name)],
        [(s.rank, (s.row_offset, s.col_offset), (s.rows, s.cols)) for s in t.shards],
        (t.num_embeddings, t.embedding_dim), layout.group, layout.device)
