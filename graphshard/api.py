"""Public entry points: shard(), compile(), explain()."""

from __future__ import annotations

import dataclasses
from typing import Literal

import torch.nn as nn

from graphshard.compiler import collective_check, regions
from graphshard.compiler.backend import make_backend
from graphshard.config import CompileConfig
from graphshard.compiler.explain import explain, noting_eager_calls, timing_compiles
from graphshard.plan import Plan
from graphshard import _compat
from graphshard.storage import (checking_new_parameters, counting_compiled_calls, feeding_local_shards,
                                loading_full_tensors, own_forward, shard, state_of)


def compile(
    model: nn.Module,
    plan: Plan,
    *,
    lower: Literal["inductor", "eager"] = "inductor",
    limit_all_gathers: int | None = 2,
    forward_prefetch: bool = True,
    backward_prefetch: Literal["pre", "post"] | None = "pre",
    regional: bool = True,
    strict: bool = False,
    dump_graphs: str | None = None,
    batch_cpp_kernels: bool = False,
    fast_isa_check: bool = False,
    share_compile: bool = True,
    check_collectives: bool = True,
    trace_once: bool = True,
    program_cache: bool = True,
) -> nn.Module:
    """Shards ``model`` by ``plan`` and compiles it with graphshard; returns the same module.

    The module keeps its FQNs (no wrapper prefix); its parameters are sharded
    DTensors; the first call traces and compiles forward and backward. The keywords are
    ``CompileConfig``'s fields; ``forward_prefetch``, ``backward_prefetch`` and
    ``limit_all_gathers`` say where each unit's all-gather is issued (FSDP1's settings).
    """
    config = CompileConfig(lower=lower, limit_all_gathers=limit_all_gathers, forward_prefetch=forward_prefetch,
                           backward_prefetch=backward_prefetch, regional=regional, strict=strict,
                           dump_graphs=dump_graphs, batch_cpp_kernels=batch_cpp_kernels,
                           fast_isa_check=fast_isa_check, share_compile=share_compile,
                           check_collectives=check_collectives, trace_once=trace_once,
                           program_cache=program_cache)
    if state_of(model) is None:
        shard(model, plan)
        loading_full_tensors(model)  # load_state_dict takes a full state dict (FSDP2's full_state_dict load)
    elif state_of(model).plan is not plan:
        raise ValueError(f"{type(model).__name__} is already sharded with another plan; shard a fresh model")
    return compile_sharded(model, model, config)


def compile_sharded(module: nn.Module, root: nn.Module, config: CompileConfig) -> nn.Module:
    """The one place graphshard compiles: ``module`` (the sharded ``root`` itself, or a frontend's wrapper
    around it) with the backend bound to ``root``'s `ShardedModel` and ``config``."""
    state = state_of(root)
    if config.trace_once and not state.dynamo_regions:
        state.dynamo_regions = regions.mark_repeated_units(root, state)
    if module is not root:  # a frontend's wrapper (FSDP1's root instance): its class's forward is every wrapper's
        own_forward(module)
    module.compile(backend=make_backend(state, config))
    name = type(root).__name__ if module is root else f"{type(module).__name__} around {type(root).__name__}"
    _compat.wrap_compiled_call(module, noting_eager_calls(state, name))  # a call dynamo ran eagerly is logged
    _compat.wrap_compiled_call(module, checking_new_parameters(root, state))  # a submodule set after the compile
    _compat.wrap_compiled_call(module, feeding_local_shards(root, state))  # dynamo sees plain local shards
    _compat.wrap_compiled_call(module, counting_compiled_calls)  # frames dynamo skips read parameters gathered
    if state.dynamo_regions:
        _compat.wrap_compiled_call(module, regions.retrying_unmarked(state.dynamo_regions, lambda: len(state.explain)))
    _compat.wrap_compiled_call(module, timing_compiles(state.explain))  # a retried trace counts too
    if agreeing := collective_check.agreeing_inputs(state, config):  # outermost: before any program runs
        _compat.wrap_compiled_call(module, agreeing)  # model-parallel ranks compare each call's input shapes
    return module


def compile_config(frontend: str, base: CompileConfig | None = None, **options) -> CompileConfig:
    """A frontend's ``**compile_options`` (`graphshard.compile`'s keywords) over ``base`` (what the
    frontend's own arguments set); an unknown keyword is an error naming it."""
    base = base or CompileConfig()
    fields = {f.name for f in dataclasses.fields(CompileConfig)}
    unknown = sorted(set(options) - fields)
    if unknown:
        raise TypeError(f"{frontend} got unexpected keyword argument(s) {unknown}; the compile options it takes "
                        f"are graphshard.compile's: {sorted(fields)}")
    return dataclasses.replace(base, **options)


__all__ = ["compile", "compile_config", "compile_sharded", "shard", "explain"]
