"""Plain-torch reference of graphshard's table-batched embedding (TBE), and the layout it shares
with the Triton kernels in ``kernels/triton_tbe.py``.

The layout (``TBELayout``) and the optimizer settings (``TBEOptimizer``) live here, not beside the
kernels, because this module needs only torch: the reference, the tests and the callers can build
a layout without Triton installed.

Layout (fbgemm's ``SplitTableBatchedEmbeddingBagsCodegen`` layout, one rank's tables):

* one flat ``weights`` buffer holds every table, row-major; table ``t`` starts at element
  ``weights_offsets[t]`` and has ``table_rows[t]`` rows of ``table_dims[t]`` columns;
* ``feature_table_map[f]`` is the table feature ``f`` looks up (several features may share one
  table); ``D_offsets[f]`` is where feature ``f``'s columns start in the pooled output, so
  ``D_offsets`` has one entry more than there are features and ``D_offsets[-1]`` is ``total_D``;
* ``indices`` are ids local to their table and ``offsets`` (length ``features * B + 1``) cut them
  into bags in KeyedJaggedTensor order: feature-major, then sample;
* ``row_offsets[t]`` numbers the rows of all tables globally (table ``t``'s rows are
  ``row_offsets[t] .. row_offsets[t] + table_rows[t] - 1``). ``row_offsets[t] + id`` is the key
  the fused backward sorts by, and the index of the row's state for row-wise Adagrad.

Optimizer state: SGD has none; Adagrad has one fp32 value per weight (same offsets as
``weights``); row-wise Adagrad one fp32 value per row, indexed by the global row.

The reference is written for reading, not speed: a loop over bags and ids.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

OPTIMIZERS = ("sgd", "adagrad", "rowwise_adagrad")
POOLINGS = ("sum", "mean")
LAYOUT = ("weights_offsets", "row_offsets", "table_rows", "D_offsets", "feature_table_map")
"""The ``TBELayout`` tensors graphshard::triton_tbe_lookup takes, in order."""
WEIGHT_DECAY_MODES = {0: "none", 1: "L2", 2: "decoupled"}
"""fbgemm's ``WeightDecayMode`` values graphshard supports (row-wise Adagrad only)."""


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


@dataclass(frozen=True, kw_only=True)
class TBEOptimizer:
    """The optimizer fused into the TBE backward, with fbgemm's EXACT_* semantics and defaults."""

    kind: str
    """``"sgd"`` (EXACT_SGD), ``"adagrad"`` (EXACT_ADAGRAD) or ``"rowwise_adagrad"`` (EXACT_ROWWISE_ADAGRAD)."""
    learning_rate: float = 0.01
    """fbgemm's default."""
    eps: float = 1.0e-8
    """Added to the square root of the state (Adagrad variants); fbgemm's default."""
    weight_decay: float = 0.0
    """Row-wise Adagrad only (fbgemm has no weight decay for EXACT_SGD / EXACT_ADAGRAD)."""
    weight_decay_mode: int = 0
    """fbgemm's ``WeightDecayMode`` value: 0 none, 1 L2 (added to the gradient), 2 decoupled."""

    def __post_init__(self):
        if self.kind not in OPTIMIZERS:
            raise ValueError(f"TBEOptimizer.kind must be one of {OPTIMIZERS}, got {self.kind!r}")
        if self.weight_decay_mode not in WEIGHT_DECAY_MODES:
            raise NotImplementedError(
                f"weight_decay_mode={self.weight_decay_mode} is not supported; use 0 (none), 1 (L2) or 2 (decoupled)"
            )
        if self.weight_decay != 0.0 and self.kind != "rowwise_adagrad":
            raise NotImplementedError(
                f"weight_decay is supported only for rowwise_adagrad (fbgemm's {self.kind} has none); "
                "set weight_decay=0.0"
            )
        if self.weight_decay != 0.0 and self.weight_decay_mode == 0:
            raise ValueError("weight_decay is set but weight_decay_mode is 0 (none); use 1 (L2) or 2 (decoupled)")


@dataclass(frozen=True)
class TBELayout:
    """Where each table and each feature lives (see the module docstring). Build it with ``create``.

    The tensors are what the kernels read, on the device of the weights; the tuples hold the same
    facts on the host so that a launch needs no device-to-host copy.
    """

    weights_offsets: torch.Tensor  # int64 [T]
    row_offsets: torch.Tensor  # int64 [T]
    table_rows: torch.Tensor  # int64 [T]
    D_offsets: torch.Tensor  # int32 [F + 1]
    feature_table_map: torch.Tensor  # int32 [F]
    table_shapes: tuple[tuple[int, int], ...]
    feature_tables: tuple[int, ...]
    weights_offsets_host: tuple[int, ...]

    @staticmethod
    def create(shapes: Sequence[tuple[int, int]], feature_table_map: Sequence[int],
               device: torch.device | str | None = None) -> "TBELayout":
        """Tables ``shapes`` (rows, dim) stored one after the other in table order; features in
        ``feature_table_map`` order, each feature's columns after the previous feature's."""
        shapes = tuple((int(r), int(d)) for r, d in shapes)
        tables = tuple(int(t) for t in feature_table_map)
        if not shapes:
            raise ValueError("a TBE needs at least one table")
        for t, (rows, dim) in enumerate(shapes):
            if rows <= 0 or dim <= 0:
                raise ValueError(f"table {t} has shape ({rows}, {dim}); rows and dim must be positive")
        if not tables:
            raise ValueError("a TBE needs at least one feature (feature_table_map is empty)")
        bad = [t for t in tables if not 0 <= t < len(shapes)]
        if bad:
            raise ValueError(f"feature_table_map names tables {bad} but there are {len(shapes)} tables")
        sizes = [r * d for r, d in shapes]
        woff = [sum(sizes[:t]) for t in range(len(shapes))]
        roff = [sum(r for r, _ in shapes[:t]) for t in range(len(shapes))]
        dims = [shapes[t][1] for t in tables]
        doff = [sum(dims[:f]) for f in range(len(dims) + 1)]
        return TBELayout(
            weights_offsets=torch.tensor(woff, dtype=torch.int64, device=device),
            row_offsets=torch.tensor(roff, dtype=torch.int64, device=device),
            table_rows=torch.tensor([r for r, _ in shapes], dtype=torch.int64, device=device),
            D_offsets=torch.tensor(doff, dtype=torch.int32, device=device),
            feature_table_map=torch.tensor(tables, dtype=torch.int32, device=device),
            table_shapes=shapes, feature_tables=tables, weights_offsets_host=tuple(woff),
        )

    def to(self, device: torch.device | str) -> "TBELayout":
        return TBELayout(self.weights_offsets.to(device), self.row_offsets.to(device), self.table_rows.to(device),
                         self.D_offsets.to(device), self.feature_table_map.to(device), self.table_shapes,
                         self.feature_tables, self.weights_offsets_host)

    @property
    def device(self) -> torch.device:
        return self.weights_offsets.device

    @property
    def num_features(self) -> int:
        return len(self.feature_tables)

    @property
    def feature_dims(self) -> tuple[int, ...]:
        return tuple(self.table_shapes[t][1] for t in self.feature_tables)

    @property
    def total_D(self) -> int:
        return sum(self.feature_dims)

    @property
    def max_D(self) -> int:
        return max(d for _, d in self.table_shapes)

    @property
    def num_weights(self) -> int:
        return sum(r * d for r, d in self.table_shapes)

    @property
    def total_rows(self) -> int:
        return sum(r for r, _ in self.table_shapes)

    def table(self, weights: torch.Tensor, t: int) -> torch.Tensor:
        """Table ``t`` as a ``[rows, dim]`` view of the flat ``weights`` (writes go through)."""
        rows, dim = self.table_shapes[t]
        start = self.weights_offsets_host[t]
        return weights[start : start + rows * dim].view(rows, dim)

    def new_state(self, optimizer: TBEOptimizer, device: torch.device | str | None = None) -> torch.Tensor:
        """A zero optimizer state for ``optimizer`` (fp32): empty, per weight, or per row."""
        size = {"sgd": 0, "adagrad": self.num_weights, "rowwise_adagrad": self.total_rows}[optimizer.kind]
        return torch.zeros(size, dtype=torch.float32, device=device if device is not None else self.device)

    def table_state(self, state: torch.Tensor, optimizer: TBEOptimizer, t: int) -> torch.Tensor | None:
        """Table ``t``'s state as a view: ``[rows, dim]`` (Adagrad), ``[rows]`` (row-wise), None (SGD)."""
        if optimizer.kind == "sgd":
            return None
        if optimizer.kind == "adagrad":
            return self.table(state, t)
        rows = self.table_shapes[t][0]
        start = sum(r for r, _ in self.table_shapes[:t])
        return state[start : start + rows]


def _bags(layout: TBELayout, offsets: torch.Tensor):
    """(feature, sample, first id, end id) of every bag, in KJT order."""
    features = layout.num_features
    batch = (offsets.numel() - 1) // features
    offs = offsets.tolist()
    for f in range(features):
        for b in range(batch):
            yield f, b, offs[f * batch + b], offs[f * batch + b + 1]


def reference_forward(weights: torch.Tensor, layout: TBELayout, indices: torch.Tensor, offsets: torch.Tensor,
                      per_sample_weights: torch.Tensor | None = None, pooling: str = "sum") -> torch.Tensor:
    """Pooled lookup ``[B, total_D]`` in fp32: per bag, the sum of its rows (times their per-sample
    weights); ``mean`` divides by the bag's length; an empty bag gives zeros."""
    batch = (offsets.numel() - 1) // layout.num_features
    out = torch.zeros(batch, layout.total_D, dtype=torch.float32, device=weights.device)
    d_offsets = layout.D_offsets.tolist()
    for f, b, lo, hi in _bags(layout, offsets):
        if hi == lo:
            continue
        table = layout.table(weights, layout.feature_tables[f]).float()
        rows = table[indices[lo:hi].long()]
        if per_sample_weights is not None:
            rows = rows * per_sample_weights[lo:hi].float()[:, None]
        pooled = rows.sum(0)
        if pooling == "mean":
            pooled = pooled * (1.0 / (hi - lo))
        out[b, d_offsets[f] : d_offsets[f + 1]] = pooled
    return out


def reference_row_gradients(grad_output: torch.Tensor, layout: TBELayout, indices: torch.Tensor,
                            offsets: torch.Tensor, per_sample_weights: torch.Tensor | None = None,
                            pooling: str = "sum") -> dict[tuple[int, int], torch.Tensor]:
    """The gradient of every (table, row) the batch touches, summed over all its occurrences
    (any bag, any feature of the table), in fp32."""
    grads: dict[tuple[int, int], torch.Tensor] = {}
    d_offsets = layout.D_offsets.tolist()
    for f, b, lo, hi in _bags(layout, offsets):
        t = layout.feature_tables[f]
        for i in range(lo, hi):
            coef = 1.0 if per_sample_weights is None else float(per_sample_weights[i])
            if pooling == "mean":
                coef *= 1.0 / (hi - lo)
            g = grad_output[b, d_offsets[f] : d_offsets[f + 1]].float() * coef
            key = (t, int(indices[i]))
            grads[key] = grads[key] + g if key in grads else g
    return grads


def reference_update_(grad_output: torch.Tensor, weights: torch.Tensor, state: torch.Tensor, layout: TBELayout,
                      indices: torch.Tensor, offsets: torch.Tensor, per_sample_weights: torch.Tensor | None = None,
                      pooling: str = "sum", *, optimizer: TBEOptimizer) -> None:
    """The backward with the optimizer fused in: every touched row is updated once, in fp32, with
    its summed gradient ``g`` (fbgemm's EXACT_* formulas):

    * SGD: ``w -= lr * g``
    * Adagrad (per element): ``m += g * g``; ``w -= lr * g / (sqrt(m) + eps)``
    * row-wise Adagrad (one ``m`` per row of dim ``D``): ``h = g + wd * w`` under L2 decay, else
      ``g``; ``m += sum(h * h) / D``; ``k = lr / (sqrt(m) + eps)``;
      ``w = c * w - k * g`` with ``c = 1 - k * wd`` (L2), ``1 - lr * wd`` (decoupled) or ``1``.
    """
    lr, eps, wd, mode = optimizer.learning_rate, optimizer.eps, optimizer.weight_decay, optimizer.weight_decay_mode
    for (t, row), g in sorted(reference_row_gradients(grad_output, layout, indices, offsets, per_sample_weights,
                                                      pooling).items()):
        table = layout.table(weights, t)
        w = table[row].float()
        if optimizer.kind == "sgd":
            new = w - lr * g
        elif optimizer.kind == "adagrad":
            m = layout.table_state(state, optimizer, t)
            m[row] += g * g
            new = w - lr * g / (m[row].sqrt() + eps)
        else:
            m = layout.table_state(state, optimizer, t)
            h = g + wd * w if mode == 1 else g
            m[row] += (h * h).sum() / g.numel()
            k = lr / (m[row].sqrt() + eps)
            c = 1.0 - k * wd if mode == 1 else (1.0 - lr * wd if mode == 2 else 1.0)
            new = c * w - k * g
        table[row] = new.to(weights.dtype)
