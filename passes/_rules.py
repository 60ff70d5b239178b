"""Placement rules: for one mesh axis, what an op needs of its inputs and what it produces.

A rule gets the node and the current placement of each tensor input (in
``tensor_args`` order) and returns ``(required_input_placements, output)``.
``output`` is a Placement, or a list of them for ops with several tensor outputs.
Ops without a rule replicate their inputs (a logged fallback).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.fx as fx
from torch.distributed.tensor import Partial, Placement, Replicate, Shard

from graphshard.passes._graph import R, aten, tensor_args, val

P = Partial()


@dataclass(frozen=True)
class StridedShard:
    """Dim ``dim`` is a merge of (``split_factor`` outer blocks) x (a sharded inner dim).

    It arises when a view merges a sharded dim into the dims before it, as the
    ``view(b * n_heads, s, head_dim)`` that ``matmul`` decomposes into for batched
    attention; the matching view back splits it into ``Shard`` again. Internal to
    the passes: it is never redistributed, only propagated.
    """

    dim: int
    split_factor: int
Rule = Callable[[fx.Node, list[Placement]], "tuple[list[Placement], Placement | list[Placement]]"]
RULES: dict = {}


def rule(*ops):
    def deco(fn):
        for op in ops:
            RULES[op] = fn
        return fn

    return deco


def _ndim(node) -> int:
    return val(node).dim()


def _shape(node):
    return tuple(val(node).shape)


# ---------------------------------------------------------------- pointwise (broadcasting)
_LINEAR_BINARY = {aten.add.Tensor, aten.sub.Tensor, aten.add_.Tensor, aten.sub_.Tensor}
_LINEAR_SCALE = {aten.mul.Tensor, aten.div.Tensor, aten.mul.Scalar, aten.div.Scalar, aten.neg.default,
                 aten.mul_.Tensor, aten.div_.Tensor}


def pointwise(node: fx.Node, ins: list[Placement]):
    args = [a for _, a in tensor_args(node)]
    out_shape = _shape(node)
    out_nd = len(out_shape)
    partial = [isinstance(p, Partial) for p in ins]
    if any(partial):
        if node.target in _LINEAR_BINARY and all(partial):
            return ins, P
        if node.target in _LINEAR_SCALE and sum(partial) == 1 and all(
            isinstance(p, Partial) or _shape(a) == () for p, a in zip(ins, args)
        ):
            return ins, P
        ins = [R if isinstance(p, Partial) else p for p in ins]
    # Shard: the first sharded input decides the output dim (aligned from the right).
    out_dim, strided = None, None
    for p, a in zip(ins, args):
        if isinstance(p, (Shard, StridedShard)):
            d = p.dim + out_nd - _ndim(a)
            if _shape(a)[p.dim] == out_shape[d]:
                out_dim, strided = d, (p.split_factor if isinstance(p, StridedShard) else None)
                break
    if out_dim is None:
        return [R] * len(ins), R
    req = []
    for a in args:
        d = out_dim - (out_nd - _ndim(a))
        if d >= 0 and _shape(a)[d] == out_shape[out_dim] and out_shape[out_dim] > 1:
            req.append(Shard(d) if strided is None else StridedShard(d, strided))
        else:
            req.append(R)
    return req, (Shard(out_dim) if strided is None else StridedShard(out_dim, strided))


# ---------------------------------------------------------------- matmul family
def _cost(cur: Placement, want: Placement) -> int:
    if cur == want:
        return 0
    if isinstance(cur, Replicate) and isinstance(want, Shard):
        return 1  # a local slice
    if isinstance(cur, Partial):
        return 4 if isinstance(want, Replicate) else 3
    return 2


def _choose(ins: list[Placement], strategies):
    return min(strategies, key=lambda s: sum(_cost(c, w) for c, w in zip(ins, s[0])))


@rule(aten.mm.default)
def mm(node, ins):
    return _choose(ins, [((R, R), R), ((Shard(0), R), Shard(0)), ((R, Shard(1)), Shard(1)),
                         ((Shard(1), Shard(0)), P)])


@rule(aten.addmm.default)
def addmm(node, ins):
    bias_nd = _ndim(node.args[0])
    col_bias = Shard(bias_nd - 1) if bias_nd >= 1 and _shape(node.args[0])[-1] > 1 else R
    row_bias = Shard(0) if bias_nd == 2 and _shape(node.args[0])[0] > 1 else R
    return _choose(ins, [((R, R, R), R), ((row_bias, Shard(0), R), Shard(0)),
                         ((col_bias, R, Shard(1)), Shard(1)), ((P, Shard(1), Shard(0)), P)])


@rule(aten.bmm.default)
def bmm(node, ins):
    strategies = [((R, R), R), ((Shard(0), Shard(0)), Shard(0)), ((Shard(1), R), Shard(1)),
                  ((R, Shard(2)), Shard(2)), ((Shard(2), Shard(1)), P)]
    for p in ins:
        if isinstance(p, StridedShard) and p.dim == 0:
            strategies.insert(0, ((p, p), p))  # heads sharded inside the batch dim: independent batches
    return _choose(ins, strategies)


# ---------------------------------------------------------------- dim permutations
def _perm_rule(perm_of):
    def r(node, ins):
        (p,) = ins[:1]
        if isinstance(p, Shard):
            perm = perm_of(node)
            return ins, Shard(perm.index(p.dim))
        return ins, p
    return r


def _transpose_perm(node):
    nd = _ndim(node.args[0])
    perm = list(range(nd))
    if nd >= 2:
        d0, d1 = node.args[1] % nd, node.args[2] % nd
        perm[d0], perm[d1] = perm[d1], perm[d0]
    return perm


RULES[aten.t.default] = _perm_rule(lambda n: list(range(_ndim(n.args[0])))[::-1])
RULES[aten.transpose.int] = _perm_rule(_transpose_perm)
RULES[aten.permute.default] = _perm_rule(lambda n: [d % _ndim(n.args[0]) for d in n.args[1]])


# ---------------------------------------------------------------- view family
def _dim_groups(src: tuple[int, ...], dst: tuple[int, ...]):
    """Pairs of (src dims, dst dims) with equal products, in order (size-1 dims attach to a group)."""
    groups, i, j = [], 0, 0
    while i < len(src) or j < len(dst):
        si, sj = [i], [j]
        a = src[i] if i < len(src) else 1
        b = dst[j] if j < len(dst) else 1
        i, j = i + 1, j + 1
        while a != b:
            if a < b and i < len(src):
                a *= src[i]; si.append(i); i += 1
            elif j < len(dst):
                b *= dst[j]; sj.append(j); j += 1
            else:
                return None
        groups.append(([d for d in si if d < len(src)], [d for d in sj if d < len(dst)]))
    return groups


@rule(aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.expand.default)
def view(node, ins):
    p = ins[0]
    if not isinstance(p, (Shard, StridedShard)):
        return ins, p
    src, dst = _shape(node.args[0]), _shape(node)
    if node.target == aten.expand.default:
        shift = len(dst) - len(src)
        return ins, Shard(p.dim + shift) if isinstance(p, Shard) else StridedShard(p.dim + shift, p.split_factor)
    for sdims, ddims in _dim_groups(src, dst) or []:
        if p.dim not in sdims:
            continue
        real_src = [d for d in sdims if src[d] != 1]
        real_dst = [d for d in ddims if dst[d] != 1]
        if isinstance(p, StridedShard):
            # (outer x sharded) splitting back into [outer, sharded]: a plain Shard again.
            if len(real_src) == 1 and len(real_dst) == 2 and dst[real_dst[0]] == p.split_factor:
                return ins, Shard(real_dst[1])
            if len(real_src) == 1 and len(real_dst) == 1:
                return ins, StridedShard(real_dst[0], p.split_factor)
            break
        if not real_dst:
            break
        if p.dim == real_src[0]:
            return ins, Shard(real_dst[0])
        if len(real_dst) == 1 and p.dim == real_src[-1]:
            # The sharded dim is the innermost of a merge: a strided shard of the merged dim.
            outer = 1
            for d in real_src[:-1]:
                outer *= src[d]
            return ins, StridedShard(real_dst[0], outer)
        break
    return [R], R


@rule(aten.unsqueeze.default)
def unsqueeze(node, ins):
    p = ins[0]
    if isinstance(p, Shard):
        d = node.args[1] % (_ndim(node.args[0]) + 1)
        return ins, Shard(p.dim + (1 if d <= p.dim else 0))
    return ins, p


# ---------------------------------------------------------------- reductions
@rule(aten.sum.dim_IntList, aten.sum.default, aten.mean.dim, aten.mean.default)
def reduction(node, ins):
    p = ins[0]
    nd = _ndim(node.args[0])
    dims = node.args[1] if len(node.args) > 1 and node.args[1] is not None else list(range(nd))
    dims = sorted(d % nd for d in (dims if isinstance(dims, (list, tuple)) else [dims]))
    keepdim = (node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False)) or False
    if isinstance(p, Partial):
        return (ins, P) if node.target in (aten.sum.dim_IntList, aten.sum.default) else ([R], R)
    if isinstance(p, Shard):
        if p.dim in dims:
            if node.target in (aten.sum.dim_IntList, aten.sum.default):
                return ins, P
            return [R], R
        return ins, Shard(p.dim if keepdim else p.dim - sum(d < p.dim for d in dims))
    return ins, R


@rule(aten._softmax.default, aten._log_softmax.default)
def softmax(node, ins):
    p = ins[0]
    if isinstance(p, Shard) and p.dim != node.args[1] % _ndim(node.args[0]):
        return ins, p
    return [R], R


@rule(aten.native_layer_norm.default)
def layer_norm(node, ins):
    p = ins[0]
    batch_nd = _ndim(node.args[0]) - len(node.args[1])
    if isinstance(p, Shard) and p.dim < batch_nd:
        return [p] + [R] * (len(ins) - 1), [p, p, p]
    return [R] * len(ins), [R, R, R]


@rule(aten.embedding.default)
def embedding(node, ins):
    w, idx = ins[0], ins[1]
    if isinstance(w, Shard) and w.dim == 1:
        return [w, R], Shard(_ndim(node))  # hidden dim is the last output dim
    if isinstance(idx, Shard) and isinstance(w, Replicate):
        return ins, idx
    return [R, R], R


_UNARY_SAME = [aten.clone.default, aten.detach.default, aten.alias.default, aten._to_copy.default,
               aten.contiguous.default, aten.gelu.default, aten.relu.default, aten.native_dropout.default]


@rule(aten.native_dropout.default)
def dropout(node, ins):
    return ins, [ins[0], ins[0]]


def lookup(target) -> Rule | None:
    r = RULES.get(target)
    if r is not None:
        return r
    if isinstance(target, torch._ops.OpOverload) and (
        torch.Tag.pointwise in target.tags or target in _UNARY_SAME
    ):
        return pointwise
    return None
