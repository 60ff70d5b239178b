"""Tensor and sequence parallelism with torch's documented API, compiled by graphshard.

``parallelize_module(module, device_mesh, parallelize_plan)`` takes the same
styles and plans as ``torch.distributed.tensor.parallel.parallelize_module``:
the module's parameters become DTensors (its FQNs unchanged) and its first call
compiles the whole forward and backward as one graph, with collectives chosen
by graphshard's placement propagation. The styles are also ``graphshard.Plan``
specs, so tensor parallelism on a ``"tp"`` mesh axis combines with
``FullyShard`` on a ``"dp"`` axis in one plan.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Mapping

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from graphshard import _compat, api
from graphshard.plan import Plan
from graphshard.styles import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
)


def parallelize_module(
    module: nn.Module,
    device_mesh: DeviceMesh | None = None,
    parallelize_plan: ParallelStyle | Mapping[str, ParallelStyle] | None = None,
) -> nn.Module:
    """Applies ``parallelize_plan`` (a style for ``module`` itself, or a dict from submodule
    FQN glob to style) over the 1-D ``device_mesh`` (default: the mesh of the enclosing
    ``with mesh:``) and compiles ``module`` with graphshard. Returns ``module``.

    A module object reachable under several FQNs is parallelized once. Calling it
    again for other submodules of an already parallelized model is fine; a
    parameter already parallelized is a ValueError.
    """
    if device_mesh is None:
        device_mesh = _compat.current_mesh()
    if not isinstance(device_mesh, DeviceMesh):
        raise ValueError(f"parallelize_module needs a DeviceMesh, got {type(device_mesh).__name__}")
    if device_mesh.ndim != 1:
        names = device_mesh.mesh_dim_names
        raise ValueError(
            f"parallelize_module takes a 1-D mesh, got a {device_mesh.ndim}-D mesh with axes {names}; slice the "
            f"tensor-parallel axis first (mesh['tp']), or use graphshard.Plan with FullyShard on the other axes"
        )
    if parallelize_plan is None:
        warnings.warn("parallelize_module: no parallelize_plan given, the module is returned unchanged", stacklevel=2)
        return module
    if isinstance(parallelize_plan, ParallelStyle):
        parallelize_plan = {"": parallelize_plan}
    elif not isinstance(parallelize_plan, Mapping):
        raise ValueError(
            f"parallelize_plan must be a ParallelStyle or a dict from module FQN to ParallelStyle, "
            f"got {type(parallelize_plan).__name__}"
        )
    for key, style in parallelize_plan.items():
        if not isinstance(style, ParallelStyle):
            raise ValueError(f"parallelize_plan[{key!r}] is {style!r}; expected a ParallelStyle such as ColwiseParallel()")
    return api.compile(module, Plan(device_mesh, dict(parallelize_plan)))


@contextlib.contextmanager
def loss_parallel():
    """Cross-entropy on logits sharded on the class dim without gathering them, forward and backward.

    Inside graphs graphshard compiles this always holds: class-sharded logits
    meet a sharded log-softmax and NLL loss (one all-reduce of a max and of a sum
    per row, one of the loss). For DTensor logits used outside a compiled graph (a
    model output with ``use_local_output=False``), this context is torch's
    ``loss_parallel``, which does the same on DTensors.
    """
    from torch.distributed.tensor.parallel import loss_parallel as _torch_loss_parallel

    with _torch_loss_parallel():
        yield


__all__ = [
    "parallelize_module",
    "loss_parallel",
    "ColwiseParallel",
    "RowwiseParallel",
    "SequenceParallel",
    "PrepareModuleInput",
    "PrepareModuleOutput",
    "ParallelStyle",
]
