"""FSDP1's optimizer-state functions over graphshard's storage.

The optimizer holds one entry per parameter it was given: with ``use_orig_params=True`` the
DTensor parameters (so its state is DTensors of the same placements), with ``False`` one flat
1-D parameter per unit (its state flat tensors of the same layout: each parameter's local
shard, padded to its chunk, in registration order; `graphshard.sharding.FlatSlot`).

- `optim_state_dict` unflattens that state to the user's parameter FQNs: full tensors
  (FULL_STATE_DICT; ``rank0_only`` gives the other ranks ``{}``, as torch) or DTensors over the
  FSDP mesh (SHARDED / LOCAL, as torch treats LOCAL), ``param_groups`` with FQN lists.
- `optim_state_dict_to_load` maps such a dict (full tensors or DTensors, from graphshard,
  torch's FSDP1 or an unwrapped model) back to what ``optim.load_state_dict`` takes: keyed by
  parameter id, each state tensor laid out as the parameter. Scalar state (``step``) of a flat
  unit is one value for all its parameters; differing values are an error, as in torch.
"""

from __future__ import annotations

import copy
import warnings
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import OptimStateKeyType, StateDictType
from torch.distributed.tensor import DTensor

from graphshard.frontends.fsdp._common import clean_fqn, local_of_full
from graphshard.frontends.fsdp._state_dict import StateDictMixin
from graphshard.sharding import FlatSlot, ShardedParam


class _Entry:
    """One parameter as the optimizer sees it: ``fqns`` the user's FQNs of the original
    parameters it holds; ``infos`` their graphshard facts (``None``: not graphshard's, copied
    as is); ``slots`` their places in a flat parameter (``None``: an original parameter)."""

    def __init__(self, param: nn.Parameter, fqns: list[str], infos: list[ShardedParam] | None = None,
                 slots: list[FlatSlot] | None = None):
        self.param, self.fqns, self.infos, self.slots = param, fqns, infos, slots
        self.name = ""  # its name in model.named_parameters() (a NamedOptimizer's key)


def _entries(model: nn.Module) -> dict[int, _Entry]:
    """``id(parameter)`` -> its entry, for every parameter of ``model``."""
    out: dict[int, _Entry] = {}
    for name, root in model.named_modules():
        if not (isinstance(root, OptimStateMixin) and root._is_root):
            continue
        pre = clean_fqn(name) + "." if clean_fqn(name) else ""
        state, inner = root._graphshard, root._fsdp_wrapped_module
        in_flat = set()
        for unit in (u.flat for u in state.units.values() if u.flat is not None):
            infos = [state.params[s.key] for s in unit.slots]
            in_flat.update(s.key for s in unit.slots)
            out[id(unit.param)] = _Entry(unit.param, [clean_fqn(pre + i.fqn) for i in infos], infos, unit.slots)
        for key, info in state.params.items():
            if key not in in_flat:
                owner, _, pname = info.layout.fqns[0].rpartition(".")
                p = inner.get_submodule(owner)._parameters[pname]
                out[id(p)] = _Entry(p, [clean_fqn(pre + info.fqn)], [info])
    for name, p in nn.Module.named_parameters(model):
        entry = out.setdefault(id(p), _Entry(p, [clean_fqn(name)]))
        entry.name = name
    return out


def _key_to_param(model: nn.Module, optim, optim_input=None, named: bool = False) -> dict[Any, nn.Parameter]:
    """The optimizer's parameter keys (ids in ``param_groups`` order, or names for a
    NamedOptimizer) -> parameters; from ``optim_input`` (deprecated) or ``model.parameters()``
    when no optimizer is given, as torch."""
    if optim is None or optim_input is not None:
        params = list(model.parameters()) if optim_input is None else list(optim_input)
        if params and isinstance(params[0], dict):
            params = [p for group in params for p in group["params"]]
        return dict(enumerate(params))
    params = [p for group in optim.param_groups for p in group["params"]]
    if named:
        names = {id(e.param): e.name for e in _entries(model).values()}
        return {names[id(p)]: p for p in params}
    return dict(enumerate(params))


# ---------------------------------------------------------------------------------------------
# optimizer state -> FQN-keyed state (optim_state_dict, full_ / sharded_optim_state_dict)
# ---------------------------------------------------------------------------------------------
def unflatten_optim_state(model: nn.Module, optim, osd: dict, *, full: bool, rank0_only: bool, cpu_offload: bool,
                          group=None, optim_input=None) -> dict:
    """``osd`` (``optim.state_dict()``'s form) keyed by the user's FQNs, full or DTensor state."""
    if "state" not in osd:
        raise ValueError('the optimizer state dict has no "state" key; pass optim.state_dict() (or None)')
    entries = _entries(model)
    states = osd["state"]
    named = bool(states) and isinstance(next(iter(states)), str)
    key_to_param = _key_to_param(model, optim, optim_input, named)
    with_state = [k for k in key_to_param if k in states]
    _check_same_keys(with_state, group)
    out: dict[Any, Any] = {}
    for key in with_state:  # the same order on every rank: the gathers line up
        out.update(_unflatten_entry(entries[id(key_to_param[key])], states[key], full, cpu_offload))
    if full and rank0_only and dist.get_rank(group) != 0:
        return {}
    for key, value in states.items():
        if key not in key_to_param:
            warnings.warn(f"optimizer state {key!r} belongs to no parameter of the model; copied as it is",
                          stacklevel=3)
            out[key] = value
    result: dict[str, Any] = {"state": out}
    if "param_groups" in osd:
        result["param_groups"] = []
        for group_ in osd["param_groups"]:
            g = copy.deepcopy(group_)
            g["params"] = [f for k in group_["params"] for f in entries[id(key_to_param[k])].fqns]
            result["param_groups"].append(g)
    return result


def _check_same_keys(keys: list, group) -> None:
    """Every rank must hold state for the same parameters (each unflattening is a collective)."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return
    gathered: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, keys, group=group)
    for rank, other in enumerate(gathered):
        if other != keys:
            diff = sorted(set(map(str, other)) ^ set(map(str, keys)))
            raise ValueError(f"rank {rank} holds optimizer state for other parameters than rank "
                             f"{dist.get_rank(group)} (differing keys: {diff[:5]}); step the optimizer on "
                             "every rank before reading its state dict")


def _unflatten_entry(e: _Entry, state: dict, full: bool, cpu_offload: bool) -> dict[str, dict]:
    if e.infos is None:  # not graphshard's: as it is
        return {e.fqns[0]: {n: v.cpu() if cpu_offload and torch.is_tensor(v) else v for n, v in state.items()}}
    out: dict[str, dict] = {f: {} for f in e.fqns}
    for name, value in state.items():
        if torch.is_tensor(value) and value.dim() > 0:
            for i, (fqn, info) in enumerate(zip(e.fqns, e.infos)):
                local = _stored_layout(e, i, value, name)
                out[fqn][name] = _full(local, info, cpu_offload) if full else _sharded(local, info, cpu_offload)
        else:
            if torch.is_tensor(value):
                value = value.detach().clone()
                value = value.cpu() if cpu_offload else value
            for fqn in e.fqns:
                out[fqn][name] = value
    return out


def _stored_layout(e: _Entry, i: int, value: torch.Tensor, name: str) -> torch.Tensor:
    """Parameter ``i``'s local part of the optimizer state ``value`` (laid out as ``e.param``)."""
    if e.slots is None:
        local = value.to_local() if isinstance(value, DTensor) else value
        want = e.param._local_tensor.shape if isinstance(e.param, DTensor) else e.param.shape
    else:
        slot = e.slots[i]
        local = value.narrow(0, slot.offset, slot.numel).view(slot.shape) if value.shape == e.param.shape else value
        want = slot.shape
    if local.shape != want:
        raise ValueError(f"optimizer state {name!r} of {e.fqns[i]!r} has shape {tuple(value.shape)}, not its "
                         f"parameter's ({tuple(e.param.shape)}); graphshard.fsdp unflattens state shaped as the "
                         "parameter (as torch's Adam/SGD keep it)")
    return local


def _full(local: torch.Tensor, info: ShardedParam, cpu_offload: bool) -> torch.Tensor:
    v = info.full(local)
    return v.cpu() if cpu_offload else v


def _sharded(local: torch.Tensor, info: ShardedParam, cpu_offload: bool) -> DTensor:
    return info.dtensor_of(local.detach().cpu() if cpu_offload else local.detach())


# ---------------------------------------------------------------------------------------------
# FQN-keyed state -> what optim.load_state_dict takes (optim_state_dict_to_load and the legacy forms)
# ---------------------------------------------------------------------------------------------
def flatten_optim_state(model: nn.Module, optim, osd: dict | None, *, rank0_only: bool, group=None,
                        optim_input=None, is_named_optimizer: bool = False) -> dict:
    """``osd`` (keyed by the user's FQNs; full tensors or DTensors) keyed and laid out as the
    optimizer of ``model`` holds its state."""
    if rank0_only:
        osd = _broadcast_from_rank0(osd, model, group)
    if not isinstance(osd, dict) or "state" not in osd:
        raise ValueError('the optimizer state dict to load has no "state" key; pass what '
                         "FSDP.optim_state_dict() returned")
    entries = _entries(model)
    states = osd["state"]
    if states and all(isinstance(k, int) for k in states):
        raise ValueError(f"the optimizer state dict to load is keyed by parameter id ({next(iter(states))}), not by "
                         "FQN; pass what FSDP.optim_state_dict() returned, or rekey it with "
                         "FSDP.rekey_optim_state_dict(osd, OptimStateKeyType.PARAM_NAME, model_it_came_from)")
    key_to_param = _key_to_param(model, optim, optim_input, is_named_optimizer)
    out: dict[Any, Any] = {}
    key_of_fqn: dict[str, Any] = {}
    for key, p in key_to_param.items():
        e = entries[id(p)]
        for i, fqn in enumerate(e.fqns):
            key_of_fqn[fqn] = key
            if e.infos is not None:  # tied names (output.weight) name the same parameter
                pre = fqn[: len(fqn) - len(clean_fqn(e.infos[i].fqn))]
                key_of_fqn.update({pre + clean_fqn(alias): key for alias in e.infos[i].layout.fqns})
        flat = _flatten_entry(e, states)
        if flat:
            out[key] = flat
    for key, value in states.items():
        if key not in key_of_fqn:  # user-defined state: as torch, copied
            out[key] = copy.copy(value)
    result: dict[str, Any] = {"state": out}
    if "param_groups" in osd:
        result["param_groups"] = []
        for g in osd["param_groups"]:
            unknown = [f for f in g["params"] if f not in key_of_fqn]
            if unknown:
                raise ValueError(f"param_groups of the optimizer state dict name {unknown[0]!r}, which is no "
                                 "parameter of this optimizer; load a state dict saved from the same model (keyed "
                                 "by FQN: FSDP.optim_state_dict or rekey_optim_state_dict(..., PARAM_NAME, ...))")
            flat_group = copy.deepcopy({k: v for k, v in g.items() if k != "params"})
            flat_group["params"] = sorted({key_of_fqn[f] for f in g["params"]})
            result["param_groups"].append(flat_group)
    return result


def _flatten_entry(e: _Entry, states: dict) -> dict:
    if e.infos is None:
        st = states.get(e.fqns[0])
        if st is None:
            return {}
        return {n: v.full_tensor() if isinstance(v, DTensor) else v for n, v in st.items()}
    per_param = [states.get(f) for f in e.fqns]
    present = [(f, st) for f, st in zip(e.fqns, per_param) if st is not None]
    if not present:
        return {}
    names = list(present[0][1])
    for fqn, st in present[1:]:
        if set(st) != set(names):
            raise ValueError(f"optimizer state of {fqn!r} has {sorted(st)} but {present[0][0]!r} (same flat "
                             f"parameter) has {sorted(names)}; one flat parameter needs one set of state names")
    out = {}
    for name in names:
        values = [st[name] if st is not None else None for st in per_param]
        known = [v for v in values if v is not None]
        if all(torch.is_tensor(v) and v.dim() > 0 for v in known):
            out[name] = _flatten_tensor(e, values, name)
        elif e.slots is None:  # a copy: optim.load_state_dict keeps a tensor ``step`` and steps it in place
            out[name] = values[0].detach().clone() if torch.is_tensor(values[0]) else values[0]
        elif all(torch.is_tensor(v) and v.dim() == 0 for v in known) and len(known) == len(values) and \
                len({(v.item(), v.dtype) for v in known}) == 1:
            out[name] = torch.tensor(known[0].item(), dtype=known[0].dtype)
        elif not any(torch.is_tensor(v) for v in known) and len(known) == len(values) and \
                all(v == known[0] for v in known):
            out[name] = known[0]
        else:
            raise ValueError(f"optimizer state {name!r} differs between the parameters {e.fqns} of one flat "
                             f"parameter ({values}); with use_orig_params=False they need one value (or load it "
                             "with use_orig_params=True)")
    return out


def _flatten_tensor(e: _Entry, values: list, name: str) -> torch.Tensor:
    if e.slots is None:
        info = e.infos[0]
        local = _local_of(values[0], info, name, e.fqns[0]).to(device=e.param.device)
        return info.dtensor_of(local.clone()) if isinstance(e.param, DTensor) else local.clone()
    dtypes = {v.dtype for v in values if v is not None}
    if len(dtypes) != 1:
        raise ValueError(f"optimizer state {name!r} of the flat parameter holding {e.fqns} has dtypes "
                         f"{sorted(map(str, dtypes))}; it needs one dtype")
    flat = torch.zeros(e.param.shape, dtype=dtypes.pop(), device=e.param.device)
    for v, slot, info, fqn in zip(values, e.slots, e.infos, e.fqns):
        if v is not None:  # a parameter without this state: zeros, as torch
            flat.narrow(0, slot.offset, slot.numel).copy_(_local_of(v, info, name, fqn).reshape(-1))
    return flat


def _local_of(v: torch.Tensor, info: ShardedParam, name: str, fqn: str) -> torch.Tensor:
    """This rank's part, laid out as graphshard stores ``info``'s parameter, of the state ``v``
    (a full tensor or a DTensor of any layout)."""
    if isinstance(v, DTensor):
        if v.device_mesh == info.mesh and tuple(v.placements) == info.placements \
                and tuple(v.shape) == tuple(info.logical_shape):
            return v.to_local()
        v = v.full_tensor()
    elif not type(v) in (torch.Tensor, nn.Parameter):
        raise ValueError(f"optimizer state {name!r} of {fqn!r} is a {type(v).__name__}; graphshard.fsdp loads full "
                         "tensors and DTensors: load a sharded checkpoint with torch.distributed.checkpoint into "
                         "FSDP.optim_state_dict(model, optim) first")
    if tuple(v.shape) != tuple(info.logical_shape):
        raise ValueError(f"optimizer state {name!r} of {fqn!r} has shape {tuple(v.shape)}, but the parameter's is "
                         f"{tuple(info.logical_shape)}; load a state dict saved from the same model")
    return local_of_full(v, info)


class _Meta:
    """A positive-dimension tensor's shape and dtype, broadcast in its place."""

    def __init__(self, t: torch.Tensor):
        self.shape, self.dtype = tuple(t.shape), t.dtype


def _broadcast_from_rank0(osd: dict | None, model: nn.Module, group) -> dict:
    """Rank 0's ``osd`` on every rank (the others' argument is ignored, as torch's)."""
    if dist.get_world_size(group) == 1:
        return osd
    rank = dist.get_rank(group)
    src = dist.get_global_rank(group, 0) if group is not None else 0
    device = next(model.parameters()).device
    if rank == 0:
        if not isinstance(osd, dict) or "state" not in osd:
            raise ValueError('rank 0 got no optimizer state dict with a "state" key to scatter; pass what '
                             "FSDP.optim_state_dict() / full_optim_state_dict() returned on rank 0")
        meta = {"state": {k: {n: _Meta(v) if torch.is_tensor(v) and v.dim() > 0 else v for n, v in st.items()}
                          if isinstance(st, dict) else st for k, st in osd["state"].items()},
                **{k: v for k, v in osd.items() if k != "state"}}
    objs = [meta if rank == 0 else None]
    dist.broadcast_object_list(objs, src=src, group=group)
    meta = objs[0]
    for key, st in meta["state"].items():
        if not isinstance(st, dict):
            continue
        for name, v in st.items():
            if isinstance(v, _Meta):
                if rank == 0:
                    t = osd["state"][key][name].to(device).contiguous()
                else:
                    t = torch.empty(v.shape, dtype=v.dtype, device=device)
                dist.broadcast(t, src=src, group=group)
                st[name] = t
    return meta


# ---------------------------------------------------------------------------------------------
# The static methods of FullyShardedDataParallel
# ---------------------------------------------------------------------------------------------
class OptimStateMixin:
    """FSDP1's optimizer-state static methods (torch's signatures and behaviour)."""

    @staticmethod
    def optim_state_dict(model: nn.Module, optim: torch.optim.Optimizer, optim_state_dict: dict | None = None,
                         group=None) -> dict[str, Any]:
        """``optim``'s state keyed by the user's FQNs, as the model's state-dict type says: full
        tensors (FULL_STATE_DICT; ``rank0_only``: ``{}`` on the other ranks) or DTensors."""
        settings = StateDictMixin.get_state_dict_type(model)
        cfg = settings.optim_state_dict_config
        full = settings.state_dict_type == StateDictType.FULL_STATE_DICT
        osd = optim.state_dict() if optim_state_dict is None else optim_state_dict
        return unflatten_optim_state(model, optim, osd, full=full,
                                     rank0_only=full and getattr(cfg, "rank0_only", False),
                                     cpu_offload=getattr(cfg, "offload_to_cpu", True), group=group)

    @staticmethod
    def optim_state_dict_to_load(model: nn.Module, optim: torch.optim.Optimizer, optim_state_dict: dict[str, Any],
                                 is_named_optimizer: bool = False, load_directly: bool = False,
                                 group=None) -> dict[str, Any]:
        """``optim_state_dict`` (from `optim_state_dict`, torch's FSDP1 or an unwrapped model, keyed
        by FQN) as ``optim.load_state_dict`` takes it; loaded too with ``load_directly``."""
        settings = StateDictMixin.get_state_dict_type(model)
        full = settings.state_dict_type == StateDictType.FULL_STATE_DICT
        rank0_only = full and getattr(settings.optim_state_dict_config, "rank0_only", False)
        result = flatten_optim_state(model, optim, optim_state_dict, rank0_only=rank0_only, group=group,
                                     is_named_optimizer=is_named_optimizer)
        if load_directly:
            optim.load_state_dict(result)
        return result

    @staticmethod
    def full_optim_state_dict(model: nn.Module, optim: torch.optim.Optimizer, optim_input=None,
                              rank0_only: bool = True, group=None) -> dict[str, Any]:
        """The full optimizer state keyed by FQN (legacy; ``rank0_only``: ``{}`` on the other ranks)."""
        return unflatten_optim_state(model, optim, optim.state_dict(), full=True, rank0_only=rank0_only,
                                     cpu_offload=True, group=group, optim_input=optim_input)

    @staticmethod
    def sharded_optim_state_dict(model: nn.Module, optim: torch.optim.Optimizer, group=None) -> dict[str, Any]:
        """The optimizer state keyed by FQN, each tensor a DTensor (legacy)."""
        return unflatten_optim_state(model, optim, optim.state_dict(), full=False, rank0_only=False,
                                     cpu_offload=True, group=group)

    @staticmethod
    def shard_full_optim_state_dict(full_optim_state_dict: dict[str, Any], model: nn.Module, optim_input=None,
                                    optim: torch.optim.Optimizer | None = None) -> dict[str, Any]:
        """A full optimizer state dict (every rank holds it) as this rank's optimizer loads it (legacy)."""
        return flatten_optim_state(model, optim, full_optim_state_dict, rank0_only=False, optim_input=optim_input)

    @staticmethod
    def scatter_full_optim_state_dict(full_optim_state_dict: dict[str, Any] | None, model: nn.Module,
                                      optim_input=None, optim: torch.optim.Optimizer | None = None,
                                      group=None) -> dict[str, Any]:
        """Rank 0's full optimizer state dict, sent to every rank, as its optimizer loads it (legacy)."""
        return flatten_optim_state(model, optim, full_optim_state_dict, rank0_only=True, group=group,
                                   optim_input=optim_input)

    @staticmethod
    def flatten_sharded_optim_state_dict(sharded_optim_state_dict: dict[str, Any], model: nn.Module,
                                         optim: torch.optim.Optimizer) -> dict[str, Any]:
        """A `sharded_optim_state_dict` as ``optim`` loads it (legacy)."""
        return flatten_optim_state(model, optim, sharded_optim_state_dict, rank0_only=False)

    @staticmethod
    def rekey_optim_state_dict(optim_state_dict: dict[str, Any], optim_state_key_type: OptimStateKeyType,
                               model: nn.Module, optim_input=None,
                               optim: torch.optim.Optimizer | None = None) -> dict[str, Any]:
        """``optim_state_dict`` keyed by parameter name (PARAM_NAME) or id (PARAM_ID), ids from
        ``optim`` (or ``optim_input`` / ``model.parameters()``); for wrapped and unwrapped models."""
        if optim_state_key_type not in (OptimStateKeyType.PARAM_NAME, OptimStateKeyType.PARAM_ID):
            raise ValueError(f"optim_state_key_type={optim_state_key_type!r}: expected OptimStateKeyType.PARAM_NAME "
                             "or OptimStateKeyType.PARAM_ID")
        keys = list(optim_state_dict["state"])
        if not (all(isinstance(k, str) for k in keys) or all(isinstance(k, int) for k in keys)):
            raise ValueError(f"Invalid parameter keys: {keys}: key an optimizer state dict all by name or all by id")
        want = str if optim_state_key_type == OptimStateKeyType.PARAM_NAME else int
        if all(isinstance(k, want) for k in keys):
            return optim_state_dict
        entries = _entries(model)
        id_to_name = {}
        for pid, p in _key_to_param(model, optim, optim_input).items():
            fqns = entries[id(p)].fqns
            if len(fqns) != 1:
                raise ValueError(f"parameter {pid} is a flat parameter holding {fqns}: it has no one name to key "
                                 "by; rekey with use_orig_params=True or the unwrapped model, or use "
                                 "FSDP.optim_state_dict / optim_state_dict_to_load")
            id_to_name[pid] = fqns[0]
        rekey = id_to_name if want is str else {v: k for k, v in id_to_name.items()}
        missing = [k for k in keys if k not in rekey]
        if missing:
            raise ValueError(f"optimizer state key {missing[0]!r} names no parameter of this model/optimizer; "
                             "rekey with the model and optimizer the state dict was saved from")
        out = {"state": {rekey[k]: v for k, v in optim_state_dict["state"].items()},
               "param_groups": copy.deepcopy(optim_state_dict["param_groups"])}
        for g in out["param_groups"]:
            g["params"] = sorted(rekey[k] for k in g["params"])
        return out


__all__ = ["OptimStateMixin", "flatten_optim_state", "unflatten_optim_state"]
