"""fbgemm's table-batched embedding (TBE) as a graph op, with the optimizer fused into its backward.

``graphshard::tbe_lookup`` pools the rows of several tables (one rank's table shards) in one
fbgemm kernel. Its autograd formula calls ``graphshard::tbe_update_``, which runs fbgemm's
backward with the optimizer fused in: it updates the weights and the optimizer state in place
and returns no gradient, so no dense gradient of a table is ever materialized. The weights
are ordinary (non-differentiable) inputs that the backward mutates; aot_autograd keeps that
mutation in the backward graph. A zero-size ``token`` that requires grad is what makes
autograd call the backward at all (fbgemm's own ``placeholder_autograd_tensor``).

fbgemm's pt2 lookup ops have no fake impls in the CPU build, so graphshard calls fbgemm's
stateless kernels (``split_embedding_codegen_forward_cpu`` and
``split_embedding_backward_codegen_<optimizer>_cpu``) from its own op, which has the fake impl
tracing needs. Those kernels take the per-sample weights as a defined tensor (an unweighted
lookup cannot be asked for from Python), so unweighted lookups pass ones.

The tables (``FusedTBE`` in ``graphshard/sparse/fused_tbe.py``) are built by fbgemm's own module, which also
imports ``fbgemm_gpu`` and so registers ``torch.ops.fbgemm``; importing this module needs no fbgemm.

The kernel always pools by sum: fbgemm's CPU backward ignores mean pooling when it is given
per-sample weights (measured: an SGD step 0.06-0.2 away from the torch reference), and the
row-wise sharded lookup needs the sum anyway (a rank sums only its rows). Mean pooling is the
sum divided by the bag's length, done by the caller on the pooled output.
"""

from __future__ import annotations

from typing import Sequence

import torch

from graphshard.kernels.tbe_reference import first_out_of_range


# --------------------------------------------------------------------------------------------
def _check_ids(indices, offsets, rows, names, row_offsets):
    """Raises ValueError naming the table and feature of the first id outside its table (or shard)."""
    counts = (offsets[1:] - offsets[:-1]).view(rows.numel(), -1).sum(1)
    found = first_out_of_range(indices, counts, rows)
    if found is not None:
        i, slot = found
        idx = int(indices[i]) + row_offsets[slot]
        raise ValueError(
            f"id {idx} of {names[slot]} is outside the table's rows "
            f"(this rank holds rows {row_offsets[slot]}..{row_offsets[slot] + int(rows[slot]) - 1}); "
            "ids must lie in [0, num_embeddings) of the feature's table"
        )


@torch.library.custom_op("graphshard::tbe_lookup", mutates_args=())
def tbe_lookup(
    token: torch.Tensor, weights: torch.Tensor, momentum: torch.Tensor, lr: torch.Tensor,
    weights_offsets: torch.Tensor, D_offsets: torch.Tensor, hash_size_cumsum: torch.Tensor,
    momentum_offsets: torch.Tensor, rows: torch.Tensor,
    indices: torch.Tensor, offsets: torch.Tensor, per_sample_weights: torch.Tensor | None,
    total_D: int, max_D: int, total_hash_size_bits: int, pooling: int, optimizer: str,
    optim_args: Sequence[float], names: str, row_offsets: Sequence[int], bounds_check: bool, grad_scale: float,
) -> torch.Tensor:
    """Pooled lookup ``[B, total_D]`` of the ids of ``D_offsets.numel() - 1`` features (``names``:
    one line per feature, for errors)."""
    if bounds_check:
        _check_ids(indices, offsets, rows, names.split("\n"), row_offsets)
    psw = per_sample_weights if per_sample_weights is not None else torch.ones(indices.shape, dtype=weights.dtype)
    return torch.ops.fbgemm.split_embedding_codegen_forward_cpu(
        weights, weights_offsets, D_offsets, total_D, hash_size_cumsum, indices, offsets, pooling,
        psw.to(weights.dtype), 0,
    )


@tbe_lookup.register_fake
def _tbe_lookup_fake(token, weights, momentum, lr, weights_offsets, D_offsets, hash_size_cumsum,
                     momentum_offsets, rows, indices, offsets, per_sample_weights, total_D, max_D,
                     total_hash_size_bits, pooling, optimizer, optim_args, names, row_offsets, bounds_check,
                     grad_scale):
    features = D_offsets.shape[0] - 1
    return weights.new_empty((offsets.shape[0] - 1) // features, total_D)


@torch.library.custom_op("graphshard::tbe_update_", mutates_args=("weights", "momentum"))
def tbe_update_(
    grad: torch.Tensor, weights: torch.Tensor, momentum: torch.Tensor, lr: torch.Tensor,
    weights_offsets: torch.Tensor, D_offsets: torch.Tensor, hash_size_cumsum: torch.Tensor,
    momentum_offsets: torch.Tensor, indices: torch.Tensor, offsets: torch.Tensor,
    per_sample_weights: torch.Tensor | None, max_D: int, total_hash_size_bits: int, pooling: int,
    optimizer: str, optim_args: Sequence[float], grad_scale: float,
) -> None:
    """fbgemm's backward with the optimizer fused in: updates ``weights`` (and ``momentum``) in place
    with ``grad_scale`` times ``grad``."""
    placements = torch.zeros(weights_offsets.shape, dtype=torch.int32)  # EmbeddingLocation.HOST
    if grad_scale != 1.0:
        grad = grad * grad_scale
    psw = per_sample_weights if per_sample_weights is not None else torch.ones(indices.shape, dtype=weights.dtype)
    common = (grad.contiguous(), weights, placements, weights_offsets, D_offsets, max_D, hash_size_cumsum,
              total_hash_size_bits, indices, offsets, pooling, psw.to(weights.dtype), False)
    fbgemm = torch.ops.fbgemm
    if optimizer == "sgd":
        fbgemm.split_embedding_backward_codegen_sgd_cpu(*common, lr)
    elif optimizer == "adagrad":
        fbgemm.split_embedding_backward_codegen_adagrad_cpu(*common, momentum, placements, momentum_offsets, lr,
                                                            optim_args[0])
    elif optimizer == "rowwise_adagrad":
        eps, weight_decay, weight_decay_mode, max_norm = optim_args
        fbgemm.split_embedding_backward_codegen_rowwise_adagrad_cpu(
            *common, momentum, placements, momentum_offsets, lr, eps, weight_decay, int(weight_decay_mode), max_norm)
    else:
        raise AssertionError(optimizer)


@tbe_update_.register_fake
def _tbe_update_fake(*args):
    return None


def _setup(ctx, inputs, output):
    (token, ctx.weights, ctx.momentum, ctx.lr, ctx.weights_offsets, ctx.D_offsets, ctx.hash_size_cumsum,
     ctx.momentum_offsets, _rows, ctx.indices, ctx.offsets, ctx.psw, _total_D, ctx.max_D, ctx.bits, ctx.pooling,
     ctx.optimizer, ctx.optim_args, _names, _row_offsets, _bounds_check, ctx.grad_scale) = inputs
    ctx.token_shape = token.shape


def _backward(ctx, grad):
    torch.ops.graphshard.tbe_update_(
        grad, ctx.weights, ctx.momentum, ctx.lr, ctx.weights_offsets, ctx.D_offsets, ctx.hash_size_cumsum,
        ctx.momentum_offsets, ctx.indices, ctx.offsets, ctx.psw, ctx.max_D, ctx.bits, ctx.pooling, ctx.optimizer,
        ctx.optim_args, ctx.grad_scale,
    )
    return (grad.new_zeros(ctx.token_shape),) + (None,) * 21


tbe_lookup.register_autograd(_backward, setup_context=_setup)
