"""The only module that touches private torch APIs, gated by version where they moved.

graphshard supports torch >= 2.11. Everything here is a thin alias or adapter,
so the rest of the package reads as if these were public.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable

import torch

TORCH_VERSION = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
if TORCH_VERSION < (2, 11):  # pragma: no cover - guarded by pyproject
    raise ImportError(f"graphshard needs torch >= 2.11, found {torch.__version__}")

# Multi-tensor ops (one launch for a list of tensors on CUDA; a loop on the CPU), as torch.optim uses them.
foreach_add = torch._foreach_add
foreach_add_ = torch._foreach_add_
foreach_div_ = torch._foreach_div_


def foreach_clone(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """New tensors holding ``tensors``' values, copied by one multi-tensor op."""
    out = [torch.empty_like(t, memory_format=torch.contiguous_format) for t in tensors]
    torch._foreach_copy_(out, tensors)
    return out


def is_inplace_op(op) -> bool:
    """Whether ``op`` (an OpOverload) is an in-place op (``bernoulli_``, ``add_``): ``torch.Tag.inplace``
    where torch has it (2.13); torch 2.11 has no such tag, so there the same from the schema, as
    torchgen tags native ops: named ``name_`` (or ``__iname__``) and writing its first argument."""
    if hasattr(torch.Tag, "inplace"):
        return torch.Tag.inplace in op.tags
    return _inplace_by_schema(op)


def _inplace_by_schema(op) -> bool:
    schema = op._schema
    name = schema.name.split("::")[-1]
    dunder = name.startswith("__") and name.endswith("__")
    if not (name.startswith("__i") if dunder else name.endswith("_")):
        return False
    alias = schema.arguments[0].alias_info if schema.arguments else None
    return alias is not None and alias.is_write


# Functional collectives (the ops Inductor knows how to issue asynchronously).
c10d = torch.ops._c10d_functional

from torch._guards import detect_fake_mode  # noqa: E402
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode  # noqa: E402
from torch.fx.experimental.proxy_tensor import make_fx  # noqa: E402
from torch._functorch.aot_autograd import aot_module_simplified  # noqa: E402
from torch._functorch.partitioners import min_cut_rematerialization_partition  # noqa: E402


FAKE_TENSOR_FALLBACK_ERRORS = tuple(getattr(torch._subclasses.fake_tensor, name) for name in (
    "DataDependentOutputException", "DynamicOutputShapeException", "UnsupportedOperatorException",
    "UnsupportedFakeTensorException", "UnsupportedMutationAliasingException",
) if hasattr(torch._subclasses.fake_tensor, name))
"""Fake-tensor errors that dynamo answers, when a backend raises them, with a graph break and an
eager run of the graph (``torch._dynamo.exc.exceptions_allowed_to_be_fallback``)."""


DYNAMO_TRACE_ERRORS = tuple(getattr(torch._dynamo.exc, name) for name in (
    "Unsupported", "InternalTorchDynamoError", "UncapturedHigherOrderOpError",
) if hasattr(torch._dynamo.exc, name))
"""What dynamo raises when it cannot trace a frame (a ``nested_compile_region`` it cannot capture
whole among them); a backend's own failure is ``BackendCompilerFailed``, not one of these."""


def fake_mode_of(example_inputs) -> FakeTensorMode:
    mode = detect_fake_mode(example_inputs)
    if mode is None:
        mode = FakeTensorMode(allow_non_fake_inputs=True)
    return mode


def allow_data_dependent_sizes(fake_mode: FakeTensorMode) -> None:
    """Lets this compile's shape environment hold sizes only known when the program runs (the
    ids an all-to-all delivers; ``.tolist()`` of its split sizes): unbacked sizes. Set on the
    ShapeEnv of the one graph being compiled (dynamo makes one per frame), not on torch's
    config, so nothing else in the process changes."""
    env = fake_mode.shape_env
    if env is None:  # graphshard's own fake mode (a graph captured outside dynamo's tracing: tests)
        from torch.fx.experimental.symbolic_shapes import ShapeEnv

        env = fake_mode.shape_env = ShapeEnv()
    import dataclasses

    env.settings = dataclasses.replace(env.settings, allow_scalar_outputs=True, allow_dynamic_output_shape_ops=True)


def trace_data_dependent_outputs() -> contextlib.AbstractContextManager:
    """dynamo's setting that traces an op whose output sizes depend on its input's data (a
    sequence lookup: each feature's rows, as many as its ids) into the graph instead of breaking
    the graph before it. Set only while graphshard's own module is called (its compile traces
    then), and restored after."""
    import torch._dynamo.config as dynamo_config

    return dynamo_config.patch(capture_dynamic_output_shape_ops=True)


def is_sharded_tensor(value) -> bool:
    """A ``torch.distributed._shard`` ShardedTensor (TorchRec's state dicts hold its tables so)."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    return isinstance(value, ShardedTensor)


def sharded_tensor(pieces: list, shards: list, size: tuple, group_name: str, device: str):
    """A ``torch.distributed._shard`` ShardedTensor, TorchRec's form of a table: ``shards`` lists every
    piece of the tensor as ``(rank, offsets, sizes)`` (rank in the group ``group_name``), ``pieces`` this
    rank's as ``(offsets, tensor)`` (views, not copies). Built from the global metadata each rank already
    has, so no collective runs (as TorchRec builds its own)."""
    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor
    from torch.distributed._shard.sharded_tensor.metadata import ShardedTensorMetadata, TensorProperties
    from torch.distributed.distributed_c10d import _resolve_process_group

    metas = [ShardMetadata(shard_offsets=list(off), shard_sizes=list(sz), placement=f"rank:{r}/{device}")
             for r, off, sz in shards]
    local = [Shard(t, ShardMetadata(shard_offsets=list(off), shard_sizes=list(t.shape),
                                    placement=f"rank:{torch.distributed.get_rank(_resolve_process_group(group_name))}/{device}"))
             for off, t in pieces]
    dtype = pieces[0][1].dtype if pieces else torch.float32
    meta = ShardedTensorMetadata(shards_metadata=metas, size=torch.Size(size),
                                 tensor_properties=TensorProperties(dtype=dtype, requires_grad=False))
    return ShardedTensor._init_from_local_shards_and_global_metadata(local, meta,
                                                                     process_group=_resolve_process_group(group_name))


def inductor_decompositions() -> dict:
    from torch._inductor.decomposition import select_decomp_table

    return dict(select_decomp_table())


def inductor_partition_fn(gm: torch.fx.GraphModule, joint_inputs, **kwargs):
    """Inductor's partitioner: its joint-graph passes (pattern rewrites such as the fused
    attention kernel), then the min-cut partition that honours recompute tags."""
    from torch._inductor.compile_fx import partition_fn

    return partition_fn(gm, joint_inputs, **kwargs)


def inductor_compile_inner(gm: torch.fx.GraphModule, example_inputs, *, is_backward: bool) -> Callable:
    """Inductor's compiler for an already partitioned ATen forward or backward graph, compiled
    whole with the facts aot_autograd holds for it (its donated buffers, its output strides)."""
    from torch._inductor.compile_fx import compile_fx_inner

    return compile_fx_inner(gm, example_inputs, is_backward=is_backward)


# Part of every region's FX graph cache key: entries written by graphshard versions that
# compiled regions with the whole graph's facts (inherited buffer donation) must never be
# served. Bump it whenever what a region is compiled with changes.
_REGION_CACHE_TAG = "graphshard-region-own-facts-1"


def inductor_compile_region(gm: torch.fx.GraphModule, example_inputs, *, is_backward: bool) -> Callable:
    """Inductor's compiler for one region of a forward or backward graph, with the region's own
    facts. aot_autograd's ``TracingContext`` describes the whole graph (``bw_donated_idxs``:
    positions in the whole backward's inputs Inductor may overwrite; static inputs; the list
    output strides are reported in), and Inductor reads it from the ambient context: a region
    compiled there overwrote its own inputs at those positions, buffers later regions read.
    So a region compiles in a context of its own that shares only the fake mode: nothing
    donated, nothing reported (``report_output_strides`` reports the whole graph's). All its
    outputs are user-visible (other compiled code reads them with their traced strides), and
    ``_REGION_CACHE_TAG`` keeps its FX graph cache entries apart, since the cache key does
    not cover donation. See docs/design/lowering.md, "A region is compiled with its own facts"."""
    from torch._guards import TracingContext, tracing
    from torch._inductor.compile_fx import compile_fx_inner
    from torch.compiler import config as compiler_config

    outer = TracingContext.try_get()
    fake_mode = outer.fake_mode if outer is not None and outer.fake_mode is not None else fake_mode_of(example_inputs)
    out = gm.graph.find_nodes(op="output")[0]
    outputs = out.args[0] if isinstance(out.args[0], (tuple, list)) else (out.args[0],)
    out.meta["user_visible_output_idxs"] = [i for i, o in enumerate(outputs) if isinstance(o, torch.fx.Node)]
    tag = compiler_config.cache_key_tag
    with (tracing(TracingContext(fake_mode)),
          compiler_config.patch(cache_key_tag=f"{tag}/{_REGION_CACHE_TAG}" if tag else _REGION_CACHE_TAG)):
        return compile_fx_inner(gm, example_inputs, is_backward=is_backward)


def lazy_graph_module(root: torch.nn.Module, graph: torch.fx.Graph | None = None,
                      class_name: str = "GraphModule") -> torch.fx.GraphModule:
    """A graph module that generates its Python code only when something reads or runs it (torch's
    ``_LazyGraphModule``, which Inductor and aot_autograd use for the same reason): graphshard edits
    and recompiles its flat graphs several times before anything runs them, and a regionally
    lowered graph is never run as code. With ``graph`` None, ``root`` itself (already lazy: as is)."""
    from torch.fx._lazy_graph_module import _LazyGraphModule

    if graph is None:
        return _LazyGraphModule.from_graphmodule(root)
    return _LazyGraphModule(root, graph, class_name=class_name)


def graph_output_strides(gm: torch.fx.GraphModule) -> list:
    """The strides of ``gm``'s outputs as their traced values have them (None for a non-tensor)."""
    out = next(n for n in gm.graph.nodes if n.op == "output")
    vals = [v.meta.get("val") if isinstance(v, torch.fx.Node) else None for v in out.args[0]]
    return [tuple(v.stride()) if isinstance(v, torch.Tensor) else None for v in vals]


def report_output_strides(strides: list) -> None:
    """Tells aot_autograd the output strides of a graph lowered in pieces (`graph_output_strides`),
    as Inductor reports them for a graph it compiled whole (aot_autograd restrides saved
    activations with them), and as a graph loaded from its cache reports them again."""
    from torch._guards import TracingContext

    tc = TracingContext.try_get()
    if tc is not None and tc.output_strides is not None:
        tc.output_strides.extend(strides)


def is_concrete_int(x) -> bool:
    """An int, or a SymInt whose value is a known constant (DTensor local sizes under fake mode)."""
    from torch.fx.experimental.symbolic_shapes import is_concrete_int as concrete

    return concrete(x)


def inductor_fx_graph_cache_enabled() -> bool:
    from torch._inductor import config
    from torch.compiler import config as compiler_config

    return bool(config.fx_graph_cache) and not (config.force_disable_caches or compiler_config.force_disable_caches)


def inductor_config_patch(**kwargs) -> contextlib.AbstractContextManager:
    from torch._inductor import config

    return config.patch(**kwargs)


def outside_fake_mode() -> contextlib.AbstractContextManager:
    """Suspends the active FakeTensorMode, if any: a c10d call made while one is active (a
    backend compiler runs under aot_autograd's) would be faked and return at once without
    communicating."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    return unset_fake_temporarily()


def default_store():
    """The default process group's key-value store (shared by every rank of the job)."""
    from torch.distributed.distributed_c10d import _get_default_store

    return _get_default_store()


def dynamo_frame() -> str | None:
    """The code dynamo is compiling, as ``qualified name (file:first line)`` with the file's base name (the same
    on every rank of a job), or None outside a dynamo compile. A graph break's resume function is a
    code of its own (``torch_dynamo_resume_in_forward_at_57``)."""
    import os

    from torch._dynamo.symbolic_convert import InstructionTranslator

    try:
        code = InstructionTranslator.current_tx().f_code
    except AttributeError:  # no frame is being translated (a graph traced without dynamo)
        return None
    name = getattr(code, "co_qualname", code.co_name)  # 3.11+: unchanged by a renamed copy (storage's forward_<n>)
    return f"{name} ({os.path.basename(code.co_filename)}:{code.co_firstlineno})"


def is_dynamo_graph_input(value) -> bool:
    """Whether ``value``, a fake tensor an op's fake implementation receives while dynamo traces a
    frame, is one of that frame's graph inputs (dynamo's fake of a real input), not a value the
    frame computed. False outside a dynamo trace."""
    from torch._dynamo.symbolic_convert import InstructionTranslator

    try:
        tx = InstructionTranslator.current_tx()
    except AttributeError:  # no frame is being translated
        return False
    if tx is None:
        return False
    for node in tx.output.root_tracer.graph.find_nodes(op="placeholder"):
        arg = node.meta.get("grapharg")  # a placeholder dynamo lifted into a body's tracer has none
        if arg is not None and getattr(arg, "fake_tensor", None) is value:
            return True
    return False


def in_dynamo_trace() -> bool:
    """Whether an op's fake implementation runs for dynamo, translating a frame (not for a ``make_fx``
    trace a backend runs while dynamo compiles the frame's graph)."""
    from torch._dynamo.symbolic_convert import InstructionTranslator

    try:
        return InstructionTranslator.current_tx() is not None and proxy_trace_graph() is None
    except AttributeError:
        return False


def dynamo_value_is_local(value) -> bool:
    """Whether ``value``, a fake tensor an op's fake implementation receives while dynamo traces, was
    computed from a ``use_local_output=True`` module output read as each rank's piece: a node of the
    graph dynamo is recording, whose inputs lead back to a ``graphshard::to_local`` without passing a
    declared layout."""
    from torch._dynamo.symbolic_convert import InstructionTranslator

    try:
        tx = InstructionTranslator.current_tx()
    except AttributeError:
        return False
    if tx is None:
        return False
    layout, to_local = torch.ops.graphshard.layout, torch.ops.graphshard.to_local
    for tracer in _tracers(tx.output.current_tracer):
        node = next((n for n in reversed(tracer.graph.nodes) if n.meta.get("example_value") is value), None)
        if node is None:
            continue
        seen, stack = set(), [node]
        while stack:
            n = stack.pop()
            if n in seen:
                continue
            seen.add(n)
            if n.op == "call_function" and n.target in (to_local, to_local.default):
                return True
            if n.op == "call_function" and n.target in (layout, layout.default):
                continue  # a declared layout: the value after it is logical
            stack.extend(n.all_input_nodes)
        return False
    return False


def _tracers(tracer):
    while tracer is not None:
        yield tracer
        tracer = getattr(tracer, "parent", None)


def proxy_trace_graph() -> torch.fx.Graph | None:
    """The graph ``make_fx`` is recording into, or None outside a trace."""
    from torch.fx.experimental.proxy_tensor import get_proxy_mode

    mode = get_proxy_mode()
    return mode.tracer.graph if mode is not None else None


def reenter_make_fx(fn: Callable) -> Callable:
    """``fn`` traced by the ``make_fx`` session in progress into a graph of its own, with the
    session's fake mode and settings (the way torch's higher-order ops trace their bodies)."""
    from torch._higher_order_ops.utils import reenter_make_fx as reenter

    return reenter(fn)


def group_ranks(group_name: str) -> list[int]:
    """The global ranks of the process group a functional collective names."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    return torch.distributed.get_process_group_ranks(_resolve_process_group(group_name))


def group_rank(group_name: str) -> int:
    """This process's rank in the process group a functional collective names."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    return torch.distributed.get_rank(_resolve_process_group(group_name))


def boxed_nop(gm: torch.fx.GraphModule, example_inputs) -> Callable:
    """The 'eager' lowering: run the graph module as is, in aot_autograd's boxed convention."""
    from torch._functorch.aot_autograd import make_boxed_func

    return make_boxed_func(gm.forward)


def maybe_mark_dynamic(t: torch.Tensor, dim: int) -> None:
    """Asks dynamo to trace ``t``'s dim ``dim`` as a symbol (without failing where it specializes):
    a size that is the data's, so that every later batch runs the same program."""
    torch._dynamo.maybe_mark_dynamic(t, dim)


def dynamo_counters() -> dict[str, Any]:
    from torch._dynamo.utils import counters

    return counters


def fake_process_group_store():
    """A store for init_process_group('fake', ...), for golden-graph tests."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    return FakeStore()


def strided_shard(dim: int, split_factor: int):
    """DTensor's placement for a data-parallel shard of model-parallel pieces (as FSDP2 over TP)."""
    from torch.distributed.tensor.placement_types import _StridedShard

    return _StridedShard(dim, split_factor=split_factor)


def has_autograd_kernel(op_name: str) -> bool:
    """Whether the operator ``namespace::name`` has a kernel for the Autograd dispatch key (its own
    derivative), as opposed to torch's fallback, which gives its inputs no gradient."""
    return torch._C._dispatch_has_kernel_for_dispatch_key(op_name, "Autograd")


def in_autograd_backward() -> bool:
    """Whether this thread is running an autograd backward pass."""
    return torch._C._current_graph_task_id() != -1


def wrap_compiled_call(module: torch.nn.Module, wrap: Callable[[Callable], Callable]) -> None:
    """Wraps the callable ``module.compile()`` installed (what ``module(...)`` runs) in ``wrap(call)``."""
    call = module.__dict__.get("_compiled_call_impl")
    if call is None:
        raise RuntimeError(f"{type(module).__name__} has no compiled call to wrap; call module.compile() first")
    module._compiled_call_impl = wrap(call)


def forward_hooks(module: torch.nn.Module) -> tuple[list, list]:
    """The forward pre-hooks and forward hooks registered on ``module`` (``register_forward_pre_hook``,
    ``register_forward_hook``), in order."""
    return list(module._forward_pre_hooks.values()), list(module._forward_hooks.values())


def drop_compiled_call(module: torch.nn.Module) -> None:
    """Undoes ``module.compile()``: ``module(...)`` runs its forward uncompiled again."""
    if "_compiled_call_impl" in module.__dict__:
        module._compiled_call_impl = None


def fsdp_default_hooks():
    """torch's FSDP default communication hooks (``allreduce_hook``, ``reduce_scatter_hook``,
    ``fp16_compress_hook``, ``bf16_compress_hook``): the module users take them from."""
    from torch.distributed.algorithms._comm_hooks import default_hooks

    return default_hooks


def incompatible_keys(missing: list[str], unexpected: list[str]):
    """``nn.Module.load_state_dict``'s result type, with these key lists."""
    from torch.nn.modules.module import _IncompatibleKeys

    return _IncompatibleKeys(missing, unexpected)


def current_mesh():
    """The DeviceMesh of the enclosing ``with mesh:`` block (as torch's parallelize_module reads it)."""
    from torch.distributed.device_mesh import _mesh_resources

    return _mesh_resources.get_current_mesh()


class _LocalTensors(torch.autograd.Function):
    """Every DTensor input's local tensor through one autograd node: one node per call
    instead of one ``to_local`` node per parameter, and gradients wrapped back into
    DTensors directly (FSDP2's ``_from_local_no_grad``), not through ``from_local``'s
    autograd function. Same result as ``to_local()`` on each: a fresh alias of the local
    tensor, whose gradient arrives as a DTensor with the input's spec."""

    @staticmethod
    def forward(ctx, *dtensors):
        ctx.specs = [d._spec for d in dtensors]
        # A fresh alias: autograd writes its metadata into the output, not into the DTensor's tensor.
        # ``detach()``, not a view: dynamo and the fake mode convert a view input as a view of its
        # base, about 1 ms a parameter more (`storage.feeding_local_shards`); the version counter is
        # shared all the same.
        outs = tuple(d._local_tensor.detach() for d in dtensors)
        ctx.mark_non_differentiable(*(o for o, d in zip(outs, dtensors) if not d.requires_grad))
        return outs

    @staticmethod
    def backward(ctx, *grads):
        from torch.distributed.tensor import DTensor

        out = []
        for g, spec in zip(grads, ctx.specs):
            if g is None:
                out.append(None)
            elif g.dtype == spec.tensor_meta.dtype:
                out.append(DTensor(g, spec, requires_grad=False))
            else:  # a gradient in another dtype keeps the placements, with its own dtype
                out.append(DTensor.from_local(g, spec.mesh, spec.placements, run_check=False,
                                              shape=spec.shape, stride=spec.stride))
        return tuple(out)


def fake_local(dtensor, fake_mode: FakeTensorMode) -> torch.Tensor:
    """The fake of ``dtensor``'s local shard, as a fresh leaf with the DTensor's ``requires_grad``.
    The DTensor's own local tensor converts as the plain tensor it is (~0.2 ms); ``to_local()``
    would hand over a new alias on every call, which the mode describes and rebuilds as a
    view of its base (~4.5 ms per parameter on a CPU)."""
    return fake_mode.from_tensor(dtensor._local_tensor).detach().requires_grad_(dtensor.requires_grad)


def is_op(value) -> bool:
    """Whether ``value`` is a torch op, an overload (``aten.mm.default``) or a packet (``aten.mm``)."""
    return isinstance(value, (torch._ops.OpOverload, torch._ops.OpOverloadPacket))


def is_higher_order_op(target) -> bool:
    """Whether an FX node's target is a higher-order op (``tag_activation_checkpoint``, ``wrap``...)."""
    return isinstance(target, torch._ops.HigherOrderOperator)


def is_plain_to_local(node: torch.fx.Node) -> bool:
    """Whether ``node`` of a dynamo graph is a DTensor's ``to_local()``. torch 2.13 (CI's) records it as
    ``call_method to_local``; torch 2.11's dynamo (``TensorVariable.method_to_local``)
    as ``call_function`` of a function it makes on the fly, named ``prim_to_local``, that holds the
    call's arguments in its closure (``args_as_value``, ``kwargs_as_value``): only one called
    without arguments counts there."""
    if node.op == "call_method":
        return node.target == "to_local"
    if node.op != "call_function" or getattr(node.target, "__name__", None) != "prim_to_local":
        return False
    code, cells = getattr(node.target, "__code__", None), getattr(node.target, "__closure__", None) or ()
    if code is None or len(node.args) != 1 or node.kwargs:
        return False
    captured = dict(zip(code.co_freevars, (c.cell_contents for c in cells)))
    return not captured.get("args_as_value", ()) and not captured.get("kwargs_as_value", {})


def local_tensors(dtensors: list) -> tuple[torch.Tensor, ...]:
    """``[d.to_local() for d in dtensors]`` with one autograd node for all of them."""
    if not dtensors:
        return ()
    return _LocalTensors.apply(*dtensors)


# --- Inductor's CPU build internals (graphshard/compiler/inductor_cpu.py's opt-in speedups) ----
def inductor_config():
    """Inductor's configuration module (``torch._inductor.config``)."""
    from torch._inductor import config

    return config


def inductor_cpu_vec_isa():
    """Inductor's vector-ISA module (``torch._inductor.cpu_vec_isa``)."""
    from torch._inductor import cpu_vec_isa

    return cpu_vec_isa


def inductor_cache_dir() -> str:
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return cache_dir()


def inductor_cpp_bindings():
    """Inductor's C++ build-and-load cache (``CppPythonBindingsCodeCache``: ``load_async``,
    ``load_pybinding``, ``_load_library_inner``)."""
    from torch._inductor.codecache import CppPythonBindingsCodeCache

    return CppPythonBindingsCodeCache


def inductor_async_compile():
    """Inductor's ``AsyncCompile`` class, whose ``cpp_pybinding`` and ``wait`` a generated module calls."""
    from torch._inductor.async_compile import AsyncCompile

    return AsyncCompile


def cuda_memory_history(enabled: bool) -> None:
    """Starts (python stacks of every allocation) or stops the CUDA caching allocator's allocation
    history (``torch.cuda.memory._record_memory_history``): what `cuda_memory_snapshot` reports."""
    torch.cuda.memory._record_memory_history(enabled="all" if enabled else None, context="all" if enabled else None,
                                             stacks="python", max_entries=1_000_000)


def cuda_memory_snapshot() -> dict:
    """The allocator's segments and the allocation history recorded since `cuda_memory_history`
    (``torch.cuda.memory._snapshot``; ``device_traces`` holds the alloc and free events)."""
    return torch.cuda.memory._snapshot()


# invoke_subgraph (torch's nested_compile_region): aot_autograd traces and partitions a body once
# per identifier, and each call reuses it. graphshard outlines repeated units into it
# (`graphshard.compiler.outline`); its partition pairs a body's forward and backward calls by the
# ``call_id`` torch >= 2.13 stamps on them, so older torch traces every unit on its own.
HAS_INVOKE_SUBGRAPH = TORCH_VERSION >= (2, 13)


def invoke_subgraph_op():
    return torch.ops.higher_order.invoke_subgraph


def call_invoke_subgraph(body: torch.fx.GraphModule, identifier: str, *operands):
    """``invoke_subgraph(body, identifier, *operands)`` as its autograd kernel runs it, without that
    kernel's check that the body mutates no input. The check builds the body's schema by tracing
    the body again at every call (about 0.2 s a call for a transformer block on the CPU, as much as
    the whole joint trace saves); graphshard outlines only bodies that mutate nothing
    (`graphshard.compiler.outline`). The autograd function and the body's output metadata are
    cached per identifier in the tracing context, as torch's kernel caches them."""
    hop = invoke_subgraph_op()
    if not torch.is_grad_enabled() or not any(isinstance(o, torch.Tensor) and o.requires_grad for o in operands):
        return hop(body, identifier, *operands)
    from torch._higher_order_ops.invoke_subgraph import (
        InvokeSubgraphAutogradOp, get_invoke_subgraph_cache, get_output_metadata)

    cache = get_invoke_subgraph_cache()
    call = cache.get_autograd_key_entry(identifier) if cache else None
    if call is None:
        metadata = get_output_metadata(body, *operands)

        def call(*args):
            return InvokeSubgraphAutogradOp.apply(body, identifier, metadata, *args)

        if cache:
            cache.add_autograd_key_entry(identifier, call)
    return call(*operands)


def rng_state_ops():
    """The higher-order ops aot_autograd's partitioner wraps a recomputed random op in when it
    saves the CPU generator's state for the backward (``functionalize_rng_ops``): the forward's
    ``run_and_save_rng_state`` and the backward's ``run_with_rng_state``."""
    from torch._prims import rng_prims

    return rng_prims.run_and_save_rng_state, rng_prims.run_with_rng_state


# --- graphshard's programs in torch's AOTAutogradCache (compiler/program_cache.py) ---

HAS_PROGRAM_CACHE = TORCH_VERSION >= (2, 13)
"""torch 2.13 bundles a compiler's own OutputCode in an AOTAutogradCache entry and reloads it
(``SerializableAOTDispatchCompiler``, ``bundled_autograd_cache``); torch 2.11 looks entries up
by Inductor's FX graph cache keys only."""


def output_code_base() -> type:
    """Inductor's ``OutputCode``: what an AOTAutogradCache entry bundles (``object`` before 2.13)."""
    if not HAS_PROGRAM_CACHE:
        return object
    from torch._inductor.output_code import OutputCode

    return OutputCode


def is_remote_device(value) -> bool:
    """Whether ``value`` is a sharded tensor's shard placement (``"rank:0/cpu"``; TorchRec's plans hold them)."""
    from torch.distributed import _remote_device

    return isinstance(value, _remote_device)


def is_op_overload(value) -> bool:
    return isinstance(value, torch._ops.OpOverload)


def is_output_code(value) -> bool:
    return HAS_PROGRAM_CACHE and isinstance(value, output_code_base())


def serializable_compiler(output_type: type, compiler: Callable) -> Callable:
    """``compiler`` (fx graph, inputs -> an ``output_type``) marked for aot_autograd as one whose
    result its cache may store."""
    from torch._functorch._aot_autograd.schemas import SerializableAOTDispatchCompiler

    return SerializableAOTDispatchCompiler(output_type, compiler)


def program_cache_settings(key_tag: str, cacheable: dict[str, str]) -> contextlib.AbstractContextManager:
    """Settings, for one aot_autograd call, under which it looks its result up in its on-disk cache
    and stores it there: bundled entries (the compiler's own ``OutputCode``), the backward compiled
    within the call (a lazily compiled backward would store the entry after these settings end),
    ``key_tag`` in the key, and the plain functions in ``cacheable`` (qualified name -> version)
    allowed in the graph."""
    from torch._functorch import config as functorch_config
    from torch._inductor import config as inductor
    from torch.compiler import config as compiler_config

    stack = contextlib.ExitStack()
    stack.enter_context(functorch_config.patch(enable_autograd_cache=True, bundled_autograd_cache=True,
                                               force_non_lazy_backward_lowering=True))
    stack.enter_context(inductor.patch(unsafe_marked_cacheable_functions={
        **inductor.unsafe_marked_cacheable_functions, **cacheable}))
    stack.enter_context(compiler_config.patch(cache_key_tag=key_tag))
    return stack


def cache_key_tag() -> str:
    from torch.compiler import config as compiler_config

    return compiler_config.cache_key_tag


def with_cache_key_tag(tag: str) -> contextlib.AbstractContextManager:
    from torch.compiler import config as compiler_config

    return compiler_config.patch(cache_key_tag=tag)


def autograd_cache_counts() -> dict[str, int]:
    """aot_autograd's cache hits, misses, bypasses and saves in this process so far."""
    from torch._dynamo.utils import counters

    c = counters["aot_autograd"]
    return {k: c[f"autograd_cache_{k}"] for k in ("hit", "miss", "bypass", "saved")}


def inductor_cudagraphs_enabled() -> bool:
    from torch._inductor import config

    return bool(config.triton.cudagraphs)


def stored_compiled_graph(compiled: Any) -> Any:
    """A copy of Inductor's compiled graph (``CompiledFxGraph``) fit to pickle: its loaded module
    replaced by its code's place in the on-disk cache, as aot_autograd's bundled entries store it."""
    import copy

    stored = copy.copy(compiled)
    stored.prepare_for_serialization()
    return stored


def load_compiled_graph(stored: Any, is_backward: bool) -> Callable:
    """A compiled region `stored_compiled_graph` kept, loaded again as Inductor loads a cache hit,
    in a tracing context of its own (as `inductor_compile_region` compiles one: nothing reported to
    the caller's aot_autograd)."""
    from torch._guards import TracingContext, tracing

    outer = TracingContext.try_get()
    fake_mode = outer.fake_mode if outer is not None and outer.fake_mode is not None else FakeTensorMode()
    with tracing(TracingContext(fake_mode)):
        return load_whole_graph(stored, [], is_backward)


def load_whole_graph(stored: Any, example_inputs, is_backward: bool) -> Callable:
    """A compiled graph `stored_compiled_graph` kept, loaded again as Inductor loads a cache hit:
    its module loaded, its output strides reported to the ambient aot_autograd."""
    from torch._inductor.codecache import FxGraphCache
    from torch._inductor.output_code import CompiledFxGraphConstants
    from torch._inductor.utils import BoxedBool

    constants = CompiledFxGraphConstants()
    graph, _ = FxGraphCache.cache_hit_post_compile(stored, {}, constants)
    if graph is None:
        raise RuntimeError("graphshard: a compiled graph stored with the program could not be loaded again")
    graph.post_compile(example_inputs, constants, {"cudagraphs": BoxedBool(False), "is_backward": is_backward,
                                                   "boxed_forward_device_index": None})
    return graph


# GraphPickler's own dumps/loads register ``slice`` as a pytree node for the call and remove it
# after: that changes the pytree registry's dict version, which dynamo guards on in any frame whose
# trace flattened a pytree (HF's checkpointed layers under invoke_subgraph), so each such frame
# compiled again on its next call. graphshard pickles with the Pickler itself, which maps node
# arguments without that registration: right for a graph with no slice among its arguments
# (graphs after aot_autograd's trace have none); a graph with one takes torch's path.
_PLAIN, _WITH_SLICES = b"p", b"s"


def graph_to_bytes(gm: torch.fx.GraphModule, meta_keys: frozenset[str]) -> bytes:
    """``gm`` as ``GraphPickler`` stores a graph, with the node metadata under ``meta_keys`` (fake
    values included), leaving torch's pytree registry as it was (above). Other keys may hold what
    does not pickle (module stacks name the classes of modules graphshard or torch's wrappers
    subclassed)."""
    import io

    from torch.fx._graph_pickler import GraphPickler, Options

    options = Options(ops_filter=None, node_metadata_key_filter=meta_keys.__contains__)  # graphshard's and c10d's ops included
    if any(_holds_slice((n.args, n.kwargs)) for n in gm.graph.nodes):
        return _WITH_SLICES + GraphPickler.dumps(gm, options)
    with io.BytesIO() as stream:
        GraphPickler(stream, options).dump(gm)
        return _PLAIN + stream.getvalue()


def _holds_slice(a) -> bool:
    if isinstance(a, (tuple, list)):
        return any(_holds_slice(x) for x in a)
    if isinstance(a, dict):
        return any(_holds_slice(x) for x in a.values())
    return isinstance(a, slice)


def graph_from_bytes(data: bytes) -> torch.fx.GraphModule:
    """A graph `graph_to_bytes` stored, its fake values in a fake mode of their own."""
    import io

    from torch.fx._graph_pickler import GraphPickler, _GraphUnpickler, _UnpickleState
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    fake_mode = FakeTensorMode(allow_non_fake_inputs=True, shape_env=ShapeEnv())
    if data[:1] == _WITH_SLICES:
        return GraphPickler.loads(data[1:], fake_mode)
    with io.BytesIO(data[1:]) as stream:
        return _GraphUnpickler(stream, _UnpickleState(fake_mode)).load()
