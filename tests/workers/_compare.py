"""How every parity worker measures a difference: NaN and inf are failures, never dropped.

Python's ``max(0.0, nan)`` is 0.0, and ``max`` over a generator keeps a NaN only when it comes
first, so a worker that kept its worst error with ``max`` once passed a run whose losses and
parameters were all NaN. Every function here returns ``math.inf`` when a value it compares is not
finite, so ``err <= tol`` is False and ``err > tol`` is True for it, wherever the check is written.
"""

from __future__ import annotations

import math
from typing import Iterable, Mapping

import torch


def worst(errors: Iterable[float]) -> float:
    """The largest of ``errors`` (0.0 for none); ``inf`` if any is NaN or infinite."""
    out = 0.0
    for e in errors:
        e = float(e)
        if not math.isfinite(e):
            return math.inf
        out = max(out, e)
    return out


def scalar_err(a: float, b: float) -> float:
    """``|a - b|``; ``inf`` if either is not finite."""
    a, b = float(a), float(b)
    return abs(a - b) if math.isfinite(a) and math.isfinite(b) else math.inf


def seq_err(xs: Iterable[float], ys: Iterable[float]) -> float:
    """The worst ``scalar_err`` of two sequences of the same length (per-step losses, norms)."""
    xs, ys = list(xs), list(ys)
    if len(xs) != len(ys):
        raise ValueError(f"sequences of different lengths: {len(xs)} vs {len(ys)}")
    return worst(scalar_err(a, b) for a, b in zip(xs, ys))


def tensor_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """``max |a - b|`` over the elements (in float64; 0.0 for empty tensors); ``inf`` if either holds
    a non-finite value. The shapes must match (no broadcasting hides a missing dimension)."""
    if tuple(a.shape) != tuple(b.shape):
        raise ValueError(f"shapes differ: {tuple(a.shape)} vs {tuple(b.shape)}")
    a = a.detach().to("cpu", torch.float64)
    b = b.detach().to("cpu", torch.float64)
    if not (bool(torch.isfinite(a).all()) and bool(torch.isfinite(b).all())):
        return math.inf
    return float((a - b).abs().max()) if a.numel() else 0.0


def value_err(a, b) -> float:
    """``tensor_err`` for floating-point tensors; any other value (an integer tensor such as an
    optimizer's ``step``, a number, a string) is 0.0 when equal and ``inf`` otherwise."""
    if torch.is_tensor(a) and torch.is_tensor(b) and a.is_floating_point() and b.is_floating_point():
        return tensor_err(a, b)
    if torch.is_tensor(a) and torch.is_tensor(b):
        return 0.0 if tuple(a.shape) == tuple(b.shape) and torch.equal(a.cpu(), b.cpu()) else math.inf
    if torch.is_tensor(a) or torch.is_tensor(b):
        return math.inf
    if isinstance(a, float) or isinstance(b, float):
        return scalar_err(a, b)
    return 0.0 if a == b else math.inf


def dict_errs(got: Mapping[str, object], want: Mapping[str, object]) -> dict[str, float]:
    """``value_err`` per key of ``want``; a key ``got`` lacks is ``inf``."""
    return {k: value_err(got[k], v) if k in got else math.inf for k, v in want.items()}


def dict_err(got: Mapping[str, torch.Tensor], want: Mapping[str, torch.Tensor]) -> tuple[float, str | None]:
    """The worst of ``dict_errs`` and its key (None when nothing differs)."""
    errs = dict_errs(got, want)
    key = max(errs, key=lambda k: errs[k], default=None)
    return (errs[key] if key is not None else 0.0), (key if key is not None and errs[key] > 0 else None)
