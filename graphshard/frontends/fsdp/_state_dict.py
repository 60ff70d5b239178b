"""FSDP1's state-dict types over graphshard's storage.

- FULL_STATE_DICT: every parameter gathered to its full shape under the user's FQN (no
  ``_fsdp_wrapped_module.``), buffers in their original dtype; ``rank0_only`` gives the other
  ranks only what FSDP does not manage (ignored modules' parameters and buffers, ignored
  parameters; an empty dict without them), as torch does; ``offload_to_cpu`` moves the values
  to the CPU.
- SHARDED_STATE_DICT: the user's FQNs, each parameter this rank's shard as a DTensor over the
  FSDP mesh (``Shard(0)``; hybrid: ``(Replicate(), Shard(0))``), which
  ``torch.distributed.checkpoint`` saves and loads into any world size.
- LOCAL_STATE_DICT: this rank's stored tensors under torch's keys (``layers.0._flat_param``:
  the flat shards with ``use_orig_params=False``; the parameters' local shards otherwise), for
  loading into the same world size and wrapping. graphshard's flat layout (each parameter's
  shard padded to its chunk) is not torch's, so these do not interchange with torch's FSDP1.
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import (
    FullOptimStateDictConfig,
    FullStateDictConfig,
    LocalOptimStateDictConfig,
    LocalStateDictConfig,
    ShardedOptimStateDictConfig,
    ShardedStateDictConfig,
    StateDictSettings,
    StateDictType,
)
from torch.distributed.tensor import DTensor

from graphshard import _compat
from graphshard.frontends.fsdp._common import clean_fqn, local_of_full
from graphshard.sharding import FLAT_PARAM

_CONFIGS = {
    StateDictType.FULL_STATE_DICT: (FullStateDictConfig, FullOptimStateDictConfig),
    StateDictType.SHARDED_STATE_DICT: (ShardedStateDictConfig, ShardedOptimStateDictConfig),
    StateDictType.LOCAL_STATE_DICT: (LocalStateDictConfig, LocalOptimStateDictConfig),
}


def fsdp_instances(module: nn.Module) -> list:
    """The ``FullyShardedDataParallel`` instances in ``module``'s tree, in pre-order."""
    return [m for m in module.modules() if isinstance(m, StateDictMixin)]


class StateDictMixin:
    """``state_dict_type`` and the state-dict methods of graphshard's FullyShardedDataParallel."""

    # ------------------------------------------------------------------ type selection
    @staticmethod
    def set_state_dict_type(module: nn.Module, state_dict_type: StateDictType, state_dict_config=None,
                            optim_state_dict_config=None) -> StateDictSettings:
        """Sets the state-dict type of every FSDP instance under ``module``; returns the previous settings."""
        if not isinstance(state_dict_type, StateDictType):
            raise ValueError(f"state_dict_type={state_dict_type!r}: expected a torch.distributed.fsdp.StateDictType")
        model_cls, optim_cls = _CONFIGS[state_dict_type]
        for what, cfg, cls in (("state_dict_config", state_dict_config, model_cls),
                               ("optim_state_dict_config", optim_state_dict_config, optim_cls)):
            if cfg is not None and type(cfg) is not cls:
                raise ValueError(
                    f"{what} is a {type(cfg).__name__}, but {state_dict_type.name} takes a {cls.__name__}; "
                    f"pass {cls.__name__}(...) or None"
                )
        instances = fsdp_instances(module)
        if not instances:
            raise ValueError(f"{type(module).__name__} holds no graphshard.fsdp FullyShardedDataParallel instance")
        prev = StateDictMixin.get_state_dict_type(module)
        settings = StateDictSettings(state_dict_type, state_dict_config or model_cls(),
                                     optim_state_dict_config or optim_cls())
        for inst in instances:
            inst._root.__dict__["_sd_settings"] = settings
        return prev

    @staticmethod
    def get_state_dict_type(module: nn.Module) -> StateDictSettings:
        """The state-dict settings of the FSDP instances under ``module`` (one for all of them)."""
        roots = {id(m._root): m._root for m in fsdp_instances(module)}
        if not roots:
            raise ValueError(f"{type(module).__name__} holds no graphshard.fsdp FullyShardedDataParallel instance")
        settings = [r.__dict__.get("_sd_settings") or _default_settings() for r in roots.values()]
        if any(s != settings[0] for s in settings[1:]):
            raise ValueError("the FSDP instances under this module have different state-dict settings")
        return settings[0]

    @staticmethod
    @contextlib.contextmanager
    def state_dict_type(module: nn.Module, state_dict_type: StateDictType, state_dict_config=None,
                        optim_state_dict_config=None):
        """Within the context, ``state_dict()`` / ``load_state_dict()`` use ``state_dict_type``."""
        prev = StateDictMixin.set_state_dict_type(module, state_dict_type, state_dict_config,
                                                            optim_state_dict_config)
        try:
            yield
        finally:
            StateDictMixin.set_state_dict_type(module, prev.state_dict_type, prev.state_dict_config,
                                                         prev.optim_state_dict_config)

    # ------------------------------------------------------------------ state_dict / load_state_dict
    def _settings(self) -> StateDictSettings:
        return self._root.__dict__.get("_sd_settings") or _default_settings()

    def state_dict(self, *args, destination=None, prefix: str = "", keep_vars: bool = False):
        if not self._is_root:
            raise NotImplementedError("graphshard.fsdp: call state_dict() on the root FullyShardedDataParallel")
        if args:  # nn.Module's deprecated positional form (destination, prefix, keep_vars)
            destination, prefix, keep_vars = (list(args) + [destination, prefix, keep_vars][len(args):])[:3]
        settings = self._settings()
        kind, cfg = settings.state_dict_type, settings.state_dict_config
        out = destination if destination is not None else OrderedDict()  # nn.Module.state_dict's type
        if kind == StateDictType.LOCAL_STATE_DICT:
            for name, t in self._local_tensors().items():
                out[prefix + name] = t if keep_vars else t.detach()
            return out
        values = self._param_values(kind, cfg)
        rank0_only = kind == StateDictType.FULL_STATE_DICT and cfg.rank0_only and dist.get_rank() != 0
        buffers = self._unmanaged_by_fqn()
        for key in self._sd_keys:
            if key in values:
                v = values[key]
            elif key in buffers:
                v = buffers[key].detach().to(self._buffer_dtypes.get(key, buffers[key].dtype))
                if getattr(cfg, "offload_to_cpu", False):
                    v = v.cpu()
            else:
                continue
            if not rank0_only or key in self._unsharded_keys:
                out[prefix + key] = v
        return out

    def _param_values(self, kind: StateDictType, cfg) -> dict[str, torch.Tensor]:
        values = {}
        for info in self._graphshard.params.values():
            if kind == StateDictType.FULL_STATE_DICT:  # gathered in the stored dtype, not param_dtype
                v = info.full()
                if cfg.offload_to_cpu:
                    v = v.cpu()
            else:
                v = info.dtensor().detach()
                if cfg.offload_to_cpu:
                    v = DTensor.from_local(v.to_local().cpu(), v.device_mesh, v.placements, run_check=False,
                                           shape=v.shape, stride=v.stride())
            for fqn in info.layout.fqns:
                values[clean_fqn(fqn)] = v
        return values

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        if not self._is_root:
            raise NotImplementedError("graphshard.fsdp: call load_state_dict() on the root FullyShardedDataParallel")

        kind = self._settings().state_dict_type
        if kind == StateDictType.LOCAL_STATE_DICT:
            return self._load_local(state_dict, strict)
        model = self._fsdp_wrapped_module
        expected = set(self._sd_keys)
        missing = [k for k in self._sd_keys if k not in state_dict]
        unexpected = [k for k in state_dict if k not in expected]
        if strict and (missing or unexpected):
            raise RuntimeError(_load_error(type(model).__name__, missing, unexpected))
        buffers = self._unmanaged_by_fqn()
        with torch.no_grad():
            for info in self._graphshard.params.values():
                fqn = next((clean_fqn(f) for f in info.layout.fqns if clean_fqn(f) in state_dict), None)
                if fqn is None:
                    continue
                value = state_dict[fqn]
                dst = info.local()
                if isinstance(value, DTensor):
                    value = value.to_local() if tuple(value.placements) == info.placements \
                        and value.to_local().shape == dst.shape else local_of_full(value.full_tensor(), info)
                else:
                    if tuple(value.shape) != tuple(info.logical_shape):
                        raise RuntimeError(f"size mismatch for {fqn}: copying a param with shape {tuple(value.shape)}, "
                                           f"the shape in the current model is {info.logical_shape}")
                    value = local_of_full(value, info)
                dst.copy_(value)
            for key, b in buffers.items():
                if key in state_dict:
                    v = state_dict[key]
                    b.copy_(v.full_tensor() if isinstance(v, DTensor) else v)
        return _compat.incompatible_keys(missing, unexpected)

    def _unmanaged_by_fqn(self) -> dict[str, torch.Tensor]:
        """Buffers and the parameters graphshard leaves alone (FSDP's ignored ones), by the
        user's FQNs: saved and loaded as the plain tensors they are."""
        model = self._fsdp_wrapped_module
        out = {clean_fqn(k): p for k, p in nn.Module.named_parameters(model, remove_duplicate=False)
               if not isinstance(p, DTensor) and not k.endswith(FLAT_PARAM)}
        out.update((clean_fqn(k), b) for k, b in nn.Module.named_buffers(model, remove_duplicate=False))
        return out

    def _local_tensors(self) -> dict[str, torch.Tensor]:
        """LOCAL_STATE_DICT: torch's keys (``layers.0._flat_param``: wrappers left out) -> this
        rank's stored tensor (a flat parameter, an original parameter's local shard, a buffer)."""
        out = {}
        for name, mod in nn.Module.named_modules(self):  # nn.Module.state_dict's order: per module, params then buffers
            pre = clean_fqn(name) + "." if clean_fqn(name) else ""
            for n, p in mod._parameters.items():
                if p is not None:
                    out[pre + n] = p._local_tensor if isinstance(p, DTensor) else p
            for n, b in mod._buffers.items():
                if b is not None and n not in mod._non_persistent_buffers_set:
                    out[pre + n] = b
        return out

    def _load_local(self, state_dict, strict: bool):
        local = self._local_tensors()
        missing = [k for k in local if k not in state_dict]
        unexpected = [k for k in state_dict if k not in local]
        if strict and (missing or unexpected):
            raise RuntimeError(_load_error(type(self._fsdp_wrapped_module).__name__, missing, unexpected))
        with torch.no_grad():
            for key, dst in local.items():
                if key in state_dict:
                    value = state_dict[key]
                    if tuple(value.shape) != tuple(dst.shape):
                        raise RuntimeError(f"size mismatch for {key}: copying a param with shape {tuple(value.shape)}, "
                                           f"the shape in the current model is {tuple(dst.shape)} (a LOCAL_STATE_DICT "
                                           "loads into the same world size and wrapping it was saved with)")
                    dst.copy_(value)
        return _compat.incompatible_keys(missing, unexpected)


def _default_settings() -> StateDictSettings:
    return StateDictSettings(StateDictType.FULL_STATE_DICT, FullStateDictConfig(), FullOptimStateDictConfig())


def _load_error(name: str, missing: list[str], unexpected: list[str]) -> str:
    parts = []
    if unexpected:
        parts.append("Unexpected key(s) in state_dict: " + ", ".join(f'"{k}"' for k in unexpected) + ". ")
    if missing:
        parts.append("Missing key(s) in state_dict: " + ", ".join(f'"{k}"' for k in missing) + ". ")
    return f"Error(s) in loading state_dict for {name}:\n\t" + "\n\t".join(parts)


__all__ = ["StateDictMixin", "FLAT_PARAM"]
