"""``FullyShardedDataParallel``: torch's FSDP1 wrapper, built as a graphshard plan and compiled.

The root instance decides the units (``auto_wrap_policy``, by torch's traversal in
``graphshard.fsdp.wrap``, or the instances already in the model: nested construction,
`_nesting`), builds one `Plan` with a unit spec per unit (the sharding strategy, mixed
precision and ``use_orig_params`` of that unit), shards the model with `graphshard.shard`
and compiles the whole model as one program. Each unit is then a real
``FullyShardedDataParallel`` instance in the module tree, holding the unit's module as
``_fsdp_wrapped_module``, so FQNs, ``named_parameters()`` and ``fsdp_modules`` read as torch's.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import threading
from typing import Any, Callable, Iterable, Iterator

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import (
    BackwardPrefetch,
    CPUOffload,
    MixedPrecision,
    ShardingStrategy,
)
from torch.distributed.fsdp import FullyShardedDataParallel as _TorchFSDP
from torch.distributed.tensor import DTensor

from graphshard import _compat
from graphshard.api import compile_config, compile_sharded
from graphshard.compiler.grad_sync import no_sync
from graphshard.config import CompileConfig
from graphshard.frontends.fsdp._common import WRAPPED, clean_fqn, local_of_full
from graphshard.frontends.fsdp._nesting import Snapshot, nested_units, take_wrappers
from graphshard.frontends.fsdp._optim_state import OptimStateMixin
from graphshard.frontends.fsdp._state_dict import StateDictMixin, fsdp_instances
from graphshard.frontends.fsdp.wrap import decide_units
from graphshard.plan import FullyShard, Plan, Replicate
from graphshard.sharding import FLAT_PARAM, ShardedParam
from graphshard.compiler.explain import ModelFallback
from graphshard.storage import in_forward, shard, state_of

class _Summoned(threading.local):
    """Per-thread: parameter key -> the full parameter a ``summon_full_params`` exposes."""

    def __init__(self):
        self.full: dict[str, torch.Tensor] = {}


_summoned = _Summoned()


class FullyShardedDataParallel(StateDictMixin, OptimStateMixin, nn.Module):
    """torch's ``FullyShardedDataParallel`` (FSDP1), same signature and behaviour, compiled by
    graphshard: one program for the whole model, one all-gather and one reduce-scatter per
    unit, scheduled by ``backward_prefetch`` / ``forward_prefetch`` / ``limit_all_gathers``."""

    def __init__(
        self,
        module: nn.Module,
        process_group=None,
        sharding_strategy: ShardingStrategy | None = None,
        cpu_offload: CPUOffload | None = None,
        auto_wrap_policy=None,
        backward_prefetch: BackwardPrefetch | None = BackwardPrefetch.BACKWARD_PRE,
        mixed_precision: MixedPrecision | None = None,
        ignored_modules: Iterable[nn.Module] | None = None,
        param_init_fn: Callable[[nn.Module], None] | None = None,
        device_id: int | torch.device | None = None,
        sync_module_states: bool = False,
        forward_prefetch: bool = False,
        limit_all_gathers: bool = True,
        use_orig_params: bool = False,
        ignored_states=None,
        device_mesh: DeviceMesh | None = None,
        **compile_options,
    ):
        super().__init__()
        _check_module(module)
        strategy = sharding_strategy or ShardingStrategy.FULL_SHARD
        if not isinstance(strategy, ShardingStrategy):
            raise ValueError(f"sharding_strategy={sharding_strategy!r}: expected a ShardingStrategy")
        if mixed_precision is not None and not isinstance(mixed_precision, MixedPrecision):
            raise ValueError(f"mixed_precision={mixed_precision!r}: expected a torch.distributed.fsdp.MixedPrecision")
        if ignored_modules is not None and ignored_states is not None:
            raise ValueError(
                "FullyShardedDataParallel got both ignored_modules and ignored_states; pass one of them "
                "(ignored_states takes the modules and parameters together)"
            )
        ignored = _ignored(module, ignored_modules, ignored_states)
        mesh = _mesh_for(strategy, process_group, device_mesh, device_id)
        if cpu_offload is not None and cpu_offload.offload_params and mesh.device_type != "cpu":
            raise NotImplementedError(
                "graphshard.fsdp: CPUOffload(offload_params=True) on a GPU mesh is not supported yet (sharded "
                "parameters stay on the device); drop cpu_offload, or shard over more ranks to fit the model"
            )
        self._config = _Config(strategy=strategy, mixed_precision=mixed_precision, use_orig_params=use_orig_params,
                               cpu_offload=cpu_offload or CPUOffload(), mesh=mesh, plan=None,
                               backward_prefetch=backward_prefetch, forward_prefetch=forward_prefetch,
                               limit_all_gathers=limit_all_gathers, notes=[])
        self._own_config = self._config  # what this instance was built with, kept as a unit of another root
        self._spec_args = {"sharding_strategy": strategy, "mixed_precision": mixed_precision}
        self._compile_options = dict(compile_options)
        compile_config("FullyShardedDataParallel", **compile_options)  # an unknown keyword fails before any change
        nested, rank_local, wrappers = [], [], {}
        if any(isinstance(m, FullyShardedDataParallel) for m in module.modules()):
            if auto_wrap_policy is not None:
                raise ValueError(
                    f"FullyShardedDataParallel got an auto_wrap_policy for a {type(module).__name__} that already holds "
                    "FullyShardedDataParallel instances; as in torch's FSDP1, auto-wrapping needs a model without "
                    "FSDP applied: drop auto_wrap_policy (the inner instances are the units), or pass the unwrapped model")
            wrappers = take_wrappers(module, FullyShardedDataParallel)  # inner roots released: every rank joins
            nested, rank_local = nested_units(module, wrappers, self._config, {**self._spec_args,
                                                                                "compile_options": self._compile_options})
            for w in {id(w): w for w in wrappers.values()}.values():  # torch: an inner instance's ignored are the root's
                inner_mods, inner_params = w.__dict__.get("_ignored_sets", (set(), set()))
                ignored = (ignored[0] | inner_mods, ignored[1] | inner_params)
            ignored = (ignored[0] | {mod for _, mod, _ in rank_local}, ignored[1])
        self._ignored_sets = ignored
        device = _compute_device(mesh.device_type, device_id)
        _materialize(module, param_init_fn, device, ignored[0])
        _move_to(module, device, ignored)  # as torch's FSDP moves the module to device_id: parameters and buffers
        if sync_module_states:
            _broadcast_from_rank0(module, ignored)
        _original_state_dict_keys = list(module.state_dict().keys())
        self._unsharded_keys = _ignored_keys(module, *ignored)
        self._buffer_dtypes = {name: b.dtype for name, b in module.named_buffers()}
        self._fsdp_wrapped_module = module
        full_precision = tuple(mixed_precision._module_classes_to_ignore) if mixed_precision is not None else ()
        if nested or rank_local:
            units = nested + [("", module, {})]
        else:
            units = decide_units(module, auto_wrap_policy, ignored_modules=ignored[0], ignored_params=ignored[1],
                                 full_precision_classes=full_precision)
        if auto_wrap_policy is not None and len(units) == 1:
            raise ValueError(
                f"auto_wrap_policy {_policy_name(auto_wrap_policy)} wraps no submodule of {type(module).__name__}: the "
                "whole model would be one unit, gathered at once. Name the block class (ModuleWrapPolicy({YourBlock})), "
                "lower min_num_params, or pass auto_wrap_policy=None to shard the model as one unit on purpose"
            )
        specs, low_precision_grads = {}, {}
        for fqn, _mod, overrides in units:
            unit_strategy = overrides.get("sharding_strategy", strategy)
            unit_mp = overrides.get("mixed_precision", mixed_precision)
            specs[fqn] = _unit_spec(unit_strategy, unit_mp, use_orig_params, mesh)
            if unit_mp is not None and unit_mp.keep_low_precision_grads and unit_mp.param_dtype is not None:
                low_precision_grads[fqn] = unit_mp.param_dtype
        plan = Plan(mesh, {_exact_glob(fqn): spec for fqn, spec in specs.items()},
                    ignored_params=_ignored_globs(module, *ignored))
        self._snapshot = Snapshot(module)  # what `_release` undoes if an outer instance absorbs this one
        shard(module, plan, cast_forward_inputs=False)  # FSDP1 casts inputs by its own MixedPrecision flags (forward)
        state = state_of(module)
        if not state.units:
            raise ValueError(f"{type(module).__name__} has no parameters to shard; FullyShardedDataParallel needs some")
        self._graphshard = state
        for fqn, dtype in low_precision_grads.items():
            if fqn in state.units and state.units[fqn].flat is not None:
                state.units[fqn].flat.param.register_post_accumulate_grad_hook(functools.partial(_keep_grad_in, dtype))
        self._config.plan = plan
        state.preamble.extend(ModelFallback(note) for note in self._config.notes)
        self._unit_fqn = ""
        self.__dict__["_root"] = self  # not a submodule (that would be a cycle in the module tree)
        children = _parents_of(module)
        for fqn, mod, overrides in units + [(fqn, mod, None) for fqn, mod, _ in rank_local]:
            if fqn == "":
                continue
            inner = wrappers.get(id(mod))
            if inner is not None:  # nested construction: the user's instance becomes the unit
                wrapper = inner._become_unit(fqn, self)
            else:
                wrapper = FullyShardedDataParallel._unit(mod, fqn, self)
                wrapper._full_precision = bool(full_precision) and isinstance(mod, tuple(set(full_precision)))
                wrapper._spec_args = {"sharding_strategy": overrides.get("sharding_strategy", strategy),
                                      "mixed_precision": overrides.get("mixed_precision", mixed_precision)}
            for parent, name in children.get(id(mod), ()):
                parent._modules[name] = wrapper
        self._sd_keys = list(_original_state_dict_keys)
        if mixed_precision is not None:
            _cast_buffers(module, mixed_precision.buffer_dtype, ignored[0],
                          full_precision if auto_wrap_policy is not None else ())
        keys = frozenset(self.__dict__)
        compile_sharded(self, module, compile_config("FullyShardedDataParallel", self._compile_config(), **compile_options))
        self._compile_keys = frozenset(self.__dict__) - keys
        _compat.wrap_compiled_call(self, functools.partial(_marking_ran, self))  # outermost: a root that ran stays one

    @classmethod
    def _unit(cls, module: nn.Module, fqn: str, root: "FullyShardedDataParallel") -> "FullyShardedDataParallel":
        """A non-root unit's wrapper: shares the root's configuration and sharded state."""
        unit = cls.__new__(cls)
        nn.Module.__init__(unit)
        unit._fsdp_wrapped_module = module
        unit._unit_fqn = fqn
        unit.__dict__["_root"] = root  # not a submodule
        unit._graphshard = root._graphshard
        unit._config = root._config
        unit._full_precision = False
        unit._ignored_sets = root._ignored_sets
        unit._own_config = root._own_config
        unit._compile_options = root._compile_options
        return unit

    def _become_unit(self, fqn: str, root: "FullyShardedDataParallel") -> "FullyShardedDataParallel":
        """This instance (built by the user inside the model, or by an inner instance's policy) as a unit
        of ``root``: it keeps its own sharding strategy and mixed precision (``_spec_args``)."""
        self._unit_fqn = fqn
        self.__dict__["_root"] = root
        self._graphshard = root._graphshard
        self._config = root._config
        self.__dict__.setdefault("_full_precision", False)
        return self

    def _release(self) -> None:
        """Undoes this root's sharding and compile set-up (`_nesting.Snapshot`): an outer instance is
        absorbing it. Its units' instances were taken out of the tree already (`_nesting.take_wrappers`)."""
        module = self._fsdp_wrapped_module
        self._snapshot.restore(self._graphshard, module)
        self.__class__ = getattr(type(self), "_graphshard_base", type(self))
        for key in self._compile_keys:
            self.__dict__.pop(key, None)
        for key in ("_snapshot", "_compile_keys", "_graphshard", "_sd_settings"):
            self.__dict__.pop(key, None)

    def _compile_config(self) -> CompileConfig:
        """FSDP1's prefetch arguments as graphshard's scheduling settings (``CompileConfig``):
        BACKWARD_PRE / BACKWARD_POST / None -> 'pre' / 'post' / None; ``limit_all_gathers=True``
        -> 2 (FSDP1's rate limiter keeps two all-gathers in flight), False -> None (unbounded)."""
        c = self._config
        backward = {BackwardPrefetch.BACKWARD_PRE: "pre", BackwardPrefetch.BACKWARD_POST: "post", None: None}
        if c.backward_prefetch not in backward:
            raise ValueError(f"backward_prefetch={c.backward_prefetch!r}: expected a BackwardPrefetch or None")
        return CompileConfig(forward_prefetch=bool(c.forward_prefetch), backward_prefetch=backward[c.backward_prefetch],
                             limit_all_gathers=2 if c.limit_all_gathers else None)

    # ------------------------------------------------------------------ module protocol
    @property
    def module(self) -> nn.Module:
        """The wrapped module."""
        return self._fsdp_wrapped_module

    @property
    def _is_root(self) -> bool:
        return self._root is self

    @property
    def sharding_strategy(self) -> ShardingStrategy:
        """This instance's (its unit's) strategy."""
        return self._spec_args["sharding_strategy"]

    @property
    def mixed_precision(self) -> MixedPrecision:
        """This instance's (its unit's) mixed precision."""
        return self._spec_args["mixed_precision"] or MixedPrecision()

    @property
    def process_group(self):
        return self._config.mesh.get_group(self._config.mesh.ndim - 1)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._modules[WRAPPED], name)

    def __getitem__(self, key: int) -> Any:
        return self._modules[WRAPPED].__getitem__(key)

    def forward(self, *args, **kwargs):
        if self.__dict__.get("_full_precision"):
            # a module of MixedPrecision._module_classes_to_ignore: computes in fp32, hands its
            # output back in its input's dtype (torch's FSDP does this with forward hooks)
            dtype = _floating_dtype((args, kwargs))
            out = self._fsdp_wrapped_module(*_cast_floating(args, torch.float32), **_cast_floating(kwargs, torch.float32))
            return out if dtype is None else _cast_floating(out, dtype)
        mp = self._spec_args["mixed_precision"]
        if mp is not None and mp.param_dtype is not None and (
                mp.cast_forward_inputs or (self._is_root and mp.cast_root_forward_inputs)):
            args, kwargs = _cast_floating((args, kwargs), mp.param_dtype)
        return self._fsdp_wrapped_module(*args, **kwargs)

    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        """torch's names (``..._fsdp_wrapped_module._flat_param`` with ``use_orig_params=False``);
        inside ``summon_full_params`` the user's names with the full parameters, as torch."""
        if _summoned.full:
            for fqn, p in super().named_parameters(prefix, recurse, remove_duplicate):
                if not fqn.endswith(FLAT_PARAM) and not isinstance(p, DTensor):  # ignored: plain, as they are
                    yield clean_fqn(fqn), p
            for key, full in _summoned.full.items():
                info = self._graphshard.params[key]
                if _in_unit(info, self._unit_fqn, recurse):
                    yield prefix + _relative(info.fqn, self._unit_fqn), full
            return
        yield from super().named_parameters(prefix, recurse, remove_duplicate)

    def named_buffers(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        names = super().named_buffers(prefix, recurse, remove_duplicate)
        if _summoned.full:
            names = ((clean_fqn(n), b) for n, b in names)
        yield from names

    def apply(self, fn: Callable[[nn.Module], None]) -> "FullyShardedDataParallel":
        """``fn`` on every submodule and ``self`` with the full parameters summoned (written back)."""
        ctx = self.summon_full_params(self, recurse=True, writeback=True) if self._is_root else contextlib.nullcontext()
        with ctx:
            return super().apply(fn)

    def _assert_state(self, state) -> None:
        """torch's FSDP1 check that an instance is in one of ``state`` (a ``TrainingState`` or a list of
        them), which torch's own test harness calls after training: ``IDLE`` outside a forward or
        backward, ``FORWARD_BACKWARD`` inside (the compiled program has no finer states)."""
        names = {getattr(s, "name", s) for s in (state if isinstance(state, (list, tuple, set)) else [state])}
        current = "FORWARD_BACKWARD" if in_forward() or _compat.in_autograd_backward() else "IDLE"
        if current not in names:
            raise AssertionError(f"expected to be in state {sorted(names)} but current state is {current}")

    # ------------------------------------------------------------------ static helpers
    @staticmethod
    def fsdp_modules(module: nn.Module, root_only: bool = False) -> list["FullyShardedDataParallel"]:
        """The ``FullyShardedDataParallel`` instances in ``module``'s tree (``module`` included), in
        pre-order; ``root_only``: only the roots."""
        found = fsdp_instances(module)
        return [m for m in found if m._is_root] if root_only else found

    @staticmethod
    @contextlib.contextmanager
    def summon_full_params(module: nn.Module, recurse: bool = True, writeback: bool = True, rank0_only: bool = False,
                           offload_to_cpu: bool = False, with_grads: bool = False) -> Iterator[None]:
        """The full parameters under the user's names and shapes inside the context; on exit the
        local slice of each (modified) full parameter is written back unless ``writeback=False``."""
        if rank0_only and writeback:
            raise NotImplementedError("summon_full_params: rank0_only=True and writeback=True is not supported "
                                      "(parameter shapes would differ across ranks); pass writeback=False")
        roots = FullyShardedDataParallel.fsdp_modules(module)
        if not roots:
            yield
            return
        if torch.compiler.is_compiling() or in_forward() or _compat.in_autograd_backward():
            raise AssertionError("summon_full_params cannot be used within a forward or backward pass, nor can "
                                 "forward and backward be started from within it; call it before or after")
        if with_grads and not roots[0]._config.use_orig_params:
            raise ValueError("summon_full_params(with_grads=True) needs use_orig_params=True, as torch's FSDP")
        root = roots[0]._root
        keys = [key for key, info in root._graphshard.params.items()
                if any(_in_unit(info, w._unit_fqn, recurse) for w in roots)]
        full: dict[str, torch.Tensor] = {}
        for key in keys:
            info = root._graphshard.params[key]
            local = info.local()
            value = info.dtensor_of(local.detach()).full_tensor()  # full precision; every rank joins
            if rank0_only and dist.get_rank() != 0:
                continue
            if offload_to_cpu:
                value = value.cpu()
            p = nn.Parameter(value, requires_grad=local.requires_grad or info.layout.unit is not None)
            if with_grads:
                grad = info.local_grad()
                if grad is not None:
                    p.grad = info.dtensor_of(grad).full_tensor()
            full[key] = p
        if keys and rank0_only and dist.get_rank() != 0:
            full = {}
        saved = dict(_summoned.full)
        _summoned.full.update(full)
        try:
            yield
        finally:
            _summoned.full = saved
            if writeback:
                with torch.no_grad():
                    for key, p in full.items():
                        info = root._graphshard.params[key]
                        info.local().copy_(local_of_full(p.detach(), info))

    def register_comm_hook(self, state: object, hook: Callable) -> None:
        """torch's FSDP hook on the gradient reduction. graphshard compiles the reduction into
        the backward program, so it cannot call a Python hook there: torch's default reductions
        (``default_hooks.allreduce_hook`` for NO_SHARD, ``reduce_scatter_hook`` otherwise) are
        what it runs already and are accepted; every other hook is refused, naming the
        equivalent setting where one exists (the compress hooks: ``MixedPrecision(reduce_dtype=...)``)."""
        if not self._is_root:
            raise AssertionError("register_comm_hook can only be called on the root FullyShardedDataParallel instance")
        default_hooks = _compat.fsdp_default_hooks()
        name = getattr(hook, "__name__", type(hook).__name__)
        expected = "allreduce_hook" if self._config.strategy == ShardingStrategy.NO_SHARD else "reduce_scatter_hook"
        if hook is getattr(default_hooks, expected):
            return  # graphshard's own reduction
        compress = {"fp16_compress_hook": "torch.float16", "bf16_compress_hook": "torch.bfloat16"}
        if name in compress:
            raise NotImplementedError(
                f"graphshard.fsdp runs the gradient reduction inside the compiled backward and cannot call {name}; "
                f"MixedPrecision(reduce_dtype={compress[name]}) reduces in that dtype the same way: pass it to "
                "FullyShardedDataParallel instead of registering the hook"
            )
        raise NotImplementedError(
            f"graphshard.fsdp cannot run the communication hook {name!r}: the gradient reduction is compiled into the "
            "backward program (one reduce-scatter or all-reduce per unit). Use torch's FullyShardedDataParallel for "
            "custom hooks, or express the change as MixedPrecision(reduce_dtype=...)"
        )

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Within the context, backward passes accumulate gradients on each rank without
        communication; the first backward after it reduces them with its own, so the result
        equals one step on the concatenated micro-batches. Root instance only (as torch's).
        The backward without reductions is compiled once, on first use (`graphshard.no_sync`)."""
        if not self._is_root:
            raise RuntimeError(f"no_sync() on the unit {self._unit_fqn!r}: call it on the root FullyShardedDataParallel "
                               "(torch's FSDP does not support no_sync on inner instances either)")
        with no_sync(self._fsdp_wrapped_module):
            yield

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clips the gradients of every parameter of the model by their total norm (computed over
        all ranks' shards, as torch's FSDP); returns the total norm. Root instance only."""
        if not self._is_root:
            raise RuntimeError(
                f"clip_grad_norm_ should only be called on the root FSDP instance; it was called on the unit "
                f"{self._unit_fqn!r}: call it on the model's outermost FullyShardedDataParallel"
            )
        from graphshard.frontends.fsdp._norm import clip_grad_norm

        return clip_grad_norm(self, max_norm, norm_type)


class _Config:
    def __init__(self, **kw):
        self.__dict__.update(kw)


def _check_module(module) -> None:
    """A module this instance may wrap: graphshard's own instances inside it are units (nested
    construction); torch's, or a module sharded by graphshard otherwise, are errors."""
    if not isinstance(module, nn.Module):
        raise ValueError(f"FullyShardedDataParallel wraps an nn.Module, got {type(module).__name__}")
    if isinstance(module, FullyShardedDataParallel):
        raise ValueError("FullyShardedDataParallel got a FullyShardedDataParallel instance to wrap; wrap its module "
                         "(.module) once, or wrap the model that holds it")

    def visit(m: nn.Module, fqn: str) -> None:
        if isinstance(m, _TorchFSDP):
            raise ValueError(
                f"module {fqn or '<root>'!r} is already wrapped by torch's FullyShardedDataParallel; graphshard.fsdp "
                "and torch's FSDP do not nest: wrap the plain model with one of them"
            )
        if isinstance(m, FullyShardedDataParallel):
            return  # nested construction: a unit of this instance (`_nesting`)
        if state_of(m) is not None:
            raise NotImplementedError(
                f"module {fqn or '<root>'!r} is already sharded by graphshard (graphshard.compile or shard); "
                "FullyShardedDataParallel wraps unsharded modules and its own instances: wrap the unsharded model"
            )
        for name, child in m._modules.items():
            if child is not None:
                visit(child, f"{fqn}.{name}" if fqn else name)

    visit(module, "")


def _marking_ran(fsdp: "FullyShardedDataParallel", call: Callable) -> Callable:
    """A root's compiled call that notes its first run: from then on it stays a root (`_nesting`)."""
    def call_and_mark(*args, **kwargs):
        if "_ran" not in fsdp.__dict__:
            fsdp.__dict__["_ran"] = True
            fsdp.__dict__.pop("_snapshot", None)
        return call(*args, **kwargs)

    return call_and_mark


def _ignored(module: nn.Module, ignored_modules, ignored_states) -> tuple[set, set]:
    mods, params = set(), set()
    kinds = {type(x) is nn.Parameter or isinstance(x, nn.Parameter) for x in ignored_states or ()}
    if len(kinds) > 1:
        raise ValueError("ignored_states takes all parameters or all modules, as torch's FSDP; got both: pass the "
                         "modules' parameters instead of the modules (or only modules)")
    for x in list(ignored_modules or ()) + list(ignored_states or ()):
        if isinstance(x, nn.Module):
            if isinstance(x, FullyShardedDataParallel):
                raise ValueError("ignored_modules must not contain FullyShardedDataParallel instances")
            mods.add(x)
        elif isinstance(x, nn.Parameter):
            params.add(x)
        else:
            raise ValueError(f"ignored_states takes modules and parameters, got {type(x).__name__}")
    return mods, params


def _ignored_keys(module: nn.Module, modules: set, params: set) -> set[str]:
    """The state-dict keys FSDP does not manage: the parameters and buffers of ignored modules (and
    everything under them) and ignored parameters. torch's FULL state dict with ``rank0_only`` keeps
    these on every rank."""
    keys = {fqn for fqn, p in module.named_parameters(remove_duplicate=False) if p in params}
    for fqn, m in module.named_modules(remove_duplicate=False):
        if m in modules:
            pre = fqn + "." if fqn else ""
            keys.update(pre + k for k in m.state_dict())
    return keys


def _policy_name(policy) -> str:
    fn = getattr(policy, "func", policy)
    return getattr(fn, "__name__", type(policy).__name__)


def _ignored_globs(module: nn.Module, modules: set, params: set) -> list[str]:
    """Plan ``ignored_params`` globs for FSDP's ignored modules (every parameter under them)
    and ignored parameters (their FQNs)."""
    if module in modules:
        raise ValueError("ignored_modules contains the wrapped module itself; FullyShardedDataParallel would have "
                         "nothing to shard: leave it unwrapped instead")
    named = dict(module.named_modules(remove_duplicate=False))
    globs = [_exact_glob(fqn) + ".**" for fqn, m in named.items() if m in modules and any(True for _ in m.parameters())]
    for fqn, p in module.named_parameters(remove_duplicate=False):
        if p in params:
            globs.append(_exact_glob(fqn))
    missing = params - set(module.parameters())
    if missing:
        raise ValueError(f"ignored_states has {len(missing)} parameter(s) that are not in the wrapped "
                         f"{type(module).__name__}; pass only its own parameters")
    return globs


def _mesh_for(strategy: ShardingStrategy, process_group, device_mesh, device_id) -> DeviceMesh:
    """The mesh graphshard shards over: ("dp",) or, for hybrid sharding, ("replicate", "shard")."""
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError("FullyShardedDataParallel needs a process group: call torch.distributed.init_process_group() "
                         "(launch with torchrun) first")
    device = _device_type(device_id)
    hybrid = strategy in (ShardingStrategy.HYBRID_SHARD, ShardingStrategy._HYBRID_SHARD_ZERO2)
    if device_mesh is not None and process_group is not None:
        raise ValueError("pass either process_group or device_mesh to FullyShardedDataParallel, not both")
    if device_mesh is not None:
        if device_mesh.ndim != (2 if hybrid else 1):
            raise ValueError(f"{strategy.name} takes a {2 if hybrid else 1}-D device_mesh, got {device_mesh.ndim}-D")
        names = ("replicate", "shard") if hybrid else ("dp",)
        if device_mesh.mesh_dim_names == names:
            return device_mesh
        groups = [device_mesh.get_group(i) for i in range(device_mesh.ndim)]
        return DeviceMesh.from_group(groups if hybrid else groups[0], device_mesh.device_type,
                                     mesh=device_mesh.mesh, mesh_dim_names=names)
    if not hybrid:
        group = process_group or dist.group.WORLD
        if isinstance(group, tuple):
            raise ValueError(f"a (shard, replicate) process-group pair is for hybrid sharding, not {strategy.name}")
        return DeviceMesh.from_group(group, device, mesh_dim_names=("dp",))
    if process_group is None:  # torch's default: shard within a node, replicate across nodes
        local = int(torch.cuda.device_count()) if device == "cuda" else _local_world_size()
        world = dist.get_world_size()
        return init_device_mesh(device, (world // local, local), mesh_dim_names=("replicate", "shard"))
    if not (isinstance(process_group, tuple) and len(process_group) == 2):
        raise ValueError(f"{strategy.name} takes process_group=(shard_group, replicate_group) or a 2-D device_mesh")
    shard_pg, replicate_pg = process_group
    rows = [None] * dist.get_world_size()
    dist.all_gather_object(rows, (dist.get_process_group_ranks(replicate_pg).index(dist.get_rank()),
                                  dist.get_process_group_ranks(shard_pg).index(dist.get_rank())))
    n_rep, n_shard = dist.get_world_size(replicate_pg), dist.get_world_size(shard_pg)
    layout = torch.empty(n_rep, n_shard, dtype=torch.int)
    for rank, (i, j) in enumerate(rows):
        layout[i, j] = rank
    return DeviceMesh.from_group([replicate_pg, shard_pg], device, mesh=layout, mesh_dim_names=("replicate", "shard"))


def _local_world_size() -> int:
    import os

    return int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size()))


def _device_type(device_id) -> str:
    if device_id is None:  # NCCL, alone or as the CUDA backend of a "cpu:gloo,cuda:nccl" group
        backend = str(dist.get_backend())
        return "cuda" if torch.cuda.is_available() and (backend == "nccl" or "cuda:nccl" in backend) else "cpu"
    if isinstance(device_id, int):
        return "cuda"
    return torch.device(device_id).type


def _compute_device(device_type: str, device_id) -> torch.device:
    """The device the shards live on: the CPU, or the current CUDA device, which ``device_id`` (an
    int or a CUDA device) must name when given."""
    if device_type != "cuda":
        return torch.device(device_type)
    current = torch.device("cuda", torch.cuda.current_device())
    if device_id is not None:
        wanted = torch.device("cuda", device_id) if isinstance(device_id, int) else torch.device(device_id)
        if wanted.index is not None and wanted != current:
            raise ValueError(
                f"device_id={device_id!r} is not the current CUDA device ({current}); graphshard places the shards "
                f"on the current device: call torch.cuda.set_device({wanted.index}) before wrapping (or pass "
                "device_id=torch.cuda.current_device())"
            )
    return current


def _move_to(module: nn.Module, device: torch.device, ignored: tuple[set, set]) -> None:
    """The managed modules' parameters and buffers on ``device`` (ignored modules and parameters stay)."""
    skip = {m for top in ignored[0] for m in top.modules()}
    with torch.no_grad():
        for m in module.modules():
            if m in skip:
                continue
            for p in m.parameters(recurse=False):
                if p not in ignored[1] and p.device != device:
                    p.data = p.data.to(device)
            for name, b in m._buffers.items():
                if b is not None and b.device != device:
                    m._buffers[name] = b.to(device)


def _keep_grad_in(dtype: torch.dtype, flat_param: nn.Parameter) -> None:
    """``keep_low_precision_grads``: a flat parameter's gradient in ``param_dtype`` after each
    accumulation, as torch's FSDP1 keeps it (autograd hands it over in the parameter's dtype,
    holding values reduced from ``param_dtype`` gradients; this rounds them as torch's cast does)."""
    if flat_param.grad is not None and flat_param.grad.dtype != dtype:
        flat_param.grad.data = flat_param.grad.data.to(dtype)


def _unit_spec(strategy: ShardingStrategy, mp: MixedPrecision | None, use_orig_params: bool, mesh: DeviceMesh):
    dtypes = {}
    if mp is not None:
        dtypes = dict(param_dtype=mp.param_dtype, reduce_dtype=mp.reduce_dtype)
        if mp.keep_low_precision_grads and use_orig_params:
            raise NotImplementedError(
                "graphshard.fsdp: MixedPrecision(keep_low_precision_grads=True) needs use_orig_params=False: a "
                "DTensor parameter's gradient keeps the parameter's dtype. Use flat parameters (the default), or "
                "drop keep_low_precision_grads")
    flat = not use_orig_params
    if strategy == ShardingStrategy.NO_SHARD:
        return Replicate(flat_params=flat, **dtypes)
    reshard = strategy in (ShardingStrategy.FULL_SHARD, ShardingStrategy.HYBRID_SHARD)
    hybrid = strategy in (ShardingStrategy.HYBRID_SHARD, ShardingStrategy._HYBRID_SHARD_ZERO2)
    return FullyShard(reshard_after_forward=reshard, flat_params=flat, shard_axis="shard" if hybrid else None, **dtypes)


def _exact_glob(fqn: str) -> str:
    if any(c in fqn for c in "*?["):
        raise NotImplementedError(f"module FQN {fqn!r} has a glob character; graphshard.fsdp cannot name it as a unit")
    return fqn


def _parents_of(root: nn.Module) -> dict[int, list[tuple[nn.Module, str]]]:
    """module id -> every (parent, attribute name) that holds it (a shared module has several)."""
    out: dict[int, list] = {}
    seen = set()
    for parent in root.modules():
        if id(parent) in seen:
            continue
        seen.add(id(parent))
        for name, child in parent._modules.items():
            if child is not None:
                out.setdefault(id(child), []).append((parent, name))
    return out


def _in_unit(info: ShardedParam, unit_fqn: str, recurse: bool) -> bool:
    if recurse:
        return unit_fqn == "" or any(f == unit_fqn or f.startswith(unit_fqn + ".") for f in info.layout.fqns)
    return info.layout.unit == unit_fqn


def _relative(fqn: str, unit_fqn: str) -> str:
    return fqn[len(unit_fqn) + 1:] if unit_fqn else fqn


def _cast_floating(tree, dtype: torch.dtype):
    return torch.utils._pytree.tree_map_only(
        torch.Tensor, lambda t: t.to(dtype) if torch.is_floating_point(t) else t, tree)


def _cast_buffers(module: nn.Module, dtype: torch.dtype | None, ignored: set, full_precision: tuple) -> None:
    """``MixedPrecision.buffer_dtype``: the buffers of managed modules held in ``dtype`` (state
    dicts save them in their original dtype, as torch's FSDP); those of ignored modules and of
    the full-precision units (``_module_classes_to_ignore``) keep theirs."""
    if dtype is None:
        return
    tops = set(ignored) | {m for m in module.modules() if full_precision and isinstance(m, tuple(set(full_precision)))}
    skip = {m for top in tops for m in top.modules()}
    for m in module.modules():
        if m in skip:
            continue
        for name, b in m._buffers.items():
            if b is not None and torch.is_floating_point(b):
                m._buffers[name] = b.to(dtype)


def _floating_dtype(tree) -> torch.dtype | None:
    leaves = [t for t in torch.utils._pytree.tree_leaves(tree) if isinstance(t, torch.Tensor) and t.is_floating_point()]
    return leaves[0].dtype if leaves else None


def _materialize(module: nn.Module, param_init_fn, device: torch.device, ignored: set) -> None:
    """Meta-device modules: ``param_init_fn`` on each module holding meta tensors, else
    ``to_empty`` + ``reset_parameters`` per module, children never re-initialized; ignored
    modules are left as they are (as torch's FSDP)."""
    ignored = {m for top in ignored for m in top.modules()}
    has_meta = any(t.is_meta for m in module.modules() if m not in ignored
                   for t in itertools.chain(m.parameters(recurse=False), m.buffers(recurse=False)))
    if not has_meta:
        if param_init_fn is not None:
            raise ValueError("param_init_fn is for modules on the meta device; this module has no meta tensors")
        return
    for m in module.modules():
        own = list(m.parameters(recurse=False)) + list(m.buffers(recurse=False))
        if m in ignored or not any(t.is_meta for t in own):
            continue
        if param_init_fn is not None:
            param_init_fn(m)
            continue
        m.to_empty(device=device, recurse=False)
        reset = getattr(m, "reset_parameters", None)
        if not callable(reset):
            raise ValueError(f"module {type(m).__name__} is on the meta device and has no reset_parameters(); "
                             "pass param_init_fn to FullyShardedDataParallel to initialize it")
        with torch.no_grad():
            reset()


def _broadcast_from_rank0(module: nn.Module, ignored: tuple[set, set]) -> None:
    """``sync_module_states``: every managed parameter and buffer from global rank 0 (ignored
    modules' and parameters' stay as each rank has them, as torch's FSDP)."""
    skip = {m for top in ignored[0] for m in top.modules()}
    tensors = {id(t): t for m in module.modules() if m not in skip
               for t in itertools.chain(m.parameters(recurse=False), m.buffers(recurse=False)) if t not in ignored[1]}
    with torch.no_grad():
        for t in tensors.values():
            dist.broadcast(t.data, src=0)
