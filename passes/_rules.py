"""Placement rules: for one mesh axis, what an op needs of its inputs and what it produces.

A rule gets the node and the current placement of each tensor input (in
``tensor_args`` order) and returns ``(required_input_placements, output)``.
``output`` is a Placement, or a list of them (one per output) for ops with
several outputs. Ops without a rule replicate their inputs (a logged fallback).
Shapes are logical (single-device) when rules run. A rule is exact for the
math or it requires Replicate; among exact strategies it picks the cheapest
given the current placements (``choose``).

Sections: pointwise; matmul family; reductions; norms and softmax;
attention; others. The view family (views, permutations, split/cat/stack,
slice/select/index, complex views) lives in ``_view_rules.py``; the registry, the ``rule``
decorator and the helpers both use in ``_rule_kit.py``.
"""

from __future__ import annotations

import torch
import torch.fx as fx
from torch.distributed.tensor import Partial, Placement, Replicate, Shard

from graphshard.passes._graph import R, aten, tensor_args, val
from graphshard.passes._rule_kit import (
    RULES, P, Rule, arg_of, broadcast_req, choose, is_partial_sum, is_shard, moved_to, ndim_of, no_grad,
    rule, shape_of,
)
from graphshard.plan import StridedShard

# Partial reduce ops besides "sum" that insert_collectives resolves (Partial -> Replicate) with a
# forward-only collective (graphshard::all_reduce_max has no autograd formula): a rule yields
# them only for values no gradient flows through (``no_grad``); otherwise it replicates first.
FORWARD_ONLY_PARTIALS = frozenset({"max"})


# ---------------------------------------------------------------- pointwise (broadcasting)
_LINEAR_BINARY = {aten.add.Tensor, aten.sub.Tensor, aten.add_.Tensor, aten.sub_.Tensor}
_LINEAR_SCALE = {aten.mul.Tensor, aten.div.Tensor, aten.mul.Scalar, aten.div.Scalar, aten.neg.default,
                 aten.mul_.Tensor, aten.div_.Tensor, aten.mul_.Scalar, aten.div_.Scalar}
_DIVIDES = {aten.div.Tensor, aten.div_.Tensor}


@rule(aten.masked_fill.Tensor, aten.where.ScalarSelf, aten.where.ScalarOther, aten.where.Scalar)
def pointwise(node: fx.Node, ins: list[Placement]):
    """Elementwise with broadcasting (aligned from the right); also complex ``mul``.

    Partial: a sum of Partial("sum") values (add/sub) is Partial, and so is one
    Partial("sum") scaled by replicated scalars (mul; div only as the numerator).
    Every other Partial (other ops, other reduce ops) is replicated first.
    Shard: the first sharded input decides the output dim; the other inputs must
    be sharded on their matching dim, or replicated where they broadcast.
    """
    pos_args = list(tensor_args(node))
    args = [a for _, a in pos_args]
    out_shape = shape_of(node)
    out_nd = len(out_shape)
    partial = [isinstance(p, Partial) for p in ins]
    if any(partial):
        sums = all(is_partial_sum(p) for p, is_p in zip(ins, partial) if is_p)
        if sums and node.target in _LINEAR_BINARY and all(partial):
            return ins, P
        if sums and node.target in _LINEAR_SCALE and sum(partial) == 1 and all(
            is_p or (isinstance(p, Replicate) and shape_of(a) == ()) for p, is_p, a in zip(ins, partial, args)
        ) and (node.target not in _DIVIDES or pos_args[partial.index(True)][0] == 0):
            return ins, P
        ins = [R if isinstance(p, Partial) else p for p in ins]
    # Shard: the first sharded input decides the output dim (aligned from the right).
    out_dim, strided = None, None
    for p, a in zip(ins, args):
        if is_shard(p):
            d = p.dim + out_nd - ndim_of(a)
            if shape_of(a)[p.dim] == out_shape[d]:
                out_dim, strided = d, (p.split_factor if isinstance(p, StridedShard) else None)
                break
    if out_dim is None:
        return [R] * len(ins), R
    req = []
    for a in args:
        r = broadcast_req(a, out_dim, out_shape)
        req.append(r if strided is None or r == R else StridedShard(r.dim, strided))
    return req, (Shard(out_dim) if strided is None else StridedShard(out_dim, strided))


_IDENTITY = {aten.clone.default, aten.detach.default, aten.alias.default, aten.contiguous.default,
             aten.lift_fresh_copy.default}


@rule(*_IDENTITY)
def identity(node, ins):
    """Value-preserving copies: every placement (any Partial too) passes through."""
    return ins, ins[0]


@rule(aten._to_copy.default)
def to_copy(node, ins):
    """A dtype/device copy. Partial("sum") stays Partial only when the cast is exact per
    element (same dtype, or a floating-point widening); a narrowing or integer cast of a
    partial sum is not the cast of the sum."""
    p = ins[0]
    if isinstance(p, Partial):
        src, dst = val(node.args[0]).dtype, val(node).dtype
        exact = src == dst or (src.is_floating_point and dst.is_floating_point and dst.itemsize > src.itemsize)
        return (ins, p) if exact and is_partial_sum(p) else ([R], R)
    return ins, p


@rule(aten.empty_like.default, aten.zeros_like.default, aten.ones_like.default, aten.full_like.default,
      aten.rand_like.default, aten.randn_like.default, aten.randint_like.default, aten.randint_like.low_dtype,
      aten.bernoulli_.float, aten.bernoulli.p, aten.uniform_.default, aten.normal_.default)
def shape_only(node, ins):
    """Ops whose output values ignore the input's values (factories ``*_like``, the in-place
    ``bernoulli_(p: float)`` of SDPA's dropout): a sharded input gives a sharded output of the local shape, a
    Partial or replicated one a replicated output. Random fills draw the logical tensor's values
    for the output's placement (``localize_random``)."""
    p = ins[0]
    return ins, p if is_shard(p) else R


@rule(aten.tril.default, aten.triu.default)
def tril(node, ins):
    """Masks the last two dims by position: a shard there would shift the diagonal (replicate);
    batch dims pass. Any Partial passes: masked entries are 0 on every rank."""
    p = ins[0]
    if is_shard(p) and p.dim >= ndim_of(node.args[0]) - 2:
        return [R], R
    return ins, p


# ---------------------------------------------------------------- matmul family
def _choose_matmul(ins: list[Placement], strategies):
    """``choose`` for the matmul family, where each strategy shards one index space (the rows,
    the columns, the batch or the contraction) on every operand it names: the same strategy
    with every ``Shard`` a ``StridedShard`` of an input's ``split_factor`` is exact too (a
    fused weight's projections stay sharded through the product)."""
    # (A symbolic split factor, a dynamic batch merged in front of the heads, gets no variants.)
    factors = dict.fromkeys(p.split_factor for p in ins if isinstance(p, StridedShard) and type(p.split_factor) is int)
    variants = []
    for k in factors:
        for req, out in strategies:
            if any(isinstance(r, Shard) for r in req):
                variants.append((tuple(StridedShard(r.dim, k) if isinstance(r, Shard) else r for r in req),
                                 StridedShard(out.dim, k) if isinstance(out, Shard) else out))
    return choose(ins, [*strategies, *variants])


def _strided_batch(ins, strategies, n: int):
    """Heads sharded inside the batch dim of a batched matmul: independent batches."""
    for p in ins:
        if isinstance(p, StridedShard) and p.dim == 0:
            strategies.insert(0, ((p,) * n, p))
    return strategies


@rule(aten.mm.default)
def mm(node, ins):
    return _choose_matmul(ins, [((R, R), R), ((Shard(0), R), Shard(0)), ((R, Shard(1)), Shard(1)),
                         ((Shard(1), Shard(0)), P)])


@rule(aten.addmm.default)
def addmm(node, ins):
    bias_nd = ndim_of(node.args[0])
    col_bias = Shard(bias_nd - 1) if bias_nd >= 1 and shape_of(node.args[0])[-1] > 1 else R
    row_bias = Shard(0) if bias_nd == 2 and shape_of(node.args[0])[0] > 1 else R
    return _choose_matmul(ins, [((R, R, R), R), ((row_bias, Shard(0), R), Shard(0)),
                         ((col_bias, R, Shard(1)), Shard(1)), ((P, Shard(1), Shard(0)), P)])


@rule(aten.bmm.default)
def bmm(node, ins):
    return _choose_matmul(ins, _strided_batch(ins, [((R, R), R), ((Shard(0), Shard(0)), Shard(0)), ((Shard(1), R), Shard(1)),
                                             ((R, Shard(2)), Shard(2)), ((Shard(2), Shard(1)), P)], 2))


@rule(aten.baddbmm.default)
def baddbmm(node, ins):
    """``beta * input + alpha * (batch1 @ batch2)``: bmm's strategies, the broadcasting ``input``
    sharded like the output (replicated where it broadcasts), or Partial with a contraction shard."""
    out = shape_of(node)
    inp = [broadcast_req(node.args[0], d, out) for d in range(3)]
    strategies = [((R, R, R), R), ((inp[0], Shard(0), Shard(0)), Shard(0)), ((inp[1], Shard(1), R), Shard(1)),
                  ((inp[2], R, Shard(2)), Shard(2)), ((P, Shard(2), Shard(1)), P)]
    for p in ins[1:]:
        if isinstance(p, StridedShard) and p.dim == 0:
            # The input must broadcast over the batch or already be laid out the same way
            # (a strided shard cannot be made from a replicated value).
            req = R if broadcast_req(node.args[0], 0, out) == R else p
            if req == R or ins[0] == p:
                strategies.insert(0, ((req, p, p), p))
    return _choose_matmul(ins, strategies)


@rule(aten.linear.default)
def linear(node, ins):
    """``input @ weight.T + bias`` (it decomposes to mm/addmm under make_fx; kept for graphs
    that keep it): column-parallel, row-parallel, or an input sharded on a batch dim."""
    x, w = node.args[0], node.args[1]
    nd, has_bias = ndim_of(x), len(ins) == 3
    if ndim_of(w) != 2 or nd < 1:
        return [R] * len(ins), R
    bias = lambda p: (p,) if has_bias else ()  # noqa: E731
    col_bias = Shard(0) if has_bias and shape_of(node.args[2])[-1] > 1 and ndim_of(node.args[2]) == 1 else R
    strategies = [((R, R) + bias(R), R), ((R, Shard(0)) + bias(col_bias), Shard(nd - 1)),
                  ((Shard(nd - 1), Shard(1)) + bias(P), P)]
    if isinstance(ins[0], Shard) and ins[0].dim < nd - 1:
        strategies.append(((ins[0], R) + bias(R), ins[0]))
    return _choose_matmul(ins, strategies)


def grouped_mm(node, ins):
    """A grouped matmul ``input [S, D] @ weight[e] [D, O]`` for the rows ``offs`` assigns to each
    expert e (``aten._grouped_mm``; transformers' CPU ``grouped_mm_fallback``): the experts'
    weights sharded on their output dim give the output sharded on its columns, sharded on
    the contraction dim (with the input's columns) a Partial sum; the offsets and the input's
    rows stay whole (which rows go to which expert is global)."""
    if len(ins) != 3 or ndim_of(node.args[0]) != 2 or ndim_of(node.args[1]) != 3:
        return [R] * len(ins), R
    return _choose_matmul(ins, [((R, R, R), R), ((R, Shard(2), R), Shard(1)), ((Shard(1), Shard(1), R), P)])


RULES[aten._grouped_mm.default] = grouped_mm
# Third-party ops by qualified name (their namespace may not be loaded when graphshard is).
RULES_BY_NAME = {"transformers::grouped_mm_fallback": grouped_mm}


# ---------------------------------------------------------------- reductions
def _reduce_dims(node, dim_name="dim"):
    """(sorted reduced dims, keepdim) of a reduction; no dim (None or []) reduces every dim."""
    nd = ndim_of(node.args[0])
    try:
        dims = arg_of(node, dim_name)
    except KeyError:
        dims = None
    if dims is None or (isinstance(dims, (list, tuple)) and len(dims) == 0):
        dims = range(nd)
    dims = sorted({d % max(nd, 1) for d in (dims if isinstance(dims, (list, tuple, range)) else [dims])})
    try:
        keepdim = bool(arg_of(node, "keepdim", False))
    except KeyError:
        keepdim = False
    return dims, keepdim


def _kept(p, dims, keepdim):
    """Where a shard on a dim that is not reduced lands in the output."""
    return moved_to(p, p.dim if keepdim else p.dim - sum(d < p.dim for d in dims))


@rule(aten.sum.dim_IntList, aten.sum.default, aten.mean.dim, aten.mean.default)
def reduction(node, ins):
    """sum and mean are linear: a Partial("sum") input stays Partial. Summing a sharded dim
    gives Partial; a mean over a sharded dim replicates first (each rank would divide by its
    own piece's size)."""
    p = ins[0]
    dims, keepdim = _reduce_dims(node)
    is_sum = node.target in (aten.sum.dim_IntList, aten.sum.default)
    if isinstance(p, Partial):
        return (ins, P) if is_partial_sum(p) else ([R], R)
    if is_shard(p):
        if p.dim in dims:
            return (ins, P) if is_sum else ([R], R)
        return ins, _kept(p, dims, keepdim)
    return ins, R


def _minmax_partial(node, ins, reduce_op):
    """amax/amin-style: a shard on a reduced dim gives Partial(reduce_op) where a collective for
    it exists and no gradient flows through (``FORWARD_ONLY_PARTIALS``), else replicate first;
    a Partial of the same reduce op passes."""
    p = ins[0]
    dims, keepdim = _reduce_dims(node)
    forward_only = reduce_op in FORWARD_ONLY_PARTIALS and no_grad(node.args[0])
    if isinstance(p, Partial):  # a max of maxima: already a forward-only value
        return (ins, p) if p.reduce_op == reduce_op else ([R], R)
    if is_shard(p):
        if p.dim not in dims:
            return ins, _kept(p, dims, keepdim)
        return (ins, Partial(reduce_op)) if forward_only else ([R], R)
    return ins, R


@rule(aten.amax.default, aten.max.default)
def amax(node, ins):
    return _minmax_partial(node, ins, "max")


@rule(aten.amin.default, aten.min.default)
def amin(node, ins):
    return _minmax_partial(node, ins, "min")


@rule(aten.var.correction, aten.std.correction, aten.var.dim, aten.std.dim, aten.any.default, aten.any.dim,
      aten.any.dims, aten.all.default, aten.all.dim, aten.all.dims, aten.argmax.default, aten.argmin.default,
      aten.prod.default, aten.prod.dim_int)
def local_reduction(node, ins):
    """Reductions that are not linear (var/std, any/all, argmax/argmin, prod): a shard on a kept
    dim passes; a reduced sharded dim or a Partial input is replicated first."""
    p = ins[0]
    dims, keepdim = _reduce_dims(node)
    if is_shard(p) and p.dim not in dims:
        return ins, _kept(p, dims, keepdim)
    return [R] * len(ins), R


@rule(aten.var_mean.correction, aten.max.dim, aten.min.dim)
def local_reduction2(node, ins):
    """Two-output reductions ((var, mean), (values, indices)): as ``local_reduction``, for both."""
    req, out = local_reduction(node, ins)
    return req, [out, out]


# ---------------------------------------------------------------- norms and softmax
@rule(aten._softmax.default, aten._log_softmax.default)
def softmax(node, ins):
    p = ins[0]
    if isinstance(p, Shard) and p.dim != node.args[1] % ndim_of(node.args[0]):
        return ins, p
    return [R], R


@rule(aten._safe_softmax.default)
def safe_softmax(node, ins):
    """``_safe_softmax`` (SDPA's math path): a shard on a dim other than the softmax dim passes."""
    p = ins[0]
    if is_shard(p) and p.dim != node.args[1] % ndim_of(node.args[0]):
        return ins, p
    return [R], R


@rule(aten.native_layer_norm.default)
def layer_norm(node, ins):
    p = ins[0]
    batch_nd = ndim_of(node.args[0]) - len(node.args[1])
    if isinstance(p, Shard) and p.dim < batch_nd:
        return [p] + [R] * (len(ins) - 1), [p, p, p]
    return [R] * len(ins), [R, R, R]


@rule(aten._fused_rms_norm.default, aten.rms_norm.default)
def rms_norm(node, ins):
    """RMS norm over the trailing ``normalized_shape`` dims: a shard on a leading dim (the sequence
    dim under sequence parallelism) passes to the output and ``rstd``; weight replicated.
    (On CPU ``F.rms_norm`` decomposes to pow/mean/rsqrt/mul under make_fx; the fused op
    is what other backends emit.)"""
    p = ins[0]
    batch_nd = ndim_of(node.args[0]) - len(node.args[1])
    n_out = len(val(node)) if isinstance(val(node), (list, tuple)) else 1
    out = p if isinstance(p, Shard) and p.dim < batch_nd else None
    if out is None:
        return [R] * len(ins), [R] * n_out if n_out > 1 else R
    return [p] + [R] * (len(ins) - 1), [out] * n_out if n_out > 1 else out


# ---------------------------------------------------------------- attention
# op -> (name of its mask/bias argument or None, indices of the outputs laid out [b, h, ...])
_SDPA = {
    aten._scaled_dot_product_flash_attention_for_cpu.default: ("attn_mask", (0, 1)),
    aten._scaled_dot_product_flash_attention.default: (None, (0, 1, 8)),
    aten._scaled_dot_product_efficient_attention.default: ("attn_bias", (0, 1)),
    aten._scaled_dot_product_cudnn_attention.default: ("attn_bias", (0, 1, 8)),
    aten.scaled_dot_product_attention.default: ("attn_mask", (0,)),
}


@rule(*_SDPA)
def sdpa(node, ins, world: int):
    """Fused attention on [b, h, s, d]: q, k and v all sharded on the batch dim or all on the
    heads dim give outputs (attention output, logsumexp, debug mask) sharded the same way; RNG
    state and sequence metadata are replicated. Grouped-query attention (fewer key/value heads
    than query heads, each serving a group of consecutive query heads) shards its heads when
    the key/value heads divide evenly over the ``world`` ranks: each rank's query heads are
    then exactly the groups of its key/value heads. The mask broadcasts to [b, h, sq, sk]:
    sharded where it has that dim at full size, else replicated. A shard on the sequence or
    head_dim, or anything else, replicates."""
    q, k, v = node.args[:3]
    mask_name, sharded_outs = _SDPA[node.target]
    outs = val(node) if isinstance(val(node), (list, tuple)) else [val(node)]
    n_in = len(ins)

    def outputs(d):
        res = []
        for i, o in enumerate(outs):
            ok = (d is not None and i in sharded_outs and isinstance(o, torch.Tensor) and o.dim() > d
                  and o.shape[d] == shape_of(q)[d])
            res.append(Shard(d) if ok else R)
        return res if len(outs) > 1 else res[0]

    strategies = [([R] * n_in, outputs(None))]
    if all(ndim_of(t) == 4 for t in (q, k, v)):
        mask = arg_of(node, mask_name) if mask_name else None
        hq, hk = shape_of(q)[1], shape_of(k)[1]
        gqa = hk != hq and shape_of(v)[1] == hk and hq % hk == 0 and hk % world == 0
        for d in (0, 1):
            if (len({shape_of(t)[d] for t in (q, k, v)}) == 1 or (d == 1 and gqa)) and shape_of(q)[d] > 1:
                req = [Shard(d)] * 3
                if n_in > 3:
                    req.append(broadcast_req(mask, d, (*shape_of(q)[:2], shape_of(q)[2], shape_of(k)[2])))
                strategies.append((req, outputs(d)))
    return choose(ins, strategies)


# ---------------------------------------------------------------- others
@rule(aten.embedding.default)
def embedding(node, ins):
    w, idx = ins[0], ins[1]
    if isinstance(w, Shard) and w.dim == 1:
        return [w, R], Shard(ndim_of(node) - 1)  # hidden dim is the last output dim
    if isinstance(idx, Shard) and isinstance(w, Replicate):
        return ins, idx
    return [R, R], R


_UNARY_SAME = [aten.clone.default, aten.detach.default, aten.alias.default, aten._to_copy.default,
               aten.contiguous.default, aten.gelu.default, aten.relu.default, aten.native_dropout.default,
               aten.bernoulli.default]


@rule(aten.native_dropout.default)
def dropout(node, ins):
    """(output, mask): the mask has the input's placement (``localize_random`` draws each piece of
    the logical mask). A Partial input is replicated first: a dropout of the summands is not a
    dropout of the sum."""
    p = ins[0]
    if isinstance(p, Partial):
        return [R], [R, R]
    return ins, [p, p]


def lookup(target) -> Rule | None:
    r = RULES.get(target)
    if r is not None:
        return r
    if isinstance(target, torch._ops.OpOverload) and target._schema.name in RULES_BY_NAME:
        return RULES_BY_NAME[target._schema.name]
    if isinstance(target, torch._ops.OpOverload) and (
        torch.Tag.pointwise in target.tags or target in _UNARY_SAME
    ):
        return pointwise
    return None


from graphshard.passes import _view_rules  # noqa: E402,F401  (registers the view-family rules)
