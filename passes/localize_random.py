"""localize_random: random ops draw the logical tensor's values, each rank its part of them.

The rule (DTensor's): a value replicated over a model-parallel axis gets the same random
values on every rank of that axis; a sharded value gets independent values per shard; each
data-parallel rank keeps its own stream. Left alone, a random op draws from each rank's own
generator: "replicated" values diverge when the ranks' generators differ (users seed per rank
for data parallelism), and shards repeat each other's values when they are equal.

Each random op (dropout's ``bernoulli_`` or ``native_dropout``, ``rand``/``randn``/``randint``
and their ``_like`` forms, ``bernoulli``, ``uniform_``, ``normal_``) becomes
``graphshard::random_bits`` (``graphshard/ops/rng.py``: 32 random bits per element, a function of
the call's key, the op's number and the element's index in the LOGICAL tensor; this rank's
coordinate on each sharding axis picks its part) and the ATen ops that turn bits into the op's
distribution. The key and coordinates are graph inputs that the backend feeds per call
(``ctx.random``). Values replicated over an axis are then equal on its ranks, shards are
slices of one logical draw, and the result does not depend on any generator state, so a
backward recompute sees the forward's values.

Random ops this pass cannot rewrite (an explicit ``generator=``, ``randperm``, attention
kernels with fused dropout, ...) keep drawing per rank: a logged fallback listed by
``explain`` (an error with ``strict=True``). Runs after ``localize_shapes``: a random op's
local size (``meta["val"]``) and logical size (``meta["logical_shape"]``) are both known, and
what it emits is per-rank code.
"""

from __future__ import annotations

import math
import operator

import torch
import torch.fx as fx
from torch.distributed.tensor import Partial, Shard
from torch.utils.checkpoint import CheckpointPolicy

from graphshard import _compat
from graphshard.ops import ops
from graphshard.passes._graph import R, aten
from graphshard.plan import StridedShard
from graphshard.passes.context import PassContext, log
from graphshard.ops.rng import RandomDraws
from graphshard.passes.tag_recomputation import RECOMPUTED

# Freshly allocated buffers that an in-place random fill may replace outright.
_FRESH = {aten.empty_like.default, aten.empty.memory_format, aten.new_empty.default, aten.zeros_like.default,
          aten.ones_like.default, aten.new_zeros.default, aten.new_ones.default}


def localize_random(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    randoms = [n for n in gm.graph.nodes if n.op == "call_function" and _is_random(n)]
    if not ctx.model_parallel:
        # Data-parallel ranks draw from their own generators: the rule holds already. A random op
        # the backward recomputes (activation checkpointing) must draw the forward's values
        # again: it draws from the per-call key too, each rank from its own.
        randoms = [n for n in randoms if n.meta.get("recompute") in RECOMPUTED]
    if not randoms:
        return gm
    draws = _Draws(gm.graph, ctx)
    for node in randoms:
        handler = _HANDLERS.get(node.target)
        why = _unsupported(node, handler)
        if why:
            _fallback(node, why, ctx)
            continue
        handler(node, _Emitter(node, draws, ctx))
    if draws.count:
        ctx.random = draws.finish()
        axes = ", ".join(repr(a) for a in ctx.model_parallel)
        ctx.report.notes.append(
            f"random ops: {draws.count} drawn by logical element from one stream per model-parallel group ({axes}) "
            "(localize_random)" if axes else f"random ops: {draws.count} in recomputed regions drawn from a "
            "per-call key, each rank its own, so the backward's recomputation draws the forward's values "
            "(localize_random)")
    return gm


# ---------------------------------------------------------------- which ops
def _is_random(node: fx.Node) -> bool:
    target = node.target
    if torch.Tag.nondeterministic_seeded not in getattr(target, "tags", ()):
        return False
    # Ops tagged random that draw nothing with these arguments (attention without dropout, eval dropout).
    if _arg(node, "dropout_p", None) == 0.0 or _arg(node, "dropout", None) == 0.0:
        return False
    return _arg(node, "train", True) is not False and _arg(node, "training", True) is not False


def _arg(node: fx.Node, name: str, default):
    for i, a in enumerate(node.target._schema.arguments):
        if a.name == name:
            if i < len(node.args) and not a.kwarg_only:
                return node.args[i]
            return node.kwargs.get(name, a.default_value if a.has_default_value() else default)
    return default


def _unsupported(node: fx.Node, handler) -> str | None:
    if handler is None:
        return "no counter-based form"
    if _arg(node, "generator", None) is not None:
        return "an explicit generator"
    if node.target in _RANDINT:
        low, high = _randint_range(node)
        if not (isinstance(low, int) and isinstance(high, int) and 0 < high - low <= 2**31):
            return f"a range of {high} - {low} (at most 2**31 values are drawn by logical index)"
    return None


def _fallback(node: fx.Node, why: str, ctx: PassContext) -> None:
    if ctx.config.strict and ctx.model_parallel:  # (data-parallel alone: recomputed ops, saved below, are right)
        raise NotImplementedError(
            f"random op {node.target} at node {node.name!r} has {why}: it would draw from each rank's own "
            f"generator, so values replicated over {list(ctx.model_parallel)} could differ between ranks; "
            "compile without strict=True to accept that, or draw without it (no generator=, dropout outside "
            "the fused attention kernel)"
        )
    msg = f"{node.target} at node {node.name!r}: {why}; drawn from each rank's own generator"
    if node.meta.get("recompute") in RECOMPUTED:
        # Its recomputation would draw other values: the backward reads the forward's draw instead.
        node.meta["recompute"] = CheckpointPolicy.MUST_SAVE
        msg += ", and saved for the backward (a recomputation would draw other values)"
    if msg not in ctx.report.fallbacks:
        ctx.report.fallbacks.append(msg)
        log.warning("graphshard fallback: %s", msg)


# ---------------------------------------------------------------- graph inputs and emission
class _Draws:
    """The key and coordinate placeholders (made on first use) and the count of rewritten ops."""

    def __init__(self, g: fx.Graph, ctx: PassContext):
        self.g, self.ctx = g, ctx
        self.key: fx.Node | None = None
        self.coords: dict[str, fx.Node] = {}
        self.device: torch.device | None = None
        self.count = 0

    def _placeholder(self, name: str, rank_local: bool) -> fx.Node:
        last = [n for n in self.g.nodes if n.op == "placeholder"][-1]
        with self.g.inserting_after(last):
            node = self.g.placeholder(name)
        with self.ctx.fake_mode:
            node.meta["val"] = torch.empty((), dtype=torch.int64, device=self.device)
        node.meta["placement"] = {a: R for a in self.ctx.model_parallel}
        node.meta["logical_shape"] = ()
        if rank_local:
            node.meta["rank_local"] = True
        self.ctx.input_units.append(None)
        self.ctx.input_requires_grad.append(False)
        return node

    def key_for(self, device: torch.device) -> fx.Node:
        if self.device is None:
            self.device = device
            self.key = self._placeholder("rng_key", rank_local=False)
        elif device != self.device:
            raise NotImplementedError(
                f"random ops on {self.device} and on {device} in one graph; graphshard draws a graph's "
                "random values on one device"
            )
        self.count += 1
        return self.key

    def coord(self, axis: str) -> fx.Node:
        """The input holding this rank's coordinate on ``axis``."""
        if axis not in self.coords:
            self.coords[axis] = self._placeholder(f"rng_coord_{axis}", rank_local=True)
        return self.coords[axis]

    def finish(self) -> RandomDraws:
        return RandomDraws(device=self.device, agree_over=tuple(self.ctx.model_parallel),
                           coord_axes=tuple(self.coords), count=self.count)


class _Emitter:
    """Inserts nodes before the random op ``anchor``; each has the anchor's local shape (or is a
    size), so it takes the anchor's placement and logical shape."""

    def __init__(self, anchor: fx.Node, draws: _Draws, ctx: PassContext):
        self.anchor, self.draws, self.ctx = anchor, draws, ctx
        self.g = anchor.graph
        out = anchor.meta["val"]
        self.out = out[0] if isinstance(out, (list, tuple)) else out
        if not ctx.model_parallel:  # a recomputed op of a data-parallel program: local is logical
            self.placement, self.logical = {}, tuple(self.out.shape)
        else:
            pl = anchor.meta["placement"]
            self.placement = pl[0] if isinstance(pl, list) else pl
            assert not any(isinstance(p, Partial) for p in self.placement.values()), (
                f"{anchor.name}: a random op's rule gave a Partial output")
            # a multi-output op (native_dropout) has no logical_shape of its own: its input's
            self.logical = (anchor.args[0].meta["logical_shape"] if isinstance(out, (list, tuple))
                            else anchor.meta["logical_shape"])
        self.key = draws.key_for(self.out.device)
        self.salt = 2 * (draws.count - 1)  # two streams per op (Box-Muller takes both)

    def __call__(self, target, *args, **kwargs) -> fx.Node:
        with self.g.inserting_before(self.anchor):
            node = self.g.call_function(target, args, kwargs)
        vals = fx.node.map_aggregate(args, lambda a: a.meta["val"] if isinstance(a, fx.Node) else a)
        kvals = fx.node.map_aggregate(kwargs, lambda a: a.meta["val"] if isinstance(a, fx.Node) else a)
        with self.ctx.fake_mode:
            node.meta["val"] = target(*vals, **kvals)
        if isinstance(node.meta["val"], torch.Tensor):
            node.meta["placement"] = dict(self.placement)
            node.meta["logical_shape"] = tuple(self.logical)
        node.meta["random_from"] = self.anchor.name
        return node

    def bits(self, like: fx.Node | list, stream: int = 0) -> fx.Node:
        """``random_bits`` of the anchor's local shape: the shape of the tensor ``like``, or a
        factory's size argument (a factory's output is replicated: local size = logical size)."""
        if isinstance(like, fx.Node):
            size = [s if isinstance(s, int) else self(aten.sym_size.int, like, d) for d, s in enumerate(self.out.shape)]
            logical = [L if isinstance(L, int) else size[d] for d, L in enumerate(self.logical)]
        else:
            size = logical = list(like)
        shards, coords = self._shards()
        return self(ops.random_bits.default, self.key, coords, self.salt + stream, size, logical, shards)

    def _shards(self) -> tuple[list[int], list[fx.Node]]:
        """``random_bits``' shard quadruples and the coordinate inputs they index."""
        quads, coords, seen = [], [], set()
        for axis, p in self.placement.items():
            if not isinstance(p, (Shard, StridedShard)):
                continue
            if p.dim in seen:
                raise NotImplementedError(
                    f"random op {self.anchor.name!r} has dim {p.dim} sharded over several model-parallel axes; "
                    "graphshard draws random values on a dim sharded over one axis"
                )
            seen.add(p.dim)
            group = self.ctx.model_parallel[axis]
            factor = getattr(p, "split_factor", 1)
            chunk = -(-(self.logical[p.dim] // factor) // group.world)
            quads += [p.dim, len(coords), chunk, factor]
            coords.append(self.draws.coord(axis))
        return quads, coords

    # ---- distributions from bits
    def uniform(self, bits: fx.Node, dtype: torch.dtype) -> fx.Node:
        """[0, 1) in ``dtype``, with as many random bits as its significand holds (at most 32)."""
        k = min(1 - round(math.log2(torch.finfo(dtype).eps)), 32)  # the significand's bits: 24 for float32
        if k < 32:
            bits = self(aten.bitwise_right_shift.Tensor_Scalar, bits, 32 - k)
        return self(aten.mul.Tensor, self(aten._to_copy.default, bits, dtype=dtype), 2.0 ** -k)

    def bernoulli(self, like: fx.Node | list, p, dtype: torch.dtype) -> fx.Node:
        u = self.uniform(self.bits(like), torch.float32)
        return self(aten._to_copy.default, self(aten.lt.Tensor if isinstance(p, fx.Node) else aten.lt.Scalar, u, p),
                    dtype=dtype)

    def normal(self, like: fx.Node | list, mean, std, dtype: torch.dtype) -> fx.Node:
        """Box-Muller on two uniforms, computed in float32 (float64 for float64 outputs)."""
        work = torch.float64 if dtype == torch.float64 else torch.float32
        u1 = self.uniform(self.bits(like, 0), work)
        u2 = self.uniform(self.bits(like, 1), work)
        radius = self(aten.sqrt.default, self(aten.mul.Tensor, self(aten.log1p.default, self(aten.neg.default, u1)), -2.0))
        z = self(aten.mul.Tensor, radius, self(aten.cos.default, self(aten.mul.Tensor, u2, 2 * math.pi)))
        if std != 1.0:
            z = self(aten.mul.Tensor, z, std)
        if mean != 0.0:
            z = self(aten.add.Tensor, z, mean)
        return self(aten._to_copy.default, z, dtype=dtype) if dtype != work else z


# ---------------------------------------------------------------- the ops
def _out_dtype(node: fx.Node) -> torch.dtype:
    v = node.meta["val"]
    return (v[0] if isinstance(v, (list, tuple)) else v).dtype


def _replace(node: fx.Node, value: fx.Node) -> None:
    """Points the random op's users at ``value`` and erases it, and the arguments that only gave
    it a shape. An in-place fill (``bernoulli_``, ``uniform_``, ``normal_``) of a fresh buffer is
    replaced with ``value``; a fill of any other tensor becomes ``copy_`` into it."""
    g = node.graph
    target = node.args[0]
    if _compat.is_inplace_op(node.target) and not (
            target.op == "call_function" and target.target in _FRESH and list(target.users) == [node]):
        with g.inserting_before(node):
            copy = g.call_function(aten.copy_.default, (target, value))
        copy.meta.update({k: node.meta[k] for k in ("val", "placement", "logical_shape") if k in node.meta})
        value = copy
    node.replace_all_uses_with(value)
    _erase(node)


def _erase(node: fx.Node) -> None:
    """Erases ``node`` and then those of its arguments that nothing else reads (views and fresh
    buffers that only gave a random op its shape)."""
    args = [a for a in node.all_input_nodes if a.op == "call_function"]
    node.graph.erase_node(node)
    for a in args:
        if not a.users and not a.is_impure():
            _erase(a)


def _like(node: fx.Node) -> fx.Node | list:
    """What gives a random op its shape: its tensor argument (``*_like``, in-place fills) or,
    for a factory (``rand(size)``), its size argument."""
    if node.target in (aten.randint.default, aten.randint.low):
        return node.args[1 if node.target == aten.randint.default else 2]
    return node.args[0]


def _uniform_op(node, e: _Emitter):
    like = _like(node)
    u = e.uniform(e.bits(like), _out_dtype(node))
    low, high = _arg(node, "from", 0.0), _arg(node, "to", 1.0)
    if (low, high) != (0.0, 1.0):
        u = e(aten.add.Tensor, e(aten.mul.Tensor, u, high - low), low)
    _replace(node, u)


def _normal_op(node, e: _Emitter):
    _replace(node, e.normal(_like(node), _arg(node, "mean", 0.0), _arg(node, "std", 1.0), _out_dtype(node)))


def _bernoulli_op(node, e: _Emitter):
    """``bernoulli_(x, p)`` / ``bernoulli(x, p)``: 1 with probability p; ``bernoulli(probs)``: per element."""
    p = node.args[0] if node.target == aten.bernoulli.default else _arg(node, "p", 0.5)
    _replace(node, e.bernoulli(node.args[0], p, _out_dtype(node)))


def _native_dropout(node, e: _Emitter):
    x, p = node.args[0], node.args[1]
    keep = e(aten.lt.Scalar, e.uniform(e.bits(x), torch.float32), 1.0 - p)
    out = e(aten.mul.Tensor, e(aten.mul.Tensor, x, keep), 1.0 / (1.0 - p) if p < 1 else 0.0)
    for user in list(node.users):
        assert user.target == operator.getitem, f"{node.name} is used by {user.name} directly"
        user.replace_all_uses_with(out if user.args[1] == 0 else keep)
        node.graph.erase_node(user)
    _erase(node)


_RANDINT = {aten.randint.default, aten.randint.low, aten.randint_like.default, aten.randint_like.low_dtype}


def _randint_range(node: fx.Node):
    if node.target in (aten.randint.default, aten.randint_like.default):
        return 0, _arg(node, "high", None)
    return _arg(node, "low", None), _arg(node, "high", None)


def _randint_op(node, e: _Emitter):
    """low + floor(bits * (high - low) / 2**32): exact in int64 for ranges up to 2**31."""
    low, high = _randint_range(node)
    v = e(aten.bitwise_right_shift.Tensor_Scalar, e(aten.mul.Tensor, e.bits(_like(node)), high - low), 32)
    if low:
        v = e(aten.add.Tensor, v, low)
    _replace(node, e(aten._to_copy.default, v, dtype=_out_dtype(node)))


_HANDLERS = {
    aten.rand.default: _uniform_op, aten.rand_like.default: _uniform_op, aten.uniform_.default: _uniform_op,
    aten.randn.default: _normal_op, aten.randn_like.default: _normal_op, aten.normal_.default: _normal_op,
    aten.bernoulli_.float: _bernoulli_op, aten.bernoulli_.Tensor: _bernoulli_op,
    aten.bernoulli.p: _bernoulli_op, aten.bernoulli.default: _bernoulli_op,
    aten.native_dropout.default: _native_dropout,
    **{op: _randint_op for op in _RANDINT},
}
