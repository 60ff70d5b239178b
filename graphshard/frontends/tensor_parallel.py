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
import dataclasses
import functools
import itertools
import logging
import re
import warnings
import weakref
from typing import Mapping

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard

from graphshard import _compat, api, storage
from graphshard.frontends import user_styles
from graphshard.plan import Plan, fqn_join, fqn_match as plan_match
from graphshard.styles import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    from_torch,
)

log = logging.getLogger("graphshard")


_PARALLELIZED: "weakref.WeakValueDictionary[int, nn.Module]" = weakref.WeakValueDictionary()
"""The modules this frontend compiled, each the outermost of its calls (`parallelize_module`), by call
number: every rank walks them in the same order (each unshard gathers)."""
_calls = itertools.count()


def _parallelized() -> list[nn.Module]:
    return [m for _, m in sorted(_PARALLELIZED.items(), key=lambda kv: kv[0])]


def _forget(module: nn.Module) -> None:
    for k, m in list(_PARALLELIZED.items()):
        if m is module:
            del _PARALLELIZED[k]


def parallelize_module(
    module: nn.Module,
    device_mesh: DeviceMesh | None = None,
    parallelize_plan: ParallelStyle | Mapping[str, ParallelStyle] | None = None,
    **compile_options,
) -> nn.Module:
    """Applies ``parallelize_plan`` (a style for ``module`` itself, or a dict from submodule
    FQN glob to style) over the 1-D ``device_mesh`` (default: the mesh of the enclosing
    ``with mesh:``) and compiles ``module`` with graphshard. Returns ``module``.

    Styles are graphshard's (the documented ones, same arguments as torch's) or a user's own
    subclass of torch's ``ParallelStyle`` whose ``_apply`` calls ``distribute_module``
    (`graphshard.frontends.user_styles`). A module object reachable under several FQNs is
    parallelized once. Several calls on one model, in any order (the root, then each block;
    each block, then the root), make one plan: each call gathers what the earlier ones sharded and
    shards and compiles the outermost module with all their styles, so the result is that of one
    call with the merged plan. A module styled by two calls is a ValueError.
    ``**compile_options``: `graphshard.compile`'s keywords (``lower="eager"`` ...); a later call's
    options add to the earlier calls'.
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
    if isinstance(parallelize_plan, (ParallelStyle, user_styles.TorchStyle)):
        parallelize_plan = {"": parallelize_plan}
    elif not isinstance(parallelize_plan, Mapping):
        raise ValueError(
            f"parallelize_plan must be a ParallelStyle or a dict from module FQN to ParallelStyle, "
            f"got {type(parallelize_plan).__name__}"
        )
    # torch's own styles are graphshard's of the same arguments (a script keeps its style imports)
    parallelize_plan = {key: from_torch(style) or style for key, style in parallelize_plan.items()}
    for key, style in parallelize_plan.items():
        if not isinstance(style, ParallelStyle) and not user_styles.is_user_style(style):
            raise ValueError(
                f"parallelize_plan[{key!r}] is {style!r}; expected a ParallelStyle: ColwiseParallel(), "
                "RowwiseParallel(), SequenceParallel(), PrepareModuleInput(), PrepareModuleOutput(), "
                "PrepareModuleInputOutput() (graphshard's or torch's), or your own subclass of torch's ParallelStyle "
                "whose _apply calls distribute_module"
            )
    target, rules = _merged(module, device_mesh, dict(parallelize_plan))
    options = {**getattr(target, "_graphshard_tp_options", {}), **compile_options}
    config = api.compile_config("parallelize_module", **options)  # an unknown keyword fails before anything changes
    for earlier in [m for m in _parallelized() if m is target or _inside(m, target)]:
        storage.unshard(earlier, within=target)  # gathers what an earlier call sharded: the merged plan shards it again
        _forget(earlier)
    plan_rules = user_styles.expand(target, device_mesh, rules)
    api.compile(target, Plan(device_mesh, plan_rules), **dataclasses.asdict(config))
    local_outputs = [k for k, st in rules.items() if _hands_on_pieces(st)]
    if local_outputs:
        _compat.wrap_compiled_call(target, _reading_local_outputs(local_outputs, storage.state_of(target), target))
    target._graphshard_tp_rules = rules  # what the next call on this model merges with
    target._graphshard_tp_options = options
    _PARALLELIZED[next(_calls)] = target
    return module


def _hands_on_pieces(style) -> bool:
    """Whether torch hands the code after a module with ``style`` its output's local piece: a sharded
    output layout with ``use_local_output=True``."""
    if not getattr(style, "use_local_output", False):
        return False
    if isinstance(style, SequenceParallel):
        return True
    if isinstance(style, PrepareModuleInputOutput):
        style = style.prepare_module_output
    if isinstance(style, PrepareModuleOutput):
        return any(isinstance(p, Shard) for p in style.desired_output_layouts)
    return isinstance(getattr(style, "output_layouts", None), Shard)


def _reading_local_outputs(keys: list[str], state, target: nn.Module):
    """A wrap of the compiled call for a model with sharded outputs declared ``use_local_output=True``.
    graphshard reads such an output whole inside the model, so that hard-coded global head counts
    run. When that trace fails on a shape (dynamo's fake-tensor error) before any graph compiled,
    the code after those modules is sized for the piece, as torch hands it on (its recipe:
    ``attn.n_heads = n_heads // tp``): the call is traced again reading each such output as each
    rank's piece (`ShardedModel.local_outputs`), as torch does. A second failure is raised, naming
    the option."""
    def wrap(call):
        @functools.wraps(call)
        def compiled_call(*args, **kwargs):
            try:
                return call(*args, **kwargs)
            except Exception as e:
                if "when making fake tensor call" not in str(e) or state.explain:
                    raise
                first = e
            if not state.local_outputs:
                storage.read_local_outputs(target)
                if state.dynamo_regions is not None and state.dynamo_regions.marked:
                    # a piece handed from one block to the next is found by its graph inputs, which a traced
                    # body's placeholders hide (`_compat.dynamo_value_is_local`): every block is traced
                    state.dynamo_regions.unmark(first)
                log.info("graphshard: the model's code does not fit the whole outputs of %s (%s); reading them as "
                         "each rank's piece, as torch hands them on (use_local_output=True)", keys, _shape_error(first))
                try:
                    return call(*args, **kwargs)
                except Exception as e:
                    if "when making fake tensor call" not in str(e):
                        raise
                    first = e
            raise NotImplementedError(
                f"tracing failed on a shape ({_shape_error(first)}) after modules whose sharded output is declared "
                f"use_local_output=True ({', '.join(map(repr, keys[:6]))}{' ...' if len(keys) > 6 else ''}), read "
                "whole and read as each rank's piece: set use_local_output=False on those styles (a DTensor "
                "output, whose shape is the whole one under torch too) and keep the model's global sizes, or size "
                "the views with -1") from first
        return compiled_call
    return wrap


def _shape_error(e: BaseException) -> str:
    shape = re.search(r"got RuntimeError\((.*?)\)\n", str(e))
    return shape.group(1) if shape else str(e).splitlines()[0][:300]


def _inside(inner: nn.Module, outer: nn.Module) -> bool:
    return inner is not outer and any(m is inner for m in outer.modules())


def _fqn_in(outer: nn.Module, inner: nn.Module) -> str | None:
    return next((fqn for fqn, m in outer.named_modules() if m is inner), None)


def _merged(module: nn.Module, mesh: DeviceMesh, plan: dict) -> tuple[nn.Module, dict]:
    """The module to compile and its merged plan: ``module``'s, with the plans of the earlier calls
    on it, on a module that holds it (then that one is compiled) or on modules it holds."""
    outer = next((m for m in _parallelized() if m is module or _inside(module, m)), None)
    earlier: list[tuple[nn.Module, str]] = []  # (a module an earlier call compiled, its FQN in the target)
    if outer is not None:
        target, prefix = outer, _fqn_in(outer, module)
        earlier.append((outer, ""))
    else:
        target, prefix = module, ""
        earlier.extend((m, _fqn_in(module, m)) for m in _parallelized() if _inside(m, module))
    if storage.state_of(target) is not None and not any(m is target for m in _parallelized()):
        raise ValueError(f"{type(target).__name__} is already sharded by graphshard (graphshard.compile or another "
                         "frontend); parallelize_module applies to a model that only parallelize_module has sharded")
    rules: dict = {}
    for mod, at in earlier:
        state = storage.state_of(mod)
        if state.plan.mesh != mesh:
            raise ValueError(
                f"parallelize_module: {type(module).__name__} is parallelized over mesh {mesh}, but an earlier call "
                f"parallelized {type(mod).__name__}{f' ({at!r})' if at else ''} over {state.plan.mesh}; every call "
                "on one model takes the same tensor-parallel mesh")
        rules.update({fqn_join(at, k): v for k, v in mod._graphshard_tp_rules.items()})
    styled = _styled_modules(target, rules)
    for key, style in plan.items():
        full = fqn_join(prefix, key)
        for fqn, mod in target.named_modules():
            if plan_match(fqn, full) and id(mod) in styled:
                before, by = styled[id(mod)]
                raise ValueError(
                    f"module {fqn!r} was parallelized by an earlier parallelize_module call ({by!r}: {before!r}); a "
                    f"module takes one style (torch would stack both styles' hooks): drop {key!r} from this plan")
        rules[full] = style
    return target, rules


def _styled_modules(root: nn.Module, rules: dict) -> dict[int, tuple]:
    out = {}
    for key, style in rules.items():
        for fqn, mod in root.named_modules():
            if plan_match(fqn, key):
                out.setdefault(id(mod), (style, key))
    return out


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
    "PrepareModuleInputOutput",
    "ParallelStyle",
]
