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

``fbgemm_state`` builds one rank's tables for ``FusedTBE`` (``kernels/fused_tbe.py``) with
fbgemm's ``SplitTableBatchedEmbeddingBagsCodegen`` from the same arguments (so the optimizer's
defaults and settings are fbgemm's) and keeps only the tensors the kernels read. These are
fbgemm's CPU kernels: ``FusedTBE`` uses them for tables on the CPU only.

The kernel always pools by sum: fbgemm's CPU backward ignores mean pooling when it is given
per-sample weights (measured: an SGD step 0.06-0.2 away from the torch reference), and the
row-wise sharded lookup needs the sum anyway (a rank sums only its rows). Mean pooling is the
sum divided by the bag's length, done by the caller on the pooled output.
"""

from __future__ import annotations

from typing import Sequence

import torch

from .fused_tbe import TBESlot, first_out_of_range, optimizer_name


def _fbgemm():
    try:
        import fbgemm_gpu  # noqa: F401  (registers torch.ops.fbgemm)
        from fbgemm_gpu.split_embedding_configs import EmbOptimType
        from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation, PoolingMode
        from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
            ComputeDevice,
            SplitTableBatchedEmbeddingBagsCodegen,
        )
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError(
            "graphshard's sharded embeddings need fbgemm_gpu; install the torchrec extra "
            "(`bash scripts/setup.sh` does: fbgemm-gpu-cpu==1.8.0 with torch 2.13)"
        ) from e
    return EmbOptimType, EmbeddingLocation, PoolingMode, ComputeDevice, SplitTableBatchedEmbeddingBagsCodegen


# --------------------------------------------------------------------------------------------
# The ops.
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




# --------------------------------------------------------------------------------------------
# One rank's tables, built by fbgemm's module.
# --------------------------------------------------------------------------------------------
_FBGEMM_KWARGS = ("optimizer", "learning_rate", "eps", "weight_decay", "weight_decay_mode", "max_norm",
                  "stochastic_rounding")
"""The fused-params keys graphshard passes to fbgemm (the optimizer's); others (caching,
prefetch, output dtype) do not apply to the CPU kernels and are ignored by the caller with a
logged note."""


def fbgemm_state(shapes: Sequence[tuple[int, int]], slots: Sequence[TBESlot], fused_params: dict) -> dict:
    """fbgemm's module for tables ``shapes`` looked up by ``slots``: its optimizer (name and
    ``(eps, weight_decay, weight_decay_mode, max_norm)``), the tensors its CPU kernels read (host
    memory), and where each table and table state starts in the flat buffers."""
    EmbOptimType, EmbeddingLocation, PoolingMode, ComputeDevice, TBE = _fbgemm()
    tables = [s.table for s in slots]
    if tables != sorted(tables):
        # fbgemm's weighted row-wise Adagrad on the CPU updates nothing when one table's features
        # are not next to each other ("num of rows processed by adagrad: 0")
        raise ValueError(f"FusedTBE slots must list each table's features together, in table order; got tables {tables}")
    params = {k: v for k, v in fused_params.items() if k in _FBGEMM_KWARGS}
    if isinstance(params.get("optimizer"), str):  # graphshard's name ("rowwise_adagrad") -> fbgemm's member
        params["optimizer"] = getattr(EmbOptimType, f"EXACT_{optimizer_name(params['optimizer']).upper()}")
    ref = TBE([(rows, dim, EmbeddingLocation.HOST, ComputeDevice.CPU) for rows, dim in shapes],
              feature_table_map=tables, pooling_mode=PoolingMode.SUM, **params)
    optimizer = optimizer_name(ref.optimizer)
    args = ref.optimizer_args
    return {
        "optimizer": optimizer,
        "optim_args": (float(args.eps), float(args.weight_decay), float(args.weight_decay_mode), float(args.max_norm)),
        "total_D": int(ref.total_D), "max_D": int(ref.max_D), "total_hash_size_bits": int(ref.total_hash_size_bits),
        "weights": ref.weights_host.detach().clone(),
        "momentum": ref.momentum1_host.detach().clone() if optimizer != "sgd" else torch.empty(0),
        "lr": ref.learning_rate_tensor.detach().clone().float(),
        "weights_offsets": ref.weights_offsets.clone(), "D_offsets": ref.D_offsets.clone(),
        "hash_size_cumsum": ref.hash_size_cumsum.clone(),
        "momentum_offsets": (ref.momentum1_offsets.clone() if optimizer != "sgd"
                             else torch.zeros(len(shapes), dtype=torch.int64)),
        # fbgemm's offsets are per feature; where each table starts, read from its own views
        "table_offsets": _starts(ref.weights_host, ref.split_embedding_weights()),
        "state_offsets": (_starts(ref.momentum1_host, [s[0] for s in ref.split_optimizer_states()])
                          if optimizer != "sgd" else []),
    }


def _starts(flat: torch.Tensor, views) -> list[int]:
    return [(v.data_ptr() - flat.data_ptr()) // flat.element_size() for v in views]
