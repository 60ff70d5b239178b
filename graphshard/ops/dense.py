"""graphshard's custom ops.

``graphshard::param`` is the *marker*: every use of a sharded parameter goes
through it. Its fake impl has the parameter's LOGICAL shape, so a traced
program reads as if for one device; its eager impl gathers the parameter (and
its autograd reduces the gradient), so a sharded model also runs without
compiling.

The other ops are the collectives that passes insert. Each has an autograd
formula (so backward collectives come from autograd) and a decomposition into
``_c10d_functional`` collectives plus ``wait_tensor``, which aot_autograd applies
while tracing, so the forward and backward graphs hold explicit async
collectives that the scheduling pass and Inductor can move.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from typing import Sequence

import torch
import torch.nn.functional as F

from graphshard import _compat
from graphshard._compat import c10d
from graphshard.params import AxisGroup, chunk_size, resolve
from graphshard.plan import StridedShard
from graphshard.ops.rng import decompositions as _rng_decompositions
from graphshard.sharding import ShardedParam

lib = torch.library.Library("graphshard", "DEF")
lib.define("param(Tensor local, str key, SymInt[] shape, ScalarType dtype) -> Tensor")
lib.define("unshard(Tensor[] shards, str[] keys) -> Tensor[]")
lib.define("all_reduce(Tensor x, str group, int world) -> Tensor")
lib.define("all_gather(Tensor x, int dim, int size, str group, int world, int rank) -> Tensor")
lib.define("reduce_scatter(Tensor x, int dim, str group, int world, int rank) -> Tensor")
lib.define("shard(Tensor x, int dim, str group, int world, int rank) -> Tensor")
lib.define("grad_all_reduce(Tensor x, str group, int world) -> Tensor")
lib.define("to_partial(Tensor x, int rank) -> Tensor")
lib.define("layout(Tensor x, str where, str axis, str placement, bool local) -> Tensor")
lib.define("from_local(Tensor x, str where, str axis, str placement, int world) -> Tensor")
lib.define("to_local(Tensor x, str where, str axis, str placement, int world) -> Tensor")
lib.define("all_reduce_max(Tensor x, str group) -> Tensor")
lib.define("all_gather_partial_grad(Tensor x, int dim, int size, str group, int world, int rank) -> Tensor")
lib.define("all_to_all(Tensor x, SymInt[] out_splits, SymInt[] in_splits, str group) -> Tensor")

ops = torch.ops.graphshard


# --------------------------------------------------------------------------------------------
# Collective building blocks (plain torch code: run eagerly, or traced into graphs).
# --------------------------------------------------------------------------------------------
def _wait(t: torch.Tensor) -> torch.Tensor:
    return c10d.wait_tensor(t)


def _all_reduce_sum(x: torch.Tensor, group: str) -> torch.Tensor:
    return _wait(c10d.all_reduce(x.contiguous(), "sum", group))


def _gather_dim(x: torch.Tensor, dim: int, size: int, group: str, world: int) -> torch.Tensor:
    """All-gather along ``dim`` to ``size`` (torch.chunk layout; short pieces padded, then cut)."""
    dim = dim % x.dim()
    c = -(-size // world)
    if x.shape[dim] != c:
        pad = [0, 0] * (x.dim() - dim - 1) + [0, c - x.shape[dim]]
        x = F.pad(x, pad)
    out = _wait(c10d.all_gather_into_tensor(x.contiguous(), world, group))  # the ranks' pieces stacked on dim 0
    if dim != 0:
        # [world * n0, ...] -> [n0, ..., world, c, ...] -> [..., world * c, ...]: the one copy moves
        # whole rows of the trailing dims (moving ``dim`` to the front instead transposed the piece
        # before the gather and the whole after it)
        out = out.unflatten(0, (world, x.shape[0])).movedim(0, dim).flatten(dim, dim + 1)
    if out.shape[dim] != size:
        out = out.narrow(dim, 0, size)
    return out.contiguous() if dim != 0 else out


def local_chunk(x: torch.Tensor, dim: int, world: int, rank: int) -> torch.Tensor:
    """``rank``'s piece of ``x`` along ``dim`` in torch.chunk layout (a view)."""
    dim = dim % x.dim()
    n = x.shape[dim]
    c = -(-n // world)
    return x.narrow(dim, min(c * rank, n), chunk_size(n, world, rank))


def _reduce_scatter_dim(x: torch.Tensor, dim: int, group: str, world: int, rank: int) -> torch.Tensor:
    dim = dim % x.dim()
    n = x.shape[dim]
    c = -(-n // world)
    if n != c * world:
        x = F.pad(x, [0, 0] * (x.dim() - dim - 1) + [0, c * world - n])
    if dim != 0:
        # [..., world * c, ...] -> [world * n0, ..., c, ...]: each rank's piece one block on dim 0,
        # already in ``x``'s layout once scattered
        x = x.unflatten(dim, (world, c)).movedim(dim, 0).flatten(0, 1)
    out = _wait(c10d.reduce_scatter_tensor(x.contiguous(), "sum", world, group))
    out = out.narrow(dim, 0, chunk_size(n, world, rank))
    return out.contiguous() if dim != 0 else out


# --------------------------------------------------------------------------------------------
# Data-parallel gather / gradient reduction of a bucket of parameters (one FSDP unit).
#
# The copies into and out of the collective buffers are opaque ops (like FSDP2's copy-in and
# split-with-sizes-copy): Inductor runs them as extern calls instead of generating a kernel for
# each fused variant, which keeps cold compile time flat.
# --------------------------------------------------------------------------------------------
lib.define("pack(Tensor[] xs, SymInt[] numels, ScalarType dtype) -> Tensor")
lib.define("unpack(Tensor buf, int world, SymInt[] numels) -> Tensor[]")
lib.define("pack_grads(Tensor[] grads, int world, SymInt[] numels, ScalarType dtype) -> Tensor")
lib.define("pack_grads_peers(Tensor[] grads, int world, int rank, SymInt[] numels, ScalarType dtype) -> (Tensor, Tensor)")
lib.define("unpack_reduced(Tensor buf, int rows, SymInt[] numels, SymInt[] keep, Tensor? own=None) -> Tensor[]")
lib.define("pack_gather(Tensor[] xs, SymInt[] numels, ScalarType dtype, int world, str group_name) -> Tensor")


def pack_into(out: torch.Tensor, xs: Sequence[torch.Tensor], numels: Sequence[int]) -> torch.Tensor:
    """Writes ``pack``'s result into ``out`` (flat, ``sum(numels)`` elements): each ``x`` in its
    ``numel``-element slot, cast to ``out``'s dtype, zero-padded to the slot's end."""
    offset = 0
    for x, n in zip(xs, numels):
        out.narrow(0, offset, x.numel()).copy_(x.reshape(-1))
        if n > x.numel():
            out.narrow(0, offset + x.numel(), n - x.numel()).zero_()
        offset += n
    return out


@torch.library.impl(lib, "pack", "CompositeExplicitAutograd")
def _pack(xs, numels, dtype):
    return pack_into(xs[0].new_empty(sum(numels), dtype=dtype), xs, numels)


@torch.library.register_fake("graphshard::pack")
def _pack_fake(xs, numels, dtype):
    return xs[0].new_empty(sum(numels), dtype=dtype)


# The in-place gather: a unit's `pack` and `all_gather_into_tensor` run as FSDP2 runs them (and as
# Inductor's FSDP pass rewrites its own pair). The shards are packed straight into this rank's slot
# of the gathered buffer, which is gathered in place (`all_gather_into_tensor_out`), so the packed
# input (a unit / world) is never a buffer of its own. It lives as long as the gather is in flight:
# for a prefetched gather, across the compute the gather hides under (under activation
# checkpointing, the unit's recomputation, where the backward's peak is). NCCL gathers in place
# only when the input is this rank's slot of the output.
def pack_into_slot(xs: Sequence[torch.Tensor], numels: Sequence[int], dtype: torch.dtype, world: int,
                   rank: int) -> torch.Tensor:
    """A new buffer of ``world`` slots with ``pack(xs, numels, dtype)`` in slot ``rank``."""
    n = sum(numels)
    out = xs[0].new_empty(world * n, dtype=dtype)
    pack_into(out.narrow(0, rank * n, n), xs, numels)
    return out


def gather_in_place(buf: torch.Tensor, world: int, rank: int, group_name: str) -> torch.Tensor:
    """Starts the all-gather of slot ``rank`` of ``buf`` into ``buf``; returns ``buf`` (to wait on)."""
    n = buf.numel() // world
    return c10d.all_gather_into_tensor_out(buf.narrow(0, rank * n, n), world, group_name, out=buf)


@torch.library.impl(lib, "pack_gather", "CompositeExplicitAutograd")
def _pack_gather(xs, numels, dtype, world, group_name):
    """`pack` then `all_gather_into_tensor`, in place; the result is waited like theirs. The rank is
    looked up when it runs, so that every rank compiles the same graph."""
    rank = _compat.group_rank(group_name)
    return gather_in_place(pack_into_slot(xs, numels, dtype, world, rank), world, rank, group_name)


@torch.library.register_fake("graphshard::pack_gather")
def _pack_gather_fake(xs, numels, dtype, world, group_name):
    return xs[0].new_empty(world * sum(numels), dtype=dtype)


@torch.library.impl(lib, "unpack", "CompositeExplicitAutograd")
def _unpack(buf, world, numels):
    if len(numels) == 1:
        return [buf.clone()]
    return [p.view(-1) for p in torch.split_with_sizes_copy(buf.view(world, -1), list(numels), dim=1)]


@torch.library.register_fake("graphshard::unpack")
def _unpack_fake(buf, world, numels):
    return [buf.new_empty(world * n) for n in numels]


def _copy_rows(dst: torch.Tensor, flat: torch.Tensor, n: int, first: int) -> None:
    """Fills ``dst`` (``k`` rows of ``n``) with rows ``first .. first + k`` of ``flat`` cut into rows
    of ``n``, zeros past its end."""
    k = dst.shape[0]
    if not k:
        return
    full = max(0, min(k, flat.numel() // n - first))  # the complete rows ``flat`` has from ``first``
    if full:
        dst.narrow(0, 0, full).copy_(flat.narrow(0, first * n, full * n).view(full, n))
    if full < k:
        start = (first + full) * n
        tail = max(0, flat.numel() - start)
        if tail:
            dst[full].narrow(0, 0, tail).copy_(flat.narrow(0, start, tail))
        dst[full].narrow(0, tail, n - tail).zero_()
        if full + 1 < k:
            dst.narrow(0, full + 1, k - full - 1).zero_()


@torch.library.impl(lib, "pack_grads", "CompositeExplicitAutograd")
def _pack_grads(grads, world, numels, dtype):
    """Rank-major layout: row r holds every gradient's r-th shard, each padded to its numel."""
    out = grads[0].new_empty(world, sum(numels), dtype=dtype)
    offset = 0
    for g, n in zip(grads, numels):
        _copy_rows(out.narrow(1, offset, n), g.reshape(-1), n, 0)
        offset += n
    return out.view(-1)


@torch.library.register_fake("graphshard::pack_grads")
def _pack_grads_fake(grads, world, numels, dtype):
    return grads[0].new_empty(world * sum(numels), dtype=dtype)


@torch.library.impl(lib, "pack_grads_peers", "CompositeExplicitAutograd")
def _pack_grads_peers(grads, world, rank, numels, dtype):
    """`pack_grads`'s layout cut in two new buffers: the rows of the other ranks, in rank order
    (what an all-to-all sends, with a zero split for ``rank``), and row ``rank`` (this rank's
    own shard of each gradient, which it keeps)."""
    peers = grads[0].new_empty(world - 1, sum(numels), dtype=dtype)
    own = grads[0].new_empty(1, sum(numels), dtype=dtype)
    offset = 0
    for g, n in zip(grads, numels):
        flat, band = g.reshape(-1), peers.narrow(1, offset, n)
        _copy_rows(band.narrow(0, 0, rank), flat, n, 0)
        _copy_rows(band.narrow(0, rank, world - 1 - rank), flat, n, rank + 1)
        _copy_rows(own.narrow(1, offset, n), flat, n, rank)
        offset += n
    return peers.view(-1), own.view(-1)


@torch.library.register_fake("graphshard::pack_grads_peers")
def _pack_grads_peers_fake(grads, world, rank, numels, dtype):
    n = sum(numels)
    return grads[0].new_empty((world - 1) * n, dtype=dtype), grads[0].new_empty(n, dtype=dtype)


@torch.library.impl(lib, "unpack_reduced", "CompositeExplicitAutograd")
def _unpack_reduced(buf, rows, numels, keep, own=None):
    """Cuts the reduced bucket into its gradients: gradient i is the first ``keep[i]`` elements
    of its ``numels[i]``-element slot. ``buf`` holds ``rows`` copies of the bucket (one per
    source rank, from an all-to-all), averaged here with ``own`` (this rank's own copy, which
    it did not send) when given; ``rows=1`` without ``own`` is a bucket the collective already
    reduced.

    Each gradient is a new tensor, as the fake impl says and as a custom op's outputs must be
    (none may alias another): Inductor takes them to start at an aligned address, and views of
    one bucket at a parameter's odd offset do not (it checks alignment in the code it
    generates). The copy (or average) is one multi-tensor op over the bucket's slices."""
    table = buf.view(rows, -1)
    starts = [0]
    for n in numels[:-1]:
        starts.append(starts[-1] + n)
    slices = [[table[r].narrow(0, s, k) for s, k in zip(starts, keep)] for r in range(rows)]
    if own is not None:
        slices.insert(0, [own.narrow(0, s, k) for s, k in zip(starts, keep)])
    if len(slices) == 1:
        return _compat.foreach_clone(slices[0])
    out = _compat.foreach_add(slices[0], slices[1])
    for r in range(2, len(slices)):
        _compat.foreach_add_(out, slices[r])
    _compat.foreach_div_(out, len(slices))
    return out


@torch.library.register_fake("graphshard::unpack_reduced")
def _unpack_reduced_fake(buf, rows, numels, keep, own=None):
    return [buf.new_empty(k) for k in keep]


def gather_params(shards: Sequence[torch.Tensor], infos: Sequence[ShardedParam]) -> list[torch.Tensor]:
    """Casts to param_dtype and all-gathers a unit's shards in ONE collective: a packed bucket,
    or on gloo a coalesced all-gather with an output per parameter (`AxisGroup.gather_coalesced`;
    a plan with ``collectives="nccl"`` keeps the bucket on gloo too)."""
    first = infos[0]
    if first.shard is None:
        return [x.to(info.param_dtype) for x, info in zip(shards, infos)]
    axis = first.shard
    numels = [info.chunk_rows * info.row_numel for info in infos]
    if axis.gather_coalesced:
        ins = _coalesced_inputs(shards, numels, first.param_dtype)
        flats = [_wait(t) for t in c10d.all_gather_into_tensor_coalesced(ins, axis.world, axis.group_name)]
    else:
        buf = ops.pack(list(shards), numels, first.param_dtype)
        gathered = _wait(c10d.all_gather_into_tensor(buf, axis.world, axis.group_name))
        flats = ops.unpack(gathered, axis.world, numels)
    outs = []
    for flat, info in zip(flats, infos):
        full = flat.view(axis.world * info.chunk_rows, *info.dp_full_shape[1:])
        rows = info.dp_full_shape[0]
        outs.append(full if full.shape[0] == rows else full.narrow(0, 0, rows))
    return outs


def _coalesced_inputs(shards: Sequence[torch.Tensor], numels: Sequence[int], dtype: torch.dtype) -> list[torch.Tensor]:
    """The shards as one rank's inputs to a per-parameter all-gather: flat, in ``dtype``, each
    padded with zeros to its chunk's ``numel``. A shard that needs neither is a view; the
    others are cast and padded by one ``pack`` (one communication-side copy rather than a
    compute kernel per unit) and go in as views of it."""
    ins = [x.reshape(-1) for x in shards]
    redo = [i for i, (x, n) in enumerate(zip(ins, numels)) if x.dtype != dtype or x.numel() != n]
    if redo:
        sizes = [numels[i] for i in redo]
        for i, y in zip(redo, ops.pack([ins[i] for i in redo], sizes, dtype).split(sizes)):
            ins[i] = y
    return ins


def _reduce_scatter_flat(grads: Sequence[torch.Tensor], numels: Sequence[int], dtype: torch.dtype,
                         axis: AxisGroup) -> tuple[torch.Tensor, int, torch.Tensor | None]:
    """Packs a unit's gradients and starts their reduce-scatter over ``axis``. Returns the result,
    how many rows of it ``unpack_reduced`` still averages, and the row this rank kept (or None):

    - ``reduce_scatter_tensor`` ("avg") of the rank-major bucket: one row, nothing kept;
    - on gloo (``AxisGroup.scatter_by_all_to_all``) an all-to-all of the other ranks' rows,
      ``world - 1`` received rows, and this rank's own row, which never leaves it: the send
      buffer and the received one are ``world - 1`` shards each, not a bucket each.

    Under ``collectives="nccl"`` gloo runs the ``reduce_scatter_tensor`` call itself: c10d's gloo
    backend implements it (an all-reduce of the whole bucket with the same op, then this
    rank's chunk), ``avg`` included."""
    if axis.scatter_by_all_to_all and axis.world > 1:
        peers, own = ops.pack_grads_peers(list(grads), axis.world, axis.rank, numels, dtype)
        split = [0 if r == axis.rank else sum(numels) for r in range(axis.world)]
        return _wait(c10d.all_to_all_single(peers, split, split, axis.group_name)), axis.world - 1, own
    buf = ops.pack_grads(list(grads), axis.world, numels, dtype)
    return _wait(c10d.reduce_scatter_tensor(buf, "avg", axis.world, axis.group_name)), 1, None


def reduce_grads(grads: Sequence[torch.Tensor | None], infos: Sequence[ShardedParam]) -> list[torch.Tensor]:
    """Averages a unit's gradients over the data-parallel ranks in reduce_dtype:
    one reduce-scatter over the shard axis (FullyShard), one all-reduce per replicate axis."""
    first = infos[0]
    grads = [
        g if g is not None else torch.zeros(info.dp_full_shape, dtype=info.reduce_dtype, device=info.mesh.device_type)
        for g, info in zip(grads, infos)
    ]
    if first.shard is not None:
        numels = [info.chunk_rows * info.row_numel for info in infos]
        keep = [info.local_rows * info.row_numel for info in infos]
        red, rows, own = _reduce_scatter_flat(grads, numels, first.reduce_dtype, first.shard)
        if own is not None and first.replicate:  # average the rows before reducing over the other axes
            red, rows, own = ops.unpack_reduced(red, rows, [sum(numels)], [sum(numels)], own)[0], 1, None
        shapes = [(info.local_rows, *info.dp_full_shape[1:]) for info in infos]
    else:
        numels = keep = [math.prod(info.dp_full_shape) for info in infos]
        red, rows, own = ops.pack(grads, numels, first.reduce_dtype), 1, None
        shapes = [info.dp_full_shape for info in infos]
    for axis in first.replicate:
        red = _wait(c10d.all_reduce(red, "avg", axis.group_name))
    kept = () if own is None else (own,)  # printed only where there is one: NCCL's graphs read as before
    pieces = ops.unpack_reduced(red, rows, numels, keep, *kept)
    return [piece.view(shape).to(info.dtype) for piece, shape, info in zip(pieces, shapes, infos)]


# --------------------------------------------------------------------------------------------
# graphshard::param, the marker
# --------------------------------------------------------------------------------------------
def _gather_logical(local: torch.Tensor, info: ShardedParam) -> torch.Tensor:
    x = gather_params([local], [info])[0]
    for axis, pl in info.model_parallel:
        if isinstance(pl, StridedShard):  # each block's pieces gathered: blocks as a dim of their own
            blocks = x.unflatten(pl.dim, (pl.split_factor, -1))
            size = info.logical_shape[pl.dim] // pl.split_factor
            x = _gather_dim(blocks, pl.dim + 1, size, axis.group_name, axis.world).flatten(pl.dim, pl.dim + 1)
        elif pl.is_shard():
            x = _gather_dim(x, pl.dim, info.logical_shape[pl.dim], axis.group_name, axis.world)
    return x


def local_strided_chunk(x: torch.Tensor, dim: int, split_factor: int, world: int, rank: int) -> torch.Tensor:
    """``rank``'s piece of each of the ``split_factor`` blocks of ``x`` along ``dim``, in order."""
    blocks = x.unflatten(dim, (split_factor, -1))
    return local_chunk(blocks, dim + 1, world, rank).flatten(dim, dim + 1)


@torch.library.impl(lib, "param", "CompositeExplicitAutograd")
def _param_eager(local, key, shape, dtype):
    return _gather_logical(local, resolve(key)).clone()  # eager: the one place a key is resolved


@torch.library.register_fake("graphshard::param")
def _param_fake(local, key, shape, dtype):
    return local.new_empty(shape, dtype=dtype)


def _param_setup(ctx, inputs, output):
    ctx.key = inputs[1]


def _param_backward(ctx, grad):
    info = resolve(ctx.key)  # eager only: a compile replaces every marker before autograd traces it
    for axis, pl in reversed(info.model_parallel):
        if isinstance(pl, StridedShard):  # eager computes replicated: every rank holds the full gradient
            grad = local_strided_chunk(grad, pl.dim, pl.split_factor, axis.world, axis.rank)
        elif pl.is_shard():
            grad = local_chunk(grad, pl.dim, axis.world, axis.rank)
    return reduce_grads([grad], [info])[0], None, None, None


torch.library.register_autograd("graphshard::param", _param_backward, setup_context=_param_setup)


# --------------------------------------------------------------------------------------------
# graphshard::unshard, the data-parallel gather of a bucket; backward reduces the gradients.
# Only passes insert it, so its fake impl, decomposition and backward run inside a compile and
# read the parameters of the model that compile is bound to (`compiling`).
# --------------------------------------------------------------------------------------------
_COMPILING: contextvars.ContextVar[dict | None] = contextvars.ContextVar("graphshard_compiling", default=None)


@contextlib.contextmanager
def compiling(params: dict):
    """Binds the parameters (key -> `ShardedParam`) of the graph being compiled for graphshard's op
    implementations that run inside the compile (unshard's fake impl, decomposition and backward)."""
    token = _COMPILING.set(params)
    try:
        yield
    finally:
        _COMPILING.reset(token)


def _bound(keys) -> list[ShardedParam]:
    params = _COMPILING.get()
    if params is None:
        raise RuntimeError(f"graphshard::unshard of {list(keys)} outside a graphshard compile: only the backend's "
                           "passes insert it, and the backend binds the model's parameters while it compiles")
    return [params[k] for k in keys]


def _unshard_decomp(shards, keys):
    return gather_params(shards, _bound(keys))


@torch.library.impl(lib, "unshard", "CompositeExplicitAutograd")
def _unshard_eager(shards, keys):  # a graph run as FX (lower="eager") after its compile
    infos = _bound(keys) if _COMPILING.get() is not None else [resolve(k) for k in keys]
    return [t.clone() for t in gather_params(shards, infos)]


@torch.library.register_fake("graphshard::unshard")
def _unshard_fake(shards, keys):
    return [x.new_empty(info.dp_full_shape, dtype=info.param_dtype) for x, info in zip(shards, _bound(keys))]


def _unshard_setup(ctx, inputs, output):
    ctx.keys = inputs[1]


def _unshard_backward(ctx, grads):
    return reduce_grads(list(grads), _bound(ctx.keys)), None


torch.library.register_autograd("graphshard::unshard", _unshard_backward, setup_context=_unshard_setup)


# --------------------------------------------------------------------------------------------
# graphshard::layout, a declared activation layout (a tensor-parallel style's module input or
# output). An identity on values: the program is logical. insert_collectives replaces it by the
# redistribution to ``placement`` on mesh axis ``axis``; ``local`` (use_local_output) says whether
# a model output the caller receives is the local shard or a DTensor.
#
# One exception, torch's ``DTensor.from_local``: a sharded layout declared on a graph input (the
# tensor the caller passes, each rank its own piece) makes the logical value, ``world`` pieces
# long on the sharded dim. While dynamo traces, the fake of such a layout has that logical shape,
# so the code after it sees what torch's module sees; the trace to ATen then puts a
# ``graphshard::from_local`` before the layout (`aten_trace._name_layouts`), and insert_collectives
# turns it into the local input carrying the logical value, as a sharded parameter's marker.
# --------------------------------------------------------------------------------------------
@torch.library.impl(lib, "layout", "CompositeExplicitAutograd")
def _layout_eager(x, where, axis, placement, local):
    return x.clone()


def _logical(x: torch.Tensor, placement: str, world: int) -> torch.Tensor:
    d = int(placement[2:-1]) % x.dim()
    return x.new_empty((*x.shape[:d], x.shape[d] * world, *x.shape[d + 1:]))


def layout_world(where: str, axis: str) -> int | None:
    """The size of mesh axis ``axis`` of the model a declared layout's ``where`` names."""
    from graphshard.sharding import model_for_key

    model = model_for_key(where)
    group = model.axes.get(axis) if model is not None else None
    return group.world if group is not None else None


def _local(x: torch.Tensor, placement: str, world: int) -> torch.Tensor:
    d = int(placement[2:-1]) % x.dim()
    return x.new_empty((*x.shape[:d], x.shape[d] // world, *x.shape[d + 1:]))


def reads_local_outputs(where: str) -> bool:
    """Whether the model a declared layout's ``where`` names reads its ``use_local_output=True``
    sharded module outputs as each rank's piece (torch's contract; `ShardedModel.local_outputs`)."""
    from graphshard.sharding import model_for_key

    model = model_for_key(where)
    return bool(model is not None and model.local_outputs)


@torch.library.register_fake("graphshard::layout")
def _layout_fake(x, where, axis, placement, local):
    if placement != "R" and x.dim():
        if _compat.is_dynamo_graph_input(x) or (reads_local_outputs(where) and _compat.dynamo_value_is_local(x)):
            world = layout_world(where, axis)  # each rank's piece, read as the logical value (from_local)
            if world is not None:
                return _logical(x, placement, world)
    return torch.empty_like(x)


@torch.library.impl(lib, "to_local", "CompositeExplicitAutograd")
def _to_local_eager(x, where, axis, placement, world):
    raise RuntimeError("graphshard::to_local is a compiler node: insert_collectives replaces it before it runs")


@torch.library.register_fake("graphshard::to_local")
def _to_local_fake(x, where, axis, placement, world):
    return _local(x, placement, world)


torch.library.register_autograd(  # never run: insert_collectives replaces the node before aot_autograd
    "graphshard::to_local", lambda ctx, g: (_logical(g, ctx.placement, ctx.world), None, None, None, None),
    setup_context=lambda ctx, inputs, output: setattr(ctx, "placement", inputs[3]) or setattr(ctx, "world", inputs[4]))


@torch.library.impl(lib, "from_local", "CompositeExplicitAutograd")
def _from_local_eager(x, where, axis, placement, world):
    raise RuntimeError("graphshard::from_local is a compiler node: insert_collectives replaces it before it runs")


@torch.library.register_fake("graphshard::from_local")
def _from_local_fake(x, where, axis, placement, world):
    return _logical(x, placement, world)


torch.library.register_autograd(
    "graphshard::layout", lambda ctx, g: (g, None, None, None, None), setup_context=lambda ctx, inputs, output: None
)


# --------------------------------------------------------------------------------------------
# Model-parallel redistributions (forward collective, backward its transpose)
# --------------------------------------------------------------------------------------------
def _all_reduce_decomp(x, group, world):
    return _all_reduce_sum(x, group)


def _all_gather_decomp(x, dim, size, group, world, rank):
    return _gather_dim(x, dim, size, group, world)


def _reduce_scatter_decomp(x, dim, group, world, rank):
    return _reduce_scatter_dim(x, dim, group, world, rank)


def _shard_decomp(x, dim, group, world, rank):
    return local_chunk(x, dim, world, rank).contiguous()


def _grad_all_reduce_decomp(x, group, world):
    return x.clone()


def _to_partial_decomp(x, rank):
    return x.clone() if rank == 0 else torch.zeros_like(x)


def _all_reduce_max_decomp(x, group):
    """Partial(max) -> Replicate. Only for values no gradient flows through (a softmax's
    stabilising maximum); it has no autograd formula."""
    return _wait(c10d.all_reduce(x.contiguous(), "max", group))


def _all_to_all_decomp(x, out_splits, in_splits, group):
    """Rows of ``x`` (dim 0) split by ``in_splits`` go to the ranks in order; row blocks of sizes
    ``out_splits`` come back (sparse ids and pooled embeddings between owners and users)."""
    return _wait(c10d.all_to_all_single(x.contiguous(), list(out_splits), list(in_splits), group))


def _fake_all_to_all(x, out_splits, in_splits, group):
    return x.new_empty((sum(out_splits), *x.shape[1:]))


def _fake_all_gather(x, dim, size, group, world, rank):
    shape = list(x.shape)
    shape[dim] = size
    return x.new_empty(shape)


def _fake_scatter(x, dim, group, world, rank):
    shape = list(x.shape)
    shape[dim] = chunk_size(shape[dim], world, rank)
    return x.new_empty(shape)


_DECOMPS = {
    "all_reduce": (_all_reduce_decomp, lambda x, group, world: torch.empty_like(x)),
    "all_gather": (_all_gather_decomp, _fake_all_gather),
    "all_gather_partial_grad": (_all_gather_decomp, _fake_all_gather),
    "reduce_scatter": (_reduce_scatter_decomp, _fake_scatter),
    "shard": (_shard_decomp, _fake_scatter),
    "grad_all_reduce": (_grad_all_reduce_decomp, lambda x, group, world: torch.empty_like(x)),
    "to_partial": (_to_partial_decomp, lambda x, rank: torch.empty_like(x)),
    "all_reduce_max": (_all_reduce_max_decomp, lambda x, group: torch.empty_like(x)),
    "all_to_all": (_all_to_all_decomp, _fake_all_to_all),
}
for _name, (_impl, _fake) in _DECOMPS.items():
    torch.library.impl(lib, _name, "CompositeExplicitAutograd")(
        lambda *a, _impl=_impl: _impl(*a).clone()
    )
    torch.library.register_fake(f"graphshard::{_name}")(_fake)


def _save_args(ctx, inputs, output):
    ctx.args = inputs[1:]
    ctx.size = inputs[0].shape


def _bw_all_reduce(ctx, g):  # Partial -> Replicate: the gradient of a replicated sum is the gradient
    return g, None, None


def _bw_all_gather(ctx, g):  # Shard -> Replicate: every rank's gradient is whole; keep our chunk
    dim, size, group, world, rank = ctx.args
    return local_chunk(g, dim, world, rank), None, None, None, None, None


def _bw_all_gather_partial_grad(ctx, g):  # every use of the gathered value is sharded compute: partial grads
    dim, size, group, world, rank = ctx.args
    return _reduce_scatter_dim(g, dim, group, world, rank), None, None, None, None, None


def _bw_reduce_scatter(ctx, g):  # Partial -> Shard: gather the shards back
    dim, group, world, rank = ctx.args
    return _gather_dim(g, dim, ctx.size[dim], group, world), None, None, None, None


def _bw_shard(ctx, g):  # Replicate -> Shard: the gradient pieces are gathered into the whole
    dim, group, world, rank = ctx.args
    return _gather_dim(g, dim, ctx.size[dim], group, world), None, None, None, None


def _bw_grad_all_reduce(ctx, g):  # identity forward; a replicated input of sharded compute gets partial grads
    group, world = ctx.args
    return _all_reduce_sum(g, group), None, None


def _bw_all_to_all(ctx, g):  # the rows go back where they came from
    out_splits, in_splits, group = ctx.args
    return _all_to_all_decomp(g, in_splits, out_splits, group), None, None, None


def _bw_to_partial(ctx, g):  # Replicate -> Partial (one rank contributes): the gradient is whole everywhere
    return g, None


for _name, _bw in [
    ("to_partial", _bw_to_partial),
    ("all_reduce", _bw_all_reduce),
    ("all_gather", _bw_all_gather),
    ("all_gather_partial_grad", _bw_all_gather_partial_grad),
    ("reduce_scatter", _bw_reduce_scatter),
    ("shard", _bw_shard),
    ("grad_all_reduce", _bw_grad_all_reduce),
    ("all_to_all", _bw_all_to_all),
]:
    torch.library.register_autograd(f"graphshard::{_name}", _bw, setup_context=_save_args)


def decompositions() -> dict:
    """aot_autograd decompositions: graphshard's collectives -> functional collectives + waits;
    ``random_bits`` -> its ATen ops (``graphshard/ops/rng.py``)."""
    return {
        **_rng_decompositions(),
        ops.unshard.default: _unshard_decomp,
        ops.all_reduce.default: _all_reduce_decomp,
        ops.all_gather.default: _all_gather_decomp,
        ops.all_gather_partial_grad.default: _all_gather_decomp,
        ops.reduce_scatter.default: _reduce_scatter_decomp,
        ops.shard.default: _shard_decomp,
        ops.grad_all_reduce.default: _grad_all_reduce_decomp,
        ops.to_partial.default: _to_partial_decomp,
        ops.all_reduce_max.default: _all_reduce_max_decomp,
        ops.all_to_all.default: _all_to_all_decomp,
    }

