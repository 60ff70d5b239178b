"""Sharded storage: parameters become DTensors; each use goes through the marker.

The model is changed in place, as torch's ``fully_shard`` does: each module that
holds a parameter gets a dynamic subclass whose property of that name returns
``graphshard::param(local, key, logical_shape)`` in a forward, where ``local`` is the local shard
(handed to dynamo as a plain tensor by `feeding_local_shards`). ``named_parameters()``,
``state_dict()`` and optimizers read ``_parameters`` and so see the user's FQNs
holding sharded DTensors. A parameter reachable under several FQNs (shared
module, tied weights) is one object, sharded once, and every FQN points at it.
"""

from __future__ import annotations

import functools
import itertools
import logging
import sys
import threading
import types
import weakref

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from graphshard import _compat, replaced, sharding
from graphshard.ops import ops
from graphshard.ops.dense import local_chunk
from graphshard.checkpointing import Checkpoint, run_checkpointed
from graphshard.params import AxisGroup
from graphshard.plan import FullyShard, Plan, StridedShard, fqn_match, resolve
from graphshard.sharding import FLAT_PARAM, FlatSlot, FlatUnit, ShardedModel, ShardedParam, ShardedUnit
from graphshard.styles import ModuleIO, layout_steps, placement_str

_model_ids = itertools.count()
_subclass_cache: dict[tuple, type] = {}

log = logging.getLogger("graphshard")


def state_of(model: nn.Module) -> ShardedModel | None:
    return getattr(model, "_graphshard", None)


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


def shard(model: nn.Module, plan: Plan, *, cast_forward_inputs: bool = True) -> nn.Module:
    """Shards ``model``'s parameters in place according to ``plan`` and returns it.

    The result runs eagerly (each parameter gathered at use: a debugging path)
    and compiles with ``torch.compile(model, backend="graphshard")``.
    ``cast_forward_inputs``: a unit whose spec has a ``param_dtype`` casts the floating-point tensors
    its forward is called with to it, as FSDP2's ``MixedPrecisionPolicy(cast_forward_inputs=True)``
    does (FSDP1's frontend casts by its own ``MixedPrecision`` flags and turns this off).
    """
    _check_process_group(plan)
    if state_of(model) is not None:
        raise ValueError(f"{type(model).__name__} is already sharded by graphshard; shard the original model once")
    if not isinstance(model, nn.Module):
        raise ValueError(f"graphshard.shard takes an nn.Module, got {type(model).__name__}")
    from graphshard.sparse.modules import shard_plan_embeddings

    collections = shard_plan_embeddings(model, plan)  # ShardEmbedding modules first: a fused table leaves the dense plan
    resolution = resolve(model, plan)
    layouts = resolution.layouts
    mesh = plan.mesh
    model_id = next(_model_ids)
    groups = {axis: axis_group(plan, axis) for axis in plan.axis_names}
    device = torch.device(mesh.device_type, torch.cuda.current_device()) if mesh.device_type == "cuda" else torch.device(mesh.device_type)

    replacements: dict[int, nn.Parameter] = {}
    records: dict[str, ShardedParam] = {}
    units: dict[str, ShardedUnit] = {}
    key_of: dict[int, str] = {}
    replaced_params: list[tuple[nn.Parameter, str]] = []
    for fqn, p in model.named_parameters():  # deduplicated by identity, in registration order
        layout = layouts.get(id(p))
        if layout is None:
            continue  # a purely model-parallel plan leaves this parameter alone
        if isinstance(p, DTensor):
            raise ValueError(
                f"parameter {fqn!r} is already sharded (an earlier graphshard.shard or parallelize_module call "
                "covered it); each module is parallelized once: drop it from this plan"
            )
        if not (p.is_floating_point() or p.is_complex()):
            owner, _, name = fqn.rpartition(".")
            raise ValueError(
                f"parameter {fqn!r} is an nn.Parameter of dtype {p.dtype}: graphshard gathers and reduces a unit's "
                "parameters as one buffer of a floating dtype, which would change an integer's values (as indices "
                "they fail to compile). Keep it out of the plan: register it as a buffer instead "
                f"({f'model.get_submodule({owner!r})' if owner else 'model'}.register_buffer({name!r}, tensor)), which stays "
                f"whole on "
                f"every rank, or name it in Plan(ignored_params=[{fqn!r}]) (FSDP: ignored_states)")
        if p.dim() == 0 and any(isinstance(pl, Shard) for pl in layout.placements):
            raise NotImplementedError(f"parameter {fqn!r} is a scalar and cannot be sharded; exclude it from sharding specs")
        mp = tuple((groups[a], pl) for a, pl in zip(plan.axis_names, layout.placements) if a in plan.model_parallel_axes)
        spec = layout.unit_spec
        shard_axis = plan.shard_axis(spec) if isinstance(spec, FullyShard) else None
        key = f"m{model_id}/{fqn}"
        record = ShardedParam(
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
        records[key] = record
        key_of[id(p)] = key
        if layout.unit is not None:
            if layout.unit not in units:
                units[layout.unit] = ShardedUnit(layout.unit, [], layout.unit_spec)
            record.unit = units[layout.unit]
            record.unit.keys.append(key)
        with torch.no_grad():
            dt = _distribute(p.detach() if p.is_meta else p.detach().to(device), record, plan)
        replacements[id(p)] = nn.Parameter(dt, requires_grad=p.requires_grad)
        replaced_params.append((p, fqn))

    modules = dict(model.named_modules())
    for unit in units.values():
        if getattr(unit.spec, "flat_params", False):
            unit.flat = _flatten(modules[unit.fqn], [records[k] for k in unit.keys], replacements, key_of)
    tp_axis = plan.tp_axis
    checkpoints = resolution.checkpoints
    casts = {}
    if cast_forward_inputs:
        for unit in units.values():
            if unit.param_dtype is not None:
                casts[id(modules[unit.fqn])] = unit.param_dtype
    for mod in model.modules():  # modules() deduplicates shared modules
        names = {}
        for pname, p in list(mod._parameters.items()):
            if p is not None and id(p) in replacements:
                record = records[key_of[id(p)]]
                names[pname] = record
                if record.owner is None:
                    record.owner = (mod, pname)
                if record.slot is not None:
                    del mod._parameters[pname]  # read through the flat parameter
                else:
                    mod._parameters[pname] = replacements[id(p)]
        io = resolution.io.get(id(mod))
        bound = _BoundIO(f"m{model_id}/{io[0]}", tp_axis, io[1], groups[tp_axis].world) if io is not None else None
        spec = checkpoints.get(id(mod))
        cast = casts.get(id(mod))
        if names or bound is not None or spec is not None or cast is not None or mod is model:
            _install(mod, params=names, io=bound, root=mod is model, checkpoint=spec, cast=cast)
    state = ShardedModel(plan=plan, model_id=model_id, params=records, units=units, axes=groups,
                         collections=list(collections), checkpointing=_checkpointing(model, resolution),
                         name=type(model).__name__)
    sharding.register(state)
    model._graphshard = state
    model._graphshard_sources = {key_of[id(p)]: weakref.ref(p) for p, _ in replaced_params}  # `unshard`'s ties
    for p, fqn in replaced_params:  # an optimizer built over the old parameters stops at its step (`replaced`)
        replaced.remember(p, fqn, type(model).__name__)
    return model


def loading_full_tensors(model: nn.Module) -> None:
    """Lets ``model.load_state_dict`` take a full (unsharded) state dict, as FSDP2's
    ``set_model_state_dict(..., StateDictOptions(full_state_dict=True))`` does: a load-state-dict pre-hook
    (torch's public per-module hook) replaces each plain tensor under a sharded parameter's key, of the
    parameter's logical shape, by its DTensor, split on each rank (every rank loads the same full state
    dict), where torch would fail with ``mixed torch.Tensor and DTensor``. A plain tensor of another shape
    is left to torch's own error, which names the key and both shapes."""
    state = state_of(model)

    def hook(module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
        for info in state.params.values():
            if info.slot is not None:  # a flat unit's shards load as its flat parameter
                continue
            for fqn in info.layout.fqns:
                key = prefix + fqn
                value = state_dict.get(key)
                if not isinstance(value, torch.Tensor) or isinstance(value, DTensor):
                    continue
                if tuple(value.shape) != tuple(info.logical_shape):
                    continue  # torch names the key and both shapes ("size mismatch for ...") and loads nothing
                local = info.local()
                with torch.no_grad():
                    state_dict[key] = _distribute(value.detach().to(device=local.device), info, state.plan,
                                                  split_here=True)

    model._graphshard_load_hook = model.register_load_state_dict_pre_hook(hook)


def unshard(model: nn.Module, within: nn.Module | None = None) -> None:
    """Gives a model sharded by a model-parallel plan alone (no data-parallel units, flat parameters
    or embedding collections) its plain self back: each sharded parameter becomes a new
    ``nn.Parameter`` holding the whole tensor (gathered, so every rank calls this together), every
    module its own class, the root its uncompiled call. Tensor parallelism's frontend uses it to
    apply several ``parallelize_module`` calls on one model as one plan (each call gathers what the
    last one sharded and shards the merged plan). ``within``: a module holding ``model`` whose other
    modules may hold the same parameters (a tied weight); they get the whole parameter too."""
    state = state_of(model)
    assert state is not None and not state.units and not state.collections, state
    for mod in getattr(state.dynamo_regions, "marked", ()):  # repeated blocks' region classes first
        mod.__class__ = type(mod).__bases__[0]
    whole: dict[int, nn.Parameter] = {}
    held = {id(q) for m in (within or model).modules() for q in m._parameters.values() if q is not None}
    sources = model.__dict__.get("_graphshard_sources", {})
    for info in state.params.values():
        mod, name = info.owner
        p = mod._parameters[name]
        source = sources[info.key]() if info.key in sources else None
        with torch.no_grad():
            if source is not None and id(source) in held:  # tied to a module outside ``model``: tied again
                source.copy_(info.full())
                whole[id(p)] = source
            else:
                whole[id(p)] = nn.Parameter(info.full(), requires_grad=p.requires_grad)
    for mod in (within or model).modules():
        for name, p in list(mod._parameters.items()):
            if p is not None and id(p) in whole:
                mod._parameters[name] = whole[id(p)]
    for mod in model.modules():
        base = getattr(type(mod), "_graphshard_base", None)
        if base is not None:
            mod.__class__ = base
        hook = mod.__dict__.get("_graphshard_load_hook")
        if hook is not None:
            hook.remove()
        for key in [k for k in mod.__dict__ if k.startswith("_graphshard")]:
            del mod.__dict__[key]
    _compat.drop_compiled_call(model)


def read_local_outputs(model: nn.Module) -> None:
    """From the next trace on, ``model``'s sharded module outputs declared ``use_local_output=True`` are
    handed on as each rank's piece (``graphshard::to_local``), as torch hands them on, and a later
    declared input layout reads the value computed from them as the logical value again
    (`ShardedModel.local_outputs`; tensor parallelism's frontend turns it on when the whole reading
    fails on a shape)."""
    state_of(model).local_outputs = True
    for mod in model.modules():
        io = mod.__dict__.get("_graphshard_io")
        if io is not None:
            io.local_outputs = True


def _checkpointing(model: nn.Module, resolution) -> list[str]:
    """What ``explain`` lists of the plan's activation checkpointing: each checkpointed module
    with its mode, then the notes on those that are not a unit (also logged: a choice the plan made)."""
    lines = [f"{fqn or '<root>'}: {resolution.checkpoints[id(m)].describe()}"
             for fqn, m in model.named_modules() if id(m) in resolution.checkpoints]
    for note in resolution.checkpoint_notes:
        log.info("graphshard: %s", note)
    return lines + [f"note: {n}" for n in resolution.checkpoint_notes]


def _flatten(module: nn.Module, records: list[ShardedParam], replacements: dict[int, nn.Parameter],
             key_of: dict[int, str]) -> FlatUnit:
    """One flat 1-D parameter holding this rank's shards of a unit's parameters, each padded to
    its chunk (the layout a unit's gather packs, so the shards go to the collective as they are)."""
    unit = records[0].layout.unit
    by_key = {key_of[pid]: p for pid, p in replacements.items()}
    tensors = [by_key[r.key] for r in records]
    for what, values in (("dtype", [p.dtype for p in tensors]), ("requires_grad", [p.requires_grad for p in tensors])):
        if len(set(values)) > 1:
            mixed = ", ".join(f"{r.fqn} ({v})" for r, v in zip(records, values))
            raise ValueError(
                f"unit {unit or '<root>'!r} has parameters with different {what} ({mixed}); a flat parameter "
                f"needs one {what}: keep the original parameters (use_orig_params=True / flat_params=False) "
                "or put these parameters in separate units"
            )
    if FLAT_PARAM in module._parameters:
        raise ValueError(f"module {unit or '<root>'!r} already has a parameter named {FLAT_PARAM!r}")
    slots, offset = [], 0
    for r, p in zip(records, tensors):
        local = p._local_tensor
        padded = r.chunk_rows * r.row_numel if r.shard is not None else local.numel()
        slots.append(FlatSlot(r.key, offset, tuple(local.shape), local.numel(), padded, r.logical_shape))
        offset += padded
    data = torch.zeros(offset, dtype=tensors[0].dtype, device=tensors[0]._local_tensor.device)
    for slot, p in zip(slots, tensors):
        data.narrow(0, slot.offset, p._local_tensor.numel()).copy_(p._local_tensor.reshape(-1))
    fu = FlatUnit(module, slots)
    module._parameters[FLAT_PARAM] = nn.Parameter(data, requires_grad=tensors[0].requires_grad)
    for r, slot in zip(records, slots):
        r.slot = slot
    return fu


def _distribute(p: torch.Tensor, info: ShardedParam, plan: Plan, split_here: bool = False) -> DTensor:
    """The DTensor holding ``p`` as ``info`` lays it out.

    When FullyShard and a model-parallel axis both shard dim 0 (FSDP over a
    column-parallel Linear), the data-parallel axis shards each model-parallel
    piece, as FSDP2 does over tensor parallelism: the data-parallel placement is a
    strided shard of dim 0 (`ShardedParam.placements`).
    """
    if info.shard is not None and any(isinstance(pl, StridedShard) and pl.dim == 0 for _, pl in info.model_parallel):
        raise NotImplementedError(
            f"parameter {info.fqn!r}: StridedShard on dim 0 together with FullyShard (which shards dim 0 too) is "
            "not supported; lay the fused dim out on another dim or leave the parameter out of FullyShard"
        )
    both_dim0 = info.shard is not None and any(pl == Shard(0) for _, pl in info.model_parallel)
    if not both_dim0:
        # a meta-device parameter (FSDP2's flow: shard on meta, then model.to_empty() and initialize) is
        # split where it is, with nothing sent: there are no values to agree on
        # (``split_here``: every rank holds the same full tensor, a loaded full state dict)
        here = p.is_meta or split_here
        return distribute_tensor(p, plan.mesh, info.placements, **({"src_data_rank": None} if here else {}))
    local = p
    for axis, pl in info.model_parallel:
        if isinstance(pl, Shard):
            local = local_chunk(local, pl.dim, axis.world, axis.rank)
    local = local_chunk(local, 0, info.shard.world, info.shard.rank).contiguous()
    return DTensor.from_local(local, plan.mesh, info.placements, run_check=False, shape=p.shape, stride=p.stride())


class _BoundIO:
    """A module's declared activation layouts, applied as ``graphshard::layout`` nodes.

    Traced, a node names its place without the module (``m<id>/?:in0``, `sharding.traced_key`), as
    the parameter markers do: every repeated block reads the same values here, so dynamo reuses
    one block's trace for all of them. The trace to ATen names the module again from the node's
    module stack (`aten_trace._name_layouts`)."""

    def __init__(self, fqn: str, axis: str, io: ModuleIO, world: int = 1):
        self.fqn, self.axis, self.io, self.world = fqn, axis, io, world
        self.traced = sharding.traced_key(fqn)
        self.local_outputs = False  # a sharded use_local_output=True output handed on as each rank's piece

    def _apply(self, x, steps, place: str):
        if not isinstance(x, torch.Tensor):
            return x
        where = f"{self.traced if torch.compiler.is_compiling() else self.fqn}:{place}"
        for p in steps:
            x = ops.layout(x, where, self.axis, placement_str(p), self.io.local(place))
        if (self.local_outputs and steps and place.startswith("out") and self.io.local(place)
                and placement_str(steps[-1]) != "R" and torch.compiler.is_compiling()):
            x = ops.to_local(x, where, self.axis, placement_str(steps[-1]), self.world)  # torch's plain local tensor
        return x

    def inputs(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        args = tuple(self._apply(a, layout_steps(self.io.inputs, i), f"in{i}") for i, a in enumerate(args))
        if self.io.kwarg_inputs:
            kwargs = dict(kwargs)
            for name, layout in self.io.kwarg_inputs:
                if name in kwargs:
                    kwargs[name] = self._apply(kwargs[name], layout.steps(), f"in[{name}]")
        return args, kwargs

    def outputs(self, out):
        outs = self.io.outputs
        if isinstance(out, torch.Tensor):
            return self._apply(out, layout_steps(outs, 0), "out0")
        if isinstance(out, (tuple, list)) and outs:
            return type(out)(self._apply(o, layout_steps(outs, i), f"out{i}") for i, o in enumerate(out))
        return out


def _install(mod: nn.Module, *, params: dict[str, ShardedParam], io: _BoundIO | None, root: bool,
             checkpoint: Checkpoint | None = None, cast: torch.dtype | None = None) -> None:
    """Swaps ``mod``'s class for a subclass whose parameter attributes go through the marker and
    whose forward casts its floating inputs to its unit's ``param_dtype`` (``cast``), applies the
    declared activation layouts, runs under activation checkpointing (a plan's `Checkpoint`) and,
    on the root, tracks forward depth.
    The module keeps, per attribute, what its getter needs: the marker's key and dtype (plain
    values, cheap for dynamo to guard on), or the parameter's record when it lives in a flat unit."""
    cls = type(mod)
    base = getattr(cls, "_graphshard_base", cls)
    markers = {**mod.__dict__.get("_graphshard_markers", {}),
               **{name: (r.key, r.param_dtype) for name, r in params.items() if r.slot is None}}
    flat = {**mod.__dict__.get("_graphshard_flat", {}), **{name: r for name, r in params.items() if r.slot is not None}}
    if io is not None:
        mod._graphshard_io = io
    if root:
        mod._graphshard_root = True
    if checkpoint is not None:
        mod._graphshard_checkpoint = checkpoint
    if cast is not None:
        mod._graphshard_cast = cast
    wraps_forward = any(k in mod.__dict__ for k in ("_graphshard_io", "_graphshard_root", "_graphshard_checkpoint",
                                                    "_graphshard_cast"))
    cache_key = (base, frozenset(markers), frozenset(flat), wraps_forward)
    sub = None if root else _subclass_cache.get(cache_key)
    if sub is None:
        attrs = {**{name: property(_marker_getter(name)) for name in markers},
                 **{name: property(_flat_getter(name)) for name in flat}}
        if wraps_forward:
            # a model's root gets a forward of its own code object: dynamo counts its recompile
            # limit per code object, so models sharing one forward would stop compiling after a few
            attrs["forward"] = _wrapped_forward(base, own_code=root)
        sub = type(base.__name__, (base,), {**attrs, "_graphshard_base": base, "__module__": base.__module__})
        if not root:
            _subclass_cache[cache_key] = sub
    mod.__class__ = sub
    if markers:
        mod._graphshard_markers = markers
        mod._graphshard_traced = {**mod.__dict__.get("_graphshard_traced", {}),
                                  **{name: (sharding.traced_key(r.key), r.param_dtype, tuple(r.logical_shape))
                                     for name, r in params.items() if r.slot is None}}
        mod.__dict__.setdefault("_graphshard_locals", {})  # filled for each compiled call (`feeding_local_shards`)
    if flat:
        mod._graphshard_flat = flat


def _wrapped_forward(base: type, own_code: bool = False):
    def forward(self, *args, **kwargs):
        cast = self.__dict__.get("_graphshard_cast")
        if cast is not None:  # the unit's param_dtype: FSDP2's cast_forward_inputs
            args, kwargs = _cast_floating(args, cast), _cast_floating(kwargs, cast)
        io = self.__dict__.get("_graphshard_io")
        if io is not None:
            args, kwargs = io.inputs(args, kwargs)
        spec = self.__dict__.get("_graphshard_checkpoint")
        if spec is not None:  # eagerly, the recomputation runs in the backward, outside the root's forward
            out = run_checkpointed(spec, _counted_forward(base), self, *args, **kwargs)
        elif self.__dict__.get("_graphshard_root"):
            out = _counted_forward(base)(self, *args, **kwargs)
        else:
            out = base.forward(self, *args, **kwargs)
        return out if io is None else io.outputs(out)

    return _own_code(forward, base) if own_code else forward


def _cast_floating(tree, dtype: torch.dtype):
    """``tree`` (a forward's args or kwargs: tensors in tuples, lists and dicts) with its floating-point
    tensors cast to ``dtype``; integer tensors and other values as they are (FSDP2's ``_cast_fp_tensor``)."""
    if isinstance(tree, torch.Tensor):
        return tree.to(dtype) if torch.is_floating_point(tree) and tree.dtype != dtype else tree
    if isinstance(tree, (tuple, list)) and not hasattr(tree, "_fields"):
        return type(tree)(_cast_floating(t, dtype) for t in tree)
    if isinstance(tree, dict):
        return {k: _cast_floating(v, dtype) for k, v in tree.items()}
    return tree


def _own_code(fn: types.FunctionType, owner: type) -> types.FunctionType:
    """``fn`` with a code object of its own (the same code): dynamo keeps its compiled entries and
    counts its recompile limit per code object, so the compiled forward of every model gets its own."""
    code = fn.__code__.replace(co_name=f"{fn.__name__}_{next(_model_ids)}")  # the same code, a distinct object
    copy = types.FunctionType(code, fn.__globals__, code.co_name, fn.__defaults__, fn.__closure__)
    copy.__kwdefaults__ = fn.__kwdefaults__
    copy.__qualname__ = f"{owner.__qualname__}.{fn.__name__}"
    return copy


def own_forward(module: nn.Module) -> None:
    """Gives ``module`` (a frontend's wrapper compiled around a sharded root: FSDP1's root instance) a
    ``forward`` of its own code object, as `shard` gives every root (`_wrapped_forward`): wrappers of one
    class share ``forward``, and after dynamo's recompile limit (8) on it every further model would run
    eagerly. The class becomes a subclass of the same name, as `shard` does for the modules it changes."""
    cls = type(module)
    if module.__dict__.get("_graphshard_own_forward"):
        return
    base = getattr(cls, "_graphshard_base", cls)
    forward = _own_code(cls.forward, base)
    module.__class__ = type(cls.__name__, (cls,), {"forward": forward, "_graphshard_base": base,
                                                   "__module__": cls.__module__, "__qualname__": cls.__qualname__})
    module._graphshard_own_forward = True


def _counted_forward(base: type):
    """``base.forward`` that, run eagerly, counts as a sharded model's forward (`in_forward`):
    parameters read in it are gathered through the marker."""
    def forward(self, *args, **kwargs):
        if torch.compiler.is_compiling():
            return base.forward(self, *args, **kwargs)
        _forward.depth += 1
        try:
            return base.forward(self, *args, **kwargs)
        finally:
            _forward.depth -= 1

    return forward


def _marker_getter(name: str):
    def get(self):
        if torch.compiler.is_compiling():
            # traced, the marker carries its model and not its FQN (the backend reads the key from the
            # tensor it wraps): every repeated block reads the same values here, so dynamo reuses one
            # block's trace for all of them (`compiler.regions`)
            fed = self._graphshard_locals
            if name in fed:  # the call's local shard, a plain tensor: dynamo never sees the DTensor
                key, dtype, shape = self._graphshard_traced[name]
                return ops.param(fed[name], key, shape, dtype)
        p = self._parameters[name]
        if isinstance(p, DTensor):
            if torch.compiler.is_compiling():  # compiled by name, without graphshard's call wrapper
                key, dtype, _ = self._graphshard_traced[name]
                return ops.param(p.to_local(), key, p.shape, dtype)
            key, dtype = self._graphshard_markers[name]
            if _gathered_read(key):
                return ops.param(p.to_local(), key, p.shape, dtype)
        return p  # outside forward: the sharded parameter itself, as FSDP2 shows it

    get.__name__ = name
    return get


def _flat_getter(name: str):
    def get(self):
        record = self._graphshard_flat[name]
        local = record.flat.local(record.slot)
        if torch.compiler.is_compiling() or _gathered_read(record.key):
            return ops.param(local, record.key, record.logical_shape, record.param_dtype)
        return record.dtensor_of(local)  # outside forward: the shard as a DTensor (a view of the flat parameter)

    get.__name__ = name
    return get


def _gathered_read(key: str) -> bool:
    """Whether a parameter read now, outside dynamo's tracing (where every read is a forward's; the
    getters test that first, so dynamo never traces this), is a forward's, which gets the parameter
    through the marker (gathered), rather than the sharded parameter itself:

    - in an uncompiled sharded forward (`in_forward`);
    - in a frame run eagerly inside a compiled sharded model's call: one dynamo did not compile
      (a graph break in a loop skips the whole frame), or code it must not trace
      (``torch.utils.checkpoint`` runs its function eagerly there). Recorded as an eager region;
    - in the backward with grad mode on: a checkpoint recomputing an eagerly run forward (the
      engine runs backward functions and hooks with grad mode off, unless ``create_graph``)."""
    if _forward.depth > 0:
        return True
    if _forward.compiled > 0:
        model = sharding.model_for_key(key)
        if model is not None and key not in model.eager_reads:  # each parameter's first eager read only
            _record_eager_read(model, key, sys._getframe(2))  # here <- the getter <- the reader
        return True
    return _compat.in_autograd_backward() and torch.is_grad_enabled()


def _record_eager_read(model: ShardedModel, key: str, reader: types.FrameType) -> None:
    info = model.params[key]
    code = reader.f_code
    where = f"{getattr(code, 'co_qualname', code.co_name)} ({code.co_filename}:{reader.f_lineno})"
    model.eager_reads[key] = where
    unit = info.layout.unit
    if unit is None or all(k == key or k not in model.eager_reads for k in model.units[unit].keys):
        log.warning("graphshard: %s of %s runs eagerly inside the compiled model: %s reads %s outside any compiled "
                    "graph (dynamo skipped the frame or was told not to trace it; TORCH_LOGS=graph_breaks says "
                    "why). Its parameters are gathered whole at each read and their gradients reduced eagerly; "
                    "explain lists every such region", f"unit {unit!r}" if unit is not None else repr(info.fqn),
                    f"{model.name or 'the model'} (model m{model.model_id})", where, info.fqn)


def in_forward() -> bool:
    """Whether a sharded model's forward is running on this thread: uncompiled, or compiled and
    running a frame eagerly."""
    return _forward.depth > 0 or _forward.compiled > 0


def counting_compiled_calls(call):
    """``call`` (a sharded model's compiled call) counted while it runs, so that the frames it runs
    eagerly read parameters as a forward does (`_gathered_read`)."""
    @functools.wraps(call)
    def compiled_call(*args, **kwargs):
        _forward.compiled += 1
        try:
            return call(*args, **kwargs)
        finally:
            _forward.compiled -= 1

    return compiled_call


def checking_new_parameters(root: nn.Module, model: ShardedModel):
    """A wrapper of ``root``'s compiled call that, after a call that compiled a graph (dynamo recompiles
    when a submodule is replaced), looks for parameters graphshard never laid out: plain
    ``nn.Parameter``s that were not in the model when it was compiled (ignored parameters, flat
    parameters and embedding tables were) and that no ``Plan(ignored_params=...)`` glob names. Such a
    parameter belongs to a submodule set after the compile (``model.layers[0] = Block(...)``): it would
    train on each rank alone, its gradient never synchronized, so the call raises ValueError naming it
    and the fix. Calls that compile nothing pay a length test."""
    known = {id(p) for p in root.parameters() if not isinstance(p, DTensor)}
    ignored = model.plan.ignored_params

    def wrap(call):
        @functools.wraps(call)
        def compiled_call(*args, **kwargs):
            before = len(model.explain)
            out = call(*args, **kwargs)
            if len(model.explain) != before:
                new = [fqn for fqn, p in ((_user_fqn(n), p) for n, p in root.named_parameters())
                       if not isinstance(p, DTensor) and id(p) not in known
                       and not any(fqn_match(fqn, g) for g in ignored)]
                if new:
                    raise ValueError(
                        f"parameter {new[0]!r}{f' (and {len(new) - 1} more: {_short(new[1:])})' if len(new) > 1 else ''} "
                        f"of the compiled {type(root).__name__} is a plain nn.Parameter graphshard never sharded: a "
                        "submodule holding it was set after graphshard.compile (model.layers[0] = Block(...)), so its "
                        "gradient would not be synchronized across ranks and the ranks would drift apart. Replace "
                        "submodules before graphshard.compile (build the model as it will train, then compile it), "
                        "or compile a fresh model; to keep a parameter unsharded on purpose, name it in "
                        "Plan(ignored_params=...)")
            return out

        return compiled_call

    return wrap


def _user_fqn(name: str) -> str:
    return name.replace("_fsdp_wrapped_module.", "")  # FSDP1's unit wrappers: the user's FQN


def _short(names: list[str], head: int = 3) -> str:
    return ", ".join(names) if len(names) <= head else f"{', '.join(names[:head])}, ..."


def feeding_local_shards(root: nn.Module, model: ShardedModel):
    """A wrapper of ``root``'s compiled call that hands dynamo each sharded parameter's local shard as
    a plain tensor (the getters read it from the module's ``_graphshard_locals``), so that dynamo
    guards a tensor per parameter, in C++, instead of a DTensor (a Python spec check and a device-mesh
    aliasing check each). All the shards come through one autograd node (`_compat.local_tensors`),
    whose backward gives each DTensor parameter its gradient; the tables are emptied after the call."""
    sites: list[tuple[nn.Module, str]] = []
    on_meta = [any(p.local().is_meta for p in model.params.values())]  # sharded on the meta device (FSDP2's flow)

    def wrap(call):
        @functools.wraps(call)
        def compiled_call(*args, **kwargs):
            if on_meta[0]:
                on_meta[0] = _check_materialized(model)
            if not sites:
                sites.extend((m, name) for m in root.modules() for name in m.__dict__.get("_graphshard_markers", ()))
            fed = _feed(sites, model)
            try:
                return call(*args, **kwargs)
            finally:
                for table in fed:
                    table.clear()
                model.fed_locals = {}

        return compiled_call

    return wrap


def _check_materialized(model: ShardedModel) -> bool:
    """Raises, naming the first parameter still on the meta device, until ``model.to_empty()`` ran."""
    meta = [p.fqn for p in model.params.values() if p.local().is_meta]
    if meta:
        raise ValueError(
            f"parameter {meta[0]!r}{f' (and {len(meta) - 1} more)' if len(meta) > 1 else ''} is on the meta device: "
            "the model was sharded on the meta device and has no values yet. Materialize it before the first "
            "call, as with FSDP2: model.to_empty(device=...) (the sharded parameters stay sharded), then "
            "initialize it (each module's reset_parameters(), your init function, or load a checkpoint with "
            "torch.distributed.checkpoint.state_dict.set_model_state_dict)")
    return False


def _feed(sites: list[tuple[nn.Module, str]], model: ShardedModel) -> list[dict]:
    dtensors, index, placed = [], {}, []
    for mod, name in sites:
        p = mod._parameters.get(name)
        if isinstance(p, DTensor):
            i = index.setdefault(id(p), len(dtensors))
            if i == len(dtensors):
                dtensors.append(p)
            placed.append((mod.__dict__["_graphshard_locals"], name, i))
    shards = _compat.local_tensors(dtensors)
    for table, name, i in placed:
        table[name] = shards[i]
    model.fed_locals = {id(s): d for s, d in zip(shards, dtensors)}
    return list({id(t): t for t, _, _ in placed}.values())


class _ForwardDepth(threading.local):
    depth = 0     # uncompiled sharded forwards running
    compiled = 0  # compiled sharded-model calls running


_forward = _ForwardDepth()
