"""One sharded embedding collection on one rank: its fused TBEs, its data-parallel tables, its program.

The collection's tables live in at most two fused TBEs on this rank (``"a2a"``: the table- and
column-wise shards it owns; ``"rw"``: its row block of each row-wise table), held as modules
under the user's module, so the compiled program receives their tensors as inputs; the
data-parallel tables stay the module's own ``nn.Parameter`` s. ``tables()`` gives every
table's local piece as a view of that storage (the state dict reads and writes through it).
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING

import torch
import torch.nn as nn

from graphshard import params
from graphshard.sparse.fused_tbe import FusedTBE, TBESlot
from graphshard.sparse.input_dist import unpack
from graphshard.sparse.layout import CollectionLayout, TableLayout, TableShard
from graphshard.sparse.program import LocalPlan, group_state, local_plan, permute_features, permute_rows, sharded_lookup
from graphshard.sparse.sequence import row_starts, sequence_lookup, width_groups

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

_ids = itertools.count()


def new_key(fqn: str) -> str:
    return f"s{next(_ids)}/{fqn}"


def _distinct_tables(tables) -> list[TableLayout]:
    return list({t.name: t for t in tables}.values())


def _distinct_shards(slots) -> list[tuple[TableLayout, TableShard]]:
    """The (table, shard) pairs of ``slots``, each once, in first-use order."""
    return list({(s.table.name, s.shard): (s.table, s.shard) for s in slots}.values())


def _rows(t: torch.Tensor | None, start: int | None, rows: int):
    """Rows ``start ..`` of a stacked table (or its optimizer state); the whole of it when ``start`` is None."""
    return t if t is None or start is None else t[start:start + rows]


class NoTables(nn.Module):
    """Stands for a group's TBE on a rank that holds none of its tables. The rank still takes part
    in the group's collectives, so its (empty) pooled output must need a gradient as the other
    ranks' do: its backward then has the same collectives. The token is that gradient's anchor."""

    def __init__(self, fused_params: dict, device: str):
        super().__init__()
        self.register_buffer("token", torch.zeros(0, device=device, requires_grad=True), persistent=False)
        self.register_buffer("weights", torch.zeros(0, device=device), persistent=False)
        self.register_buffer("momentum", torch.zeros(0, device=device), persistent=False)
        self.register_buffer("lr", torch.tensor(float(fused_params.get("learning_rate", 0.0)), device=device),
                             persistent=False)

    def constants(self) -> dict:
        return {}


class SparseCollection:
    """The sharded state and program of one collection on this rank.

    ``weights``: each table's full logical weight (``[rows, dim]``, on any device); this rank
    copies its pieces into the TBEs. ``inits``: for a table whose weight is on the meta device,
    the ``(low, high)`` its pieces are drawn from uniformly instead. ``dp_params``: the data-parallel tables' parameters, by
    table name (they stay where they are). ``fused_params``: fbgemm's optimizer keywords.
    """

    __unkeyed__ = {"tbes": "the kernels' modules, built from the layout, plan and fused_params (keyed)",
                   "table_params": "views of the TBEs for named_parameters (state.table_parameter), made after "
                                   "the program from the layout (keyed)"}

    def __init__(self, layout: CollectionLayout, weights: dict[str, torch.Tensor], dp_params: dict[str, nn.Parameter],
                 fused_params: dict, bounds_check: bool = True, need_indices: bool = False,
                 inits: dict[str, tuple[float, float]] | None = None):
        layout.check()
        self.inits = dict(inits or {})
        self.need_indices = need_indices
        self.layout = layout
        self.plan: LocalPlan = local_plan(layout)
        self.fused_params = dict(fused_params)
        self.bounds_check = bounds_check
        self.dp_params = dp_params
        self.tbes = nn.ModuleDict()
        self.pieces: dict[str, list[tuple[TableShard, str, int]]] = {}  # table -> (shard, tbe name, table index)
        self.table_meshes: dict[tuple[int, ...], DeviceMesh] = {}  # the state dict's meshes by global ranks (state.py)
        self.table_params: dict = {}  # each fused table as named_parameters lists it (state.table_parameter)
        rank = layout.rank
        twrw_here = [self.plan.twrw_features[i][0] for i in (self.plan.twrw_by_host[rank // layout.local_world]
                                                             if self.plan.twrw_features else [])]
        rw_here = [(t, t.shard_on(rank)[0]) for t in _distinct_tables(t for t, _ in self.plan.rw_features)]
        if layout.sequence:  # one group per shard width, and row-wise; see sequence.py
            groups = {g.name: _distinct_shards(g.slots[rank]) for g in width_groups(self.plan)}
            present = dict.fromkeys(groups, True)
        else:
            groups = {"a2a": _distinct_shards(self.plan.a2a_slots[rank])}
            present = {"a2a": any(self.plan.a2a_slots)}
        groups.update(rw=rw_here, twrw=[(t, t.shard_on(rank)[0]) for t in _distinct_tables(twrw_here)])
        present.update(rw=bool(self.plan.rw_features), twrw=bool(self.plan.twrw_features))
        for name, shards in groups.items():
            if not shards:
                if present[name]:  # the group's collectives run on every rank, this one's lookup is empty
                    self.tbes[name] = NoTables(self.fused_params, layout.device)
                continue
            self.tbes[name] = self._fused(name, shards, weights)
        params.remember(layout.key, self)

    def _fused(self, name: str, shards: list[tuple[TableLayout, TableShard]], weights) -> FusedTBE:
        """One group's TBE holding ``shards``, with this rank's pieces of ``weights`` copied in. A
        sequence group's shards (one width) are stacked into one table of the TBE."""
        common = dict(fused_params=self.fused_params, bounds_check=False, grad_scale=1.0 / self.layout.world,
                      kernel=self.layout.kernel, device=self.layout.device)
        if self.layout.sequence:
            starts = row_starts([s for _, s in shards])
            tbe = FusedTBE([(sum(s.rows for _, s in shards), shards[0][1].cols)],
                           [TBESlot(0, f"the stacked shards of {[t.name for t, _ in shards]}")],
                           row_offsets=[0], **common)
            where = [(0, start) for start in starts]
        else:
            slots = [TBESlot(i, f"feature {f!r} (table {t.name!r})") for i, (t, _) in enumerate(shards) for f in t.features]
            tbe = FusedTBE([(s.rows, s.cols) for _, s in shards], slots, row_offsets=[s.row_offset for _, s in shards],
                           **common)
            where = [(i, None) for i in range(len(shards))]
        with torch.no_grad():
            for (t, s), (i, start) in zip(shards, where):
                self.pieces.setdefault(t.name, []).append((s, name, i, start))
                piece = _rows(tbe.table(i), start, s.rows)
                if weights[t.name].is_meta:
                    if t.name not in self.inits:
                        raise ValueError(f"table {t.name!r} is on the meta device and has no init bounds: "
                                         "build it on a real device or give its (weight_init_min, weight_init_max)")
                    piece.uniform_(*self.inits[t.name])
                else:
                    piece.copy_(weights[t.name][s.row_offset:s.row_offset + s.rows, s.col_offset:s.col_offset + s.cols])
        return tbe

    # ---- what the program reads ----
    def state_tensors(self) -> list[torch.Tensor]:
        return group_state(self.tbes) + [self.dp_params[t.name] for t in self.plan.dp_tables]

    def state_requires_grad(self) -> list[bool]:
        """Per ``state_tensors()`` entry: whether the program's autograd flows into it."""
        return [isinstance(t, torch.Tensor) and t.requires_grad for t in self.state_tensors()]

    def run(self, values, lengths, weights, state, keys, constants=None, received=None):
        """The lookup's program. ``received``: ``(groups, tensors)`` where a pipeline exchanged the
        ids a batch ahead (`graphshard.sparse.input_dist`, which checked their bounds)."""
        if self.layout.sequence:
            return sequence_lookup(self.layout, self.plan, dict(self.tbes.items()), list(keys), values, lengths,
                                   list(state), torch.float32, constants, self.bounds_check, self.need_indices)
        if received is not None:
            received = unpack(*received, self.layout.weighted)
        return sharded_lookup(self.layout, self.plan, dict(self.tbes.items()), list(keys), values, lengths,
                              weights, list(state), torch.float32, constants, self.bounds_check and received is None,
                              received=received)

    def run_uses(self, uses: list, state, constants=None) -> list:
        """Several lookups of this collection in one step (a module reachable under several FQNs),
        as one: the uses' batches side by side, one input distribution, one lookup, one output
        distribution, so the fused optimizer applies the sum of the uses' gradients once.
        ``uses``: (values, lengths, weights, keys) each, equal batch sizes. Returns each use's
        result (a sequence collection's: its list of per-feature tensors)."""
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
        kjt = self.layout.kjt_ops
        parts = [permute_features(values, lengths, weights, keys, features, kjt) for values, lengths, weights, keys in uses]
        n, f = len(parts), len(features)
        lengths2d = torch.cat([p[0] for p in parts])
        values = torch.cat([p[1] for p in parts])
        weights = torch.cat([p[2] for p in parts]) if self.layout.weighted else None
        # rows (use, feature) -> (feature, use): each feature's bags are the uses' batches in turn
        merged = permute_rows([u * f + i for i in range(f) for u in range(n)], lengths2d, values, weights, kjt=kjt)
        out = self.run(merged[1], merged[0].reshape(-1), merged[2], state, features, constants)
        if not self.layout.sequence:
            return list(out.split(batch))
        # each feature's rows (then, with need_indices, its ids): the uses' ids in turn
        counts = torch.stack([p[0].sum(1) for p in parts]).tolist()  # per use, per feature
        per_use: list[list[torch.Tensor]] = [[] for _ in uses]
        for i, rows in enumerate(out):
            sizes = [counts[u][i % f] for u in range(n)]
            torch._check(rows.shape[0] == sum(sizes))
            for u, piece in enumerate(rows.split(sizes)):
                per_use[u].append(piece)
        return per_use

    # ---- what the state dict and the optimizer read ----
    def fused(self) -> list[FusedTBE]:
        """This rank's fused TBEs (the groups it holds tables of)."""
        return [m for m in self.tbes.values() if isinstance(m, FusedTBE)]

    def local_pieces(self, table: str) -> list[tuple[TableShard, torch.Tensor]]:
        """This rank's pieces of a sharded table, each a view of the TBE's weights."""
        return [(s, _rows(self.tbes[name].table(i), start, s.rows)) for s, name, i, start in self.pieces.get(table, [])]

    def local_state(self, table: str) -> list[tuple[TableShard, torch.Tensor | None]]:
        """This rank's pieces of a table's fused optimizer state (row-wise Adagrad: one value per row)."""
        return [(s, _rows(self.tbes[name].state(i), start, s.rows)) for s, name, i, start in self.pieces.get(table, [])]

    def table(self, name: str) -> TableLayout:
        return next(t for t in self.layout.tables if t.name == name)
