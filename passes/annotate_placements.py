"""annotate_placements: give every node its placement on each model-parallel mesh axis.

Anchors: the ``graphshard::param`` markers carry their parameters' model-parallel
placements; graph inputs are logical and replicated. Every other node's
placement comes from its op's rule (``_rules.py``) applied to the placements of
its inputs, axis by axis. Results go to ``node.meta``:

- ``placement``: {axis: Placement} (a list of them for multi-output nodes);
- ``required``: {arg position: {axis: Placement}} for inputs that must be
  redistributed first (insert_collectives turns these into collectives).

A ``graphshard::layout`` node (a module input or output layout declared by a
tensor-parallel style) requires its input in the declared placement. A graph
output that is a declared module output keeps that placement (the caller gets
the local shard, or a DTensor with ``use_local_output=False``); every other
output is required replicated, the logical value. Ops that stay sharded only
when rewritten (vocabulary-sharded embedding, class-sharded log-softmax and
NLL loss) are expanded in place first (``_expansions.py``).

Data-parallel axes need no propagation: activations are per-rank there and
parameters are gathered whole. A mesh without model-parallel axes leaves the
graph untouched.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from graphshard.ops import ops
from graphshard.passes import _expansions, _rules
from graphshard.passes._graph import R, is_tensor_node, tensor_args
from graphshard.passes.context import PassContext, log
from graphshard.styles import parse_placement


def annotate_placements(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    axes = list(ctx.model_parallel)
    if not axes:
        return gm
    erased: set[fx.Node] = set()
    for node in list(gm.graph.nodes):
        if node in erased:
            continue  # replaced by an expansion
        if node.op == "placeholder":
            node.meta["placement"] = {a: R for a in axes} if is_tensor_node(node) else None
        elif node.op == "call_function" and node.target == ops.param.default:
            info = ctx.params[node.args[1]]
            mp = {axis.name: pl for axis, pl in info.model_parallel}
            node.meta["placement"] = {a: mp.get(a, R) for a in axes}
        elif node.op == "call_function" and node.target == ops.layout.default:
            _annotate_layout(node, axes)
        elif node.op == "call_function" and node.target == operator.getitem:
            parent = node.args[0].meta.get("placement")
            node.meta["placement"] = parent[node.args[1]] if isinstance(parent, list) else parent
        elif node.op == "call_function":
            erased.update(_annotate_op(node, axes, ctx))
        elif node.op == "output":
            _annotate_outputs(node)
    return gm


def _annotate_layout(node: fx.Node, axes: list[str]) -> None:
    x, where, axis, placement = node.args[:4]
    if axis not in axes:
        raise ValueError(
            f"{where.split('/', 1)[-1]}: a declared layout on mesh axis {axis!r}, which is not a model-parallel "
            f"axis of this program ({axes}); declare layouts only on the tensor-parallel axis"
        )
    cur = dict(x.meta.get("placement") or {a: R for a in axes})
    want = parse_placement(placement, node.meta["val"].dim())
    node.meta["required"] = {0: {axis: want}} if cur.get(axis, R) != want else {}
    node.meta["placement"] = {**cur, axis: want}


def _annotate_outputs(node: fx.Node) -> None:
    """The program's outputs are logical values (replicated), except declared module outputs,
    which keep their declared placement; ``meta["output_layouts"]`` lists those."""
    outs = node.args[0] if isinstance(node.args[0], (list, tuple)) else []
    required, declared = {}, {}
    for i, a in enumerate(outs):
        if not is_tensor_node(a):
            continue
        pl = a.meta.get("placement") or {}
        if a.op == "call_function" and a.target == ops.layout.default:
            if any(p != R for p in pl.values()):
                declared[i] = (dict(pl), a.args[4])
            continue
        want = {ax: R for ax, p in pl.items() if p != R}
        if want:
            required[i] = want
    node.meta["required"] = required
    node.meta["output_layouts"] = declared


def _annotate_op(node: fx.Node, axes: list[str], ctx: PassContext) -> set[fx.Node]:
    """Annotates ``node``; returns the nodes an expansion erased (empty otherwise)."""
    args = list(tensor_args(node))
    if not args:
        node.meta["placement"] = _like_output(node, {a: R for a in axes})
        return set()
    current = {axis: [_placement(a, axis) for _, a in args] for axis in axes}
    if any(p != R for ps in current.values() for p in ps):
        new = _expansions.expand(node, current, ctx)
        if new is not None:
            return _expansions.replace(node, new)
    rule = _rules.lookup(node.target)
    required: dict = {}
    out_per_axis: dict[str, object] = {}
    for axis in axes:
        cur = current[axis]
        if all(p == R for p in cur):
            req, out = cur, R
        elif rule is None:
            if ctx.config.strict:
                raise NotImplementedError(
                    f"graphshard has no placement rule for {node.target} (node {node.name!r}); "
                    "compile without strict=True to replicate its inputs, or add a rule in passes/_rules.py"
                )
            msg = f"{node.target} at node {node.name!r}: no placement rule, inputs replicated on {axis!r}"
            if msg not in ctx.report.fallbacks:
                ctx.report.fallbacks.append(msg)
                log.warning("graphshard fallback: %s", msg)
            req, out = [R] * len(cur), R
        elif getattr(rule, "takes_world", False):
            req, out = rule(node, cur, world=ctx.model_parallel[axis].world)
        else:
            req, out = rule(node, cur)
        for (pos, _), c, r in zip(args, cur, req):
            if c != r:
                required.setdefault(pos, {})[axis] = r
        out_per_axis[axis] = out
    node.meta["required"] = required
    n_out = len(node.meta["val"]) if isinstance(node.meta.get("val"), (list, tuple)) else None
    if n_out is None:
        node.meta["placement"] = {a: (o[0] if isinstance(o, list) else o) for a, o in out_per_axis.items()}
    else:
        node.meta["placement"] = [
            {a: (o[i] if isinstance(o, list) else o) for a, o in out_per_axis.items()} for i in range(n_out)
        ]
    return set()


def _placement(node: fx.Node, axis: str):
    pl = node.meta.get("placement")
    return pl.get(axis, R) if isinstance(pl, dict) else R


def _like_output(node: fx.Node, pl: dict):
    v = node.meta.get("val")
    if isinstance(v, (list, tuple)):
        return [dict(pl) for _ in v]
    return pl if isinstance(v, torch.Tensor) else None
