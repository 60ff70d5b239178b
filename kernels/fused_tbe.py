"""One rank's embedding tables with a fused optimizer (``FusedTBE``), run by either TBE kernel.

``FusedTBE`` holds a rank's table shards in fbgemm's TBE layout (``TBELayout`` in
``kernels/tbe_reference.py``: the tables one after another in one flat weights buffer, the
optimizer state per row or per weight) and calls one of two kernels, each with the optimizer
fused into its backward (no dense gradient of a table is ever formed):

- ``"fbgemm"``: fbgemm's CPU kernels (``kernels/fbgemm_tbe.py``). The buffers are built by
  fbgemm's own module, so fbgemm's defaults and checks apply. Tables on the CPU only.
- ``"triton"``: graphshard's Triton TBE (``kernels/triton_tbe.py`` through the graph op of
  ``kernels/triton_tbe_op.py``), on a CUDA device, or on the CPU under Triton's interpreter.
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

from .tbe_reference import OPTIMIZERS, TBELayout, TBEOptimizer

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
            from .fbgemm_tbe import fbgemm_state

            st = fbgemm_state(self.shapes, self.slots, fused_params)
            self.max_D, self.total_hash_size_bits = st["max_D"], st["total_hash_size_bits"]
            for name in ("weights_offsets", "D_offsets", "hash_size_cumsum", "momentum_offsets"):
                self.register_buffer(name, st[name], persistent=False)
            self.register_buffer("rows", torch.tensor([shapes[s.table][0] for s in slots], dtype=torch.int64),
                                 persistent=False)
        else:
            st = _triton_state(self.shapes, self.slots, fused_params, device)
            from .triton_tbe_op import LAYOUT

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
            from .triton_tbe_op import LAYOUT

            return {f"triton_{name}": getattr(self, f"triton_{name}") for name in LAYOUT}
        return {name: getattr(self, name) for name in self.CONSTANTS}

    def lookup_with(self, token: torch.Tensor, weights: torch.Tensor, momentum: torch.Tensor, lr: torch.Tensor,
                    indices: torch.Tensor, offsets: torch.Tensor, per_sample_weights: torch.Tensor | None = None,
                    constants: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
        """``lookup`` with the state tensors (and, when tracing, the layout constants) given."""
        c = constants or self.constants()
        if self.kernel == "triton":
            from .triton_tbe_op import LAYOUT

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
