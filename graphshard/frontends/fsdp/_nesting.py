"""FSDP1's nested construction: ``FullyShardedDataParallel`` instances inside the module a later
instance wraps (``FSDP(layer)`` in a model's ``__init__``, the ``enable_wrap``/``wrap`` idiom).

In torch each instance is a unit and the outermost one the root unit with the parameters left
over. graphshard compiles one program per root, and cannot tell at construction whether an
outer instance will follow, so:

* every instance is complete when constructed (sharded, its compile set up): used alone, or
  called from a plain parent, it is a root, as in torch;
* an instance constructed around a module that holds graphshard instances absorbs them
  (`take_wrappers`): each inner root is released (`Snapshot.restore`: its full parameters
  gathered back into the plain modules, every change its sharding and compile set-up made to
  them undone), and every inner instance, a user's or one an inner ``auto_wrap_policy`` made,
  becomes a unit of the new root with the arguments it was built with (`nested_units`).

The gather is a collective at construction, which every rank reaches in the same order (as
torch's own construction collectives). An instance that has run a forward is not released
(its parameters may be in an optimizer already): wrapping it again is an error.
"""

from __future__ import annotations

import logging
import weakref
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.fsdp import ShardingStrategy

log = logging.getLogger("graphshard")

HOMOGENEOUS = ("use_orig_params", "limit_all_gathers", "cpu_offload")
"""Settings every instance of one model must share. torch's FSDP1 requires the first two of all its
instances (``HOMOGENEOUS_ATTR_NAMES``); graphshard keeps CPU offload per program too."""


class Snapshot:
    """What sharding a root and setting up its compile change on its modules, recorded before:
    each module's class, attribute names, buffers, and its parameters (weakly: the ones sharding
    replaces are freed, their values come back from the shards)."""

    def __init__(self, module: nn.Module):
        self.entries = []
        for m in module.modules():
            params = [(n, None if p is None else weakref.ref(p), bool(p is not None and p.requires_grad))
                      for n, p in m._parameters.items()]
            self.entries.append((m, m.__class__, frozenset(m.__dict__), dict(m._buffers), params))

    def restore(self, state, module: nn.Module) -> None:
        """Puts ``module`` (the plain tree sharded as ``state``) back as it was before sharding, each
        sharded parameter a plain parameter holding its full value (gathered: every rank joins)."""
        modules = dict(module.named_modules(remove_duplicate=False))
        full: dict[tuple[int, str], nn.Parameter] = {}
        for info in state.params.values():
            value = info.full()
            param = None
            for fqn in info.layout.fqns:
                owner, _, name = fqn.rpartition(".")
                mod = modules[owner]
                if param is None:
                    param = _original(self, mod, name)
                    if param is None:
                        param = nn.Parameter(value, requires_grad=_requires_grad(self, mod, name))
                    else:
                        with torch.no_grad():
                            param.data = value
                full[(id(mod), name)] = param
        for m, cls, keys, buffers, params in self.entries:
            m.__class__ = cls
            for key in [k for k in m.__dict__ if k not in keys]:
                del m.__dict__[key]
            m._buffers.clear()
            m._buffers.update(buffers)
            restored = {}
            for name, ref, _ in params:
                p = full.get((id(m), name))
                if p is None and ref is not None:
                    p = ref()
                    assert p is not None, f"parameter {name!r} of {type(m).__name__} was freed and is not sharded"
                restored[name] = p
            m._parameters.clear()
            m._parameters.update(restored)


def _entry(snapshot: Snapshot, mod: nn.Module):
    return next(e for e in snapshot.entries if e[0] is mod)


def _original(snapshot: Snapshot, mod: nn.Module, name: str) -> nn.Parameter | None:
    """The parameter object ``mod.name`` held before sharding, if it still lives (one the user holds)."""
    ref = next((r for n, r, _ in _entry(snapshot, mod)[4] if n == name), None)
    return None if ref is None else ref()


def _requires_grad(snapshot: Snapshot, mod: nn.Module, name: str) -> bool:
    return next(rg for n, _, rg in _entry(snapshot, mod)[4] if n == name)


def take_wrappers(module: nn.Module, cls: type) -> dict[int, Any]:
    """Replaces every ``cls`` instance in ``module``'s tree by the module it wraps, in every parent
    that holds it; returns them by the id of their module. Inner roots are released first."""
    found: dict[int, Any] = {}
    slots = []
    for parent in module.modules():
        for name, child in parent._modules.items():
            if isinstance(child, cls):
                slots.append((parent, name, child))
                found[id(child._fsdp_wrapped_module)] = child
    roots = {id(w): w for w in found.values() if w._is_root}
    for w in roots.values():
        if w.__dict__.get("_ran"):
            raise ValueError(
                f"a FullyShardedDataParallel around {type(w._fsdp_wrapped_module).__name__} has already run a forward "
                "as a root, and is now wrapped again: its parameters may be in an optimizer. Wrap the whole model "
                "before the first forward (torch's FSDP1 decides the root at the first forward too)")
    for parent, name, w in slots:
        parent._modules[name] = w._fsdp_wrapped_module
    for w in roots.values():
        w._release()
    return found


def nested_units(module: nn.Module, wrappers: dict[int, Any], root_config, root_args: dict) -> list:
    """The units of ``module`` that its inner instances make, as `decide_units` gives them:
    ``(fqn, module, overrides)`` children first, each module once at its first FQN. An instance's
    sharding strategy and mixed precision are its unit's; the settings one program holds once must
    agree with the root's (ValueError naming the setting). Also returns the modules of units over a
    process group of one rank (each rank its own parameters, never reduced: ``MixtureOfExperts``'
    experts), which the root keeps as ignored modules."""
    from graphshard.frontends.fsdp.wrap import targeted_units

    by_module = {m: w for m in module.modules() if (w := wrappers.get(id(m))) is not None}
    units, rank_local = [], []
    for fqn, mod, _ in targeted_units(module, {m: {} for m in by_module}):
        w = by_module[mod]
        cfg = w._own_config  # as built (a unit of an inner root: that root's), not the root it joined last
        where = f"the FullyShardedDataParallel around {fqn!r} ({type(mod).__name__})"
        for name in HOMOGENEOUS:
            if getattr(cfg, name) != getattr(root_config, name):
                raise ValueError(
                    f"{where} has {name}={getattr(cfg, name)!r}, the root {getattr(root_config, name)!r}; every "
                    f"instance of one model takes the same {name} (torch's FSDP1 requires it too): pass the root's "
                    "value to the inner instances")
        if w._compile_options != root_args["compile_options"]:
            raise ValueError(
                f"{where} has compile options {w._compile_options}, the root {root_args['compile_options']}; the "
                "root compiles the whole model once, with its own: pass the same to every instance (or to the root only)")
        if not _same_mesh(cfg.mesh, root_config.mesh):
            if cfg.mesh.size() == 1 and root_config.mesh.size() > 1:
                mp = w._spec_args.get("mixed_precision")
                if mp is not None and mp.param_dtype is not None:
                    raise NotImplementedError(
                        f"{where} shards over a process group of one rank (its parameters are this rank's own, as "
                        "MixtureOfExperts' experts) and has mixed_precision: graphshard keeps such a unit's parameters "
                        "unsharded in full precision. Drop mixed_precision on that instance, or wrap it over the "
                        "root's process group")
                if any(o is not mod and o in by_module for o in mod.modules()):
                    raise NotImplementedError(
                        f"{where} shards over a process group of one rank and holds FullyShardedDataParallel "
                        "instances of its own; graphshard keeps it unsharded as a whole: wrap its inner modules "
                        "over the same one-rank group only through it, or over the root's process group")
                rank_local.append((fqn, mod, w))
                continue
            raise NotImplementedError(
                f"{where} shards over ranks {cfg.mesh.mesh.tolist()}, the root over {root_config.mesh.mesh.tolist()}: "
                "one compiled program shards over one mesh. Pass the root's process_group (or device_mesh) to the "
                "inner instances; a process group of one rank (each rank its own parameters) is supported")
        _note_prefetch(w, fqn, cfg, root_config)
        overrides = {}
        if w._spec_args["sharding_strategy"] != root_args["sharding_strategy"]:
            overrides["sharding_strategy"] = w._spec_args["sharding_strategy"]
        if w._spec_args["mixed_precision"] != root_args["mixed_precision"]:
            overrides["mixed_precision"] = w._spec_args["mixed_precision"]
        _check_strategy(where, overrides.get("sharding_strategy"), root_args["sharding_strategy"])
        units.append((fqn, mod, overrides))
    return units, rank_local


def _check_strategy(where: str, unit: ShardingStrategy | None, root: ShardingStrategy) -> None:
    hybrid = (ShardingStrategy.HYBRID_SHARD, ShardingStrategy._HYBRID_SHARD_ZERO2)
    if unit is not None and (unit in hybrid) != (root in hybrid):
        raise NotImplementedError(
            f"{where} has sharding_strategy={unit.name}, the root {root.name}: hybrid and non-hybrid units need "
            "meshes of different shapes, and one compiled program has one mesh. Give the root and the inner "
            "instances both a hybrid strategy (on one 2-D device_mesh) or neither")


def _note_prefetch(w, fqn: str, cfg, root_config) -> None:
    """Per-instance prefetch settings (torch's FSDP1 keeps them per instance) only reorder the program's
    collectives; graphshard schedules every unit by the root's, and says so (log, ``explain``)."""
    diff = [f"{n}={getattr(cfg, n)!r}" for n in ("backward_prefetch", "forward_prefetch")
            if getattr(cfg, n) != getattr(root_config, n)]
    if diff:
        note = (f"unit {fqn!r} was built with {', '.join(diff)}; the program schedules every unit by the root's "
                "prefetch settings")
        log.warning("graphshard.fsdp: %s", note)
        root_config.notes.append(note)


def _same_mesh(a, b) -> bool:
    return (a.device_type == b.device_type and a.mesh.tolist() == b.mesh.tolist()
            and a.mesh_dim_names == b.mesh_dim_names)
