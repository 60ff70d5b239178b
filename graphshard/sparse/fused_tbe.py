"""One rank's embedding tables with a fused optimizer (``FusedTBE``), run by either TBE kernel.

``FusedTBE`` holds a rank's table shards in fbgemm's TBE layout (``TBELayout`` in
``kernels/tbe_reference.py``: the tables one after another in one flat weights buffer, the
optimizer state per row or per weight) and calls one of two kernels, each with the optimizer
fused into its backward (no dense gradient of a table is ever formed):

- ``"fbgemm"``: fbgemm's CPU kernels (``graphshard/ops/tbe_fbgemm.py``). The buffers are built by
  fbgemm's own module, so fbgemm's defaults and checks apply. Tables on the CPU only.
- ``"triton"``: graphshard's Triton TBE (``kernels/triton_tbe.py`` through the graph op of
  ``graphshard/ops/tbe_triton.py``), on a CUDA device, or on the CPU under Triton's interpreter.
  The buffers are built here, on the tables' device, from ``TBELayout`` and fbgemm's optimizer
  defaults (``TBEOptimizer``): this path never imports fbgemm.

The layout is the same either way, so the state dict, the optimizer state and TorchRec's
checkpoints read the same views (``table``, ``state``) whichever kernel runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn as nn

from graphshard.kernels.tbe_reference import LAYOUT, OPTIMIZERS, TBELayout, TBEOptimizer
from graphshard.ops import ops

KERNELS = ("fbgemm", "triton")

_EXACT = {"EXACT_SGD": "sgd", "EXACT_ADAGRAD": "adagrad", "EXACT_ROWWISE_ADAGRAD": "rowwise_adagrad"}


def optimizer_name(optim) -> str:
    """fbgemm's ``EmbOptimType`` (or its member's name, or graphshard's name) -> the name
    graphshard's kernels use; unsupported ones are refused. Needs no fbgemm."""
    name = getattr(optim, "name", optim)
    if isinstance(name, str) and name.lower() in OPTIMIZERS:
        return name.lower()
    if name in _EXACT:
        return _EXACT[name]
    raise NotImplementedError(
        f"fused optimizer {optim} is not supported by graphshard's TBE; use EXACT_SGD, EXACT_ADAGRAD "
        "or EXACT_ROWWISE_ADAGRAD (fused_params={'optimizer': ...})"
    )


def fbgemm_unavailable(device_type: str) -> str | None:
    """Why fbgemm's TBE cannot hold tables on ``device_type`` here (None: it can). graphshard calls
    fbgemm's CPU kernels; fbgemm's CUDA TBE is not wired as a graph op (neither environment this
    project is checked on has a CUDA build of fbgemm: its CPU build has no CUDA kernels, the GPU
    machine has no fbgemm)."""
    if device_type != "cpu":
        return f"fbgemm's TBE runs as graphshard's graph op on the CPU only, and the tables are on {device_type}"
    try:
        import fbgemm_gpu  # noqa: F401
    except ImportError as e:
        return f"fbgemm_gpu cannot be imported ({e})"
    return None


def choose_kernel(requested: str, device_type: str, where: str) -> tuple[str, str]:
    """The TBE kernel that runs a collection's tables and, when it is not the one asked for, why.

    ``requested``: ``"triton"``; ``"fbgemm"`` (``ShardEmbedding(kernel="fbgemm")``: refused where
    fbgemm's TBE cannot run); ``"fused"`` (TorchRec's compute kernel: a fused-optimizer TBE, fbgemm's
    where it can run, else graphshard's Triton TBE, with a note); ``"auto"`` (the same, no note)."""
    if requested == "triton":
        return "triton", ""
    if requested not in ("fbgemm", "fused", "auto"):
        raise ValueError(f"{where}: TBE kernel {requested!r}; expected 'auto', 'fbgemm' or 'triton'")
    why = fbgemm_unavailable(device_type)
    if why is None:
        return "fbgemm", ""
    if requested == "fbgemm":
        raise ValueError(f"{where}: kernel 'fbgemm' cannot run here: {why}; use kernel='triton' (graphshard's Triton "
                         "TBE) or 'auto'")
    return "triton", ("" if requested == "auto"
                      else f"{where}: compute kernel 'fused' runs graphshard's Triton TBE: {why}")


@dataclass(frozen=True)
class TBESlot:
    """One feature looked up by a ``FusedTBE``: its table's position and its name (for errors)."""

    table: int
    name: str


def fused_optimizer(fused_params: dict) -> tuple[TBEOptimizer, float]:
    """fbgemm's fused-params keywords (``optimizer``, ``learning_rate``, ``eps``, ``weight_decay``,
    ``weight_decay_mode``, ``max_norm``) -> graphshard's ``TBEOptimizer`` and the ``max_norm``,
    with fbgemm's defaults for the unset ones (EXACT_SGD, learning rate 0.01, eps 1e-8, no
    weight decay, no max norm)."""
    mode = fused_params.get("weight_decay_mode", 0)
    optimizer = TBEOptimizer(kind=optimizer_name(fused_params.get("optimizer", "sgd")),
                             learning_rate=float(fused_params.get("learning_rate", 0.01)),
                             eps=float(fused_params.get("eps", 1.0e-8)),
                             weight_decay=float(fused_params.get("weight_decay", 0.0)),
                             weight_decay_mode=int(getattr(mode, "value", mode)))
    return optimizer, float(fused_params.get("max_norm", 0.0))


def _triton_state(shapes: Sequence[tuple[int, int]], slots: Sequence[TBESlot], fused_params: dict,
                  device: torch.device) -> dict:
    """What ``FusedTBE`` keeps for the Triton kernel, built on ``device`` without fbgemm."""
    optimizer, max_norm = fused_optimizer(fused_params)
    if max_norm:
        raise NotImplementedError(f"max_norm={max_norm}: graphshard's Triton TBE has no max_norm; "
                                  "use compute_kernel='fused' (fbgemm's kernels, CPU)")
    layout = TBELayout.create(shapes, [s.table for s in slots], device)
    rows_before = [sum(r for r, _ in layout.table_shapes[:t]) for t in range(len(shapes))]
    return {
        "optimizer": optimizer.kind,
        "optim_args": (optimizer.eps, optimizer.weight_decay, float(optimizer.weight_decay_mode), max_norm),
        "total_D": layout.total_D, "layout": layout,
        "weights": torch.zeros(layout.num_weights, dtype=torch.float32, device=device),
        "momentum": layout.new_state(optimizer),
        "lr": torch.tensor(optimizer.learning_rate, dtype=torch.float32, device=device),
        "table_offsets": list(layout.weights_offsets_host),
        "state_offsets": {"sgd": [], "adagrad": list(layout.weights_offsets_host),
                          "rowwise_adagrad": rows_before}[optimizer.kind],
    }


def fbgemm_types():
    """fbgemm's TBE types (importing ``fbgemm_gpu`` registers ``torch.ops.fbgemm``); a clear
    ImportError where it is not installed."""
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


_FBGEMM_KWARGS = ("optimizer", "learning_rate", "eps", "weight_decay", "weight_decay_mode", "max_norm",
                  "stochastic_rounding")
"""The fused-params keys graphshard passes to fbgemm (the optimizer's); others (caching,
prefetch, output dtype) do not apply to the CPU kernels and are ignored by the caller with a
logged note."""


def _fbgemm_state(shapes: Sequence[tuple[int, int]], slots: Sequence[TBESlot], fused_params: dict) -> dict:
    """fbgemm's module for tables ``shapes`` looked up by ``slots``: its optimizer (name and
    ``(eps, weight_decay, weight_decay_mode, max_norm)``), the tensors its CPU kernels read (host
    memory), and where each table and table state starts in the flat buffers."""
    EmbOptimType, EmbeddingLocation, PoolingMode, ComputeDevice, TBE = fbgemm_types()
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


class FusedTBE(nn.Module):
    """One rank's table shards (``shapes``: rows, dim each) with a fused optimizer, in fbgemm's layout.

    ``slots`` are the features looked up, in the order of the lookup's KJT, each naming its table
    (several features may share one table). ``grad_scale`` multiplies the gradient the optimizer
    applies (a sharded table: one over the world size, the global batch's mean gradient).
    ``fused_params`` are fbgemm's constructor keywords (``optimizer``, ``learning_rate``, ``eps``,
    ``weight_decay``, ...); unset ones keep fbgemm's defaults. ``row_offsets`` says where each
    shard starts in its logical table (error messages). ``kernel``: ``"fbgemm"`` (CPU) or
    ``"triton"``; ``device``: where the tables live (the module's buffers).
    """

    CONSTANTS = ("weights_offsets", "D_offsets", "hash_size_cumsum", "momentum_offsets", "rows")
    """The layout tensors fbgemm's kernels read that never change (a traced program holds them as constants)."""

    def __init__(self, shapes: Sequence[tuple[int, int]], slots: Sequence[TBESlot], *,
                 fused_params: dict, row_offsets: Sequence[int], bounds_check: bool = True, grad_scale: float = 1.0,
                 kernel: str = "fbgemm", device: torch.device | str | None = None):
        super().__init__()
        if kernel not in KERNELS:
            raise ValueError(f"FusedTBE kernel={kernel!r}: use 'fbgemm' (compute_kernel='fused') or 'triton' "
                             "(compute_kernel='fused_triton')")
        device = torch.device(device if device is not None else "cpu")
        self.kernel = kernel
        self.shapes = [tuple(s) for s in shapes]
        self.slots = list(slots)
        if kernel == "fbgemm":
            if device.type != "cpu":
                raise ValueError(f"FusedTBE kernel='fbgemm' runs fbgemm's CPU kernels; tables on {device} take "
                                 "kernel='triton' (compute_kernel='fused_triton')")
            st = _fbgemm_state(self.shapes, self.slots, fused_params)
            self.max_D, self.total_hash_size_bits = st["max_D"], st["total_hash_size_bits"]
            for name in ("weights_offsets", "D_offsets", "hash_size_cumsum", "momentum_offsets"):
                self.register_buffer(name, st[name], persistent=False)
            self.register_buffer("rows", torch.tensor([shapes[s.table][0] for s in slots], dtype=torch.int64),
                                 persistent=False)
        else:
            import graphshard.ops.tbe_triton  # noqa: F401  (registers graphshard::triton_tbe_lookup)

            st = _triton_state(self.shapes, self.slots, fused_params, device)
            for name in LAYOUT:
                self.register_buffer(f"triton_{name}", getattr(st["layout"], name), persistent=False)
        self.optimizer, self.optim_args, self.total_D = st["optimizer"], st["optim_args"], st["total_D"]
        self.pooling = 0  # PoolingMode.SUM: mean pooling is the caller's division of the sum
        self.bounds_check = bounds_check
        self.grad_scale = float(grad_scale)
        self.names = [s.name for s in slots]
        self.slot_row_offsets = [int(row_offsets[s.table]) for s in slots]
        self._table_offsets, self._state_offsets = st["table_offsets"], st["state_offsets"]
        self.register_buffer("weights", st["weights"])
        self.register_buffer("momentum", st["momentum"])
        self.register_buffer("lr", st["lr"])
        self.register_buffer("token", torch.zeros(0, device=device, requires_grad=True), persistent=False)

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

    def constants(self) -> dict[str, torch.Tensor]:
        """The layout tensors the kernel reads that never change (a traced program holds them as constants)."""
        if self.kernel == "triton":
            return {f"triton_{name}": getattr(self, f"triton_{name}") for name in LAYOUT}
        return {name: getattr(self, name) for name in self.CONSTANTS}

    def lookup_with(self, token: torch.Tensor, weights: torch.Tensor, momentum: torch.Tensor, lr: torch.Tensor,
                    indices: torch.Tensor, offsets: torch.Tensor, per_sample_weights: torch.Tensor | None = None,
                    constants: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
        """``lookup`` with the state tensors (and, when tracing, the layout constants) given. Ids
        and offsets may be int32 (TorchRec's batches are, through the exchange); the kernels take
        int64, as fbgemm's own TBE module casts them."""
        c = constants or self.constants()
        indices, offsets = indices.long(), offsets.long()
        if self.kernel == "triton":
            return ops.triton_tbe_lookup(
                token, weights, momentum, lr, *(c[f"triton_{name}"] for name in LAYOUT), indices, offsets,
                per_sample_weights, [v for shape in self.shapes for v in shape], [s.table for s in self.slots],
                self.total_D, self.optimizer, list(self.optim_args), self.bounds_check, self.grad_scale,
            )
        return ops.tbe_lookup(
            token, weights, momentum, lr, c["weights_offsets"], c["D_offsets"], c["hash_size_cumsum"],
            c["momentum_offsets"], c["rows"], indices, offsets, per_sample_weights,
            self.total_D, self.max_D, self.total_hash_size_bits, self.pooling, self.optimizer,
            list(self.optim_args), "\n".join(self.names), self.slot_row_offsets, self.bounds_check, self.grad_scale,
        )


def reference_lookup(tables: Sequence[torch.Tensor], slots: Sequence[TBESlot], indices: torch.Tensor,
                     offsets: torch.Tensor, per_sample_weights: torch.Tensor | None, pooling: str) -> torch.Tensor:
    """The torch reference of a ``FusedTBE`` lookup: ``embedding_bag`` per feature, side by side."""
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
