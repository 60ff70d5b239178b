"""``graphshard::region``: a repeated block's call while the backend traces to ATen.

``aten_trace`` traces each distinct region body once; in the outer trace, each call of a body
is this op, and its copy of the body replaces it before anything else reads the graph. The op
gives what the ops after the call need to trace as they would after the body itself: outputs of
the body's shapes, strides, dtypes and devices (its fake kernel), and the body's
differentiability (its autograd kernel marks the outputs the body gives without gradient). The
outputs of the bodies traced so far are `region_outputs`' table, set for the duration of one
trace. It has no kernel and no derivative: it never runs.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Callable, Iterator

import torch

from graphshard.ops.dense import lib

lib.define("region(str body, Tensor[] operands) -> Tensor[]")

OutputSpec = tuple  # (shape, stride, dtype, device, requires_grad)

_outputs_of: contextvars.ContextVar[Callable[[str], list[OutputSpec]] | None] = contextvars.ContextVar(
    "graphshard_region_outputs", default=None)


@contextlib.contextmanager
def region_outputs(outputs_of: Callable[[str], list[OutputSpec]]) -> Iterator[None]:
    """Within it, ``graphshard::region(body, ...)`` gives outputs as ``outputs_of(body)`` describes."""
    token = _outputs_of.set(outputs_of)
    try:
        yield
    finally:
        _outputs_of.reset(token)


def _outputs(body: str) -> list[OutputSpec]:
    outputs_of = _outputs_of.get()
    if outputs_of is None:
        raise RuntimeError(f"graphshard::region({body!r}) outside graphshard's trace to ATen, where it stands for "
                           "a region body's call")
    return outputs_of(body)


@torch.library.register_fake("graphshard::region")
def _region_fake(body: str, operands: list[torch.Tensor]) -> list[torch.Tensor]:
    return [torch.empty_strided(shape, stride, dtype=dtype, device=device)
            for shape, stride, dtype, device, _ in _outputs(body)]


def _region_setup(ctx, inputs, output) -> None:
    fixed = [o for o, (*_, requires_grad) in zip(output, _outputs(inputs[0])) if not requires_grad]
    if fixed:
        ctx.mark_non_differentiable(*fixed)


def _region_backward(ctx, grads):
    raise RuntimeError("graphshard::region is a tracing placeholder, replaced by its body before anything "
                       "differentiates it")


torch.library.register_autograd("graphshard::region", _region_backward, setup_context=_region_setup)
