"""annotate_placements: give every node its placement on each model-parallel mesh axis.

Anchors: the ``graphshard::param`` markers carry their parameters' model-parallel
placements; graph inputs are logical and replicated. Every other node's
placement comes from its op's rule (``_rules.py``) applied to the placements of
its inputs, axis by axis. Results go to ``node.meta``:

- ``placement``: {axis: Placement} (a list of them for multi-output nodes);
- ``required``: {arg position: {axis: Placement}} for inputs that must be
  redistributed first (insert_collectives turns these into collectives).

Data-parallel axes need no propagation: activations are per-rank there and
parameters are gathered whole. A mesh without model-parallel axes leaves the
graph untouched.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from graphshard.ops import ops
from graphshard.params import lookup as lookup_param
from graphshard.passes import _rules
from graphshard.passes._graph import R, is_tensor_node, tensor_args
from graphshard.passes.pipeline import PassContext, log


def annotate_placements(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    axes = list(ctx.model_parallel)
    if not axes:
        return gm
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            node.meta["placement"] = {a: R for a in axes} if is_tensor_node(node) else None
        elif node.op == "call_function" and node.target == ops.param.default:
            info = lookup_param(node.args[1])
            mp = {axis.name: pl for axis, pl in info.model_parallel}
            node.meta["placement"] = {a: mp.get(a, R) for a in axes}
        elif node.op == "call_function" and node.target == operator.getitem:
            parent = node.args[0].meta.get("placement")
            node.meta["placement"] = parent[node.args[1]] if isinstance(parent, list) else parent
        elif node.op == "call_function":
            _annotate_op(node, axes, ctx)
        elif node.op == "output":
            # The program's outputs are logical values: the caller gets them replicated.
            outs = node.args[0] if isinstance(node.args[0], (list, tuple)) else []
            node.meta["required"] = {
                i: {ax: R for ax, p in (a.meta.get("placement") or {}).items() if p != R}
                for i, a in enumerate(outs) if is_tensor_node(a)
            }
            node.meta["required"] = {i: want for i, want in node.meta["required"].items() if want}
    return gm


def _annotate_op(node: fx.Node, axes: list[str], ctx: PassContext) -> None:
    args = list(tensor_args(node))
    if not args:
        node.meta["placement"] = _like_output(node, {a: R for a in axes})
        return
    rule = _rules.lookup(node.target)
    required: dict = {}
    out_per_axis: dict[str, object] = {}
    for axis in axes:
        cur = [a.meta.get("placement", {}).get(axis, R) if isinstance(a.meta.get("placement"), dict) else R
               for _, a in args]
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


def _like_output(node: fx.Node, pl: dict):
    v = node.meta.get("val")
    if isinstance(v, (list, tuple)):
        return [dict(pl) for _ in v]
    return pl if isinstance(v, torch.Tensor) else None
