"""graphshard's Triton TBE (``kernels/triton_tbe.py``) as a graph op, the twin of ``fbgemm_tbe``'s.

``graphshard::triton_tbe_lookup`` pools the rows of one rank's tables with the Triton forward;
its autograd formula calls ``graphshard::triton_tbe_update_``, the Triton backward with the
optimizer fused in (weights and state updated in place, no gradient returned), exactly as
``graphshard::tbe_lookup`` / ``tbe_update_`` do with fbgemm's CPU kernels. ``FusedTBE`` selects
it with ``kernel="triton"`` (TorchRec's ``compute_kernel="fused_triton"``): the tables, the
optimizer state and its layout are fbgemm's (``FusedTBE`` builds them, without fbgemm), so the
two kernels are interchangeable on the same buffers.

The layout travels as tensors (``TBELayout``'s) plus its host facts as int lists, because an
op's arguments are tensors and scalars; the op rebuilds the ``TBELayout`` (no copy).

On CPU tensors the kernels run under the Triton interpreter: set ``TRITON_INTERPRET=1`` before
graphshard's Triton module is imported (the launcher says so otherwise).
"""

from __future__ import annotations

from typing import Sequence

import torch

from graphshard.kernels.tbe_reference import TBELayout, TBEOptimizer
from graphshard.kernels.triton_tbe import tbe_backward_update_, tbe_forward

def _layout(tensors: Sequence[torch.Tensor], shapes: Sequence[int], tables: Sequence[int]) -> TBELayout:
    pairs = tuple((int(shapes[i]), int(shapes[i + 1])) for i in range(0, len(shapes), 2))
    offsets = tuple(sum(r * d for r, d in pairs[:t]) for t in range(len(pairs)))
    return TBELayout(*tensors, table_shapes=pairs, feature_tables=tuple(int(t) for t in tables),
                     weights_offsets_host=offsets)


def _optimizer(kind: str, optim_args: Sequence[float]) -> TBEOptimizer:
    """The fused optimizer's settings (its learning rate is a tensor the kernel reads)."""
    eps, weight_decay, weight_decay_mode, max_norm = optim_args
    if max_norm:
        raise NotImplementedError(f"max_norm={max_norm}: graphshard's Triton TBE has no max_norm; use the 'fused' kernel")
    return TBEOptimizer(kind=kind, eps=eps, weight_decay=weight_decay, weight_decay_mode=int(weight_decay_mode))


@torch.library.custom_op("graphshard::triton_tbe_lookup", mutates_args=())
def triton_tbe_lookup(
    token: torch.Tensor, weights: torch.Tensor, state: torch.Tensor, lr: torch.Tensor,
    weights_offsets: torch.Tensor, row_offsets: torch.Tensor, table_rows: torch.Tensor, D_offsets: torch.Tensor,
    feature_table_map: torch.Tensor, indices: torch.Tensor, offsets: torch.Tensor,
    per_sample_weights: torch.Tensor | None, shapes: Sequence[int], tables: Sequence[int], total_D: int,
    optimizer: str, optim_args: Sequence[float], bounds_check: bool, grad_scale: float,
) -> torch.Tensor:
    """Pooled (sum) lookup ``[B, total_D]`` of every feature of the rank's tables, in one launch."""
    layout = _layout((weights_offsets, row_offsets, table_rows, D_offsets, feature_table_map), shapes, tables)
    return tbe_forward(weights, layout, indices, offsets, per_sample_weights, pooling="sum", validate=bounds_check)


@triton_tbe_lookup.register_fake
def _lookup_fake(token, weights, state, lr, weights_offsets, row_offsets, table_rows, D_offsets, feature_table_map,
                 indices, offsets, per_sample_weights, shapes, tables, total_D, optimizer, optim_args, bounds_check,
                 grad_scale):
    return weights.new_empty((offsets.shape[0] - 1) // len(tables), total_D, dtype=torch.float32)


@torch.library.custom_op("graphshard::triton_tbe_update_", mutates_args=("weights", "state"))
def triton_tbe_update_(
    grad: torch.Tensor, weights: torch.Tensor, state: torch.Tensor, lr: torch.Tensor,
    weights_offsets: torch.Tensor, row_offsets: torch.Tensor, table_rows: torch.Tensor, D_offsets: torch.Tensor,
    feature_table_map: torch.Tensor, indices: torch.Tensor, offsets: torch.Tensor,
    per_sample_weights: torch.Tensor | None, shapes: Sequence[int], tables: Sequence[int], optimizer: str,
    optim_args: Sequence[float], grad_scale: float,
) -> None:
    """The Triton backward with the optimizer fused in: ``weights`` and ``state`` updated in place
    with ``grad_scale`` times ``grad``."""
    layout = _layout((weights_offsets, row_offsets, table_rows, D_offsets, feature_table_map), shapes, tables)
    if grad_scale != 1.0:
        grad = grad * grad_scale
    tbe_backward_update_(grad, weights, state, layout, indices, offsets, per_sample_weights, pooling="sum",
                         optimizer=_optimizer(optimizer, optim_args), learning_rate=lr.reshape(1), validate=False)


@triton_tbe_update_.register_fake
def _update_fake(*args):
    return None


def _setup(ctx, inputs, output):
    (token, ctx.weights, ctx.state, ctx.lr, *ctx.layout, ctx.indices, ctx.offsets, ctx.psw, ctx.shapes, ctx.tables,
     _total_D, ctx.optimizer, ctx.optim_args, _bounds_check, ctx.grad_scale) = inputs
    ctx.token_shape = token.shape


def _backward(ctx, grad):
    torch.ops.graphshard.triton_tbe_update_(
        grad, ctx.weights, ctx.state, ctx.lr, *ctx.layout, ctx.indices, ctx.offsets, ctx.psw, ctx.shapes, ctx.tables,
        ctx.optimizer, ctx.optim_args, ctx.grad_scale,
    )
    return (grad.new_zeros(ctx.token_shape),) + (None,) * 18


triton_tbe_lookup.register_autograd(_backward, setup_context=_setup)


