"""The per-rank program of a sharded *sequence* collection (TorchRec's ``EmbeddingCollection``).

A sequence collection returns one row per id (each feature's ids' embeddings, ``[ids, dim]``),
not one pooled row per sample. The program has the pooled one's shape (``program.py``):

- *input distribution*: as pooled. Table- and column-wise features go to their owners by an
  all-to-all, grouped by the shards' width (each width group is its own exchange and lookup);
  row-wise ids are bucketized by row block (``bucketize`` with ``sequence=True``, which also
  gives the permutation back to the ids' order).
- *lookup*: the received ids in the order they arrived (source rank, then feature, then
  sample), each id its own bag of a pooled TBE over one table: the rank's table shards of the
  group stacked (they share the width), ids made row indices of the stack by adding their
  shard's first row. fbgemm's CPU kernels have no sequence (``PoolingMode.NONE``) path of
  their own; a bag of one id pooled by sum is the id's row, and the fused optimizers update
  per row, so stacking the shards changes nothing they compute.
- *output distribution*: the rows go back to the ranks that sent the ids, by an all-to-all
  with the ids' split sizes swapped, and arrive in the order the ids were sent. Row-wise rows
  are put back in the ids' order by the bucketize permutation; column-wise blocks are put side
  by side; each feature's rows are its part of the result.

The per-feature row counts are data-dependent (``.tolist()`` of the lengths' sums: unbacked
sizes in the graph); the whole program compiles once for every batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from graphshard.sparse.fused_tbe import FusedTBE
from graphshard.ops import ops
from graphshard.sparse.layout import CollectionLayout
from graphshard.sparse.program import LocalPlan, Slot, permute_rows, read_kjt, send_ids, split_state


@dataclass(frozen=True)
class WidthGroup:
    """The table- and column-wise shards of one width: one exchange and one lookup."""

    name: str
    width: int
    slots: list[list[Slot]]  # per rank, in its TBE's order


def width_groups(plan: LocalPlan) -> list[WidthGroup]:
    """The table- and column-wise lookups split by shard width (a sequence TBE has one width); the
    same groups, in the same order, on every rank."""
    widths = sorted({s.shard.cols for slots in plan.a2a_slots for s in slots})
    return [WidthGroup(f"a2a_d{w}", w, [[s for s in slots if s.shard.cols == w] for slots in plan.a2a_slots])
            for w in widths]


def row_starts(shards) -> list[int]:
    """Where each shard starts in its group's stacked table."""
    starts, at = [], 0
    for s in shards:
        starts.append(at)
        at += s.rows
    return starts


def _stacked_starts(slots: list[Slot]) -> list[int]:
    """Per slot: its shard's first row in the stacked table (shards in first-use order)."""
    shards = list(dict.fromkeys((s.table.name, s.shard) for s in slots))
    starts = dict(zip(shards, row_starts([sh for _, sh in shards])))
    return [starts[(s.table.name, s.shard)] for s in slots]


def _lookup_rows(tbe, state: list, constants, slot_counts, ids, starts: list[int], width: int, dtype):
    """One row per id: ``ids`` come in slot blocks of ``slot_counts`` ids; ``starts[i]`` is slot i's
    first row in the stacked table."""
    if not isinstance(tbe, FusedTBE):
        # no shard of this group here (see program._lookup): an empty result tied to the state and
        # the received ids, so this rank's backward has the group's collectives too
        return (state[0].to(dtype) + ids[:0].to(dtype)).view(0, width)
    if any(starts):
        first = torch.tensor(starts, dtype=ids.dtype, device=ids.device)
        ids = ids + torch.repeat_interleave(first, slot_counts, output_size=ids.shape[0])
    offsets = torch.arange(ids.shape[0] + 1, dtype=ids.dtype, device=ids.device)
    token, weights, momentum, lr = state
    return tbe.lookup_with(token, weights, momentum, lr, ids, offsets, None, constants)


def sequence_lookup(layout: CollectionLayout, plan: LocalPlan, tbes: dict, keys: list[str], values: torch.Tensor,
                    lengths: torch.Tensor, state: list[torch.Tensor], dtype: torch.dtype,
                    constants: dict | None = None, bounds_check: bool = True,
                    need_indices: bool = False) -> list[torch.Tensor]:
    """Each of the collection's features' rows (``[ids, dim]``, its ids in the KJT's order), in the
    collection's feature order; with ``need_indices``, then each feature's ids."""
    constants = constants or {}
    world, rank, group = layout.world, layout.rank, layout.group
    kjt = layout.kjt_ops
    kpos, batch, lengths2d, values = read_kjt(layout, keys, values, lengths, bounds_check)
    counts = lengths2d.sum(1).tolist()  # ids per feature: the program's one host sync of its own
    for c in counts:
        torch._check(c >= 0)
    torch._check(sum(counts) == values.shape[0])
    per_group, dp_weights = split_state(tbes, state)
    blocks: dict[tuple[str, str, int], torch.Tensor] = {}  # (table, feature, first column) -> rows

    def select(features: list[str]):
        rows = [kpos[f] for f in features]
        sizes = [counts[r] for r in rows]
        l2d, v, _ = permute_rows(rows, lengths2d, values, None, sum(sizes), kjt=kjt)
        return l2d, v, sizes

    for g in width_groups(plan):
        sent = [s for slots in g.slots for s in slots]
        l2d, v, sizes = select([s.feature for s in sent])
        in_splits = [sum(counts[kpos[s.feature]] for s in slots) for slots in g.slots]
        mine = g.slots[rank]
        rl, rv, _, _, out_splits = send_ids(l2d, v, None, [len(s) for s in g.slots], len(mine), batch, group,
                                            world, in_splits)
        rows = _lookup_rows(tbes[g.name], per_group[g.name], constants.get(g.name),
                            rl.view(world * len(mine), batch).sum(1), rv, _stacked_starts(mine) * world, g.width,
                            dtype)
        back = ops.all_to_all(rows, in_splits, out_splits, group)  # in the order the ids were sent
        for s, piece in zip(sent, back.split(sizes)):
            blocks[(s.table.name, s.feature, s.shard.col_offset)] = piece

    if plan.rw_features:
        feats = plan.rw_features
        n = len(feats)
        l2d, v, sizes = select([f for _, f in feats])
        block = torch.tensor([t.row_block for t, _ in feats], dtype=l2d.dtype, device=l2d.device)
        bl, bv, _, unbucketize = kjt.bucketize(l2d.reshape(-1), v, block, world, None, sequence=True)
        rl, rv, _, in_splits, out_splits = send_ids(bl.view(world * n, batch), bv, None, [n] * world, n, batch, group,
                                                    world)
        mine = [Slot(t, t.shard_on(rank)[0], f) for t, f in feats]
        rows = _lookup_rows(tbes["rw"], per_group["rw"], constants.get("rw"), rl.view(world * n, batch).sum(1), rv,
                            _stacked_starts(mine) * world, layout.tables[0].embedding_dim, dtype)
        back = ops.all_to_all(rows, in_splits, out_splits, group)  # in bucketized order
        back = back.index_select(0, unbucketize)  # in the ids' order
        torch._check(back.shape[0] == sum(sizes))
        for (t, f), piece in zip(feats, back.split(sizes)):
            blocks[(t.name, f, 0)] = piece

    for t, weight in zip(plan.dp_tables, dp_weights):
        _, v, sizes = select(list(t.features))
        for f, piece in zip(t.features, F.embedding(v, weight).to(dtype).split(sizes)):
            blocks[(t.name, f, 0)] = piece

    out = []
    for t, f in ((t, f) for t in layout.tables for f in t.features):  # a feature of several tables: each's rows
        mine = sorted(((c, b) for (tn, g, c), b in blocks.items() if (tn, g) == (t.name, f)), key=lambda x: x[0])
        out.append(torch.cat([b for _, b in mine], dim=1) if len(mine) > 1 else mine[0][1])
    if need_indices:
        _, v, sizes = select(list(layout.features))
        out.extend(v.split(sizes))
    return out
