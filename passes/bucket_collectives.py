"""bucket_collectives: one data-parallel collective per unit.

insert_collectives leaves one ``graphshard::unshard`` per parameter use. This
pass merges those of each unit (FSDP unit = bucket) into one ``unshard`` over
all the unit's parameters used in the graph, placed where the unit's first
parameter is first used, and a parameter used twice (tied weights) is gathered
once. Because ``unshard``'s backward reduces all its gradients together, the
backward gets one reduce-scatter (or all-reduce) per unit as well.
"""

from __future__ import annotations

import math
import operator

import torch.fx as fx

from graphshard.report import CollectiveRecord
from graphshard.ops import ops
from graphshard.passes.context import PassContext


def unshard_units(gm: fx.GraphModule, ctx: PassContext) -> dict[str, list[fx.Node]]:
    """unit FQN -> its unshard nodes, in graph order."""
    units: dict[str, list[fx.Node]] = {}
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target == ops.unshard.default:
            unit = ctx.params[node.args[1][0]].layout.unit
            units.setdefault(unit, []).append(node)
    return units


def _record(ctx: PassContext, unit: str, infos) -> None:
    """One explain record per unit and data-parallel axis: what its bucket moves."""
    first = infos[0]
    label = f"unit {unit or '<root>'} ({len(infos)} parameters)"
    if first.shard is not None:
        nbytes = sum(i.chunk_rows * i.row_numel for i in infos) * first.param_dtype.itemsize
        ctx.report.collectives.append(CollectiveRecord("all_gather", first.shard.name, nbytes, label, "pre_autograd"))
        grad_bytes = sum(i.chunk_rows * i.row_numel for i in infos) * first.shard.world * first.reduce_dtype.itemsize
        kind, cause = (("all_to_all", ", backward: a reduce-scatter on gloo") if first.shard.scatter_by_all_to_all
                       else ("reduce_scatter", ", backward"))
        ctx.report.collectives.append(CollectiveRecord(kind, first.shard.name, grad_bytes, label + cause, "pre_autograd"))
    for axis in first.replicate:
        nbytes = sum(math.prod(i.dp_full_shape) for i in infos) * first.reduce_dtype.itemsize
        nbytes //= first.shard.world if first.shard is not None else 1
        ctx.report.collectives.append(CollectiveRecord("all_reduce", axis.name, nbytes, label + ", backward", "pre_autograd"))


def bucket_collectives(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    g = gm.graph
    for unit, nodes in unshard_units(gm, ctx).items():
        keys, shards, vals, placements = [], [], [], []
        uses: list[tuple[fx.Node, int]] = []  # (getitem user, index into merged outputs)
        for un in nodes:
            for i, key in enumerate(un.args[1]):
                if key not in keys:
                    keys.append(key)
                    shards.append(un.args[0][i])
                    vals.append(un.meta["val"][i])
                    placements.append((un.meta.get("placement") or [None] * (i + 1))[i])
                for user in list(un.users):
                    if user.target == operator.getitem and user.args[1] == i:
                        uses.append((user, keys.index(key)))
        infos = [ctx.params[k] for k in keys]
        ctx.report.units[unit] = [info.fqn for info in infos]
        _record(ctx, unit, infos)
        if len(nodes) == 1 and len(keys) == len(nodes[0].args[1]):
            continue
        _hoist_before(g, shards, nodes[0])
        with g.inserting_before(nodes[0]):
            merged = g.call_function(ops.unshard.default, (shards, keys))
        merged.meta["val"] = vals
        merged.meta["placement"] = placements
        outs: dict[int, fx.Node] = {}
        for user, idx in uses:
            if idx not in outs:
                with g.inserting_after(merged):
                    outs[idx] = g.call_function(operator.getitem, (merged, idx))
                outs[idx].meta.update(user.meta)
            user.replace_all_uses_with(outs[idx])
            g.erase_node(user)
        for un in nodes:
            g.erase_node(un)
    return gm


def _hoist_before(g: fx.Graph, values: list[fx.Node], anchor: fx.Node) -> None:
    """Moves the nodes that compute ``values`` (a flat parameter's views: ``slice`` and
    ``reshape`` of a graph input) from after ``anchor`` to just before it, in graph order."""
    position = {n: i for i, n in enumerate(g.nodes)}
    late: set[fx.Node] = set()
    stack = [v for v in values if position[v] > position[anchor]]
    while stack:
        n = stack.pop()
        if n in late:
            continue
        assert n.op == "call_function", f"{n.name} feeds a unit's gather but is computed after it"
        late.add(n)
        stack.extend(a for a in n.all_input_nodes if position[a] > position[anchor])
    for n in sorted(late, key=position.__getitem__):
        anchor.prepend(n)
