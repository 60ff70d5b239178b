"""What every placement rule is built from: the registry, the decorator and the helpers
shared by `_rules` (elementwise, matmul, reductions, attention, ...) and `_view_rules` (the
view family). Both register into ``RULES`` on import; `_rules.lookup` reads it."""

from __future__ import annotations

import inspect
from typing import Callable

import torch.fx as fx
from torch.distributed.tensor import Partial, Placement, Replicate, Shard

from graphshard.passes._graph import R, aten, val
from graphshard.plan import StridedShard

P = Partial()


Rule = Callable[..., "tuple[list[Placement], Placement | list[Placement]]"]
RULES: dict = {}


def rule(*ops):
    """Registers a rule ``(node, input placements) -> (required, output)`` for ``ops``. A rule
    that also takes ``world`` (the axis's rank count) gets it: whether a layout can stay
    sharded sometimes depends on how a dim divides over the ranks."""
    def deco(fn):
        fn.takes_world = "world" in inspect.signature(fn).parameters
        for op in ops:
            RULES[op] = fn
        return fn

    return deco


# ---------------------------------------------------------------- helpers
def ndim_of(node) -> int:
    return val(node).dim()


def shape_of(node):
    return tuple(val(node).shape)


def is_shard(p) -> bool:
    return isinstance(p, (Shard, StridedShard))


def moved_to(p, dim: int):
    """``p`` (a Shard or StridedShard) on dim ``dim`` instead."""
    return StridedShard(dim, p.split_factor) if isinstance(p, StridedShard) else Shard(dim)


def is_partial_sum(p) -> bool:
    return isinstance(p, Partial) and p.reduce_op == "sum"


def arg_of(node: fx.Node, name: str, default=None):
    """The value of argument ``name`` of an OpOverload call, positional or keyword."""
    if name in node.kwargs:
        return node.kwargs[name]
    for i, a in enumerate(node.target._schema.arguments):
        if a.name == name:
            if a.kwarg_only:
                return default
            return node.args[i] if i < len(node.args) else default
    raise KeyError(f"{node.target} has no argument {name!r}")


def broadcast_req(arg, out_dim: int, out_shape) -> Placement:
    """What a broadcasting input must be when the output is sharded on ``out_dim``:
    sharded on its matching dim if it has that dim at full size, else replicated."""
    d = out_dim - (len(out_shape) - ndim_of(arg))
    if d >= 0 and shape_of(arg)[d] == out_shape[out_dim] and out_shape[out_dim] > 1:
        return Shard(d)
    return R


def no_grad(node) -> bool:
    """No gradient can flow through ``node``'s value: it is detached or not floating point."""
    v = val(node)
    return (isinstance(node, fx.Node) and node.target == aten.detach.default) or not (
        v.is_floating_point() or v.is_complex())


def placement_cost(cur: Placement, want: Placement) -> int:
    if cur == want:
        return 0
    if isinstance(cur, Partial) and not is_partial_sum(cur) and not isinstance(want, Replicate):
        return 100  # no redistribution exists
    if isinstance(cur, Replicate) and isinstance(want, Shard):
        return 1  # a local slice
    if isinstance(cur, Partial):
        return 4 if isinstance(want, Replicate) else 3
    return 2


def choose(ins: list[Placement], strategies):
    return min(strategies, key=lambda s: sum(placement_cost(c, w) for c, w in zip(ins, s[0])))
