"""insert_collectives: make every consumer see the placement it needs.

- Each ``graphshard::param`` marker becomes the parameter's data-parallel gather,
  ``graphshard::unshard([local], [key])`` (its backward averages the gradient
  over the data-parallel ranks), or, on a mesh without data-parallel axes, the
  local shard itself.
- Each input whose placement differs from what its consumer's rule requires
  (``meta["required"]``) is redistributed, one mesh axis at a time:
  Shard->Replicate all_gather, Partial->Replicate all_reduce, Partial->Shard
  reduce_scatter, Replicate->Shard shard (a local slice), Replicate->Partial
  to_partial. Backward collectives come from these ops' autograd formulas.
- A replicated value that needs a gradient and feeds an op whose output is
  sharded or partial on an axis gets ``grad_all_reduce`` (identity forward,
  all-reduce backward): its gradient from that op is a partial sum.
- ``graphshard::layout`` nodes (declared module layouts) have done their job
  once their input is redistributed; they are removed. A ``graphshard::from_local``
  (a graph input declared sharded: each rank passed its piece) becomes an alias
  of the input that carries the logical value, as a sharded parameter's marker does.
- Gradient guards are then merged: a value all of whose uses (directly or
  through views) are guarded gets one guard instead of one per use, and an
  all-gather whose every use is guarded becomes ``all_gather_partial_grad``,
  whose backward is one reduce-scatter (sequence parallelism's pattern) instead
  of all-reduces followed by a local slice.
"""

from __future__ import annotations

import operator

import torch.fx as fx
from torch.distributed.tensor import Partial, Replicate, Shard

from graphshard.report import CollectiveRecord
from graphshard.ops import ops
from graphshard.passes._graph import R, aten, fmt_placement, tensor_args
from graphshard.plan import StridedShard
from graphshard.passes.context import PassContext, log


def insert_collectives(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    g = gm.graph
    needs_grad = _needs_grad(gm, ctx)
    cache: dict[tuple, fx.Node] = {}
    for node in list(g.nodes):
        if node.op == "call_function" and node.target == ops.param.default:
            # The parameter as the program now reads it needs a gradient as the marker did
            # (``_guard_replicated_grads`` asks, once FullyShard has replaced it by a gather).
            needs_grad.add(_replace_marker(g, node, ctx))
            continue
        if node.op == "call_function" and node.target == ops.to_local.default:
            # a module output handed on as each rank's piece: in the per-rank program the value its
            # layout made is that piece already
            node.replace_all_uses_with(node.args[0])
            g.erase_node(node)
            continue
        if node.op == "call_function" and node.target == ops.from_local.default:
            local = _replace_from_local(g, node)
            if local.args[0] in needs_grad:
                needs_grad.add(local)
            continue
        req = node.meta.get("required") or {}
        for pos, want in req.items():
            arg = _get_arg(node, pos)
            new = _redistribute(g, arg, want, node, ctx, cache)
            if arg in needs_grad:
                needs_grad.add(new)
            _set_arg(node, pos, new)
        if node.op == "call_function" and node.target == ops.layout.default:
            node.replace_all_uses_with(node.args[0])
            g.erase_node(node)
            continue
        if ctx.model_parallel and node.op == "call_function":
            _guard_replicated_grads(g, node, needs_grad, ctx, cache)
    if ctx.model_parallel:
        _merge_grad_guards(g)
    return gm


_VIEWS = {aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.t.default,
          aten.transpose.int, aten.permute.default, aten.unsqueeze.default, aten.expand.default}


def _is_guard(node: fx.Node, group: str | None = None) -> bool:
    return (node.op == "call_function" and node.target == ops.grad_all_reduce.default
            and (group is None or node.args[1] == group))


def _merge_grad_guards(g: fx.Graph) -> None:
    """One gradient all-reduce per value instead of one per use; all-gathers whose uses are all
    guarded reduce-scatter their gradient instead."""
    changed = True
    while changed:
        changed = False
        erased: set[fx.Node] = set()
        for guard in [n for n in g.nodes if _is_guard(n)]:
            if guard in erased:
                continue
            view = guard.args[0]
            if view.op != "call_function" or view.target not in _VIEWS:
                continue
            source = view.args[0]
            group, world = guard.args[1], guard.args[2]
            uses = list(source.users)
            if not all(_is_guard(u, group) or (u.target in _VIEWS and u.users and all(_is_guard(w, group) for w in u.users))
                       for u in uses):
                continue
            with g.inserting_after(source):
                merged = g.call_function(ops.grad_all_reduce.default, (source, group, world))
            merged.meta.update({k: v for k, v in guard.meta.items() if k != "val"})
            merged.meta["val"] = source.meta["val"]
            merged.meta["placement"] = source.meta.get("placement")
            for u in uses:
                if _is_guard(u):
                    u.replace_all_uses_with(merged)
                    g.erase_node(u)
                    erased.add(u)
                else:
                    u.replace_input_with(source, merged)
                    for w in list(u.users):
                        w.replace_all_uses_with(u)
                        g.erase_node(w)
                        erased.add(w)
            changed = True
    for node in list(g.nodes):
        if node.op == "call_function" and node.target == ops.all_gather.default and node.users and all(
            _is_guard(u, node.args[3]) for u in node.users
        ):
            for u in list(node.users):
                u.replace_all_uses_with(node)
                g.erase_node(u)
            node.target = ops.all_gather_partial_grad.default


def _needs_grad(gm: fx.GraphModule, ctx: PassContext) -> set[fx.Node]:
    """Nodes whose values depend on a parameter or on an input that requires grad."""
    out: set[fx.Node] = set()
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    out.update(n for n, rg in zip(placeholders, ctx.input_requires_grad) if rg)
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target == ops.param.default:
            out.add(node)
        elif node.op == "call_function" and node.target == aten.detach.default:
            continue
        elif any(a in out for a in node.all_input_nodes):
            out.add(node)
    return out


def _replace_marker(g: fx.Graph, marker: fx.Node, ctx: PassContext) -> fx.Node:
    """Replaces ``marker`` by the per-rank parameter it stands for; returns that node."""
    local, key = marker.args[0], marker.args[1]
    info = ctx.params[key]
    with g.inserting_before(marker):
        if info.shard is None and not info.replicate:
            # No data-parallel axis: the local shard is the per-rank parameter. Until
            # localize_shapes the program is logical, so a model-parallel shard enters it as
            # an alias carrying the logical value (the placeholder's value is the local one).
            new = local
            if tuple(local.meta["val"].shape) != tuple(marker.meta["val"].shape):
                new = g.call_function(aten.alias.default, (local,))
                new.meta.update(marker.meta)
        else:
            un = g.call_function(ops.unshard.default, ([local], [key]))
            un.meta["val"] = [marker.meta["val"]]
            un.meta["placement"] = [marker.meta.get("placement")]
            new = g.call_function(operator.getitem, (un, 0))
            new.meta.update(marker.meta)
    if marker.meta.get("placement") is not None:
        new.meta["placement"] = marker.meta["placement"]
    marker.replace_all_uses_with(new)
    g.erase_node(marker)
    return new


def _replace_from_local(g: fx.Graph, node: fx.Node) -> fx.Node:
    """A graph input that is each rank's piece (``graphshard::from_local``) enters the program as an
    alias of the input carrying the logical value, sharded, as a model-parallel parameter's local
    shard does (`_replace_marker`); localize_shapes gives it the local shape again."""
    with g.inserting_before(node):
        new = g.call_function(aten.alias.default, (node.args[0],))
    new.meta.update(node.meta)
    node.replace_all_uses_with(new)
    g.erase_node(node)
    return new


def _redistribute(g, arg: fx.Node, want: dict, consumer: fx.Node, ctx: PassContext, cache) -> fx.Node:
    cur = dict(arg.meta.get("placement") or {})
    key = (arg, tuple(sorted((a, str(p)) for a, p in want.items())))
    if key in cache:
        return cache[key]
    x = arg
    for axis_name, target in want.items():
        src = cur.get(axis_name, R)
        if src == target:
            continue
        axis = ctx.model_parallel[axis_name]
        for op, op_args, kind, after in _steps(src, target, tuple(x.meta["val"].shape)):
            before = src
            with g.inserting_after(x if x.op != "placeholder" else _last_placeholder(g)):
                new = g.call_function(op, _op_args(op, x, op_args, axis))
            if op == aten.reshape.default:  # a dim split into blocks, or the blocks merged back
                with ctx.fake_mode:
                    new.meta["val"] = x.meta["val"].reshape(op_args[0])
            else:
                new.meta["val"] = x.meta["val"]  # logical shapes are unchanged; localize_shapes makes them local
            cur[axis_name] = src = after
            new.meta["placement"] = dict(cur)
            new.meta["cause"] = consumer.name
            if kind is not None:
                v = x.meta["val"]
                ctx.report.collectives.append(
                    CollectiveRecord(kind, axis_name, v.numel() * v.element_size(), _cause(consumer), "pre_autograd")
                )
            if op == ops.all_gather.default and not _declared(consumer):
                _report_gather(ctx, arg, consumer, axis_name, fmt_placement(before))
            x = new
    cache[key] = x
    return x


def _declared(consumer: fx.Node) -> bool:
    """Whether a redistribution for ``consumer`` is one the user asked for: a declared module
    layout, or the logical value of a graph output."""
    return consumer.op == "output" or (consumer.op == "call_function" and consumer.target == ops.layout.default)


def _report_gather(ctx: PassContext, arg: fx.Node, consumer: fx.Node, axis: str, src: str) -> None:
    """A gather no declared layout asked for: the consumer's rule could not keep the value
    sharded (or the cheapest exact strategy replicates). Logged and listed by ``explain``."""
    msg = (f"all_gather of {arg.name} ({src} -> R on {axis!r}) for node {consumer.name} ({consumer.target}): "
           "its placement rule does not keep this layout sharded")
    if msg not in ctx.report.fallbacks:
        ctx.report.fallbacks.append(msg)
        log.warning("graphshard fallback: %s", msg)


def _cause(consumer: fx.Node) -> str:
    if consumer.op == "call_function" and consumer.target == ops.layout.default:
        where = consumer.args[1].split("/", 1)[-1]
        return f"declared layout {where} = {consumer.args[3]}"
    if consumer.op == "output":
        return "graph output (the caller gets the logical value)"
    return f"node {consumer.name} ({consumer.target})"


def _steps(src, dst, shape: tuple[int, ...]):
    """The op sequence that turns placement ``src`` into ``dst`` on one axis, for a value of
    logical ``shape``: ``(op, op args, kind for explain or None, placement after)`` per step."""
    if isinstance(src, StridedShard):
        # Each block's pieces are gathered with the blocks as a dim of their own.
        d, k = src.dim, src.split_factor
        blocks = (*shape[:d], k, shape[d] // k, *shape[d + 1:])
        return [(aten.reshape.default, (list(blocks),), None, Shard(d + 1)),
                (ops.all_gather.default, (d + 1,), "all_gather", R),
                (aten.reshape.default, (list(shape),), None, R)] + (_steps(R, dst, shape) if dst != R else [])
    if isinstance(dst, StridedShard):
        # Replicate -> each rank's piece of every block (a local slice), through the same view.
        d, k = dst.dim, dst.split_factor
        blocks = (*shape[:d], k, shape[d] // k, *shape[d + 1:])
        to_r = _steps(src, R, shape) if src != R else []
        return to_r + [(aten.reshape.default, (list(blocks),), None, R),
                       (ops.shard.default, (d + 1,), "shard (local)", Shard(d + 1)),
                       (aten.reshape.default, (list(shape),), None, dst)]
    if isinstance(src, Partial) and src.reduce_op == "max" and isinstance(dst, Replicate):
        return [(ops.all_reduce_max.default, (), "all_reduce(max)", R)]
    if isinstance(src, Partial) and src.reduce_op != "sum":
        raise NotImplementedError(f"graphshard cannot redistribute {fmt_placement(src)} -> {fmt_placement(dst)}")
    if isinstance(src, Shard) and isinstance(dst, Replicate):
        return [(ops.all_gather.default, (src.dim,), "all_gather", R)]
    if isinstance(src, Partial) and isinstance(dst, Replicate):
        return [(ops.all_reduce.default, (), "all_reduce", R)]
    if isinstance(src, Partial) and isinstance(dst, Shard):
        return [(ops.reduce_scatter.default, (dst.dim,), "reduce_scatter", dst)]
    if isinstance(src, Replicate) and isinstance(dst, Shard):
        return [(ops.shard.default, (dst.dim,), "shard (local)", dst)]
    if isinstance(src, Replicate) and isinstance(dst, Partial):
        return [(ops.to_partial.default, (), "to_partial (local)", dst)]
    if isinstance(src, Shard) and isinstance(dst, (Shard, Partial)):
        return _steps(src, R, shape) + _steps(R, dst, shape)
    raise NotImplementedError(f"graphshard cannot redistribute {fmt_placement(src)} -> {fmt_placement(dst)}")


def _op_args(op, x: fx.Node, op_args, axis):
    if op == aten.reshape.default:
        return (x, *op_args)
    if op == ops.all_gather.default:
        (dim,) = op_args
        return (x, dim, x.meta["val"].shape[dim], axis.group_name, axis.world, axis.rank)
    if op == ops.all_reduce.default:
        return (x, axis.group_name, axis.world)
    if op == ops.all_reduce_max.default:
        return (x, axis.group_name)
    if op in (ops.reduce_scatter.default, ops.shard.default):
        return (x, op_args[0], axis.group_name, axis.world, axis.rank)
    if op == ops.to_partial.default:
        return (x, axis.rank)
    raise AssertionError(op)


def _guard_replicated_grads(g, node: fx.Node, needs_grad, ctx: PassContext, cache) -> None:
    out = node.meta.get("placement")
    if not isinstance(out, dict):
        out = out[0] if isinstance(out, list) and out else {}
    for pos, arg in list(tensor_args(node)):
        if arg not in needs_grad or node.target == ops.grad_all_reduce.default:
            continue
        pl = arg.meta.get("placement") or {}
        for axis_name, p_out in out.items():
            if pl.get(axis_name, R) == R and p_out != R:
                axis = ctx.model_parallel[axis_name]
                key = (arg, "grad_all_reduce", axis_name)
                if key not in cache:
                    with g.inserting_after(arg):
                        new = g.call_function(ops.grad_all_reduce.default, (arg, axis.group_name, axis.world))
                    new.meta["val"] = arg.meta["val"]
                    new.meta["placement"] = dict(pl)
                    cache[key] = new
                    v = arg.meta["val"]
                    ctx.report.collectives.append(CollectiveRecord(
                        "all_reduce(grad)", axis_name, v.numel() * v.element_size(),
                        f"node {node.name}: replicated input of a sharded op", "pre_autograd"))
                _set_arg(node, pos, cache[key])
                arg = cache[key]


def _last_placeholder(g: fx.Graph) -> fx.Node:
    return [n for n in g.nodes if n.op == "placeholder"][-1]


def _get_arg(node: fx.Node, pos):
    if isinstance(pos, int):
        if node.op == "output":
            return node.args[0][pos]
        return node.args[pos]
    if isinstance(pos, str) and "." in pos:
        i, j = map(int, pos.split("."))
        return node.args[i][j]
    return node.kwargs[pos]


def _set_arg(node: fx.Node, pos, new) -> None:
    if node.op == "output":
        outs = list(node.args[0])
        outs[pos] = new
        node.args = (type(node.args[0])(outs),)
        return
    if isinstance(pos, int):
        args = list(node.args)
        args[pos] = new
        node.args = tuple(args)
    elif "." in pos:
        i, j = map(int, pos.split("."))
        args = list(node.args)
        inner = list(args[i])
        inner[j] = new
        args[i] = type(node.args[i])(inner)
        node.args = tuple(args)
    else:
        kwargs = dict(node.kwargs)
        kwargs[pos] = new
        node.kwargs = kwargs
