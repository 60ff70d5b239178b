"""One sharded embedding collection on one rank: its fused TBEs, its data-parallel tables, its program.

The collection's tables live in at most two fused TBEs on this rank (``"a2a"``: the table- and
column-wise shards it owns; ``"rw"``: its row block of each row-wise table), held as modules
under the user's module, so the compiled program receives their tensors as inputs; the
data-parallel tables stay the module's own ``nn.Parameter`` s. ``tables()`` gives every
table's local piece as a view of that storage (the state dict reads and writes through it).
"""

from __future__ import annotations

import itertools
import weakref

import torch
import torch.nn as nn

from graphshard.kernels.fbgemm_tbe import FusedTBE, TBESlot
from graphshard.sparse.layout import CollectionLayout, TableLayout, TableShard
from graphshard.sparse.program import LocalPlan, group_state, local_plan, permute_features, permute_rows, sharded_lookup

_COLLECTIONS: "weakref.WeakValueDictionary[str, SparseCollection]" = weakref.WeakValueDictionary()
_ids = itertools.count()


def collection_for(key: str) -> "SparseCollection":
    coll = _COLLECTIONS.get(key)
    if coll is None:
        raise KeyError(f"no sharded embedding collection {key!r} (its model was freed?)")
    return coll


def new_key(fqn: str) -> str:
    return f"s{next(_ids)}/{fqn}"


def _distinct_tables(tables) -> list[TableLayout]:
    return list({t.name: t for t in tables}.values())


class NoTables(nn.Module):
    """Stands for a group's TBE on a rank that holds none of its tables. The rank still takes part
    in the group's collectives, so its (empty) pooled output must need a gradient as the other
    ranks' do: its backward then has the same collectives. The token is that gradient's anchor."""

    def __init__(self, fused_params: dict):
        super().__init__()
        self.register_buffer("token", torch.zeros(0, requires_grad=True), persistent=False)
        self.register_buffer("weights", torch.zeros(0), persistent=False)
        self.register_buffer("momentum", torch.zeros(0), persistent=False)
        self.register_buffer("lr", torch.tensor(float(fused_params.get("learning_rate", 0.0))), persistent=False)

    def constants(self) -> dict:
        return {}


class SparseCollection:
    """The sharded state and program of one collection on this rank.

    ``weights``: each table's full logical weight (``[rows, dim]``, on any device); this rank
    copies its pieces into the TBEs. ``dp_params``: the data-parallel tables' parameters, by
    table name (they stay where they are). ``fused_params``: fbgemm's optimizer keywords.
    """

    def __init__(self, layout: CollectionLayout, weights: dict[str, torch.Tensor], dp_params: dict[str, nn.Parameter],
                 fused_params: dict, bounds_check: bool = True):
        layout.check()
        self.layout = layout
        self.plan: LocalPlan = local_plan(layout)
        self.fused_params = dict(fused_params)
        self.bounds_check = bounds_check
        self.dp_params = dp_params
        self.tbes = nn.ModuleDict()
        self.pieces: dict[str, list[tuple[TableShard, str, int]]] = {}  # table -> (shard, tbe name, table index)
        rank = layout.rank
        twrw_here = [self.plan.twrw_features[i][0] for i in (self.plan.twrw_by_host[rank // layout.local_world]
                                                             if self.plan.twrw_features else [])]
        groups = {
            "a2a": list({(s.table.name, s.shard): (s.table, s.shard) for s in self.plan.a2a_slots[rank]}.values()),
            "rw": [(t, t.shard_on(rank)[0]) for t in _distinct_tables(t for t, _ in self.plan.rw_features)],
            "twrw": [(t, t.shard_on(rank)[0]) for t in _distinct_tables(twrw_here)],
        }
        present = {"a2a": any(self.plan.a2a_slots), "rw": bool(self.plan.rw_features),
                   "twrw": bool(self.plan.twrw_features)}
        for name, shards in groups.items():
            if not shards:
                if present[name]:  # the group's collectives run on every rank, this one's lookup is empty
                    self.tbes[name] = NoTables(self.fused_params)
                continue
            slots = [TBESlot(i, f"feature {f!r} (table {t.name!r})") for i, (t, _) in enumerate(shards) for f in t.features]
            tbe = FusedTBE([(s.rows, s.cols) for _, s in shards], slots, fused_params=self.fused_params,
                           row_offsets=[s.row_offset for _, s in shards], bounds_check=False,
                           grad_scale=1.0 / layout.world)
            with torch.no_grad():
                for i, (t, s) in enumerate(shards):
                    w = weights[t.name]
                    tbe.table(i).copy_(w[s.row_offset:s.row_offset + s.rows, s.col_offset:s.col_offset + s.cols])
                    self.pieces.setdefault(t.name, []).append((s, name, i))
            self.tbes[name] = tbe
        _COLLECTIONS[layout.key] = self

    # ---- what the program reads ----
    def state_tensors(self) -> list[torch.Tensor]:
        return group_state(self.tbes) + [self.dp_params[t.name] for t in self.plan.dp_tables]

    def state_requires_grad(self) -> list[bool]:
        """Per ``state_tensors()`` entry: whether the program's autograd flows into it."""
        return [isinstance(t, torch.Tensor) and t.requires_grad for t in self.state_tensors()]

    def run(self, values, lengths, weights, state, keys, constants=None):
        return sharded_lookup(self.layout, self.plan, dict(self.tbes.items()), list(keys), values, lengths,
                              weights, list(state), torch.float32, constants, self.bounds_check)

    def run_uses(self, uses: list, state, constants=None) -> list[torch.Tensor]:
        """Several lookups of this collection in one step (a module reachable under several FQNs),
        as one: the uses' batches side by side, one input distribution, one lookup, one output
        distribution, so the fused optimizer applies the sum of the uses' gradients once.
        ``uses``: (values, lengths, weights, keys) each, equal batch sizes."""
        if len(uses) == 1:
            values, lengths, weights, keys = uses[0]
            return [self.run(values, lengths, weights, state, keys, constants)]
        features = list(self.layout.features)
        batches = [lengths.shape[0] // len(keys) for _, lengths, _, keys in uses]
        if any(b != batches[0] for b in batches):
            raise NotImplementedError(
                f"{self.layout.fqns}: the uses of one shared embedding module in a step have batch sizes "
                f"{batches}; graphshard merges them into one lookup, which needs equal batch sizes"
            )
        batch = batches[0]
        parts = [permute_features(values, lengths, weights, keys, features) for values, lengths, weights, keys in uses]
        n, f = len(parts), len(features)
        lengths2d = torch.cat([p[0] for p in parts])
        values = torch.cat([p[1] for p in parts])
        weights = torch.cat([p[2] for p in parts]) if self.layout.weighted else None
        # rows (use, feature) -> (feature, use): each feature's bags are the uses' batches in turn
        merged = permute_rows([u * f + i for i in range(f) for u in range(n)], lengths2d, values, weights)
        out = self.run(merged[1], merged[0].reshape(-1), merged[2], state, features, constants)
        return list(out.split(batch))

    # ---- what the state dict and the optimizer read ----
    def fused(self) -> list[FusedTBE]:
        """This rank's fused TBEs (the groups it holds tables of)."""
        return [m for m in self.tbes.values() if isinstance(m, FusedTBE)]

    def local_pieces(self, table: str) -> list[tuple[TableShard, torch.Tensor]]:
        """This rank's pieces of a sharded table, each a view of the TBE's weights."""
        return [(s, self.tbes[name].table(i)) for s, name, i in self.pieces.get(table, [])]

    def local_state(self, table: str) -> list[tuple[TableShard, torch.Tensor | None]]:
        """This rank's pieces of a table's fused optimizer state (row-wise Adagrad: one value per row)."""
        return [(s, self.tbes[name].state(i)) for s, name, i in self.pieces.get(table, [])]

    def table(self, name: str) -> TableLayout:
        return next(t for t in self.layout.tables if t.name == name)
