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

import torch
import torch.fx as fx
from torch.distributed.tensor import Shard

from graphshard.params import chunk_size
from graphshard.passes._graph import aten
from graphshard.passes._rules import StridedShard
from graphshard.passes.pipeline import PassContext

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
                if isinstance(p, (Shard, StridedShard)) and isinstance(sizes[p.dim], int) and sizes[p.dim] != -1:
                    axis = ctx.model_parallel[axis_name]
                    outer = getattr(p, "split_factor", 1)
                    sizes[p.dim] = outer * chunk_size(sizes[p.dim] // outer, axis.world, axis.rank)
            args = list(node.args)
            args[i] = sizes
            node.args = tuple(args)
        if isinstance(node.meta.get("val"), torch.Tensor):
            node.meta["logical_shape"] = tuple(node.meta["val"].shape)
        _rederive(node, ctx)
        _check_local(node, ctx)
    return gm


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
        if isinstance(p, Shard) and out.dim() > p.dim:
            axis = ctx.model_parallel[axis_name]
            # The local size must be some rank's chunk: a logical size divided by world size, rounded up or down.
            assert out.shape[p.dim] <= -(-node_logical_size(node, p.dim) // axis.world), (
                f"localize_shapes: node {node.name} has local dim {p.dim} of size {out.shape[p.dim]}, "
                f"larger than a {axis.world}-way shard of {node_logical_size(node, p.dim)}"
            )


def node_logical_size(node: fx.Node, dim: int) -> int:
    return node.meta["logical_shape"][dim]
