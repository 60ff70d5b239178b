"""Sharded storage: parameters become DTensors; each use goes through the marker.

The model is changed in place, as torch's ``fully_shard`` does: each module that
holds a parameter gets a dynamic subclass whose property of that name returns
``graphshard::param(p.to_local(), key, logical_shape)``. ``named_parameters()``,
``state_dict()`` and optimizers read ``_parameters`` and so see the user's FQNs
holding sharded DTensors. A parameter reachable under several FQNs (shared
module, tied weights) is one object, sharded once, and every FQN points at it.
"""

from __future__ import annotations

import itertools
import threading
import weakref
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from graphshard.ops import ops
from graphshard.params import AxisGroup, ParamInfo, register
from graphshard.plan import FullyShard, Plan, resolve

_model_ids = itertools.count()
_STATES: "weakref.WeakValueDictionary[int, ShardedState]" = weakref.WeakValueDictionary()
_subclass_cache: dict[tuple[type, frozenset[str]], type] = {}


@dataclass
class ShardedState:
    """What graphshard knows about a sharded model; stored as ``model._graphshard``."""

    plan: Plan
    model_id: int
    infos: dict[str, ParamInfo]                       # by key
    units: dict[str, list[str]]                       # unit FQN -> parameter keys, in registration order
    explain: list = field(default_factory=list)       # one Explanation per compiled graph

    def info_for_fqn(self, fqn: str) -> ParamInfo:
        for info in self.infos.values():
            if fqn in info.layout.fqns:
                return info
        raise KeyError(fqn)


def state_of(model: nn.Module) -> ShardedState | None:
    return getattr(model, "_graphshard", None)


def state_for_key(key: str) -> ShardedState | None:
    """The state of the model a parameter key (``"m<id>/<fqn>"``) belongs to."""
    return _STATES.get(int(key.split("/", 1)[0][1:]))


def _axis_group(mesh, axis: str) -> AxisGroup:
    group = mesh.get_group(axis)
    return AxisGroup(axis, group.group_name, dist.get_world_size(group), dist.get_rank(group))


def _check_process_group(plan: Plan) -> None:
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError(
            "graphshard.shard needs a process group: call torch.distributed.init_process_group() "
            "(launch with torchrun) and build the DeviceMesh before sharding"
        )


def shard(model: nn.Module, plan: Plan) -> nn.Module:
    """Shards ``model``'s parameters in place according to ``plan`` and returns it.

    The result runs eagerly (each parameter gathered at use: a debugging path)
    and compiles with ``torch.compile(model, backend="graphshard")``.
    """
    _check_process_group(plan)
    if state_of(model) is not None:
        raise ValueError(f"{type(model).__name__} is already sharded by graphshard; shard the original model once")
    if not isinstance(model, nn.Module):
        raise ValueError(f"graphshard.shard takes an nn.Module, got {type(model).__name__}")
    layouts = resolve(model, plan)
    mesh = plan.mesh
    model_id = next(_model_ids)
    groups = {axis: _axis_group(mesh, axis) for axis in mesh.mesh_dim_names}
    device = torch.device(mesh.device_type, torch.cuda.current_device()) if mesh.device_type == "cuda" else torch.device(mesh.device_type)

    replacements: dict[int, nn.Parameter] = {}
    infos: dict[str, ParamInfo] = {}
    units: dict[str, list[str]] = {}
    key_of: dict[int, str] = {}
    for fqn, p in model.named_parameters():  # deduplicated by identity, in registration order
        layout = layouts[id(p)]
        if p.dim() == 0 and any(isinstance(pl, Shard) for pl in layout.placements):
            raise NotImplementedError(f"parameter {fqn!r} is a scalar and cannot be sharded; exclude it from sharding specs")
        mp = tuple((groups[a], pl) for a, pl in zip(mesh.mesh_dim_names, layout.placements) if a in plan.model_parallel_axes)
        spec = layout.unit_spec
        shard_axis = plan.shard_axis(spec) if isinstance(spec, FullyShard) else None
        if shard_axis is not None and any(pl == Shard(0) for _, pl in mp):
            raise NotImplementedError(
                f"parameter {fqn!r} is sharded on dim 0 by both FullyShard and a model-parallel spec; "
                "shard the model-parallel axis on another dim"
            )
        key = f"m{model_id}/{fqn}"
        info = ParamInfo(
            key=key,
            fqn=fqn,
            layout=layout,
            logical_shape=tuple(p.shape),
            dtype=p.dtype,
            mesh=mesh,
            shard=groups[shard_axis] if shard_axis else None,
            replicate=tuple(groups[a] for a in plan.data_parallel_axes if a != shard_axis),
            model_parallel=mp,
        )
        infos[key] = info
        key_of[id(p)] = key
        if layout.unit is not None:
            units.setdefault(layout.unit, []).append(key)
        with torch.no_grad():
            dt = distribute_tensor(p.detach().to(device), mesh, list(layout.placements))
        replacements[id(p)] = nn.Parameter(dt, requires_grad=p.requires_grad)

    seen: set[int] = set()
    for mod in model.modules():  # modules() deduplicates shared modules
        if id(mod) in seen:
            continue
        seen.add(id(mod))
        names = {}
        for pname, p in list(mod._parameters.items()):
            if p is not None and id(p) in replacements:
                mod._parameters[pname] = replacements[id(p)]
                names[pname] = key_of[id(p)]
        if names:
            _install_markers(mod, names)
    _install_root_forward(model)
    state = ShardedState(plan=plan, model_id=model_id, infos=infos, units=units)
    register(list(infos.values()), model)
    model._graphshard = state
    _STATES[model_id] = state
    return model


def _install_markers(mod: nn.Module, keys: dict[str, str]) -> None:
    """Swaps ``mod``'s class for a subclass whose parameter attributes go through the marker."""
    cls = type(mod)
    if getattr(cls, "_graphshard_base", None) is not None:
        cls = cls._graphshard_base
    cache_key = (cls, frozenset(keys))
    sub = _subclass_cache.get(cache_key)
    if sub is None:
        props = {name: property(_marker_getter(name)) for name in keys}
        sub = type(cls.__name__, (cls,), {**props, "_graphshard_base": cls, "__module__": cls.__module__})
        _subclass_cache[cache_key] = sub
    mod.__class__ = sub
    mod._graphshard_keys = dict(keys)


def _marker_getter(name: str):
    def get(self):
        p = self._parameters[name]
        if isinstance(p, DTensor) and (torch.compiler.is_compiling() or _forward.depth > 0):
            return ops.param(p.to_local(), self._graphshard_keys[name], p.shape)
        return p  # outside forward: the sharded parameter itself, as FSDP2 shows it

    get.__name__ = name
    return get


class _ForwardDepth(threading.local):
    depth = 0


_forward = _ForwardDepth()


def _install_root_forward(model: nn.Module) -> None:
    """Parameters read inside the sharded model's forward go through the marker (gathered);
    read anywhere else they are the sharded DTensors."""
    cls = type(model)
    base = getattr(cls, "_graphshard_base", cls)

    def forward(self, *args, **kwargs):
        if torch.compiler.is_compiling():
            return base.forward(self, *args, **kwargs)
        _forward.depth += 1
        try:
            return base.forward(self, *args, **kwargs)
        finally:
            _forward.depth -= 1

    model.__class__ = type(base.__name__, (cls,), {"forward": forward, "_graphshard_base": base,
                                                   "__module__": base.__module__})
