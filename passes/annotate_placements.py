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
from torch.distributed.tensor import Shard

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
    data_only: set[fx.Node] = set()  # nodes found to be computed from graph inputs alone (`_logical`)
    for node in list(gm.graph.nodes):
        if node in erased:
            continue  # replaced by an expansion
        if node.op == "placeholder":
            node.meta["placement"] = {a: R for a in axes} if is_tensor_node(node) else None
        elif node.op == "call_function" and node.target == ops.param.default:
            info = ctx.params[node.args[1]]
            mp = {axis.name: pl for axis, pl in info.model_parallel}
            node.meta["placement"] = {a: mp.get(a, R) for a in axes}
        elif node.op == "call_function" and node.target == ops.from_local.default:
            _annotate_from_local(node, axes)
        elif node.op == "call_function" and node.target == ops.to_local.default:
            node.meta["required"] = {}
            node.meta["placement"] = {**(node.args[0].meta.get("placement") or {a: R for a in axes}),
                                      node.args[2]: LOCAL}
        elif node.op == "call_function" and node.target == ops.layout.default:
            _annotate_layout(node, axes, data_only)
        elif node.op == "call_function" and node.target == operator.getitem:
            parent = node.args[0].meta.get("placement")
            node.meta["placement"] = parent[node.args[1]] if isinstance(parent, list) else parent
        elif node.op == "call_function":
            erased.update(_annotate_op(node, axes, ctx))
        elif node.op == "output":
            _annotate_outputs(node)
    return gm


def _annotate_layout(node: fx.Node, axes: list[str], data_only: set[fx.Node]) -> None:
    x, where, axis, placement = node.args[:4]
    if axis not in axes:
        raise ValueError(
            f"{where.split('/', 1)[-1]}: a declared layout on mesh axis {axis!r}, which is not a model-parallel "
            f"axis of this program ({axes}); declare layouts only on the tensor-parallel axis"
        )
    cur = dict(x.meta.get("placement") or {a: R for a in axes})
    want = parse_placement(placement, node.meta["val"].dim())
    if want != R and not _logical(x, data_only):
        _refuse_local_piece(node, x, want)
    node.meta["required"] = {0: {axis: want}} if cur.get(axis, R) != want else {}
    node.meta["placement"] = {**cur, axis: want}


def describe_place(where: str) -> str:
    """``"m3/net1:in0"`` as ``module 'net1' input 0`` (``in[y]``: keyword input 'y', ``out0``: output 0)."""
    module, _, place = where.split("/", 1)[-1].rpartition(":")
    module = f"module {module!r}" if module else "the root module"
    if place.startswith("in["):
        return f"{module} keyword input {place[3:-1]!r} (input_kwarg_layouts)"
    if place.startswith("in"):
        return f"{module} input {place[2:]} (input_layouts)"
    return f"{module} output {place[3:]} (output_layouts)"


def _logical(x: fx.Node, data_only: set[fx.Node]) -> bool:
    """Whether ``x`` is a value of the logical program: computed from a parameter or from a declared
    layout. Anything else (a graph input, values computed from graph inputs and constants alone)
    is what each rank passed or made itself: torch's local tensor, which graphshard reads as the
    whole value. ``data_only`` keeps the nodes earlier searches found to be such, so each node is
    searched through once per graph."""
    sources = (ops.param.default, ops.layout.default, ops.from_local.default, ops.unshard.default)
    seen, stack = set(), [x]
    while stack:
        n = stack.pop()
        if n in seen or n in data_only:
            continue
        seen.add(n)
        if n.op == "call_function" and n.target in sources:
            return True
        stack.extend(n.all_input_nodes)
    data_only.update(seen)
    return False


def _refuse_local_piece(node: fx.Node, x: fx.Node, want) -> None:
    where = node.args[1]
    raise NotImplementedError(
        f"{describe_place(where)} is declared {fmt(want)}: torch reads the tensor there as this rank's piece of a "
        f"larger tensor (DTensor.from_local), but it is {'the graph input ' + repr(x.name) + ' reached through a traced body' if x.op == 'placeholder' else 'computed from the graph inputs alone (node ' + repr(x.name) + ')'}, "
        "which graphshard reads as the whole value on every rank. graphshard takes a sharded layout as each "
        "rank's piece only on a graph input passed straight to the module: pass the input to the module itself "
        "(and do that computation inside it or after it), or declare Replicate() there and pass every rank the "
        "whole tensor"
    )


def fmt(p) -> str:
    return f"Shard({p.dim})" if isinstance(p, Shard) else f"{type(p).__name__}()"


def _annotate_from_local(node: fx.Node, axes: list[str]) -> None:
    """A graph input that is each rank's piece of a logical value (a sharded layout declared on it,
    torch's ``DTensor.from_local``): the logical value, sharded on ``axis``."""
    x, where, axis, placement, world = node.args
    val = node.meta["val"]
    want = parse_placement(placement, val.dim())
    if _placement(x, axis) is LOCAL:  # a module's piece handed on (to_local), read whole again
        node.meta["required"] = {}
        node.meta["placement"] = {**{a: R for a in axes}, axis: want}
        return
    if x.op != "placeholder":
        _refuse_local_piece(node, x, want)
    others = [u for u in x.users if not (u.op == "call_function" and u.target == ops.from_local.default
                                          and u.args[3] == placement and u.args[2] == axis)]
    if others:
        u = others[0]
        raise NotImplementedError(
            f"graph input {x.name!r} is declared {fmt(want)} at {describe_place(where)}, so each rank passes its own "
            f"piece; it is also used by node {u.name!r} ({u.target}) outside that declaration, where graphshard would "
            "read the piece as the whole tensor (torch computes on the piece there). Pass the input only to the "
            "module that declares it (use that module's output elsewhere), or declare Replicate() and pass every "
            "rank the whole tensor"
        )
    if not isinstance(val.shape[want.dim], int):
        raise NotImplementedError(
            f"graph input {x.name!r} is declared {fmt(want)} at {describe_place(where)}, and its dim {want.dim} has a "
            f"dynamic size ({x.meta['val'].shape[want.dim]} a rank): graphshard needs each rank's piece of a sharded "
            "input to have one static size, the same on every rank (the logical size is it times the mesh size). "
            "Mark the dim static (torch._dynamo.mark_static) or compile with dynamic=False"
        )
    node.meta["required"] = {}
    node.meta["placement"] = {**{a: R for a in axes}, axis: want}


def _annotate_outputs(node: fx.Node) -> None:
    """The program's outputs are logical values (replicated), except declared module outputs,
    which keep their declared placement; ``meta["output_layouts"]`` lists those."""
    outs = node.args[0] if isinstance(node.args[0], (list, tuple)) else []
    required, declared = {}, {}
    for i, a in enumerate(outs):
        if not is_tensor_node(a):
            continue
        pl = a.meta.get("placement") or {}
        if any(p is LOCAL for p in pl.values()):
            continue  # each rank's piece, returned as torch returns it
        if a.op == "call_function" and a.target == ops.layout.default:
            if any(p != R for p in pl.values()):
                declared[i] = (dict(pl), a.args[4])
            elif not a.args[4]:
                raise NotImplementedError(
                    f"{describe_place(a.args[1])} is declared Replicate() with use_local_output=False, and it is the "
                    "model's output: torch returns a replicated DTensor there, graphshard returns DTensors only for "
                    "sharded layouts. Set use_local_output=True (the tensor is the same on every rank), and wrap it "
                    "yourself if a DTensor is needed: DTensor.from_local(out, mesh, [Replicate()])"
                )
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
    if any(p is LOCAL for ps in current.values() for p in ps):
        return _annotate_local(node, current)
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


class _Local:
    """The placement of a value computed from a module output handed on as each rank's piece
    (``graphshard::to_local``, `ShardedModel.local_outputs`): per-rank, as torch's plain local
    tensor. No rule, no size rewrite and no collective applies to it; a declared input layout
    (``graphshard::from_local``) reads it as the logical value again."""

    per_rank = True

    def __repr__(self):
        return "Local()"


LOCAL = _Local()


def _annotate_local(node: fx.Node, current: dict) -> set:
    """A per-rank op on pieces: its other inputs must be the same on every rank (replicated)."""
    for axis, ps in current.items():
        if any(p is LOCAL for p in ps) and any(p is not LOCAL and p != R for p in ps):
            raise NotImplementedError(
                f"node {node.name!r} ({node.target}) computes on a module output handed on as each rank's piece "
                f"(use_local_output=True) and on a value sharded on {axis!r} ({[fmt(p) for p in ps]}): torch mixes a "
                "local tensor with a DTensor there. Keep that computation between the declared layouts")
    node.meta["required"] = {}
    out = {axis: (LOCAL if any(p is LOCAL for p in ps) else R) for axis, ps in current.items()}
    node.meta["placement"] = _like_output(node, out)
    return set()


def _placement(node: fx.Node, axis: str):
    pl = node.meta.get("placement")
    return pl.get(axis, R) if isinstance(pl, dict) else R


def _like_output(node: fx.Node, pl: dict):
    v = node.meta.get("val")
    if isinstance(v, (list, tuple)):
        return [dict(pl) for _ in v]
    return pl if isinstance(v, torch.Tensor) else None
