"""localize_shapes: turn the logical program into the per-rank program.

After insert_collectives every value has a known placement; a value sharded on
dim ``d`` of a model-parallel axis holds ``chunk(L_d)`` elements there. This pass
walks the graph in order, rewrites the size arguments that user code hard-coded
for the logical program (``view(b, s, n_heads, head_dim)``, ``expand``,
``new_zeros``, factory sizes) to local sizes, and re-derives every
``meta["val"]`` by running the op on fake local inputs, so later passes and
aot_autograd see true per-rank shapes.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx
from torch.distributed.tensor import Shard

from graphshard.params import chunk_size
from graphshard.passes._graph import aten
from graphshard.plan import StridedShard
from graphshard.passes.context import PassContext

# op -> index of its size argument
_SIZE_ARG = {
    aten.view.default: 1, aten._unsafe_view.default: 1, aten.reshape.default: 1, aten.expand.default: 1,
    aten.new_empty.default: 1, aten.new_zeros.default: 1, aten.new_ones.default: 1, aten.new_full.default: 1,
    aten.full.default: 0, aten.zeros.default: 0, aten.ones.default: 0, aten.empty.memory_format: 0,
}


def localize_shapes(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    if not ctx.model_parallel:
        return gm
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        pl = node.meta.get("placement")
        if node.target in _SIZE_ARG and isinstance(pl, dict):
            i = _SIZE_ARG[node.target]
            sizes = list(node.args[i])
            for axis_name, p in pl.items():
                if isinstance(p, (Shard, StridedShard)) and not (isinstance(sizes[p.dim], int) and sizes[p.dim] == -1):
                    axis = ctx.model_parallel[axis_name]
                    sizes[p.dim] = _local_size(gm.graph, node, sizes[p.dim], p, axis)
            args = list(node.args)
            args[i] = sizes
            node.args = tuple(args)
        if node.target in _SPLITS:
            _localize_split(node, ctx)
        if isinstance(node.meta.get("val"), torch.Tensor):
            node.meta["logical_shape"] = tuple(node.meta["val"].shape)
        _rederive(node, ctx)
        _check_local(node, ctx)
    return gm


_SPLITS = {aten.split.Tensor, aten.unsafe_split.Tensor, aten.split_with_sizes.default,
           aten.unsafe_split_with_sizes.default}


def _localize_split(node: fx.Node, ctx: PassContext) -> None:
    """A split of a ``StridedShard`` dim along its blocks (the ``split`` rule allows no other):
    each piece's size becomes its blocks times this rank's piece of a block."""
    src = node.args[0]
    dim = (node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0)) % src.meta["val"].dim()
    for axis_name, p in (src.meta.get("placement") or {}).items():
        if not (isinstance(p, StridedShard) and p.dim == dim):
            continue
        axis = ctx.model_parallel[axis_name]
        block = src.meta["logical_shape"][dim] // p.split_factor
        local_block = chunk_size(block, axis.world, axis.rank)
        sizes = node.args[1]
        local = ([s // block * local_block for s in sizes] if isinstance(sizes, (list, tuple))
                 else sizes // block * local_block)
        node.args = (src, local, *node.args[2:])


def _local_size(g: fx.Graph, node: fx.Node, size, p, axis):
    """The per-rank size of a sharded dim; the sharded factor must be static (a symbolic batch
    merged in front of it, as in ``view(b * n_heads, ...)``, is fine). ``size`` is an int or,
    for a symbolic size, the graph node computing it."""
    outer = getattr(p, "split_factor", 1)
    value = size.meta["val"] if isinstance(size, fx.Node) else size
    try:
        inner = int(value // outer)
    except Exception:  # a data-dependent or symbolic sharded size
        raise NotImplementedError(
            f"node {node.name!r} ({node.target}) shards dim {p.dim} whose size {size} is dynamic; "
            "graphshard shards only static sizes: mark that dim static (torch._dynamo.mark_static) "
            "or compile with dynamic=False"
        ) from None
    local_inner = chunk_size(inner, axis.world, axis.rank)
    if isinstance(outer, int):
        return outer * local_inner
    # symbolic outer factor: (size // inner) * local_inner, as graph nodes
    with g.inserting_before(node):
        q = g.call_function(operator.floordiv, (size, inner))
        q.meta["val"] = value // inner
        local = g.call_function(operator.mul, (q, local_inner))
        local.meta["val"] = q.meta["val"] * local_inner
    return local


def _rederive(node: fx.Node, ctx: PassContext) -> None:
    def v(a):
        return a.meta["val"] if isinstance(a, fx.Node) else a

    args = fx.node.map_aggregate(node.args, v)
    kwargs = fx.node.map_aggregate(node.kwargs, v)
    with ctx.fake_mode:
        node.meta["val"] = node.target(*args, **kwargs)


def _check_local(node: fx.Node, ctx: PassContext) -> None:
    pl, out = node.meta.get("placement"), node.meta.get("val")
    if not isinstance(pl, dict) or not isinstance(out, torch.Tensor):
        return
    for axis_name, p in pl.items():
        if isinstance(p, Shard) and out.dim() > p.dim and isinstance(out.shape[p.dim], int):
            axis = ctx.model_parallel[axis_name]
            # The local size must be some rank's chunk: a logical size divided by world size, rounded up or down.
            assert out.shape[p.dim] <= -(-node_logical_size(node, p.dim) // axis.world), (
                f"localize_shapes: node {node.name} has local dim {p.dim} of size {out.shape[p.dim]}, "
                f"larger than a {axis.world}-way shard of {node_logical_size(node, p.dim)}"
            )


def node_logical_size(node: fx.Node, dim: int) -> int:
    return node.meta["logical_shape"][dim]
