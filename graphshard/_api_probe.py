"""The private torch APIs graphshard uses, declared with who uses them, and their probe.

``PRIVATE_APIS`` names every private torch name that graphshard (graphshard/, passes/, kernels/)
reaches, through ``_compat`` or directly. ``probe_private_apis()`` checks each on the installed
torch, so a torch that lacks one (the GPU machine's is older than CI's) is named before anything
breaks on it; ``scripts/gpu_check.sh`` runs it first. Nothing here is imported when graphshard
is: the probe imports what it checks only when called. A new private use gets an entry here;
tests/test_compat.py checks every entry on the installed torch and that the list covers the code.
"""

from __future__ import annotations

from typing import Any, Callable

# A name reads from ``torch`` left to right:
#   torch.a.b.c                  a module or an attribute (modules imported as needed)
#   torch.a.config[k.sub]        a config key that ``torch.a.config.patch(k.sub=...)`` accepts
#   torch.a.C{f}                 a field of dataclass (or key of TypedDict) C
#   torch.a.C().x                an attribute of an instance of C (made by _PROBE_INSTANCES)
#   torch.a.f(kw=)               callable f takes the keyword argument kw
#   torch.a.mod:"text"           the source of module torch.a.mod has "text" (a convention the
#                                module reads or writes, such as an FX node meta key)


class PrivateAPI:
    """One private torch name graphshard uses (``name`` in the syntax above), who uses it, and,
    for a name graphshard checks for itself, what it does without it (``gate``)."""

    __slots__ = ("name", "used_by", "gate")

    def __init__(self, name: str, used_by: str, gate: str = "") -> None:
        self.name, self.used_by, self.gate = name, used_by, gate

    def __repr__(self) -> str:
        gate = f", gate={self.gate!r}" if self.gate else ""
        return f"PrivateAPI({self.name!r}, used_by={self.used_by!r}{gate})"


_COMPAT = "graphshard/_compat.py"
_BATCH = "graphshard/compiler/experimental.py batched_cpp_kernels (CompileConfig.batch_cpp_kernels)"
_ISA = "graphshard/compiler/inductor_cpu.py inductor_cpu_settings (CompileConfig.fast_isa_check)"
_ISA_GATE = "without it fast_isa_check does nothing: Inductor checks every ISA itself"
_CACHE = "graphshard/compiler/program_cache.py (_compat: CompileConfig.program_cache)"
_CACHE_GATE = "without it program_cache is off and explain says why"

PRIVATE_APIS: tuple[PrivateAPI, ...] = tuple(PrivateAPI(*entry) for entry in (
    ("torch.distributed._remote_device", "graphshard/fingerprint.py TorchRec plans' shard placements in the program "
     "cache's key (_compat.is_remote_device)"),
    # multi-tensor ops and functional collectives
    ("torch._foreach_add", "graphshard/ops/dense.py grad packing (_compat.foreach_add)"),
    ("torch._foreach_add_", "graphshard/ops/dense.py grad packing (_compat.foreach_add_)"),
    ("torch._foreach_div_", "graphshard/ops/dense.py grad packing (_compat.foreach_div_)"),
    ("torch._foreach_copy_", "graphshard/ops/dense.py grad packing (_compat.foreach_clone)"),
    ("torch.ops._c10d_functional.all_gather_into_tensor.default",
     "ops.py, passes/schedule_overlap.py (_compat.c10d)"),
    ("torch.ops._c10d_functional.all_gather_into_tensor_out.default",
     "graphshard/ops/dense.py gather_in_place (_compat.c10d)"),
    ("torch.ops._c10d_functional.all_gather_into_tensor_coalesced.default",
     "ops.py, passes/schedule_overlap.py (_compat.c10d)"),
    ("torch.ops._c10d_functional.reduce_scatter_tensor.default",
     "ops.py, passes/no_sync_programs.py, passes/schedule_overlap.py (_compat.c10d)"),
    ("torch.ops._c10d_functional.all_reduce.default",
     "ops.py, passes/no_sync_programs.py, passes/schedule_overlap.py (_compat.c10d)"),
    ("torch.ops._c10d_functional.all_reduce_.default",
     "graphshard/compiler/lowering.py all_reduce_in_place (_compat.c10d)"),
    ("torch.ops._c10d_functional.all_to_all_single.default",
     "ops.py, passes/no_sync_programs.py, passes/schedule_overlap.py (_compat.c10d)"),
    ("torch.ops._c10d_functional.wait_tensor.default", "ops.py, passes/schedule_overlap.py (_compat.c10d)"),
    # private ATen / prims ops that the passes have rules or expansions for
    ("torch.ops.aten._to_copy.default", "passes/_rules.py, _expansions.py, localize_random.py, schedule_overlap.py"),
    ("torch.ops.aten._unsafe_view.default",
     "passes/_view_rules.py, insert_collectives.py, localize_shapes.py, schedule_overlap.py"),
    ("torch.ops.aten._softmax.default", "passes/_rules.py"),
    ("torch.ops.aten._log_softmax.default", "passes/_rules.py, passes/_expansions.py"),
    ("torch.ops.aten._safe_softmax.default", "passes/_rules.py"),
    ("torch.ops.aten._fused_rms_norm.default", "passes/_rules.py"),
    ("torch.ops.aten._grouped_mm.default", "passes/_rules.py (MoE experts)"),
    ("torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default", "passes/_rules.py (attention)"),
    ("torch.ops.aten._scaled_dot_product_flash_attention.default", "passes/_rules.py (attention)"),
    ("torch.ops.aten._scaled_dot_product_efficient_attention.default", "passes/_rules.py (attention)"),
    ("torch.ops.aten._scaled_dot_product_cudnn_attention.default", "passes/_rules.py (attention)"),
    ("torch.ops.prims.convert_element_type.default", "passes/schedule_overlap.py"),
    ("torch._ops.OpOverload", "lowering.py, outline.py, passes/_rules.py"),
    ("torch.ops.aten.add.Tensor._schema", "lowering.py, outline.py, passes/_rules.py, localize_random.py (OpOverload._schema)"),
    ("torch._check", "sparse/collection.py, sparse/sequence.py"),
    ("torch.Tag.nondeterministic_seeded", "passes/localize_random.py, outline.py (which ops draw random numbers)"),
    ("torch.Tag.pointwise", "passes/_rules.py (the pointwise placement rule)"),
    ("torch.Tag.inplace", "passes/localize_random.py (_compat.is_inplace_op)",
     "torch 2.11 has no such tag: is_inplace_op reads the schema instead"),
    ("torch.ops.aten.add.Tensor._schema.arguments", f"{_COMPAT} is_inplace_op (torch 2.11), passes/_rules.py"),
    # fake tensors, tracing, shapes
    ("torch._guards.detect_fake_mode", f"{_COMPAT} fake_mode_of (compiler/prepare.py)"),
    ("torch._guards.TracingContext.try_get", f"{_COMPAT} inductor_compile_region, report_output_strides"),
    ("torch._guards.TracingContext().fake_mode", f"{_COMPAT} inductor_compile_region"),
    ("torch._guards.TracingContext().output_strides", f"{_COMPAT} report_output_strides (lowering.py)"),
    ("torch._guards.tracing", f"{_COMPAT} inductor_compile_region"),
    ("torch._subclasses.fake_tensor.FakeTensor", "compiler/prepare.py (_compat.FakeTensor)"),
    ("torch._subclasses.fake_tensor.FakeTensorMode", "compiler/prepare.py (_compat.fake_mode_of, fake_local)"),
    ("torch._subclasses.fake_tensor.FakeTensorMode().shape_env", f"{_COMPAT} allow_data_dependent_sizes"),
    ("torch._subclasses.fake_tensor.unset_fake_temporarily", "rng.py (_compat.outside_fake_mode)"),
    *((f"torch._subclasses.fake_tensor.{name}", "compiler/backend.py (_compat.FAKE_TENSOR_FALLBACK_ERRORS)",
       "left out of FAKE_TENSOR_FALLBACK_ERRORS: that error fails the compile instead of a graph break")
      for name in ("DataDependentOutputException", "DynamicOutputShapeException", "UnsupportedOperatorException",
                   "UnsupportedFakeTensorException", "UnsupportedMutationAliasingException")),
    *((f"torch._dynamo.exc.{name}", "api.py's compiled call (_compat.DYNAMO_TRACE_ERRORS, compiler/regions.py)",
       "left out of DYNAMO_TRACE_ERRORS: a region dynamo cannot capture fails the call instead of a flat retrace")
      for name in ("Unsupported", "InternalTorchDynamoError", "UncapturedHigherOrderOpError")),
    ("torch.fx.experimental.proxy_tensor.make_fx", "aten_trace.py, passes/shard_embeddings.py (_compat.make_fx)"),
    ("torch.fx.experimental.proxy_tensor.make_fx(tracing_mode=)", "aten_trace.py, passes/shard_embeddings.py"),
    ("torch.fx.experimental.proxy_tensor.get_proxy_mode",
     "aten_trace.py (_compat.proxy_trace_graph: stack traces kept through the trace to ATen)"),
    *((f"torch._higher_order_ops.invoke_subgraph.{name}",
       "compiler/outline.py (_compat.call_invoke_subgraph: an outlined block's call, without the kernel's per-call "
       "mutation check)", "without it (torch < 2.13: _compat.HAS_INVOKE_SUBGRAPH) trace_once outlines nothing")
      for name in ("InvokeSubgraphAutogradOp", "get_invoke_subgraph_cache", "get_output_metadata")),
    ("torch._higher_order_ops.utils.reenter_make_fx",
     "aten_trace.py (_compat.reenter_make_fx: a region body traced once, inside the trace to ATen)"),
    ("torch.fx.experimental.symbolic_shapes.ShapeEnv", f"{_COMPAT} allow_data_dependent_sizes"),
    ("torch.fx.experimental.symbolic_shapes.ShapeEnv().settings", f"{_COMPAT} allow_data_dependent_sizes (compiler/prepare.py)"),
    ("torch.fx.experimental.symbolic_shapes.ShapeEnvSettings{allow_scalar_outputs}",
     f"{_COMPAT} allow_data_dependent_sizes (compiler/prepare.py; data-dependent sizes: sparse all-to-all)"),
    ("torch.fx.experimental.symbolic_shapes.ShapeEnvSettings{allow_dynamic_output_shape_ops}",
     f"{_COMPAT} allow_data_dependent_sizes (compiler/prepare.py; data-dependent sizes: sparse all-to-all)"),
    ("torch.fx.experimental.symbolic_shapes.is_concrete_int", "lowering.py (_compat.is_concrete_int)"),
    ("torch.fx._lazy_graph_module._LazyGraphModule.from_graphmodule",
     "aten_trace.py, compiler/aot.py: flat graphs that generate their code lazily (_compat.lazy_graph_module)"),
    ("torch.fx.experimental.symbolic_shapes.GuardOnDataDependentSymNode", "graphshard/report.py"),
    ("torch._dynamo.config[capture_dynamic_output_shape_ops]",
     "model_parallel/_dmp.py (_compat.trace_data_dependent_outputs: sequence lookups)"),
    ("torch._dynamo.utils.counters", "tests (_compat.dynamo_counters), program_cache.py (_compat.autograd_cache_counts)"),
    ("torch._dynamo.maybe_mark_dynamic",
     "sparse/input_dist.py: the ids a pipeline exchanged ahead (_compat.maybe_mark_dynamic)"),
    ("torch._dynamo.symbolic_convert.InstructionTranslator.current_tx",
     "compiler/prepare.py (_compat.dynamo_frame: the collective check names programs by code), ops/dense.py "
     "(_compat.in_dynamo_trace, _compat.dynamo_value_is_local: a module's piece read whole again)"),
    ("torch._dynamo.reset", "tests/conftest.py"),
    ("torch._dynamo.mark_static", "passes/localize_shapes.py (named in its error message)"),
    ("torch._C._dispatch_has_kernel_for_dispatch_key",
     "sparse/torchrec.py (_compat.has_autograd_kernel: fbgemm's permute_pooled_embs gets a derivative)"),
    # aot_autograd and the partitioner
    ("torch._functorch.aot_autograd.aot_module_simplified", "compiler/aot.py (_compat.aot_module_simplified)"),
    ("torch._functorch.aot_autograd.aot_module_simplified(fw_compiler=)", "compiler/aot.py"),
    ("torch._functorch.aot_autograd.aot_module_simplified(bw_compiler=)", "compiler/aot.py"),
    ("torch._functorch.aot_autograd.aot_module_simplified(partition_fn=)", "compiler/aot.py"),
    ("torch._functorch.aot_autograd.aot_module_simplified(decompositions=)", "compiler/aot.py"),
    ("torch._functorch.aot_autograd.make_boxed_func", "compiler/aot.py (_compat.boxed_nop: lower='eager')"),
    ("torch._functorch.partitioners.min_cut_rematerialization_partition",
     "compiler/aot.py (_compat.min_cut_rematerialization_partition: lower='eager')"),
    ('torch._functorch.partitioners:"recompute"', "passes/tag_recomputation.py (node.meta['recompute'])"),
    ('torch._functorch.partitioners:"ac_graph_id"', "passes/tag_recomputation.py (node.meta['ac_graph_id'])"),
    ("torch._ops.HigherOrderOperator", "compiler/prepare.py (_compat.is_higher_order_op: checkpointed bodies)"),
    ("torch._ops.OpOverloadPacket", "checkpointing.py (_compat.is_op: Checkpoint(save=...) validated)"),
    ("torch._higher_order_ops.wrap.tag_activation_checkpoint",
     "compiler/prepare.py (the dynamo op of a checkpointed function, traced to tagged ATen ops)"),
    ("torch._prims.rng_prims.run_and_save_rng_state",
     "outline.py (_compat.rng_state_ops: a recomputed random op's saved CPU generator state)"),
    ("torch._prims.rng_prims.run_with_rng_state", "outline.py (_compat.rng_state_ops)"),
    # Inductor
    ("torch._inductor.decomposition.select_decomp_table", "compiler/aot.py (_compat.inductor_decompositions)"),
    ("torch._inductor.compile_fx.partition_fn", "compiler/aot.py (_compat.inductor_partition_fn)"),
    ("torch._inductor.compile_fx.compile_fx_inner",
     "compiler/aot.py, lowering.py (_compat.inductor_compile_inner, inductor_compile_region)"),
    ("torch._inductor.compile_fx._CompileFxKwargs{is_backward}",
     f"{_COMPAT} inductor_compile_inner, inductor_compile_region (compile_fx_inner(is_backward=))"),
    ('torch._inductor.graph:"user_visible_output_idxs"', f"{_COMPAT} inductor_compile_region (lowering.py)"),
    ("torch._inductor.config[fx_graph_cache]", "compiler/program_cache.py (_compat.inductor_fx_graph_cache_enabled)"),
    ("torch._inductor.config[force_disable_caches]", "compiler/program_cache.py (_compat.inductor_fx_graph_cache_enabled)"),
    ("torch._inductor.config[reorder_for_locality]", "compiler/aot.py (INDUCTOR_SETTINGS)"),
    ("torch._inductor.config[reorder_for_peak_memory]", "compiler/aot.py (INDUCTOR_SETTINGS)"),
    ("torch._inductor.config[compile_threads]", "compile_share.py (compile_threads)"),
    ("torch._inductor.config[cpp.vec_isa_ok]", _ISA, _ISA_GATE),
    ("torch._inductor.config[cpp.simdlen]", _ISA, _ISA_GATE),
    ("torch._inductor.config.is_fbcode", _ISA, _ISA_GATE),
    ("torch._inductor.config.get_hash", _BATCH),
    ("torch.compiler.config[cache_key_tag]", f"{_COMPAT} inductor_compile_region (lowering.py)"),
    ("torch.compiler.config[force_disable_caches]", "compiler/program_cache.py (_compat.inductor_fx_graph_cache_enabled)"),
    ("torch._inductor.cpu_vec_isa.x86_isa_checker", _ISA, _ISA_GATE),
    ("torch._inductor.cpu_vec_isa.supported_vec_isa_list", _ISA, _ISA_GATE),
    ("torch._inductor.cpu_vec_isa.get_isa_from_cpu_capability", _ISA, _ISA_GATE),
    ("torch._inductor.cpu_vec_isa.invalid_vec_isa", _ISA, _ISA_GATE),
    ("torch._inductor.cpu_vec_isa.pick_vec_isa", _BATCH),
    ("torch._inductor.runtime.cache_dir_utils.cache_dir", _BATCH),
    ("torch._inductor.codecache.CppPythonBindingsCodeCache.load_async", _BATCH),
    ("torch._inductor.codecache.CppPythonBindingsCodeCache.load_pybinding", _BATCH),
    ("torch._inductor.codecache.CppPythonBindingsCodeCache._load_library_inner", _BATCH),
    ('torch._inductor.codecache:"_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR"', _BATCH),
    ("torch._inductor.async_compile.AsyncCompile.cpp_pybinding", _BATCH),
    ("torch._inductor.async_compile.AsyncCompile.wait", _BATCH),
    # graphshard's programs in aot_autograd's cache (CompileConfig.program_cache; torch >= 2.13)
    ("torch._inductor.output_code.OutputCode", _CACHE, _CACHE_GATE),
    ("torch._inductor.output_code.CompiledFxGraphConstants", _CACHE, _CACHE_GATE),
    ("torch._inductor.codecache.FxGraphCache.cache_hit_post_compile", _CACHE, _CACHE_GATE),
    ("torch._inductor.utils.BoxedBool", _CACHE, _CACHE_GATE),
    ("torch._functorch._aot_autograd.schemas.SerializableAOTDispatchCompiler", _CACHE, _CACHE_GATE),
    ("torch._functorch.config[enable_autograd_cache]", _CACHE, _CACHE_GATE),
    ("torch._functorch.config[bundled_autograd_cache]", _CACHE, _CACHE_GATE),
    ("torch._functorch.config[force_non_lazy_backward_lowering]", _CACHE, _CACHE_GATE),
    ("torch._inductor.config[unsafe_marked_cacheable_functions]", _CACHE, _CACHE_GATE),
    ("torch._inductor.config[triton.cudagraphs]", _CACHE, _CACHE_GATE),
    ("torch.fx._graph_pickler.GraphPickler", _CACHE, _CACHE_GATE),
    ("torch.fx._graph_pickler.Options(ops_filter=)", _CACHE, _CACHE_GATE),
    ("torch.fx._graph_pickler._GraphUnpickler", _CACHE, _CACHE_GATE),
    ("torch.fx._graph_pickler._UnpickleState", _CACHE, _CACHE_GATE),
    # torch.distributed, DTensor, FSDP1
    ("torch.distributed.distributed_c10d._get_default_store",
     "compile_share.py (_compat.default_store: compile sharing), collective_check.py"),
    ("torch.distributed.distributed_c10d._resolve_process_group",
     "collective_check.py, ops/dense.py, compiler/lowering.py (_compat.group_ranks, _compat.group_rank)"),
    ("torch.distributed.device_mesh._mesh_resources.get_current_mesh", "tensor_parallel.py (_compat.current_mesh)"),
    ("torch.distributed.tensor.placement_types._StridedShard", "storage.py (_compat.strided_shard: FSDP over TP)"),
    ("torch.distributed.tensor.placement_types._StridedShard(split_factor=)", "storage.py (_compat.strided_shard)"),
    ("torch.distributed.tensor.DTensor._local_tensor",
     "storage.py, fsdp/_wrapper.py, fsdp/_state_dict.py, fsdp/_optim_state.py, _compat.fake_local"),
    ("torch.distributed.tensor.DTensor._spec", f"{_COMPAT} local_tensors (backend.py)"),
    ("torch.distributed.tensor._dtensor_spec.DTensorSpec{tensor_meta}", f"{_COMPAT} local_tensors (backend.py)"),
    ("torch.distributed.tensor._dtensor_spec.DTensorSpec.shape", f"{_COMPAT} local_tensors (backend.py)"),
    ("torch.distributed.tensor._dtensor_spec.DTensorSpec.stride", f"{_COMPAT} local_tensors (backend.py)"),
    ("torch.distributed.tensor.DTensor.from_local(shape=)", f"{_COMPAT} local_tensors (backend.py)"),
    ("torch.distributed.tensor.DTensor.from_local(stride=)", f"{_COMPAT} local_tensors (backend.py)"),
    ("torch.distributed._shard.sharded_tensor.ShardedTensor", "sparse/state.py (_compat.is_sharded_tensor)"),
    ("torch.distributed._shard.sharded_tensor.ShardedTensor._init_from_local_shards_and_global_metadata",
     "sparse/state.py (_compat.sharded_tensor: a column-wise table with several or unequal blocks a rank)"),
    ("torch.distributed._shard.sharded_tensor.Shard", "sparse/state.py (_compat.sharded_tensor)"),
    ("torch.distributed._shard.sharded_tensor.metadata.ShardedTensorMetadata", "sparse/state.py (_compat.sharded_tensor)"),
    ("torch.distributed._shard.sharded_tensor.metadata.TensorProperties", "sparse/state.py (_compat.sharded_tensor)"),
    ("torch.distributed._shard.metadata.ShardMetadata", "sparse/state.py (_compat.sharded_tensor)"),
    ("torch.distributed.algorithms._comm_hooks.default_hooks.allreduce_hook",
     "fsdp/_wrapper.py (_compat.fsdp_default_hooks)"),
    ("torch.distributed.algorithms._comm_hooks.default_hooks.reduce_scatter_hook",
     "fsdp/_wrapper.py (_compat.fsdp_default_hooks)"),
    ("torch.distributed.algorithms._comm_hooks.default_hooks.fp16_compress_hook",
     "fsdp/_wrapper.py (_compat.fsdp_default_hooks)"),
    ("torch.distributed.algorithms._comm_hooks.default_hooks.bf16_compress_hook",
     "fsdp/_wrapper.py (_compat.fsdp_default_hooks)"),
    ("torch.distributed.fsdp.ShardingStrategy._HYBRID_SHARD_ZERO2", "fsdp/_wrapper.py"),
    ("torch.distributed.fsdp.MixedPrecision{_module_classes_to_ignore}", "fsdp/_wrapper.py, fsdp/wrap.py"),
    ("torch.distributed.fsdp.wrap.ModuleWrapPolicy._run_policy", "fsdp/wrap.py (auto_wrap_policy overrides)"),
    ("torch.testing._internal.distributed.fake_pg.FakeStore", "tests/conftest.py (_compat.fake_process_group_store)"),
    # autograd, nn.Module internals, pytree
    ("torch._C._current_graph_task_id", "fsdp/_wrapper.py (_compat.in_autograd_backward)"),
    ("torch.nn.modules.module._IncompatibleKeys", "fsdp/_state_dict.py (_compat.incompatible_keys)"),
    ("torch.nn.Module()._compiled_call_impl", f"{_COMPAT} wrap_compiled_call (api.py compile_sharded), drop_compiled_call"),
    ("torch.nn.Module()._parameters", "storage.py, params.py, fsdp/, frontends/user_styles.py (parameter storage)"),
    ("torch.nn.Module()._forward_pre_hooks", f"{_COMPAT} forward_hooks (frontends/user_styles.py)"),
    ("torch.nn.Module()._forward_hooks", f"{_COMPAT} forward_hooks (frontends/user_styles.py)"),
    ("torch.nn.Module()._buffers", "storage.py, fsdp/_state_dict.py"),
    ("torch.nn.Module()._modules", "storage.py (module tree rewrites)"),
    ("torch.nn.Module()._non_persistent_buffers_set", "fsdp/_state_dict.py"),
    ("torch.utils._pytree.tree_map_only", "fsdp/_wrapper.py (mixed-precision casts)"),
    ("torch.utils._pytree.tree_leaves", "fsdp/_wrapper.py (mixed-precision casts)"),
    # the CUDA allocator's history (benchmarks' GS_BENCH_MEMORY_SNAPSHOT)
    ("torch.cuda.memory._record_memory_history(stacks=)", "benchmarks/_common.py (_compat.cuda_memory_history)"),
    ("torch.cuda.memory._record_memory_history(max_entries=)", "benchmarks/_common.py (_compat.cuda_memory_history)"),
    ("torch.cuda.memory._snapshot", "benchmarks/_common.py (_compat.cuda_memory_snapshot)"),
))
"""Every private torch name graphshard uses, with who uses it (see the syntax above); a gated one
(graphshard checks for it and does without) says what it does without it."""

_PROBE_INSTANCES: dict[str, Callable[[Any], Any]] = {
    "torch._guards.TracingContext": lambda cls: cls(None),  # its fake mode
}
"""How the probe makes an instance of a class whose constructor needs arguments (default: ``cls()``)."""


def _probe_resolve(path: str):
    """The object at dotted ``path`` from ``torch``, importing modules on the way."""
    import importlib
    import types

    parts = path.split(".")
    if parts[0] != "torch":
        raise ValueError(f"{path}: a private API name starts with 'torch'")
    obj, here = importlib.import_module("torch"), "torch"
    for part in parts[1:]:
        here = f"{here}.{part}"
        try:
            obj = getattr(obj, part)
            continue
        except AttributeError:
            pass
        if not (isinstance(obj, types.ModuleType) and hasattr(obj, "__path__")):
            raise AttributeError(f"{here} does not exist")
        try:  # a submodule of a package, not imported yet
            obj = importlib.import_module(here)
        except ModuleNotFoundError as e:
            if e.name is None or not (here == e.name or here.startswith(e.name + ".")):
                raise  # the module is there but something it imports is not
            raise AttributeError(f"{here} does not exist") from None
    return obj


def _probe_one(name: str) -> str | None:
    """None when ``name`` (the syntax above) is there on this torch, else why not."""
    import dataclasses
    import inspect

    try:
        if name.endswith('"') and ':"' in name:  # module source has the text
            path, text = name.split(':"', 1)
            text = text[:-1]
            source = inspect.getsource(_probe_resolve(path))
            return None if text in source else f"source of {path} no longer has {text!r}"
        if name.endswith("=)"):  # callable takes the keyword
            path, kw = name[:-2].split("(", 1)
            fn = _probe_resolve(path)
            try:
                params = inspect.signature(fn).parameters
            except ValueError:  # a pybind11 builtin (placements are C++ in torch 2.11): its docstring's signatures
                import re

                doc = (fn.__init__ if isinstance(fn, type) else fn).__doc__ or ""
                sigs = [line.strip() for line in doc.splitlines() if "(" in line and "->" in line]
                if any(re.search(rf"[(,*]\s*{re.escape(kw)}\s*:", line) for line in sigs):
                    return None
                return f"{path} takes no keyword argument {kw!r} (signatures: {sigs})"
            p = params.get(kw)
            if p is None or p.kind not in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD):
                return f"{path} takes no keyword argument {kw!r} (signature {tuple(params)})"
            return None
        if name.endswith("}"):  # dataclass field / TypedDict key
            path, field = name[:-1].split("{", 1)
            cls = _probe_resolve(path)
            names = ({f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls)
                     else set(getattr(cls, "__required_keys__", ())) | set(getattr(cls, "__optional_keys__", ())))
            return None if field in names else f"{path} has no field {field!r}"
        if name.endswith("]"):  # config key
            path, key = name[:-1].split("[", 1)
            config = _probe_resolve(path)
            try:
                value = config
                for part in key.split("."):
                    value = getattr(value, part)
                with config.patch(**{key: value}):
                    pass
            except AttributeError as e:
                return f"config key missing: {e}"
            return None
        if "()." in name:  # instance attribute
            path, attr = name.split("().", 1)
            cls = _probe_resolve(path)
            inst = _PROBE_INSTANCES.get(path, lambda c: c())(cls)
            for part in attr.split("."):
                inst = getattr(inst, part)
            return None
        _probe_resolve(name)
        return None
    except ImportError as e:
        return f"import error: {type(e).__name__}: {e}"
    except AttributeError as e:
        return f"attribute missing: {e}"
    except Exception as e:  # noqa: BLE001 - the probe reports, it does not raise
        return f"{type(e).__name__}: {e}"


def probe_private_apis(apis: tuple[PrivateAPI, ...] | None = None) -> dict[str, str | None]:
    """Each private torch API graphshard uses (``PRIVATE_APIS``, or ``apis``) by name -> None
    when this torch has it, else a short reason (import error, attribute missing, config key
    missing, ...; a gated one's reason ends with what graphshard does without it). Imports what
    it checks only now."""
    import warnings

    out: dict[str, str | None] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # deprecated modules (torch.distributed._shard) warn on import
        for api in PRIVATE_APIS if apis is None else apis:
            why = _probe_one(api.name)
            out[api.name] = why if why is None or not api.gate else f"{why} [gated: {api.gate}]"
    return out


def missing_private_apis(apis: tuple[PrivateAPI, ...] | None = None, *, gated: bool = False) -> dict[str, str]:
    """The private APIs this torch lacks that graphshard cannot do without (with ``gated``: those
    it checks for and does without, too): name -> "reason (used by ...)"; empty when none is."""
    apis = PRIVATE_APIS if apis is None else apis
    by_name = {a.name: a for a in apis}
    return {name: f"{why} (used by {by_name[name].used_by})" for name, why in probe_private_apis(apis).items()
            if why is not None and (gated or not by_name[name].gate)}
