"""Sharded decompositions: ops that stay sharded only when rewritten into local work plus a collective.

A placement rule maps input placements to an output placement; some ops need
more than that to stay sharded, because each rank must compute with its own
offset into the sharded dim:

- ``embedding`` on a table sharded on its rows (``RowwiseParallel`` on an
  ``nn.Embedding``, the vocabulary split over ranks): each rank looks up the ids
  that fall in its rows and zeroes the others; the sum over ranks is the
  lookup, so the result is ``Partial``.
- ``_log_softmax`` over a dim the input is sharded on (logits sharded on the
  class dim, as ``loss_parallel`` keeps them): the max and the sum of
  exponentials are reduced over ranks (two all-reduces of one value per row),
  the output stays sharded.
- ``nll_loss_forward`` on log-probabilities sharded on the class dim: each rank
  picks the targets that fall in its classes; the per-row losses are ``Partial``.

Together the last two are cross-entropy on class-sharded logits without ever
gathering the logits, forward and backward (the backward comes from autograd of
the emitted ops). ``annotate_placements`` asks ``expand`` before applying an
op's rule; the emitted nodes carry their placements and the inputs they need
redistributed (``meta["required"]``), which ``insert_collectives`` honours.
Values that only steer the local computation (shifted ids, validity masks) are
rank-dependent and marked ``meta["rank_local"]``; no consumer outside the
expansion sees them.
"""

from __future__ import annotations

import operator

import torch.fx as fx
from torch.distributed.tensor import Partial, Shard

from graphshard.params import AxisGroup, chunk_size
from graphshard.passes._graph import R, aten, val

P = Partial()
PMAX = Partial("max")


class _Emitter:
    """Inserts nodes before ``anchor`` with fake values and placements on one mesh axis."""

    def __init__(self, g: fx.Graph, anchor: fx.Node, axis: str, fake_mode, others: dict):
        self.g, self.anchor, self.axis, self.fake_mode = g, anchor, axis, fake_mode
        self.others = others  # placements on the other model-parallel axes (all replicated)

    def __call__(self, target, *args, placement=R, required=None, rank_local=False, **kwargs) -> fx.Node:
        with self.g.inserting_before(self.anchor):
            node = self.g.call_function(target, args, kwargs)
        vals = fx.node.map_aggregate(args, lambda a: val(a) if isinstance(a, fx.Node) else a)
        kvals = fx.node.map_aggregate(kwargs, lambda a: val(a) if isinstance(a, fx.Node) else a)
        with self.fake_mode:
            node.meta["val"] = target(*vals, **kvals)
        node.meta["placement"] = {**self.others, self.axis: placement}
        node.meta["required"] = {pos: {self.axis: p} for pos, p in (required or {}).items()}
        if rank_local:
            node.meta["rank_local"] = True
        node.meta["expanded_from"] = self.anchor.name
        return node


def _offset_and_count(n: int, axis: AxisGroup) -> tuple[int, int]:
    """Where this rank's piece of a dim of size ``n`` starts, and its size (torch.chunk layout)."""
    c = -(-n // axis.world)
    return min(c * axis.rank, n), chunk_size(n, axis.world, axis.rank)


def _in_range(emit: _Emitter, ids: fx.Node, start: int, count: int) -> tuple[fx.Node, fx.Node]:
    """(ids - start where the id is in this rank's piece, else 0), and the mask of those ids."""
    shifted = emit(aten.sub.Tensor, ids, start, rank_local=True)
    lo = emit(aten.ge.Scalar, shifted, 0, rank_local=True)
    hi = emit(aten.lt.Scalar, shifted, count, rank_local=True)
    valid = emit(aten.bitwise_and.Tensor, lo, hi, rank_local=True)
    safe = emit(aten.mul.Tensor, shifted, valid, rank_local=True)
    return safe, valid


def _vocab_embedding(node, emit: _Emitter, axis: AxisGroup):
    weight, ids = node.args[0], node.args[1]
    start, count = _offset_and_count(val(weight).shape[0], axis)
    safe, valid = _in_range(emit, ids, start, count)
    looked_up = emit(aten.embedding.default, weight, safe, *node.args[2:], placement=P)
    mask = emit(aten.unsqueeze.default, valid, -1, rank_local=True)
    return emit(aten.mul.Tensor, looked_up, mask, placement=P)


def _class_sharded_log_softmax(node, emit: _Emitter, axis: AxisGroup):
    x, dim = node.args[0], node.args[1] % val(node.args[0]).dim()
    shard = Shard(dim)
    stop = emit(aten.detach.default, x, placement=shard)
    row_max = emit(aten.amax.default, stop, [dim], True, placement=PMAX)
    shifted = emit(aten.sub.Tensor, x, row_max, placement=shard, required={1: R})
    exp = emit(aten.exp.default, shifted, placement=shard)
    total = emit(aten.sum.dim_IntList, exp, [dim], True, placement=P)
    log_total = emit(aten.log.default, total, placement=R, required={0: R})
    return emit(aten.sub.Tensor, shifted, log_total, placement=shard)


def _class_sharded_nll_loss(node, emit: _Emitter, axis: AxisGroup):
    logp, target, weight, reduction, ignore_index = node.args[:5]
    start, count = _offset_and_count(val(logp).shape[1], axis)
    safe, valid = _in_range(emit, target, start, count)
    kept = emit(aten.ne.Scalar, target, ignore_index)
    valid = emit(aten.bitwise_and.Tensor, valid, kept, rank_local=True)
    index = emit(aten.unsqueeze.default, safe, 1, rank_local=True)
    picked = emit(aten.gather.default, logp, 1, index, placement=P)
    picked = emit(aten.squeeze.dim, picked, 1, placement=P)
    dtype = val(logp).dtype
    mask = emit(aten._to_copy.default, valid, dtype=dtype, rank_local=True)
    losses = emit(aten.neg.default, emit(aten.mul.Tensor, picked, mask, placement=P), placement=P)
    weight_total = emit(aten.sum.default, emit(aten._to_copy.default, kept, dtype=dtype))
    if reduction == 0:  # none
        out = losses
    else:
        out = emit(aten.sum.default, losses, placement=P)
        if reduction == 1:  # mean over the targets that are not ignored
            out = emit(aten.div.Tensor, out, weight_total, placement=P)
    return [out, weight_total]


def expand(node: fx.Node, current: dict[str, list], ctx) -> fx.Node | list[fx.Node] | None:
    """Rewrites ``node`` into sharded local work if its inputs' placements call for it.

    ``current`` is, per model-parallel axis, the placements of the node's tensor
    inputs. Returns the replacement (a list for multi-output ops), or None.
    """
    for axis_name, cur in current.items():
        if any(p != R for a, ps in current.items() if a != axis_name for p in ps):
            continue  # only one model-parallel axis at a time is sharded here
        others = {a: R for a in current if a != axis_name}
        axis = ctx.model_parallel[axis_name]
        fn = None
        if node.target == aten.embedding.default and cur[0] == Shard(0):
            fn = _vocab_embedding
        elif node.target == aten._log_softmax.default and cur[0] == Shard(node.args[1] % val(node.args[0]).dim()):
            fn = _class_sharded_log_softmax
        elif (node.target == aten.nll_loss_forward.default and val(node.args[0]).dim() == 2
              and cur[0] == Shard(1) and node.args[2] is None and cur[1] == R):
            fn = _class_sharded_nll_loss
        if fn is None:
            continue
        emit = _Emitter(node.graph, node, axis_name, ctx.fake_mode, others)
        return fn(node, emit, axis)
    return None


def replace(node: fx.Node, new) -> set[fx.Node]:
    """Points ``node``'s users at its replacement and erases it; returns the erased nodes."""
    erased = {node}
    if isinstance(new, list):
        for user in list(node.users):
            assert user.target == operator.getitem, f"{node.name} is used by {user.name} directly"
            user.replace_all_uses_with(new[user.args[1]])
            node.graph.erase_node(user)
            erased.add(user)
    else:
        node.replace_all_uses_with(new)
    node.graph.erase_node(node)
    return erased

