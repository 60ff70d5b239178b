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
import math
import threading
import types
import weakref
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from graphshard import _compat
from graphshard.ops import local_chunk, ops
from graphshard.params import AxisGroup, ParamInfo, lookup, register
from graphshard.plan import FullyShard, Plan, StridedShard, resolve
from graphshard.styles import ModuleIO, layout_steps, placement_str

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
    preamble: list = field(default_factory=list)      # what explain prints first (objects with .format())
    flat: dict[str, "FlatUnit"] = field(default_factory=dict)  # unit FQN -> its flat parameter (flat_params)
    sync_gradients: bool = True                       # False inside graphshard.no_sync: backward skips dp reductions
    owners: dict[str, tuple[nn.Module, str]] = field(default_factory=dict)  # key -> (module holding it, attribute)

    def info_for_fqn(self, fqn: str) -> ParamInfo:
        for info in self.infos.values():
            if fqn in info.layout.fqns:
                return info
        raise KeyError(fqn)


@dataclass(frozen=True)
class FlatSlot:
    """Where one parameter's local shard lies in its unit's flat parameter."""

    key: str
    offset: int                   # first element in the flat parameter
    shape: tuple[int, ...]        # the local shard's shape
    numel: int                    # its elements
    padded: int                   # elements reserved: the shard padded to its chunk (what the gather packs)
    logical_shape: tuple[int, ...]


@dataclass
class FlatUnit:
    """A unit whose parameters live in one flat 1-D parameter ``module._flat_param``."""

    module: nn.Module
    slots: list[FlatSlot]

    @property
    def param(self) -> nn.Parameter:
        return self.module._parameters[FLAT_PARAM]

    def local(self, slot: FlatSlot) -> torch.Tensor:
        """The local shard of ``slot``'s parameter: a view of the flat parameter."""
        return self.module._flat_param.narrow(0, slot.offset, slot.numel).view(slot.shape)


FLAT_PARAM = "_flat_param"
"""The attribute name of a unit's flat parameter (FSDP1's)."""


def stored_local(model: nn.Module, info: ParamInfo) -> torch.Tensor:
    """The tensor that holds this rank's shard of ``info``'s parameter in ``model`` (the sharded
    root): the DTensor parameter's local tensor, or its view of the unit's flat parameter.
    Writing into it changes the model."""
    mod, name = owner_of(model, info)
    flat = mod.__dict__.get("_graphshard_flat", {})
    if name in flat:
        unit, slot = flat[name]
        return unit.local(slot)
    return mod._parameters[name]._local_tensor


def owner_of(model: nn.Module, info: ParamInfo) -> tuple[nn.Module, str]:
    """The module that holds ``info``'s parameter and the attribute name, as sharded (the
    module object itself, wherever a frontend has since moved it in the tree)."""
    return state_of(model).owners[info.key]


def state_of(model: nn.Module) -> ShardedState | None:
    return getattr(model, "_graphshard", None)


def state_for_key(key: str) -> ShardedState | None:
    """The state of the model a parameter key (``"m<id>/<fqn>"``) belongs to."""
    return _STATES.get(int(key.split("/", 1)[0][1:]))


def axis_group(plan: Plan, axis: str) -> AxisGroup:
    group = plan.group(axis)
    return AxisGroup(axis, group.group_name, dist.get_world_size(group), dist.get_rank(group),
                     backend_on(str(dist.get_backend(group)), plan.mesh.device_type), plan.collectives)


def backend_on(name: str, device_type: str) -> str:
    """``device_type``'s entry of a c10d backend string: ``"gloo"`` for ``"gloo"``, ``"nccl"``
    for ``"cpu:gloo,cuda:nccl"`` on ``"cuda"``."""
    for entry in name.split(","):
        dev, sep, backend = entry.partition(":")
        if not sep:
            return entry
        if dev == device_type:
            return backend
    return name


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
    from graphshard.sparse.modules import shard_plan_embeddings

    shard_plan_embeddings(model, plan)  # ShardEmbedding modules first: a fused table leaves the dense plan
    resolution = resolve(model, plan)
    layouts = resolution.layouts
    mesh = plan.mesh
    model_id = next(_model_ids)
    groups = {axis: axis_group(plan, axis) for axis in plan.axis_names}
    device = torch.device(mesh.device_type, torch.cuda.current_device()) if mesh.device_type == "cuda" else torch.device(mesh.device_type)

    replacements: dict[int, nn.Parameter] = {}
    infos: dict[str, ParamInfo] = {}
    units: dict[str, list[str]] = {}
    key_of: dict[int, str] = {}
    for fqn, p in model.named_parameters():  # deduplicated by identity, in registration order
        layout = layouts.get(id(p))
        if layout is None:
            continue  # a purely model-parallel plan leaves this parameter alone
        if isinstance(p, DTensor):
            raise ValueError(
                f"parameter {fqn!r} is already sharded (an earlier graphshard.shard or parallelize_module call "
                "covered it); each module is parallelized once: drop it from this plan"
            )
        if p.dim() == 0 and any(isinstance(pl, Shard) for pl in layout.placements):
            raise NotImplementedError(f"parameter {fqn!r} is a scalar and cannot be sharded; exclude it from sharding specs")
        mp = tuple((groups[a], pl) for a, pl in zip(plan.axis_names, layout.placements) if a in plan.model_parallel_axes)
        spec = layout.unit_spec
        shard_axis = plan.shard_axis(spec) if isinstance(spec, FullyShard) else None
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
            dt = _distribute(p.detach().to(device), info, plan)
        replacements[id(p)] = nn.Parameter(dt, requires_grad=p.requires_grad)

    modules = dict(model.named_modules())
    flat = {unit: _flatten(modules[unit], [infos[k] for k in keys], replacements, key_of)
            for unit, keys in units.items() if getattr(infos[keys[0]].layout.unit_spec, "flat_params", False)}
    slot_of = {slot.key: (fu, slot) for fu in flat.values() for slot in fu.slots}
    tp_axis = plan.tp_axis
    owners: dict[str, tuple[nn.Module, str]] = {}
    for mod in model.modules():  # modules() deduplicates shared modules
        names, flat_names = {}, {}
        for pname, p in list(mod._parameters.items()):
            if p is not None and id(p) in replacements:
                names[pname] = key_of[id(p)]
                owners.setdefault(names[pname], (mod, pname))
                if names[pname] in slot_of:
                    del mod._parameters[pname]
                    flat_names[pname] = slot_of[names[pname]]
                else:
                    mod._parameters[pname] = replacements[id(p)]
        if flat_names:
            mod._graphshard_flat = {**getattr(mod, "_graphshard_flat", {}), **flat_names}
        io = resolution.io.get(id(mod))
        bound = _BoundIO(f"m{model_id}/{io[0]}", tp_axis, io[1]) if io is not None else None
        if names or bound is not None or mod is model:
            _install(mod, keys=names, io=bound, root=mod is model)
    state = ShardedState(plan=plan, model_id=model_id, infos=infos, units=units, flat=flat, owners=owners)
    register(list(infos.values()), model)
    model._graphshard = state
    _STATES[model_id] = state
    return model


def _flatten(module: nn.Module, infos: list[ParamInfo], replacements: dict[int, nn.Parameter],
             key_of: dict[int, str]) -> FlatUnit:
    """One flat 1-D parameter holding this rank's shards of a unit's parameters, each padded to
    its chunk (the layout a unit's gather packs, so the shards go to the collective as they are)."""
    unit = infos[0].layout.unit
    by_key = {key_of[pid]: p for pid, p in replacements.items()}
    params = [by_key[info.key] for info in infos]
    for what, values in (("dtype", [p.dtype for p in params]), ("requires_grad", [p.requires_grad for p in params])):
        if len(set(values)) > 1:
            mixed = ", ".join(f"{info.fqn} ({v})" for info, v in zip(infos, values))
            raise ValueError(
                f"unit {unit or '<root>'!r} has parameters with different {what} ({mixed}); a flat parameter "
                f"needs one {what}: keep the original parameters (use_orig_params=True / flat_params=False) "
                "or put these parameters in separate units"
            )
    if FLAT_PARAM in module._parameters:
        raise ValueError(f"module {unit or '<root>'!r} already has a parameter named {FLAT_PARAM!r}")
    slots, offset = [], 0
    for info, p in zip(infos, params):
        local = p._local_tensor
        padded = info.chunk_rows * info.row_numel if info.shard is not None else local.numel()
        slots.append(FlatSlot(info.key, offset, tuple(local.shape), local.numel(), padded, info.logical_shape))
        offset += padded
    data = torch.zeros(offset, dtype=params[0].dtype, device=params[0]._local_tensor.device)
    for slot, p in zip(slots, params):
        data.narrow(0, slot.offset, p._local_tensor.numel()).copy_(p._local_tensor.reshape(-1))
    fu = FlatUnit(module, slots)
    module._parameters[FLAT_PARAM] = nn.Parameter(data, requires_grad=params[0].requires_grad)
    return fu


def _distribute(p: torch.Tensor, info: ParamInfo, plan: Plan) -> DTensor:
    """The DTensor holding ``p`` as ``info`` lays it out.

    When FullyShard and a model-parallel axis both shard dim 0 (FSDP over a
    column-parallel Linear), the data-parallel axis shards each model-parallel
    piece, as FSDP2 does over tensor parallelism: the data-parallel placement is a
    strided shard of dim 0.
    """
    placements = [_compat.strided_shard(pl.dim, pl.split_factor) if isinstance(pl, StridedShard) else pl
                  for pl in info.layout.placements]
    if info.shard is not None and any(isinstance(pl, StridedShard) and pl.dim == 0 for _, pl in info.model_parallel):
        raise NotImplementedError(
            f"parameter {info.fqn!r}: StridedShard on dim 0 together with FullyShard (which shards dim 0 too) is "
            "not supported; lay the fused dim out on another dim or leave the parameter out of FullyShard"
        )
    both_dim0 = info.shard is not None and any(pl == Shard(0) for _, pl in info.model_parallel)
    if not both_dim0:
        return distribute_tensor(p, plan.mesh, placements)
    local = p
    for axis, pl in info.model_parallel:
        if isinstance(pl, Shard):
            local = local_chunk(local, pl.dim, axis.world, axis.rank)
    local = local_chunk(local, 0, info.shard.world, info.shard.rank).contiguous()
    dp_index = plan.axis_names.index(info.shard.name)
    mp_world = math.prod(axis.world for axis, pl in info.model_parallel if pl == Shard(0))
    placements[dp_index] = _compat.strided_shard(0, mp_world)
    return DTensor.from_local(local, plan.mesh, placements, run_check=False, shape=p.shape, stride=p.stride())



class _BoundIO:
    """A module's declared activation layouts, applied as ``graphshard::layout`` nodes."""

    def __init__(self, fqn: str, axis: str, io: ModuleIO):
        self.fqn, self.axis, self.io = fqn, axis, io

    def _apply(self, x, steps, where: str):
        if not isinstance(x, torch.Tensor):
            return x
        for p in steps:
            x = ops.layout(x, where, self.axis, placement_str(p), self.io.use_local_output)
        return x

    def inputs(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        args = tuple(self._apply(a, layout_steps(self.io.inputs, i), f"{self.fqn}:in{i}") for i, a in enumerate(args))
        if self.io.kwarg_inputs:
            kwargs = dict(kwargs)
            for name, layout in self.io.kwarg_inputs:
                if name in kwargs:
                    kwargs[name] = self._apply(kwargs[name], layout.steps(), f"{self.fqn}:in[{name}]")
        return args, kwargs

    def outputs(self, out):
        outs = self.io.outputs
        if isinstance(out, torch.Tensor):
            return self._apply(out, layout_steps(outs, 0), f"{self.fqn}:out0")
        if isinstance(out, (tuple, list)) and outs:
            return type(out)(self._apply(o, layout_steps(outs, i), f"{self.fqn}:out{i}") for i, o in enumerate(out))
        return out


def _install(mod: nn.Module, *, keys: dict[str, str], io: _BoundIO | None, root: bool) -> None:
    """Swaps ``mod``'s class for a subclass whose parameter attributes go through the marker and
    whose forward applies the declared activation layouts (and, on the root, tracks forward depth)."""
    cls = type(mod)
    base = getattr(cls, "_graphshard_base", cls)
    keys = {**getattr(mod, "_graphshard_keys", {}), **keys}
    if io is not None:
        mod._graphshard_io = io
    if root:
        mod._graphshard_root = True
    wraps_forward = "_graphshard_io" in mod.__dict__ or "_graphshard_root" in mod.__dict__
    flat = frozenset(mod.__dict__.get("_graphshard_flat", ()))
    cache_key = (base, frozenset(keys), flat, wraps_forward)
    sub = None if root else _subclass_cache.get(cache_key)
    if sub is None:
        attrs = {name: property(_flat_getter(name) if name in flat else _marker_getter(name)) for name in keys}
        if wraps_forward:
            # a model's root gets a forward of its own code object: dynamo counts its recompile
            # limit per code object, so models sharing one forward would stop compiling after a few
            attrs["forward"] = _wrapped_forward(base, own_code=root)
        sub = type(base.__name__, (base,), {**attrs, "_graphshard_base": base, "__module__": base.__module__})
        if not root:
            _subclass_cache[cache_key] = sub
    mod.__class__ = sub
    if keys:
        mod._graphshard_keys = keys


def _wrapped_forward(base: type, own_code: bool = False):
    def forward(self, *args, **kwargs):
        io = self.__dict__.get("_graphshard_io")
        if io is not None:
            args, kwargs = io.inputs(args, kwargs)
        if self.__dict__.get("_graphshard_root") and not torch.compiler.is_compiling():
            _forward.depth += 1
            try:
                out = base.forward(self, *args, **kwargs)
            finally:
                _forward.depth -= 1
        else:
            out = base.forward(self, *args, **kwargs)
        return out if io is None else io.outputs(out)

    if not own_code:
        return forward
    code = forward.__code__.replace(co_name=f"forward_{next(_model_ids)}")  # the same code, a distinct object
    fn = types.FunctionType(code, forward.__globals__, code.co_name, forward.__defaults__, forward.__closure__)
    fn.__qualname__ = f"{base.__qualname__}.forward"
    return fn


def _marker_getter(name: str):
    def get(self):
        p = self._parameters[name]
        if isinstance(p, DTensor) and (torch.compiler.is_compiling() or _forward.depth > 0):
            return ops.param(p.to_local(), self._graphshard_keys[name], p.shape)
        return p  # outside forward: the sharded parameter itself, as FSDP2 shows it

    get.__name__ = name
    return get


def _flat_getter(name: str):
    def get(self):
        unit, slot = self._graphshard_flat[name]
        local = unit.local(slot)
        if torch.compiler.is_compiling() or _forward.depth > 0:
            return ops.param(local, slot.key, slot.logical_shape)
        return _flat_dtensor(local, slot)

    get.__name__ = name
    return get


def _flat_dtensor(local: torch.Tensor, slot: FlatSlot) -> DTensor:
    """Outside forward: this rank's shard of a flat unit's parameter as a DTensor (a view of the flat parameter)."""
    info = lookup(slot.key)
    return DTensor.from_local(local, info.mesh, _stored_placements(info), run_check=False,
                              shape=torch.Size(info.logical_shape),
                              stride=torch.empty(info.logical_shape, device="meta").stride())


def _stored_placements(info: ParamInfo) -> list:
    """The DTensor placements ``_distribute`` stores ``info``'s parameter with."""
    placements = [_compat.strided_shard(pl.dim, pl.split_factor) if isinstance(pl, StridedShard) else pl
                  for pl in info.layout.placements]
    if info.shard is not None and any(pl == Shard(0) for _, pl in info.model_parallel):
        mp_world = math.prod(axis.world for axis, pl in info.model_parallel if pl == Shard(0))
        placements[info.mesh.mesh_dim_names.index(info.shard.name)] = _compat.strided_shard(0, mp_world)
    return placements


def in_forward() -> bool:
    """Whether a sharded model's forward is running (eagerly) on this thread."""
    return _forward.depth > 0


def sharded_value(model: nn.Module, info: ParamInfo) -> DTensor:
    """This rank's shard of ``info``'s parameter as a DTensor over the plan's mesh (sharing storage)."""
    return DTensor.from_local(stored_local(model, info), info.mesh, _stored_placements(info), run_check=False,
                              shape=torch.Size(info.logical_shape),
                              stride=torch.empty(info.logical_shape, device="meta").stride())


def dtensor_of_local(local: torch.Tensor, info: ParamInfo) -> DTensor:
    """``local``, a tensor laid out as this rank's shard of ``info``'s parameter (its optimizer
    state, say), as a DTensor with the parameter's placements (sharing storage)."""
    return DTensor.from_local(local, info.mesh, _stored_placements(info), run_check=False,
                              shape=torch.Size(info.logical_shape),
                              stride=torch.empty(info.logical_shape, device="meta").stride())


def full_copy(local: torch.Tensor, info: ParamInfo) -> torch.Tensor:
    """The whole of ``info``'s parameter from ``local`` (its shard, or a tensor laid out like
    it), on every rank, in a tensor of its own. Over a world of one (or with no sharding) a
    DTensor's ``full_tensor`` is the local tensor itself; a state dict or optimizer state
    that aliased the live shard would change with the next step, so that case is copied."""
    local = local.detach()
    full = dtensor_of_local(local, info).full_tensor()
    if full.untyped_storage().data_ptr() == local.untyped_storage().data_ptr():
        full = full.clone()
    return full


class _ForwardDepth(threading.local):
    depth = 0


_forward = _ForwardDepth()
