"""The per-rank program of a sharded embedding collection: input distribution, lookup, output distribution.

Plain torch code over tensors, run eagerly (debugging) or traced by the ``shard_embeddings``
pass into the compiled program, where every step is a graph node:

- *input distribution*: the local batch's ids (a KJT: ``lengths`` per feature and sample,
  ``values``) go to the ranks that own their rows. Table- and column-wise features are
  selected per destination (``permute``); row-wise ids are bucketized by row block
  (``bucketize``, ids made local to the block): fbgemm's ops beside fbgemm's TBE, graphshard's
  torch ones beside the Triton TBE (``kjt_ops.py``).
  Lengths go by an all-to-all of static sizes; their sums give the sizes of the ids'
  all-to-all (data-dependent: ``.tolist()`` in the program, unbacked sizes in the graph).
  Received ids are regrouped feature-major over the world's batch ("recat").
- *lookup*: one fused TBE per rank and group (``graphshard::tbe_lookup`` or
  ``graphshard::triton_tbe_lookup``), pooled by sum;
  data-parallel tables by ``embedding_bag`` on the replicated weight (under DMP: every rank's
  bags on every rank, so the table's gradient is whole everywhere and needs no all-reduce).
- *output distribution*: pooled rows go back to the rank whose sample they are, by an
  all-to-all (table- and column-wise) or a reduce-scatter (row-wise: each rank summed only
  its rows); columns are put in the collection's order; mean pooling divides by the bag size.

Backward comes from autograd: the all-to-alls' transposes, the reduce-scatter's all-gather,
the TBE's fused update; the ids need no gradient.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from graphshard.sparse.fused_tbe import FusedTBE
from graphshard.ops import ops
from graphshard.ops.kjt import KJTOps
from graphshard.sparse.layout import COLUMN_WISE, CollectionLayout, TableLayout, TableShard
from graphshard.ops.sparse import ops as sparse_ops


@dataclass(frozen=True)
class Slot:
    """One feature's lookup in one table shard on one rank."""

    table: TableLayout
    shard: TableShard
    feature: str

    @property
    def name(self) -> str:
        return f"feature {self.feature!r} (table {self.table.name!r})"


@dataclass
class LocalPlan:
    """What one rank sends, receives and looks up, derived from the layout once."""

    a2a_slots: list[list[Slot]]          # per rank: the table-/column-wise lookups it does, in TBE order
    rw_features: list[tuple[TableLayout, str]]  # row-wise (table, feature), the same order on every rank
    dp_tables: list[TableLayout]
    twrw_features: list[tuple[TableLayout, str]] = field(default_factory=list)  # table-row-wise, table order
    twrw_by_host: list[list[int]] = field(default_factory=list)  # per host: positions in twrw_features
    columns: list[int] = field(default_factory=list)  # output column -> position in the concatenated parts


def local_plan(layout: CollectionLayout) -> LocalPlan:
    world = layout.world
    a2a = [[] for _ in range(world)]
    for t in layout.tables:
        if t.sharding_type in ("table_wise", *COLUMN_WISE):
            for shard in sorted(t.shards, key=lambda s: s.col_offset):
                a2a[shard.rank].append((t, shard))
    a2a_slots = [[Slot(t, s, f) for t, s in shards for f in t.features] for shards in a2a]
    rw = [(t, f) for t in layout.tables if t.sharding_type == "row_wise" for f in t.features]
    dp = [t for t in layout.tables if t.sharding_type == "data_parallel"]
    twrw = [(t, f) for t in layout.tables if t.sharding_type == "table_row_wise" for f in t.features]
    by_host = [[i for i, (t, _) in enumerate(twrw) if t.host(layout.local_world) == h] for h in range(layout.hosts)] \
        if twrw else []

    # where each lookup's columns start in the output, by (table, feature): a feature looked up by
    # several tables has a block of columns per table
    start, at = {}, 0
    for t in layout.tables:
        for f in t.features:
            start[(t.name, f)] = at
            at += t.embedding_dim
    pos = []  # the concatenated parts' columns, as output columns
    for slots in a2a_slots:
        for s in slots:
            first = start[(s.table.name, s.feature)] + s.shard.col_offset
            pos.extend(range(first, first + s.shard.cols))
    for t, f in rw:
        pos.extend(range(start[(t.name, f)], start[(t.name, f)] + t.embedding_dim))
    for host in by_host:
        for i in host:
            t, f = twrw[i]
            pos.extend(range(start[(t.name, f)], start[(t.name, f)] + t.embedding_dim))
    for t in dp:
        for f in t.features:
            pos.extend(range(start[(t.name, f)], start[(t.name, f)] + t.embedding_dim))
    assert sorted(pos) == list(range(layout.total_dim)), "the sharded lookups cover every output column once"
    columns = [0] * len(pos)
    for i, c in enumerate(pos):
        columns[c] = i
    return LocalPlan(a2a_slots, rw, dp, twrw_features=twrw, twrw_by_host=by_host, columns=columns)


def permute_features(values, lengths, weights, keys: list[str], features: list[str], kjt: KJTOps):
    """A KJT's (values, lengths, weights) with ``keys`` -> its ``features`` only, in that order:
    (lengths ``[len(features), batch]``, values, weights)."""
    kpos = {k: i for i, k in enumerate(keys)}
    return permute_rows([kpos[f] for f in features], lengths.view(len(keys), -1), values, weights, kjt=kjt)


def permute_rows(rows: list[int], lengths2d, values, weights, total=None, *, kjt: KJTOps):
    """The KJT's features ``rows`` (repeats allowed), in that order. ``total``: the selected ids'
    count where the caller knows it (keeps the traced sizes one expression, not a new unknown)."""
    if rows == list(range(lengths2d.shape[0])):
        return lengths2d, values, weights
    index = torch.tensor(rows, dtype=torch.int32, device=lengths2d.device)
    out = kjt.permute(index, lengths2d, values, weights, total)
    return out[0], out[1], out[2]


def destinations(lengths2d, send: list[int], world: int):
    """How many ids go to each rank (a ``[world]`` tensor), for a KJT whose features are grouped by
    destination (``send[d]`` features for rank d)."""
    owner = torch.tensor([d for d, n in enumerate(send) for _ in range(n)], dtype=torch.int64, device=lengths2d.device)
    return torch.zeros(world, dtype=lengths2d.dtype, device=lengths2d.device).index_add(
        0, owner, lengths2d.sum(1).to(lengths2d.dtype))


def send_ids(lengths2d, values, weights, send: list[int], recv_features: int, batch: int, group: str, world: int,
             in_splits: list | None = None):
    """All-to-all of a KJT whose features are grouped by destination (``send[d]`` features for rank d):
    this rank's ``recv_features`` features from each rank in turn (source-major), and the ids' split
    sizes (sent, received). ``in_splits``: the ids sent to each rank, where the caller has them."""
    flat = lengths2d.reshape(-1)
    if in_splits is None:
        in_counts = destinations(lengths2d, send, world)
    recv_lengths = ops.all_to_all(flat, [recv_features * batch] * world, [n * batch for n in send], group)
    out_counts = recv_lengths.view(world, recv_features * batch).sum(1)
    if in_splits is None:
        in_splits = in_counts.tolist()
    out_splits = out_counts.tolist()
    recv_values = ops.all_to_all(values, out_splits, in_splits, group)
    recv_weights = ops.all_to_all(weights, out_splits, in_splits, group) if weights is not None else None
    return recv_lengths, recv_values, recv_weights, in_splits, out_splits


def _exchange(lengths2d, values, weights, send: list[int], recv_features: int, batch: int, group: str, world: int,
              kjt: KJTOps):
    """``send_ids``, the received features regrouped feature-major over the world's batch (each
    feature's bags: rank 0's samples, rank 1's, ...), as a pooled TBE reads them."""
    recv_lengths, recv_values, recv_weights, _, _ = send_ids(lengths2d, values, weights, send, recv_features, batch,
                                                             group, world)
    return regroup(recv_lengths, recv_values, recv_weights, recv_features, batch, world, kjt)


def regroup(recv_lengths, recv_values, recv_weights, recv_features: int, batch: int, world: int, kjt: KJTOps):
    """Received features (source-major) -> feature-major over the world's batch: (lengths, values, weights)."""
    if recv_features == 0:
        return recv_lengths, recv_values, recv_weights
    recat = [s * recv_features + j for j in range(recv_features) for s in range(world)]
    lengths, values, weights = permute_rows(recat, recv_lengths.view(world * recv_features, batch), recv_values,
                                            recv_weights, kjt=kjt)
    return lengths.reshape(-1), values, weights


@dataclass
class Outgoing:
    """One lookup group's ids as they leave this rank, grouped by destination: ``send[d]`` features
    (rows of ``lengths2d``) for rank d; ``recv`` features come from each rank."""

    lengths2d: torch.Tensor
    values: torch.Tensor
    weights: torch.Tensor | None
    send: list[int]
    recv: int


EXCHANGED = ("a2a", "rw")
"""The groups whose ids go by one all-to-all over the collection's group, which a pipeline can
run a batch ahead (`graphshard.sparse.input_dist`); table-row-wise and data-parallel tables
exchange theirs in the step."""


def outgoing(layout: CollectionLayout, plan: LocalPlan, group: str, kpos: dict, lengths2d, values, weights,
             kjt: KJTOps) -> Outgoing:
    """The ids this rank sends for one of the ``EXCHANGED`` groups: ``"a2a"``, the table- and
    column-wise features selected per destination; ``"rw"``, the row-wise ids bucketized by row
    block."""
    if group == "a2a":
        send_rows = [kpos[s.feature] for slots in plan.a2a_slots for s in slots]
        l2d, v, w = permute_rows(send_rows, lengths2d, values, weights, kjt=kjt)
        return Outgoing(l2d, v, w, [len(s) for s in plan.a2a_slots], len(plan.a2a_slots[layout.rank]))
    n = len(plan.rw_features)
    bl, bv, bw = _bucketize([kpos[f] for _, f in plan.rw_features], lengths2d, values, weights,
                            [t.row_block for t, _ in plan.rw_features], layout.world, kjt)
    return Outgoing(bl, bv, bw, [n] * layout.world, n)


def exchanged_groups(plan: LocalPlan) -> list[str]:
    """The ``EXCHANGED`` groups a collection has."""
    return [g for g, present in zip(EXCHANGED, (any(plan.a2a_slots), bool(plan.rw_features))) if present]


def _lookup(tbe, state: list, constants, lengths, values, weights, bags: int, dtype, kjt: KJTOps):
    if not isinstance(tbe, FusedTBE):
        # no table of this group here: an empty output that reads what the collectives delivered
        # (so none of them is dead code on this rank alone) and needs a gradient (so the backward
        # has the same collectives on every rank)
        empty = state[0].to(dtype) + values[:0].to(dtype)
        if weights is not None:
            empty = empty + weights[:0].to(dtype)
        return empty.view(bags, 0)
    offsets = kjt.offsets(lengths)
    token, w, momentum, lr = state
    return tbe.lookup_with(token, w, momentum, lr, values, offsets, weights, constants)


STATE = ("token", "weights", "momentum", "lr")
"""What the program reads of each group's TBE (or its stand-in), in order."""


def group_state(tbes) -> list[torch.Tensor]:
    """The TBE tensors the program reads, in its order: the groups' (``tbes``, a ModuleDict built
    once in a fixed order), each group's ``STATE``. A module's installed forward reads them
    through its own ``_graphshard_tbes`` (so dynamo sees module buffers)."""
    return [getattr(tbe, attr) for tbe in tbes.values() for attr in STATE]


def split_state(tbes, state: list) -> tuple[dict, list]:
    """``state`` (as ``group_state`` lists it, then the data-parallel tables' weights) -> the
    groups' tensors by group name, and the data-parallel weights."""
    per_group, at = {}, 0
    for name in tbes:
        per_group[name], at = state[at:at + len(STATE)], at + len(STATE)
    return per_group, state[at:]


def read_kjt(layout: CollectionLayout, keys: list[str], values, lengths, bounds_check: bool):
    """A KJT's feature positions, batch size, ``[features, batch]`` lengths, and its ids (bounds-checked)."""
    kpos = {k: i for i, k in enumerate(keys)}
    batch = lengths.shape[0] // len(keys)
    lengths2d = lengths.view(len(keys), batch)
    if bounds_check:
        values = check_ids(layout, keys, values, lengths)
    return kpos, batch, lengths2d, values


def check_ids(layout: CollectionLayout, keys: list[str], values, lengths):
    """The bounds check, where the user gave the ids (global ids, named features). A feature looked up
    by several tables is checked against the smallest of them."""
    kpos = {k: i for i, k in enumerate(keys)}
    limits, names = [-1] * len(keys), ["an unused feature"] * len(keys)
    for t in layout.tables:
        for f in t.features:
            if limits[kpos[f]] < 0 or t.num_embeddings < limits[kpos[f]]:
                limits[kpos[f]], names[kpos[f]] = t.num_embeddings, f"feature {f!r} (table {t.name!r})"
    return sparse_ops.check_ids(values, lengths, limits, "\n".join(names))


def _bucketize(rows: list[int], lengths2d, values, weights, blocks: list[int], buckets: int, kjt: KJTOps):
    """The features ``rows`` of a KJT, each id bucketized by row block (``blocks[i]`` rows per block
    for feature ``i``; ids made local to their block): lengths ``[buckets * len(rows), batch]``."""
    l2d, v, w = permute_rows(rows, lengths2d, values, weights, kjt=kjt)
    sizes = torch.tensor(blocks, dtype=l2d.dtype, device=l2d.device)
    bl, bv, bw, _ = kjt.bucketize(l2d.reshape(-1), v, sizes, buckets, w)
    return bl.view(buckets * len(rows), lengths2d.shape[1]), bv, bw


def _blocks(back: torch.Tensor, batch: int, widths: list[int]) -> list[torch.Tensor]:
    """A pooled all-to-all's received rows as ``[batch, width]`` blocks, one per sender with columns."""
    return [b.view(batch, wd) for b, wd in zip(back.split([batch * wd for wd in widths]), widths) if wd]


def _table_row_wise(layout, plan, tbe, state, constants, kpos, lengths2d, values, weights, batch, dtype, kjt):
    """Table-row-wise: each feature's ids bucketized by row block within its table's host and sent
    to that host's ranks (one all-to-all over the world); each rank sums its blocks' rows; the
    partial sums are reduce-scattered within the host (each local rank gets the rows of the
    samples of the ranks with its local index) and sent across hosts by an all-to-all among the
    ranks with the same local index."""
    world, local, hosts = layout.world, layout.local_world, layout.hosts
    feats = plan.twrw_features
    n = len(feats)
    bl, bv, bw = _bucketize([kpos[f] for _, f in feats], lengths2d, values, weights, [t.row_block for t, _ in feats],
                            local, kjt)
    # to rank (host h, local index l): bucket l of the features whose table lives on host h
    send_rows = [d % local * n + i for d in range(world) for i in plan.twrw_by_host[d // local]]
    sl, sv, sw = permute_rows(send_rows, bl, bv, bw, kjt=kjt)
    send = [len(plan.twrw_by_host[d // local]) for d in range(world)]
    my_host, my_local = divmod(layout.rank, local)
    mine = len(plan.twrw_by_host[my_host])
    rl, rv, rw = _exchange(sl, sv, sw, send, mine, batch, layout.group, world, kjt)
    partial = _lookup(tbe, state, constants, rl, rv, rw, world * batch, dtype, kjt)  # rows: source rank, then sample
    width = partial.shape[1]
    # rows grouped by the sources' local index, so the host's reduce-scatter hands local rank l
    # the sums for the sources (h', l) of every host h'
    order = [h * local + li for li in range(local) for h in range(hosts)]
    if order != list(range(world)):
        partial = partial.view(world, batch, width).index_select(
            0, torch.tensor(order, dtype=torch.int64, device=partial.device)).reshape(world * batch, width)
    summed = ops.reduce_scatter(partial, 0, layout.host_group, local, my_local)  # [hosts * batch, width]
    widths = [sum(feats[i][0].embedding_dim for i in plan.twrw_by_host[h]) for h in range(hosts)]
    back = ops.all_to_all(summed.reshape(-1), [batch * wd for wd in widths], [batch * width] * hosts,
                          layout.cross_group)
    return _blocks(back, batch, widths)


def _gathered_bags(lengths2d, values, weights, table, group: str, world: int, rank: int, kjt: KJTOps):
    """A data-parallel table's pooled bags of this rank (``[features * batch, dim]``), computed so
    that the table's gradient needs no reduction: every rank's ids are gathered (an all-gather of
    the lengths, an all-to-all of the ids), every rank looks up every rank's bags, keeps its own
    (``ops.shard``), and in the backward gathers every rank's bag gradients back: each rank then
    computes the whole batch's table gradient itself, made the mean by ``scale_grad``. The
    exchange carries ids forward and pooled rows backward instead of an all-reduce of the whole
    table's gradient (DDP's), which is far larger for a table of many rows."""
    flat = lengths2d.reshape(-1)
    n = values.shape[0]
    all_lengths = ops.all_gather(flat, 0, world * flat.shape[0], group, world, rank)
    counts = all_lengths.view(world, -1).sum(1).tolist()
    all_values = ops.all_to_all(values.repeat(world), counts, [n] * world, group)
    all_weights = ops.all_to_all(weights.repeat(world), counts, [n] * world, group) if weights is not None else None
    offsets = kjt.offsets(all_lengths)
    pooled = F.embedding_bag(all_values, table, offsets, mode="sum", per_sample_weights=all_weights,
                             include_last_offset=True)  # [world * features * batch, dim], rank-major
    mine = ops.shard(pooled, 0, group, world, rank)
    return sparse_ops.scale_grad(mine, 1.0 / world)


def sharded_lookup(layout: CollectionLayout, plan: LocalPlan, tbes: dict, keys: list[str],
                   values: torch.Tensor, lengths: torch.Tensor, weights: torch.Tensor | None,
                   state: list[torch.Tensor], dtype: torch.dtype, constants: dict | None = None,
                   bounds_check: bool = True, received: dict | None = None) -> torch.Tensor:
    """The pooled ``[batch, total_dim]`` output of this rank's samples, columns in the collection's order.

    ``keys``: the KJT's features (any order, a superset of the collection's); ``state``: the
    tensors ``SparseCollection.state_tensors()`` lists (each TBE's token, weights, optimizer
    state and learning rate, then each data-parallel table's weight); ``constants``: per TBE,
    its layout tensors when they are traced as inputs (default: the TBE's own); ``received``: the
    ``EXCHANGED`` groups' ids as they arrived, (lengths, values, weights) by group, where a pipeline
    exchanged them a batch ahead (`graphshard.sparse.input_dist`).
    """
    constants = constants or {}
    world, rank, group = layout.world, layout.rank, layout.group
    kjt = layout.kjt_ops
    kpos, batch, lengths2d, values = read_kjt(layout, keys, values, lengths, bounds_check)
    parts = []
    per_group, dp_weights = split_state(tbes, state)

    def arrived(name: str):  # a group's ids on this rank: exchanged here, or a batch ahead
        if received is not None:
            return received[name]
        o = outgoing(layout, plan, name, kpos, lengths2d, values, weights, kjt)
        return _exchange(o.lengths2d, o.values, o.weights, o.send, o.recv, batch, group, world, kjt)

    if any(plan.a2a_slots):
        rl, rv, rw = arrived("a2a")
        pooled = _lookup(tbes["a2a"], per_group["a2a"], constants.get("a2a"), rl, rv, rw, world * batch, dtype, kjt)
        widths = [sum(s.shard.cols for s in slots) for slots in plan.a2a_slots]
        back = ops.all_to_all(pooled.reshape(-1), [batch * d for d in widths], [batch * pooled.shape[1]] * world, group)
        parts.extend(_blocks(back, batch, widths))

    if plan.rw_features:
        rl, rv, rw = arrived("rw")
        partial = _lookup(tbes["rw"], per_group["rw"], constants.get("rw"), rl, rv, rw, world * batch, dtype, kjt)
        parts.append(ops.reduce_scatter(partial, 0, group, world, rank))

    if plan.twrw_features:
        parts.extend(_table_row_wise(layout, plan, tbes["twrw"], per_group["twrw"], constants.get("twrw"), kpos,
                                     lengths2d, values, weights, batch, dtype, kjt))

    for t, weight in zip(plan.dp_tables, dp_weights):
        rows = [kpos[f] for f in t.features]
        l2d, v, w = permute_rows(rows, lengths2d, values, weights, kjt=kjt)
        if layout.dp_gathered:
            pooled = _gathered_bags(l2d, v, w, weight, group, world, rank, kjt)
        else:
            offsets = kjt.offsets(l2d.reshape(-1))
            pooled = F.embedding_bag(v, weight, offsets, mode="sum", per_sample_weights=w, include_last_offset=True)
        parts.append(pooled.view(len(t.features), batch, t.embedding_dim).transpose(0, 1)
                     .reshape(batch, len(t.features) * t.embedding_dim).to(dtype))

    out = torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]
    if plan.columns != list(range(len(plan.columns))):
        out = out.index_select(1, torch.tensor(plan.columns, dtype=torch.int64, device=out.device))
    if any(t.pooling == "mean" for t in layout.tables):
        rows = [kpos[f] for t in layout.tables for f in t.features for _ in range(t.embedding_dim)]
        mean = [t.pooling == "mean" for t in layout.tables for f in t.features for _ in range(t.embedding_dim)]
        sizes = lengths2d.index_select(0, torch.tensor(rows, dtype=torch.int64, device=out.device)).t()
        keep = torch.tensor([not m for m in mean], device=out.device)
        out = out / (sizes.clamp(min=1).to(out.dtype)).masked_fill(keep, 1.0)
    return out
