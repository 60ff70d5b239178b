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

``FusedTBE`` holds one rank's tables in fbgemm's layout: the module's buffers are built by
fbgemm's ``SplitTableBatchedEmbeddingBagsCodegen`` from the same arguments (so the optimizer's
defaults and settings are fbgemm's), and it keeps only the tensors the kernels read.

The kernel always pools by sum: fbgemm's CPU backward ignores mean pooling when it is given
per-sample weights (measured: an SGD step 0.06-0.2 away from the torch reference), and the
row-wise sharded lookup needs the sum anyway (a rank sums only its rows). Mean pooling is the
sum divided by the bag's length, done by the caller on the pooled output.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn as nn

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


def optimizer_name(optim) -> str:
    """fbgemm's ``EmbOptimType`` -> the name graphshard's kernels use; unsupported ones are refused."""
    EmbOptimType = _fbgemm()[0]
    names = {EmbOptimType.EXACT_SGD: "sgd", EmbOptimType.EXACT_ADAGRAD: "adagrad",
             EmbOptimType.EXACT_ROWWISE_ADAGRAD: "rowwise_adagrad"}
    if optim not in names:
        raise NotImplementedError(
            f"fused optimizer {optim} is not supported by graphshard's TBE; use EXACT_SGD, EXACT_ADAGRAD "
            "or EXACT_ROWWISE_ADAGRAD (fused_params={'optimizer': ...})"
        )
    return names[optim]


# --------------------------------------------------------------------------------------------
# The ops.
# --------------------------------------------------------------------------------------------
def first_out_of_range(ids: torch.Tensor, counts: torch.Tensor, limits: torch.Tensor) -> tuple[int, int] | None:
    """(position, row) of the first id outside ``[0, limit)`` of its row, or None. The ids are
    grouped by row, ``counts[r]`` of them in row ``r``; a negative limit checks only the sign."""
    if ids.numel() == 0:
        return None
    limit = torch.repeat_interleave(limits, counts, output_size=ids.numel())
    bad = (ids < 0) | ((ids >= limit) & (limit >= 0))
    if not bool(bad.any()):
        return None
    i = int(bad.nonzero()[0, 0])
    return i, int(torch.searchsorted(counts.cumsum(0), i, right=True))


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
# One rank's tables in fbgemm's layout.
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class TBESlot:
    """One feature looked up by a ``FusedTBE``: its table's position and its name (for errors)."""

    table: int
    name: str


class FusedTBE(nn.Module):
    """One rank's table shards (``shapes``: rows, dim each) with a fused optimizer, in fbgemm's layout.

    ``slots`` are the features looked up, in the order of the lookup's KJT, each naming its table
    (several features may share one table). ``grad_scale`` multiplies the gradient the optimizer
    applies (a sharded table: one over the world size, the global batch's mean gradient).
    ``fused_params`` are fbgemm's constructor keywords
    (``optimizer``, ``learning_rate``, ``eps``, ``weight_decay``, ...); unset ones keep fbgemm's
    defaults. ``row_offsets`` says where each shard starts in its logical table (error messages).
    """

    def __init__(self, shapes: Sequence[tuple[int, int]], slots: Sequence[TBESlot], *,
                 fused_params: dict, row_offsets: Sequence[int], bounds_check: bool = True, grad_scale: float = 1.0,
                 kernel: str = "fbgemm"):
        super().__init__()
        if kernel not in ("fbgemm", "triton"):
            raise ValueError(f"FusedTBE kernel={kernel!r}: use 'fbgemm' (compute_kernel='fused') or 'triton' "
                             "(compute_kernel='fused_triton')")
        self.kernel = kernel
        EmbOptimType, EmbeddingLocation, PoolingMode, ComputeDevice, TBE = _fbgemm()
        tables = [s.table for s in slots]
        if tables != sorted(tables):
            # fbgemm's weighted row-wise Adagrad on the CPU updates nothing when one table's features
            # are not next to each other ("num of rows processed by adagrad: 0")
            raise ValueError(f"FusedTBE slots must list each table's features together, in table order; got tables {tables}")
        params = {k: v for k, v in fused_params.items() if k in _FBGEMM_KWARGS}
        ref = TBE([(rows, dim, EmbeddingLocation.HOST, ComputeDevice.CPU) for rows, dim in shapes],
                  feature_table_map=[s.table for s in slots],
                  pooling_mode=PoolingMode.SUM, **params)
        self.optimizer = optimizer_name(ref.optimizer)
        args = ref.optimizer_args
        self.optim_args = (float(args.eps), float(args.weight_decay), float(args.weight_decay_mode),
                           float(args.max_norm))
        self.shapes = [tuple(s) for s in shapes]
        self.slots = list(slots)
        self.pooling = 0  # PoolingMode.SUM
        self.total_D = int(ref.total_D)
        self.max_D = int(ref.max_D)
        self.total_hash_size_bits = int(ref.total_hash_size_bits)
        self.bounds_check = bounds_check
        self.grad_scale = float(grad_scale)
        self.names = [s.name for s in slots]
        self.slot_row_offsets = [int(row_offsets[s.table]) for s in slots]
        self.register_buffer("weights", ref.weights_host.detach().clone())
        self.register_buffer("momentum", ref.momentum1_host.detach().clone() if self.optimizer != "sgd"
                             else torch.empty(0))
        self.register_buffer("lr", ref.learning_rate_tensor.detach().clone().float())
        self.register_buffer("token", torch.zeros(0, requires_grad=True), persistent=False)
        self.register_buffer("weights_offsets", ref.weights_offsets.clone(), persistent=False)
        self.register_buffer("D_offsets", ref.D_offsets.clone(), persistent=False)
        self.register_buffer("hash_size_cumsum", ref.hash_size_cumsum.clone(), persistent=False)
        self.register_buffer("momentum_offsets", ref.momentum1_offsets.clone() if self.optimizer != "sgd"
                             else torch.zeros(len(shapes), dtype=torch.int64), persistent=False)
        self.register_buffer("rows", torch.tensor([shapes[s.table][0] for s in slots], dtype=torch.int64),
                             persistent=False)
        # fbgemm's offsets are per feature; where each table starts, read from its own views
        self._table_offsets = _starts(ref.weights_host, ref.split_embedding_weights())
        self._state_offsets = (_starts(ref.momentum1_host, [s[0] for s in ref.split_optimizer_states()])
                               if self.optimizer != "sgd" else [])
        if kernel == "triton":
            self._triton_buffers(shapes, slots)

    def _triton_buffers(self, shapes, slots) -> None:
        """The Triton kernel's layout tensors. It reads and updates fbgemm's own buffers in place:
        tables one after another, the state per row (row-wise Adagrad) or per weight (Adagrad)."""
        from graphshard.kernels.triton_tbe_op import layout_buffers

        for name, t in layout_buffers(shapes, [s.table for s in slots]).items():
            self.register_buffer(f"triton_{name}", t, persistent=False)
        assert self._table_offsets == self.triton_weights_offsets.tolist(), (self._table_offsets, shapes)
        if self.optimizer == "rowwise_adagrad":
            assert self._state_offsets == self.triton_row_offsets.tolist(), self._state_offsets
        elif self.optimizer == "adagrad":
            assert self._state_offsets == self._table_offsets, self._state_offsets
        if self.optim_args[3]:
            raise NotImplementedError(f"max_norm={self.optim_args[3]}: the 'fused_triton' kernel has no max_norm; "
                                      "use compute_kernel='fused'")

    @property
    def learning_rate(self) -> float:
        return float(self.lr)

    def table(self, t: int) -> torch.Tensor:
        """Table shard ``t`` as a ``[rows, dim]`` view of the flat weights (reads and writes go through)."""
        rows, dim = self.shapes[t]
        start = self._table_offsets[t]
        return self.weights[start : start + rows * dim].view(rows, dim)

    def state(self, t: int) -> torch.Tensor | None:
        """Table shard ``t``'s optimizer state as a view: per row (row-wise Adagrad), per element
        (Adagrad), None (SGD)."""
        if self.optimizer == "sgd":
            return None
        rows, dim = self.shapes[t]
        start = self._state_offsets[t]
        if self.optimizer == "rowwise_adagrad":
            return self.momentum[start : start + rows]
        return self.momentum[start : start + rows * dim].view(rows, dim)

    def lookup(self, indices: torch.Tensor, offsets: torch.Tensor,
               per_sample_weights: torch.Tensor | None = None) -> torch.Tensor:
        return self.lookup_with(self.token, self.weights, self.momentum, self.lr, indices, offsets, per_sample_weights)

    CONSTANTS = ("weights_offsets", "D_offsets", "hash_size_cumsum", "momentum_offsets", "rows")
    """The layout tensors the kernels read that never change (a traced program holds them as constants)."""

    def constants(self) -> dict[str, torch.Tensor]:
        if self.kernel == "triton":
            from graphshard.kernels.triton_tbe_op import LAYOUT

            return {f"triton_{name}": getattr(self, f"triton_{name}") for name in LAYOUT}
        return {name: getattr(self, name) for name in self.CONSTANTS}

    def lookup_with(self, token: torch.Tensor, weights: torch.Tensor, momentum: torch.Tensor, lr: torch.Tensor,
                    indices: torch.Tensor, offsets: torch.Tensor, per_sample_weights: torch.Tensor | None = None,
                    constants: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
        """``lookup`` with the state tensors (and, when tracing, the layout constants) given."""
        c = constants or self.constants()
        if self.kernel == "triton":
            from graphshard.kernels.triton_tbe_op import LAYOUT

            return torch.ops.graphshard.triton_tbe_lookup(
                token, weights, momentum, lr, *(c[f"triton_{name}"] for name in LAYOUT), indices, offsets,
                per_sample_weights, [v for shape in self.shapes for v in shape], [s.table for s in self.slots],
                self.total_D, self.optimizer, list(self.optim_args), self.bounds_check, self.grad_scale,
            )
        return torch.ops.graphshard.tbe_lookup(
            token, weights, momentum, lr, c["weights_offsets"], c["D_offsets"], c["hash_size_cumsum"],
            c["momentum_offsets"], c["rows"], indices, offsets, per_sample_weights,
            self.total_D, self.max_D, self.total_hash_size_bits, self.pooling, self.optimizer,
            list(self.optim_args), "\n".join(self.names), self.slot_row_offsets, self.bounds_check, self.grad_scale,
        )


def _starts(flat: torch.Tensor, views) -> list[int]:
    return [(v.data_ptr() - flat.data_ptr()) // flat.element_size() for v in views]


_FBGEMM_KWARGS = ("optimizer", "learning_rate", "eps", "weight_decay", "weight_decay_mode", "max_norm",
                  "stochastic_rounding")
"""The fused-params keys graphshard passes to fbgemm (the optimizer's); others (caching,
prefetch, output dtype) do not apply to the CPU kernels and are ignored by the caller with a
logged note."""


def reference_lookup(tables: Sequence[torch.Tensor], slots: Sequence[TBESlot], indices: torch.Tensor,
                     offsets: torch.Tensor, per_sample_weights: torch.Tensor | None, pooling: str) -> torch.Tensor:
    """The torch reference of ``tbe_lookup``: ``embedding_bag`` per feature, side by side."""
    n = len(slots)
    bags = (offsets.numel() - 1) // n
    outs = []
    for f, slot in enumerate(slots):
        lo, hi = int(offsets[f * bags]), int(offsets[(f + 1) * bags])
        local = offsets[f * bags : (f + 1) * bags + 1] - lo
        psw = per_sample_weights[lo:hi] if per_sample_weights is not None else None
        outs.append(torch.nn.functional.embedding_bag(indices[lo:hi], tables[slot.table], local,
                                                      mode=pooling, per_sample_weights=psw,
                                                      include_last_offset=True))
    return torch.cat(outs, dim=1)
