"""Placement rules for the view family: ops that move, merge, split, select or join dims.

The common rule: a sharded dim the op does not touch stays sharded (renumbered
to where it lands in the output); an op that splits, joins, slices or selects
*along* the sharded dim replicates first. Views and selections are linear and
pick elements without combining them, so any Partial passes through them
(except the complex views, which pass only Partial("sum")). Registered into
``_rule_kit.RULES`` on import (``_rules`` imports this module at its end, so the registry is
complete once ``_rules`` is imported).
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import Partial, Shard

from graphshard.passes._graph import R, aten, val
from graphshard.passes._rule_kit import (
    RULES, arg_of, choose, is_partial_sum, is_shard, moved_to, ndim_of, rule, shape_of,
)
from graphshard.plan import StridedShard


# ---------------------------------------------------------------- dim permutations
def _perm_rule(perm_of):
    def r(node, ins):
        p = ins[0]
        if is_shard(p):
            return ins, moved_to(p, perm_of(node).index(p.dim))
        return ins, p
    return r


def _transpose_perm(node):
    nd = ndim_of(node.args[0])
    perm = list(range(nd))
    if nd >= 2:
        d0, d1 = node.args[1] % nd, node.args[2] % nd
        perm[d0], perm[d1] = perm[d1], perm[d0]
    return perm


RULES[aten.t.default] = _perm_rule(lambda n: list(range(ndim_of(n.args[0])))[::-1])
RULES[aten.transpose.int] = _perm_rule(_transpose_perm)
RULES[aten.permute.default] = _perm_rule(lambda n: [d % ndim_of(n.args[0]) for d in n.args[1]])


# ---------------------------------------------------------------- reshapes
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
    """A shard on the outermost real dim of a merge or split group lands on the group's
    outermost real output dim; a shard on the innermost dim of a merge becomes a StridedShard
    (split back into Shard by the matching view); anything else replicates."""
    p = ins[0]
    if not is_shard(p):
        return ins, p
    src, dst = shape_of(node.args[0]), shape_of(node)
    if node.target == aten.expand.default:
        return ins, moved_to(p, p.dim + len(dst) - len(src))
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
    if is_shard(p):
        d = node.args[1] % (ndim_of(node.args[0]) + 1)
        return ins, moved_to(p, p.dim + (1 if d <= p.dim else 0))
    return ins, p


@rule(aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default)
def squeeze(node, ins):
    """Drops the named size-1 dims. A shard on a named dim replicates: a rank's piece of a larger
    dim may have size 1 and would be squeezed locally only. ``squeeze()`` names every dim."""
    p = ins[0]
    if not is_shard(p):
        return ins, p
    shape = shape_of(node.args[0])
    nd = len(shape)
    if node.target == aten.squeeze.default:
        named = set(range(nd))
    else:
        dims = node.args[1] if len(node.args) > 1 else ()
        named = {d % max(nd, 1) for d in (dims if isinstance(dims, (list, tuple)) else [dims])}
    if p.dim in named:
        return [R], R
    removed = sum(1 for d in named if d < p.dim and shape[d] == 1)
    return ins, moved_to(p, p.dim - removed)


@rule(aten.view_as_complex.default)
def view_as_complex(node, ins):
    """[..., 2] real -> [...] complex: a shard on another dim passes; on the trailing pair, or
    a Partial other than a sum (complex numbers have no max), replicates."""
    p = ins[0]
    if isinstance(p, Partial):
        return (ins, p) if is_partial_sum(p) else ([R], R)
    if is_shard(p) and p.dim == ndim_of(node.args[0]) - 1:
        return [R], R
    return ins, p


@rule(aten.view_as_real.default)
def view_as_real(node, ins):
    """[...] complex -> [..., 2] real: every dim keeps its number; Partial("sum") passes."""
    p = ins[0]
    if isinstance(p, Partial) and not is_partial_sum(p):
        return [R], R
    return ins, p


# ---------------------------------------------------------------- split and join
def _dim(node, name="dim", default=0, nd=None):
    d = arg_of(node, name, default)
    return d % (nd if nd is not None else ndim_of(node.args[0]))


@rule(aten.split.Tensor, aten.split_with_sizes.default, aten.unsafe_split.Tensor,
      aten.unsafe_split_with_sizes.default)
def split(node, ins):
    """(``chunk`` decomposes to ``split``.) Every piece keeps a shard on another dim. Splitting a
    ``StridedShard`` dim along its block boundaries (a fused projection into q, k and v) leaves
    each piece sharded: a ``Shard`` of one block, a ``StridedShard`` of several. Any other split
    of the sharded dim replicates first (the pieces' boundaries differ from the shards')."""
    p = ins[0]
    n = len(val(node))
    if is_shard(p) and p.dim == _dim(node):
        blocks = pieces_in_blocks(node, p)
        if blocks is None:
            return [R], [R] * n
        return ins, [Shard(p.dim) if b == 1 else StridedShard(p.dim, b) for b in blocks]
    return ins, [p] * n


def pieces_in_blocks(node, p) -> list[int] | None:
    """The number of ``p``'s blocks in each piece of split ``node``, or None when ``p`` is not a
    ``StridedShard`` or a piece boundary falls inside a block."""
    if not isinstance(p, StridedShard):
        return None
    sizes = [int(v.shape[p.dim]) for v in val(node)]
    block = shape_of(node.args[0])[p.dim] // p.split_factor
    if any(s % block for s in sizes):
        return None
    return [s // block for s in sizes]


@rule(aten.unbind.int)
def unbind(node, ins):
    p = ins[0]
    n = len(val(node))
    if is_shard(p):
        dim = _dim(node)
        if p.dim == dim:
            return [R], [R] * n
        return ins, [moved_to(p, p.dim - (p.dim > dim))] * n
    return ins, [p] * n


def _join(node, ins, out_dim_of):
    """cat/stack: all inputs sharded on the same dim d (not the joined one) give the output
    sharded on ``out_dim_of(d)`` (None: not allowed); replicated inputs are sliced to match.
    All inputs the same Partial give that Partial (the same reduction volume). A Partial
    joined with other placements is reduced first (to a shard where that is cheapest) rather
    than made the pending reduction of the larger joined tensor. Otherwise replicate."""
    n = len(ins)
    if all(isinstance(p, Partial) for p in ins) and len(set(ins)) == 1:
        return ins, ins[0]
    strategies = [([R] * n, R)]
    for c in dict.fromkeys(p for p in ins if is_shard(p)):
        d = out_dim_of(c.dim)
        if d is None or (isinstance(c, StridedShard) and any(p != c for p in ins)):
            continue  # a replicated or differently laid out input cannot be made a strided shard
        strategies.append(([c] * n, moved_to(c, d)))
    return choose(ins, strategies)


def _legacy_empty(t) -> bool:
    """A 1-D tensor with no elements: ``cat`` skips it whatever the other inputs' shapes (HF's
    ``DynamicCache`` starts each layer's keys and values as ``torch.tensor([])``)."""
    v = val(t)
    return v is not None and v.dim() == 1 and v.shape[0] == 0


@rule(aten.cat.default)
def cat(node, ins):
    """Inputs sharded alike on a dim other than the joined one keep the shard (``_join``).
    Legacy empty 1-D inputs take no part: they hold nothing to lay out and stay as they are."""
    tensors = node.args[0]
    out_nd = ndim_of(node)
    if len(ins) != len(tensors):
        return [R] * len(ins), R  # a non-tensor in the list (cannot happen for aten.cat)
    real = [i for i, t in enumerate(tensors) if not (_legacy_empty(t) and out_nd != 1)]
    if not real or any(ndim_of(tensors[i]) != out_nd for i in real):
        return [R] * len(ins), R
    dim = _dim(node, nd=out_nd)
    req, out = _join(node, [ins[i] for i in real], lambda d: None if d == dim else d)
    full = list(ins)
    for i, r in zip(real, req):
        full[i] = r
    return full, out


@rule(aten.stack.default)
def stack(node, ins):
    """Stacking adds a new dim: a shared shard always passes, renumbered past the new dim."""
    dim = _dim(node, nd=ndim_of(node))
    return _join(node, ins, lambda d: d + (d >= dim))


# ---------------------------------------------------------------- slicing and indexing
def _whole(node, dim, start, end, step=1) -> bool:
    size = shape_of(node.args[0])[dim]
    return (step == 1 and start in (None, 0) and (end is None or (isinstance(end, int) and end >= size)))


@rule(aten.slice.Tensor, aten.narrow.default)
def slice_(node, ins):
    """A slice along another dim keeps the shard; along the sharded dim only the whole range
    (``x[:, ...]`` emits ``slice(x, 0, 0, 9223372036854775807)``) keeps it, else replicate."""
    p = ins[0]
    if not is_shard(p):
        return ins, p
    dim = _dim(node)
    if p.dim != dim:
        return ins, p
    if node.target == aten.narrow.default:
        start, length = node.args[2], node.args[3]
        whole = start == 0 and isinstance(length, int) and length == shape_of(node.args[0])[dim]
    else:
        whole = _whole(node, dim, arg_of(node, "start"), arg_of(node, "end"), arg_of(node, "step", 1))
    return (ins, p) if whole else ([R], R)


@rule(aten.select.int)
def select(node, ins):
    p = ins[0]
    if not is_shard(p):
        return ins, p
    dim = _dim(node)
    if p.dim == dim:
        return [R], R
    return ins, moved_to(p, p.dim - (p.dim > dim))


@rule(aten.index.Tensor)
def index(node, ins):
    """Advanced indexing ``x[i0, i1, ...]`` (a list with None for ``:``). The index tensors
    broadcast to one shape B; the indexed dims of x are replaced by B's dims, in place when
    the indexed dims are adjacent, else in front. Strategies: x sharded on a dim it is not
    indexed on (indices replicated) keeps that shard, renumbered; x replicated and the indices
    sharded on one broadcast dim (like a pointwise op) give the output sharded there; a
    Partial x passes with replicated indices. Boolean masks replicate (data-dependent shape)."""
    indices = list(node.args[1])
    tensors = [t for t in indices if t is not None]
    if not tensors or len(ins) != 1 + len(tensors) or any(val(t).dtype in (torch.bool, torch.uint8) for t in tensors):
        return [R] * len(ins), R
    pos = [i for i, t in enumerate(indices) if t is not None]
    bshape = tuple(torch.broadcast_shapes(*(shape_of(t) for t in tensors)))
    nb = len(bshape)
    adjacent = pos == list(range(pos[0], pos[-1] + 1))
    offset = pos[0] if adjacent else 0  # where B's dims start in the output

    def out_dim_of_x(d):
        if adjacent:
            return d if d < pos[0] else d - len(pos) + nb
        return nb + sum(1 for e in range(d) if e not in pos)

    px = ins[0]
    if isinstance(px, Partial) and all(p == R for p in ins[1:]):
        return ins, px
    n_idx = len(tensors)
    strategies = [([R] * len(ins), R)]
    if is_shard(px) and px.dim not in pos:
        strategies.append(([px] + [R] * n_idx, moved_to(px, out_dim_of_x(px.dim))))
    for t, p in zip(tensors, ins[1:]):
        if isinstance(p, Shard) and shape_of(t)[p.dim] > 1:
            b = p.dim + nb - ndim_of(t)
            req = [R]
            for u in tensors:
                e = b - (nb - ndim_of(u))
                req.append(Shard(e) if e >= 0 and shape_of(u)[e] == bshape[b] else R)
            strategies.append((req, Shard(offset + b)))
    return choose(ins, strategies)
