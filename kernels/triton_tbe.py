"""graphshard's own table-batched embedding (TBE) in Triton: pooled lookup, and a backward with the
optimizer fused in.

Layout: fbgemm's TBE layout (``TBELayout`` in ``kernels/tbe_reference.py``, which needs only torch):
one flat weights buffer holding every table of one rank (table ``t`` at ``weights_offsets[t]``),
``feature_table_map`` (the table of each feature; features may share a table), ``D_offsets``
(where each feature's columns start in the ``[B, total_D]`` output), ``indices`` local to their
table (int32 or int64) and ``offsets`` of length ``features * B + 1`` in KeyedJaggedTensor order
(feature-major, then sample), optional per-sample weights (one per id). So these kernels can take
the place of fbgemm's inside ``FusedTBE`` without moving any data.

Kernels:

* ``_tbe_forward_kernel``: one program per (bag, block of columns); all features and tables of a
  rank in ONE launch. A program gathers ``BLOCK_L`` rows of its bag at a time as a
  ``[BLOCK_L, BLOCK_D]`` tile (several loads in flight rather than one row after another), scales
  them by their per-sample weights, sums them in fp32 and, for MEAN pooling, multiplies by
  ``1 / length`` (an empty bag stays zero). Weights may be fp32, fp16 or bf16; the output is fp32.
* ``_tbe_update_kernel``: the backward with SGD, Adagrad or row-wise Adagrad fused in. It never
  materializes a table's dense gradient: it reads ``grad_output`` and writes only the rows the
  batch touched, in place.

Why sort and segment: fbgemm's EXACT_* optimizers update a row that appears several times in a
batch (in one bag, in several bags, through several features of one table) ONCE, with the sum of
its gradients. Adagrad is not linear in the gradient, so applying each occurrence on its own (or
racing with atomics) gives another answer, and atomics would make it nondeterministic. The
launcher therefore sorts the ids by the key ``row_offsets[table] + id`` (a global row number) with
a stable sort, so each unique row becomes one contiguous segment whose occurrences keep their
original order. The kernel runs one program per sorted position; the program at a segment's first
position sums the segment's gradient rows in that fixed order (``BLOCK_L`` at a time) and applies
the optimizer; the others do nothing. Segment ends come from ``searchsorted`` on the sorted keys,
so the launch needs no device-to-host copy (its grid is the number of ids, known on the host).
The result is bitwise reproducible run to run.

Formulas (fbgemm's ``split_weight_update`` / ``split_weight_update_cpu`` in
``fbgemm_gpu/codegen/genscript/optimizers.py``), ``g`` the summed fp32 gradient of a row:
SGD ``w -= lr * g``; Adagrad ``m += g * g; w -= lr * g / (sqrt(m) + eps)``; row-wise Adagrad
``m += mean_d((g + wd * w)^2 under L2, else g^2); k = lr / (sqrt(m) + eps); w = c * w - k * g``
with ``c = 1 - k * wd`` (L2), ``1 - lr * wd`` (decoupled), else 1. Square roots and the divisions
of the update are correctly rounded (``sqrt_rn`` / ``div_rn``) like CUDA's ``sqrtf`` and ``/``.
Weights in fp16/bf16 are updated in fp32 and rounded to nearest (no stochastic rounding).

Running: on a CUDA device with Triton, or on CPU tensors under the Triton interpreter
(``TRITON_INTERPRET=1`` set before this module is imported; library code never sets it).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .tbe_reference import OPTIMIZERS, POOLINGS, TBELayout, TBEOptimizer

__all__ = ["TBELayout", "TBEOptimizer", "tbe_forward", "tbe_backward_update_", "interpreted"]

_WEIGHT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_INDEX_DTYPES = (torch.int32, torch.int64)
MAX_D = 4096
"""Widest row the fused backward takes (one program holds a whole row for row-wise Adagrad)."""


# --------------------------------------------------------------------------------------------
# Kernels.
# --------------------------------------------------------------------------------------------
# The kernels use only Triton builtins and this module's own jit functions, not triton.language's
# jit-defined helpers (tl.sum, tl.zeros): those are made when triton is first imported, and under
# the interpreter they only work if TRITON_INTERPRET=1 was already set then. torch imports triton
# early (torch._dynamo does), so this module works whenever the variable is set before IT is imported.
@triton.jit
def _add(a, b):
    return a + b


@triton.jit
def _store_rounded(ptrs, x, mask):
    """Stores fp32 ``x`` in the pointers' dtype, rounded to nearest even. bf16 is rounded here with
    integer ops because the interpreter's fp32 -> bf16 cast truncates (the GPU's rounds to nearest)."""
    if ptrs.dtype.element_ty == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = bits + (0x7FFF + ((bits >> 16) & 1))
        tl.store(ptrs, (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True), mask=mask)
    else:
        tl.store(ptrs, x.to(ptrs.dtype.element_ty), mask=mask)


@triton.jit
def _tbe_forward_kernel(
    weights_ptr, weights_offsets_ptr, D_offsets_ptr, feature_table_map_ptr,
    indices_ptr, offsets_ptr, per_sample_weights_ptr, out_ptr,
    B, total_D,
    WEIGHTED: tl.constexpr, MEAN: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_D: tl.constexpr,
):
    bag = tl.program_id(0)  # feature * B + sample
    col_block = tl.program_id(1)
    feature = bag // B
    sample = bag - feature * B
    col_begin = tl.load(D_offsets_ptr + feature)
    dim = tl.load(D_offsets_ptr + feature + 1) - col_begin
    cols = col_block * BLOCK_D + tl.arange(0, BLOCK_D)
    col_mask = cols < dim
    table = tl.load(feature_table_map_ptr + feature)
    table_begin = tl.load(weights_offsets_ptr + table)
    start = tl.load(offsets_ptr + bag).to(tl.int64)
    end = tl.load(offsets_ptr + bag + 1).to(tl.int64)
    # a column block past this feature's dim has nothing to do: an empty loop, a fully masked store
    end = start + (end - start) * (col_block * BLOCK_D < dim).to(tl.int64)
    acc = tl.full([BLOCK_D], 0.0, tl.float32)
    first = start
    while first < end:  # a while loop: the interpreter cannot range() over loaded bounds
        pos = first + tl.arange(0, BLOCK_L)
        pos_mask = pos < end
        ids = tl.load(indices_ptr + pos, mask=pos_mask, other=0).to(tl.int64)
        ptrs = weights_ptr + table_begin + ids[:, None] * dim + cols[None, :]
        rows = tl.load(ptrs, mask=pos_mask[:, None] & col_mask[None, :], other=0.0).to(tl.float32)
        if WEIGHTED:
            psw = tl.load(per_sample_weights_ptr + pos, mask=pos_mask, other=0.0).to(tl.float32)
            rows = rows * psw[:, None]
        acc += tl.reduce(rows, 0, _add)
        first += BLOCK_L
    if MEAN:
        length = (end - start).to(tl.float32)
        acc = acc * tl.where(length > 0, 1.0 / tl.maximum(length, 1.0), 0.0)
    tl.store(out_ptr + sample.to(tl.int64) * total_D + col_begin + cols, acc, mask=col_mask)


@triton.jit
def _tbe_update_kernel(
    grad_ptr, weights_ptr, state_ptr, weights_offsets_ptr, D_offsets_ptr, feature_table_map_ptr,
    indices_ptr, offsets_ptr, per_sample_weights_ptr,
    bag_of_id_ptr, sorted_keys_ptr, order_ptr, segment_end_ptr,
    lr_ptr, B, total_D, eps, weight_decay,
    OPTIMIZER: tl.constexpr, WEIGHT_DECAY_MODE: tl.constexpr, WEIGHTED: tl.constexpr, MEAN: tl.constexpr,
    BLOCK_L: tl.constexpr, BLOCK_D: tl.constexpr,
):
    # OPTIMIZER: 0 SGD, 1 Adagrad, 2 row-wise Adagrad (the order of tbe_reference.OPTIMIZERS)
    j = tl.program_id(0).to(tl.int64)  # a position in the sorted ids
    key = tl.load(sorted_keys_ptr + j)
    previous = tl.load(sorted_keys_ptr + j - 1, mask=j > 0, other=-1)
    leader = (j == 0) | (key != previous)  # first occurrence of its row: this program updates it
    segment_end = tl.where(leader, tl.load(segment_end_ptr + j), j)

    first_id = tl.load(order_ptr + j)
    feature = tl.load(bag_of_id_ptr + first_id) // B
    table = tl.load(feature_table_map_ptr + feature)
    dim = tl.load(D_offsets_ptr + feature + 1) - tl.load(D_offsets_ptr + feature)
    row_begin = tl.load(weights_offsets_ptr + table) + tl.load(indices_ptr + first_id).to(tl.int64) * dim
    cols = tl.arange(0, BLOCK_D)
    col_mask = cols < dim

    # the row's gradient, summed over its occurrences in sorted (= original) order
    grad = tl.full([BLOCK_D], 0.0, tl.float32)
    first = j
    while first < segment_end:
        pos = first + tl.arange(0, BLOCK_L)
        pos_mask = pos < segment_end
        ids = tl.load(order_ptr + pos, mask=pos_mask, other=0)
        bag = tl.load(bag_of_id_ptr + ids, mask=pos_mask, other=0)
        f = bag // B
        sample = (bag - f * B).to(tl.int64)
        col_begin = tl.load(D_offsets_ptr + f, mask=pos_mask, other=0)
        ptrs = grad_ptr + sample[:, None] * total_D + col_begin[:, None] + cols[None, :]
        g = tl.load(ptrs, mask=pos_mask[:, None] & col_mask[None, :], other=0.0).to(tl.float32)
        if WEIGHTED:
            psw = tl.load(per_sample_weights_ptr + ids, mask=pos_mask, other=0.0).to(tl.float32)
            g = g * psw[:, None]
        if MEAN:
            length = (tl.load(offsets_ptr + bag + 1, mask=pos_mask, other=1)
                      - tl.load(offsets_ptr + bag, mask=pos_mask, other=0)).to(tl.float32)
            g = g * (1.0 / length)[:, None]
        grad += tl.reduce(g, 0, _add)
        first += BLOCK_L

    # the row's columns where this program leads, else none; a select, not `col_mask & leader`: Triton's
    # 3.9 interpreter makes a block-and-scalar `&` an int32 block, which it then refuses as a mask
    update_mask = tl.where(leader, col_mask, False)
    learning_rate = tl.load(lr_ptr).to(tl.float32)  # read on the device: a changed rate needs no new launch or host sync
    w_ptrs = weights_ptr + row_begin + cols
    w = tl.load(w_ptrs, mask=update_mask, other=0.0).to(tl.float32)
    if OPTIMIZER == 0:
        new_w = w - learning_rate * grad
    elif OPTIMIZER == 1:
        m_ptrs = state_ptr + row_begin + cols
        m = tl.load(m_ptrs, mask=update_mask, other=0.0) + grad * grad
        tl.store(m_ptrs, m, mask=update_mask)
        new_w = w - tl.div_rn(learning_rate * grad, tl.sqrt_rn(m) + eps)
    else:
        h = grad
        if WEIGHT_DECAY_MODE == 1:
            h = grad + weight_decay * w
        h = tl.where(col_mask, h, 0.0)
        mean_square = tl.div_rn(tl.reduce(h * h, 0, _add), dim.to(tl.float32))
        m = tl.load(state_ptr + key, mask=leader, other=0.0) + mean_square
        tl.store(state_ptr + key, m, mask=leader)
        multiplier = tl.div_rn(learning_rate, tl.sqrt_rn(m) + eps)
        if WEIGHT_DECAY_MODE == 1:
            correction = 1.0 - multiplier * weight_decay
        elif WEIGHT_DECAY_MODE == 2:
            correction = 1.0 - learning_rate * weight_decay
        else:
            correction = 1.0
        new_w = correction * w - multiplier * grad
    _store_rounded(w_ptrs, new_w, update_mask)


# --------------------------------------------------------------------------------------------
# Launchers.
# --------------------------------------------------------------------------------------------
def interpreted() -> bool:
    """Whether this module's kernels run under the Triton interpreter (``TRITON_INTERPRET=1`` was set
    when it was imported)."""
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(_tbe_forward_kernel, InterpretedFunction)


def _check_device(device: torch.device) -> None:
    if device.type == "cuda":
        return
    if device.type == "cpu":
        if not interpreted():
            raise ValueError(
                "graphshard's Triton TBE got CPU tensors but Triton's interpreter is off: set "
                "TRITON_INTERPRET=1 before importing graphshard.kernels.triton_tbe, or use a CUDA device"
            )
        return
    raise ValueError(f"graphshard's Triton TBE runs on CUDA devices (or CPU under TRITON_INTERPRET=1), got {device}")


def _check_same_device(weights: torch.Tensor, layout: TBELayout, **tensors) -> None:
    if layout.device != weights.device:
        raise ValueError(f"layout tensors are on {layout.device} but weights on {weights.device}; "
                         f"use layout.to({str(weights.device)!r})")
    for name, t in tensors.items():
        if t is not None and t.device != weights.device:
            raise ValueError(f"{name} is on {t.device} but weights on {weights.device}")


def _check_batch(weights: torch.Tensor, layout: TBELayout, indices: torch.Tensor, offsets: torch.Tensor,
                 per_sample_weights: torch.Tensor | None, pooling: str, validate: bool) -> int:
    """Checks what the forward and the backward share; returns the batch size B."""
    if weights.dtype not in _WEIGHT_DTYPES or weights.dim() != 1:
        raise ValueError(f"weights must be a 1-D fp32, fp16 or bf16 tensor, got {weights.dtype} of shape "
                         f"{tuple(weights.shape)}")
    if weights.numel() < layout.num_weights:
        raise ValueError(f"weights has {weights.numel()} elements but the layout's tables need {layout.num_weights}")
    if not weights.is_contiguous():
        raise ValueError("weights must be contiguous (the kernels update it in place)")
    if pooling not in POOLINGS:
        raise ValueError(f"pooling must be one of {POOLINGS}, got {pooling!r}")
    for name, t in (("indices", indices), ("offsets", offsets)):
        if t.dtype not in _INDEX_DTYPES or t.dim() != 1:
            raise ValueError(f"{name} must be a 1-D int32 or int64 tensor, got {t.dtype} of shape {tuple(t.shape)}")
    features = layout.num_features
    if offsets.numel() < 1 or (offsets.numel() - 1) % features:
        raise ValueError(f"offsets has {offsets.numel()} entries; it needs features * B + 1 = {features} * B + 1 "
                         "(KJT order: feature-major, then sample)")
    if per_sample_weights is not None:
        if not per_sample_weights.is_floating_point() or per_sample_weights.shape != indices.shape:
            raise ValueError(f"per_sample_weights must be a float tensor shaped like indices {tuple(indices.shape)}, "
                             f"got {per_sample_weights.dtype} {tuple(per_sample_weights.shape)}")
    _check_same_device(weights, layout, indices=indices, offsets=offsets, per_sample_weights=per_sample_weights)
    _check_device(weights.device)
    if validate:  # data-dependent checks: they read device values back (pass validate=False to skip)
        _validate_ids(layout, indices, offsets)
    return (offsets.numel() - 1) // features


def _validate_ids(layout: TBELayout, indices: torch.Tensor, offsets: torch.Tensor) -> None:
    offs = offsets.long()
    if int(offs[0]) != 0 or int(offs[-1]) != indices.numel() or bool((offs[1:] < offs[:-1]).any()):
        raise ValueError(f"offsets must start at 0, never decrease and end at indices.numel() = {indices.numel()}")
    if indices.numel() == 0:
        return
    bags = _bag_of_id(offs, indices.numel())
    batch = (offsets.numel() - 1) // layout.num_features
    tables = layout.feature_table_map.long()[bags // batch]
    ids = indices.long()
    bad = (ids < 0) | (ids >= layout.table_rows[tables])
    if bool(bad.any()):
        i = int(bad.nonzero()[0, 0])
        f, t = int(bags[i]) // batch, int(tables[i])
        raise ValueError(f"id {int(ids[i])} at position {i} (feature {f}) is outside table {t}'s rows "
                         f"[0, {layout.table_shapes[t][0]})")


def _bag_of_id(offsets: torch.Tensor, num_ids: int) -> torch.Tensor:
    """The bag (feature * B + sample) each id belongs to; no device-to-host copy."""
    bags = torch.arange(offsets.numel() - 1, device=offsets.device)
    return torch.repeat_interleave(bags, offsets[1:] - offsets[:-1], output_size=num_ids)


def sorted_ids(layout: TBELayout, indices: torch.Tensor, offsets: torch.Tensor, batch: int):
    """What the fused backward launches over: ``(bag_of_id, sorted_keys, order, segment_end)``, the
    ids' global row numbers (``row_offsets[table] + id``) stably sorted, the positions they came
    from, and the end of each one's run of equal keys. The keys are int32 when the layout's rows
    fit (a radix sort then makes half as many passes as over int64 keys)."""
    bag_of_id = _bag_of_id(offsets, indices.numel())
    tables = layout.feature_table_map[bag_of_id // batch]
    keys = layout.row_offsets[tables] + indices.long()
    if layout.total_rows < 2**31:
        keys = keys.to(torch.int32)
    sorted_keys, order = torch.sort(keys, stable=True)
    segment_end = torch.searchsorted(sorted_keys, sorted_keys, right=True)
    return bag_of_id, sorted_keys, order, segment_end


def _next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def _tile(max_d: int, ids_per_group: float, *, whole_row: bool) -> tuple[int, int, int]:
    """(BLOCK_L, BLOCK_D, num_warps). ``BLOCK_D``: the next power of two of the widest row (capped at
    256 for the forward, which splits wider rows over the grid; the backward holds a whole row).
    ``BLOCK_L``: ids per tile, the next power of two of ``ids_per_group`` (the mean bag length, or
    the mean number of occurrences of a row), so short bags do not fill tiles with masked lanes;
    at most 2048 values per tile (512 under the interpreter, where a tile's cost is its size)."""
    block_d = _next_pow2(max_d) if whole_row else min(_next_pow2(max_d), 256)
    budget = 512 if interpreted() else 2048
    block_l = max(1, min(32, budget // block_d, _next_pow2(max(1, math.ceil(ids_per_group)))))
    size = block_l * block_d
    num_warps = 8 if size >= 4096 else 4 if size >= 1024 else 2 if size >= 256 else 1
    return block_l, block_d, num_warps


def tbe_forward(weights: torch.Tensor, layout: TBELayout, indices: torch.Tensor, offsets: torch.Tensor,
                per_sample_weights: torch.Tensor | None = None, *, pooling: str = "sum",
                validate: bool = True) -> torch.Tensor:
    """Pooled lookup of every feature of ``layout`` in one launch: ``[B, total_D]`` fp32, feature
    ``f``'s bag of sample ``b`` in ``out[b, D_offsets[f]:D_offsets[f+1]]``.

    ``pooling`` is ``"sum"`` or ``"mean"`` (weighted sum divided by the bag's length; an empty bag
    gives zeros). ``validate`` also checks offsets and ids against the tables (reads device values
    back; pass False on hot paths whose ids are already checked).
    """
    batch = _check_batch(weights, layout, indices, offsets, per_sample_weights, pooling, validate)
    out = torch.empty(batch, layout.total_D, dtype=torch.float32, device=weights.device)
    if batch == 0 or layout.total_D == 0:
        return out
    bags = layout.num_features * batch
    block_l, block_d, num_warps = _tile(layout.max_D, indices.numel() / bags, whole_row=False)
    grid = (bags, triton.cdiv(layout.max_D, block_d))
    psw = per_sample_weights.contiguous() if per_sample_weights is not None else weights  # unread if unweighted
    _tbe_forward_kernel[grid](
        weights, layout.weights_offsets, layout.D_offsets, layout.feature_table_map,
        indices.contiguous(), offsets.contiguous(), psw, out, batch, layout.total_D,
        WEIGHTED=per_sample_weights is not None, MEAN=pooling == "mean",
        BLOCK_L=block_l, BLOCK_D=block_d, num_warps=num_warps,
    )
    return out


def tbe_backward_update_(grad_output: torch.Tensor, weights: torch.Tensor, state: torch.Tensor, layout: TBELayout,
                         indices: torch.Tensor, offsets: torch.Tensor,
                         per_sample_weights: torch.Tensor | None = None, *, pooling: str = "sum",
                         optimizer: TBEOptimizer, learning_rate: torch.Tensor | None = None,
                         validate: bool = True) -> None:
    """The backward of ``tbe_forward`` with ``optimizer`` fused in: updates ``weights`` (and the
    optimizer ``state``, see ``TBELayout.new_state``) in place. Each (table, row) the batch touches
    is updated once with the sum of its gradients, deterministically; no dense gradient is formed.
    ``learning_rate``: a one-element fp32 tensor on the weights' device that the kernel reads
    (a fused optimizer's rate, changed in place between steps); by default ``optimizer``'s.
    """
    batch = _check_batch(weights, layout, indices, offsets, per_sample_weights, pooling, validate)
    if not isinstance(optimizer, TBEOptimizer):
        raise ValueError(f"optimizer must be a TBEOptimizer, got {type(optimizer).__name__}")
    if grad_output.shape != (batch, layout.total_D) or not grad_output.is_floating_point():
        raise ValueError(f"grad_output must be a float tensor of shape [B, total_D] = [{batch}, {layout.total_D}], "
                         f"got {grad_output.dtype} {tuple(grad_output.shape)}")
    want = {"sgd": 0, "adagrad": layout.num_weights, "rowwise_adagrad": layout.total_rows}[optimizer.kind]
    if optimizer.kind != "sgd" and (state.dtype != torch.float32 or state.dim() != 1 or state.numel() < want
                                    or not state.is_contiguous()):
        raise ValueError(f"{optimizer.kind} needs a contiguous 1-D fp32 state of {want} elements "
                         f"(layout.new_state(optimizer)), got {state.dtype} {tuple(state.shape)}")
    if learning_rate is None:
        learning_rate = torch.full((1,), optimizer.learning_rate, dtype=torch.float32, device=weights.device)
    elif learning_rate.numel() != 1 or learning_rate.dtype != torch.float32:
        raise ValueError(f"learning_rate must be a one-element fp32 tensor, got {learning_rate.dtype} "
                         f"{tuple(learning_rate.shape)}")
    _check_same_device(weights, layout, grad_output=grad_output, state=state if optimizer.kind != "sgd" else None,
                       learning_rate=learning_rate)
    if layout.max_D > MAX_D:
        raise NotImplementedError(f"the fused TBE backward takes rows up to {MAX_D} wide, got {layout.max_D}")
    num_ids = indices.numel()
    if batch == 0 or num_ids == 0:
        return
    offsets = offsets.contiguous()
    bag_of_id, sorted_keys, order, segment_end = sorted_ids(layout, indices, offsets, batch)
    # most rows occur a few times (uniform ids); a hot row loops over more tiles
    block_l, block_d, num_warps = _tile(layout.max_D, 4, whole_row=True)
    psw = per_sample_weights.contiguous() if per_sample_weights is not None else weights
    _tbe_update_kernel[(num_ids,)](
        grad_output.contiguous(), weights, state if optimizer.kind != "sgd" else weights,
        layout.weights_offsets, layout.D_offsets, layout.feature_table_map,
        indices.contiguous(), offsets, psw, bag_of_id, sorted_keys, order, segment_end,
        learning_rate, batch, layout.total_D, float(optimizer.eps), float(optimizer.weight_decay),
        OPTIMIZER=OPTIMIZERS.index(optimizer.kind), WEIGHT_DECAY_MODE=optimizer.weight_decay_mode,
        WEIGHTED=per_sample_weights is not None, MEAN=pooling == "mean",
        BLOCK_L=block_l, BLOCK_D=block_d, num_warps=num_warps,
    )
