"""The only module that touches private torch APIs, gated by version where they moved.

graphshard supports torch >= 2.11. Everything here is a thin alias or adapter,
so the rest of the package reads as if these were public.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import platform
import tempfile
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable

import torch

log = logging.getLogger(__name__)

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


def inductor_decompositions() -> dict:
    from torch._inductor.decomposition import select_decomp_table

    return dict(select_decomp_table())


def inductor_partition_fn(gm: torch.fx.GraphModule, joint_inputs, **kwargs):
    """Inductor's partitioner: its joint-graph passes (pattern rewrites such as the fused
    attention kernel), then the min-cut partition that honours recompute tags."""
    from torch._inductor.compile_fx import partition_fn

    return partition_fn(gm, joint_inputs, **kwargs)


def inductor_compile_inner(gm: torch.fx.GraphModule, example_inputs, *, is_backward: bool,
                           batch: bool = False) -> Callable:
    """Inductor's compiler for an already partitioned ATen forward or backward graph, compiled
    whole with the facts aot_autograd holds for it (its donated buffers, its output strides).
    ``batch``: its C++ kernels built as one library (``batched_cpp_kernels``)."""
    from torch._inductor.compile_fx import compile_fx_inner

    with batched_cpp_kernels(enabled=batch):
        return compile_fx_inner(gm, example_inputs, is_backward=is_backward)


# Part of every region's FX graph cache key: entries written by graphshard versions that
# compiled regions with the whole graph's facts (inherited buffer donation) must never be
# served. Bump it whenever what a region is compiled with changes.
_REGION_CACHE_TAG = "graphshard-region-own-facts-1"


def inductor_compile_region(gm: torch.fx.GraphModule, example_inputs, *, is_backward: bool,
                            batch: bool = False) -> Callable:
    """Inductor's compiler for one region of a forward or backward graph, with the region's own
    facts. aot_autograd's ``TracingContext`` describes the whole graph (``bw_donated_idxs``:
    positions in the whole backward's inputs Inductor may overwrite; static inputs; the list
    output strides are reported in), and Inductor reads it from the ambient context: a region
    compiled there overwrote its own inputs at those positions, buffers later regions read.
    So a region compiles in a context of its own that shares only the fake mode: nothing
    donated, nothing reported (``report_output_strides`` reports the whole graph's). All its
    outputs are user-visible (other compiled code reads them with their traced strides), and
    ``_REGION_CACHE_TAG`` keeps its FX graph cache entries apart, since the cache key does
    not cover donation. See docs/design.md, "A region is compiled with its own facts"."""
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
          compiler_config.patch(cache_key_tag=f"{tag}/{_REGION_CACHE_TAG}" if tag else _REGION_CACHE_TAG),
          batched_cpp_kernels(enabled=batch)):
        return compile_fx_inner(gm, example_inputs, is_backward=is_backward)


def report_output_strides(gm: torch.fx.GraphModule) -> None:
    """Tells aot_autograd the strides of a graph lowered in pieces, as Inductor reports them
    for a graph it compiled whole (aot_autograd restrides saved activations with them)."""
    from torch._guards import TracingContext

    tc = TracingContext.try_get()
    if tc is None or tc.output_strides is None:
        return
    out = next(n for n in gm.graph.nodes if n.op == "output")
    for v in out.args[0]:
        val = v.meta.get("val") if isinstance(v, torch.fx.Node) else None
        tc.output_strides.append(tuple(val.stride()) if isinstance(val, torch.Tensor) else None)


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


_isa_checks: dict[str, Future] = {}  # ISA -> its build check, started by inductor_cpu_warmup
_isa_lock = threading.Lock()


def inductor_cpu_warmup() -> None:
    """Starts, on a thread of its own, the check Inductor makes before its first C++ kernel,
    that the compiler builds (and the machine loads) code for the vector ISA it will use.
    Started when the joint graph's partition begins, it runs beside the ranks' partitions;
    started earlier it slows the tracing ranks. ``inductor_cpu_settings`` reads its result.
    Only with ``CompileConfig.fast_isa_check``."""
    isa = _picked_isa()
    if isa is None:
        return
    with _isa_lock:
        if str(isa) not in _isa_checks:
            pool = ThreadPoolExecutor(1, thread_name_prefix="graphshard-inductor-warmup")
            _isa_checks[str(isa)] = pool.submit(bool, isa)
            pool.shutdown(wait=False)  # the thread ends once the check is done


def inductor_cpu_settings() -> dict[str, Any]:
    """Inductor settings for a compile of CPU code: ``cpp.vec_isa_ok`` once the ISA Inductor
    picks has passed its build check (``CompileConfig.fast_isa_check``, off by default).

    Inductor's ``valid_vec_isa_list`` builds a test library for every ISA the CPU reports,
    one after another (AVX-512 VNNI, AVX-512 and AVX2 here: ~7 s of gcc on the 2-core
    machine, ~3 s for the first), though it uses only the one it picks: the first of that
    list. Each ISA's flags include the next one's, so a compiler that builds the first, on a
    machine that loads it, builds the others too. graphshard checks only the ISA Inductor will
    pick, with Inductor's own check (``bool(isa)``, cached per process and on disk), and when
    it is the first and passes tells Inductor the check is done. Otherwise (another ISA asked
    for through ``ATEN_CPU_CAPABILITY``, ``cpp.simdlen`` or ``cpp.vec_isa_ok`` set by the
    user, a CPU other than x86, a failed check) it returns no setting and Inductor checks
    every ISA itself, as without graphshard.

    The setting lives only inside graphshard's config patch (thread-local in torch >= 2.12),
    but Inductor keeps the list of valid ISAs it builds under it for the whole process
    (``valid_vec_isa_list`` is cached): a compile that runs later in the process, on any
    thread, takes its list from graphshard's check instead of checking every ISA. That list
    is the one Inductor's own check gives whenever the first ISA builds and loads (each
    ISA's flags include the next one's), which is why this is an opt-in and not a default."""
    isa = _picked_isa()
    if isa is None:
        return {}
    inductor_cpu_warmup()
    with _isa_lock:
        check = _isa_checks[str(isa)]
    try:
        ok = check.result()
    except Exception as e:  # noqa: BLE001 - Inductor then runs its own check
        log.warning("graphshard: the %s build check failed (%r); Inductor checks every ISA itself", isa, e)
        ok = False
    return {"cpp.vec_isa_ok": True} if ok else {}


def _picked_isa():
    """The ISA Inductor will pick when it is the first one the CPU reports and nothing asks for
    another (read afresh on every call, no build); None when the shortcut does not apply."""
    from torch._inductor import config
    from torch._inductor import cpu_vec_isa as isa_mod

    names = ("x86_isa_checker", "supported_vec_isa_list", "get_isa_from_cpu_capability", "invalid_vec_isa")
    if (not all(hasattr(isa_mod, name) for name in names) or platform.machine() not in ("x86_64", "AMD64")
            or config.is_fbcode() or config.cpp.simdlen is not None or config.cpp.vec_isa_ok is not None):
        return None
    flags = isa_mod.x86_isa_checker()
    candidates = [isa for isa in isa_mod.supported_vec_isa_list if all(f in flags for f in str(isa).split())]
    if not candidates:
        return None
    picked = isa_mod.get_isa_from_cpu_capability(os.getenv("ATEN_CPU_CAPABILITY"), candidates,
                                                  isa_mod.invalid_vec_isa)
    return picked if picked is candidates[0] else None


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


def boxed_nop(gm: torch.fx.GraphModule, example_inputs) -> Callable:
    """The 'eager' lowering: run the graph module as is, in aot_autograd's boxed convention."""
    from torch._functorch.aot_autograd import make_boxed_func

    return make_boxed_func(gm.forward)


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


def in_autograd_backward() -> bool:
    """Whether this thread is running an autograd backward pass."""
    return torch._C._current_graph_task_id() != -1


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
        outs = tuple(d._local_tensor.view_as(d._local_tensor) for d in dtensors)
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


# --- C++ kernels built together ------------------------------------------------------------
#
# Inductor builds every C++ kernel of a CPU graph as its own shared library. Almost all of
# that gcc run is fixed cost, not the kernel: loading the precompiled header (~0.7 s) and
# linking against libtorch (~0.5 s), against ~0.1-0.2 s for the kernel's own code (a
# layer-norm kernel on the 2-core machine). While ``batched_cpp_kernels`` is active, the
# kernels a generated module asks for are collected and built as one translation unit when
# the module waits for its kernels (or at the first call of one), with Inductor's flags,
# precompiled header and on-disk cache. With ``defer=True`` the kernels of every module
# generated in the block build as one library when the block ends: a rank compiling several
# regions pays the fixed cost once. An index in Inductor's cache directory maps each kernel
# to the library that holds it, so a rank that loads a region another rank compiled finds
# its kernels there. Anything the batch cannot take (an argument type it does not parse, a
# compile or load error) falls back to Inductor's per-kernel build, so the result is always
# Inductor's kernels.

_BATCH_ARG_PARSERS = {
    "int64_t": "graphshard_arg_int64",
    "uintptr_t": "graphshard_arg_uintptr",
    "float": "graphshard_arg_float",
}

_BATCH_PRELUDE = r"""
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <cstdlib>
#include <cerrno>
#include <stdexcept>

// Set at module init from the address Inductor publishes for its own kernel modules.
static void* (*graphshard_tensor_data_ptr)(PyObject* obj);

template <typename T> static inline T graphshard_arg_ptr(PyObject* args, size_t n) {
    return static_cast<T>(graphshard_tensor_data_ptr(PyTuple_GET_ITEM(args, n)));
}
static inline int64_t graphshard_arg_int64(PyObject* args, size_t n) {
    auto v = PyLong_AsSsize_t(PyTuple_GET_ITEM(args, n));
    if (v == -1 && PyErr_Occurred()) throw std::runtime_error("expected int arg");
    return v;
}
static inline uintptr_t graphshard_arg_uintptr(PyObject* args, size_t n) {
    auto v = PyLong_AsVoidPtr(PyTuple_GET_ITEM(args, n));
    if (v == reinterpret_cast<void*>(-1) && PyErr_Occurred()) throw std::runtime_error("expected int arg");
    return reinterpret_cast<uintptr_t>(v);
}
static inline float graphshard_arg_float(PyObject* args, size_t n) {
    auto v = PyFloat_AsDouble(PyTuple_GET_ITEM(args, n));
    if (v == -1.0 && PyErr_Occurred()) throw std::runtime_error("expected float arg");
    return static_cast<float>(v);
}
"""

_BATCH_METHOD = r"""
static PyObject* kernel_{i}_py(PyObject* self, PyObject* args) {{
    try {{
        if (!PyTuple_CheckExact(args) || PyTuple_GET_SIZE(args) != {nargs})
            throw std::runtime_error("kernel_{i} takes {nargs} args");
        graphshard_k{i}::kernel_{i}({parsed});
        Py_RETURN_NONE;
    }} catch (std::exception const& e) {{
        PyErr_SetString(PyExc_RuntimeError, e.what());
        return nullptr;
    }}
}}
"""

_BATCH_MODULE = r"""
static PyMethodDef graphshard_methods[] = {{
{methods}
    {{NULL, NULL, 0, NULL}}}};

static struct PyModuleDef graphshard_module = {{PyModuleDef_HEAD_INIT, "kernel", NULL, -1, graphshard_methods}};

PyMODINIT_FUNC PyInit_kernel(void) {{
    const char* addr = std::getenv("_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR");
    if (!addr) {{
        PyErr_SetString(PyExc_RuntimeError, "_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR is not set");
        return nullptr;
    }}
    errno = 0;
    char* end = nullptr;
    uintptr_t value = std::strtoull(addr, &end, 10);
    if (errno != 0 || end == addr || value == 0) {{
        PyErr_SetString(PyExc_RuntimeError, "bad _TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR");
        return nullptr;
    }}
    graphshard_tensor_data_ptr = reinterpret_cast<decltype(graphshard_tensor_data_ptr)>(value);
    return PyModule_Create(&graphshard_module);
}}
"""


def _kernel_batch_source(kernels: list[tuple[list[str], str]]) -> str:
    """One translation unit for ``kernels`` (Inductor's ``(argtypes, source)`` pairs, each
    source defining ``extern "C" void kernel(...)``): kernel i is renamed ``kernel_i`` inside
    a namespace of its own, and a Python module ``kernel`` binds ``kernel_0 .. kernel_{n-1}``
    with the argument conventions of Inductor's own bindings."""
    includes: list[str] = []
    bodies: list[str] = []
    methods: list[str] = []
    for i, (argtypes, source) in enumerate(kernels):
        body = []
        for line in source.splitlines():
            if line.startswith("#include"):
                if line not in includes:
                    includes.append(line)
            else:
                body.append(line)
        bodies.append(f"namespace graphshard_k{i} {{\n#define kernel kernel_{i}\n"
                      + "\n".join(body) + "\n#undef kernel\n}\n")
        parsed = []
        for n, argtype in enumerate(argtypes):
            t = argtype.replace("const ", "").strip()
            if t.endswith("*"):
                parsed.append(f"graphshard_arg_ptr<{t}>(args, {n})")
            elif t in _BATCH_ARG_PARSERS:
                parsed.append(f"{_BATCH_ARG_PARSERS[t]}(args, {n})")
            else:
                raise ValueError(f"kernel argument type {argtype!r} is not one the batch parses")
        methods.append(_BATCH_METHOD.format(i=i, nargs=len(argtypes), parsed=", ".join(parsed)))
    table = "\n".join(f'    {{"kernel_{i}", kernel_{i}_py, METH_VARARGS, ""}},' for i in range(len(kernels)))
    return ("\n".join(includes) + "\n" + "\n".join(bodies) + _BATCH_PRELUDE
            + "".join(methods) + _BATCH_MODULE.format(methods=table))


def _kernel_index_dir() -> str:
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return os.path.join(cache_dir(), "graphshard_kernels")


def _kernel_idents(kernels: list[tuple[list[str], str]]) -> list[str]:
    """Index keys: the kernel with what else decides its build (torch, vector ISA, Inductor's
    configuration as its FX graph cache hashes it)."""
    from torch._inductor import config
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    context = hashlib.sha256(f"{torch.__version__}\0{pick_vec_isa()}\0".encode() + config.get_hash())
    idents = []
    for argtypes, source in kernels:
        h = context.copy()
        h.update("\0".join([*argtypes, source]).encode())
        idents.append(h.hexdigest())
    return idents


def _indexed_kernel(ident: str) -> Callable | None:
    """The kernel ``ident`` from a library an earlier batch built, if the index has it."""
    from torch._inductor.codecache import CppPythonBindingsCodeCache

    try:
        with open(os.path.join(_kernel_index_dir(), ident)) as f:
            path, name = f.read().split("\n")[:2]
        key = os.path.basename(path).split(".")[0]
        return getattr(CppPythonBindingsCodeCache._load_library_inner(path, key), name)
    except (OSError, ValueError, ImportError, AttributeError):
        return None


def _index_kernels(module, idents: list[str]) -> None:
    root = _kernel_index_dir()
    os.makedirs(root, exist_ok=True)
    for i, ident in enumerate(idents):
        fd, tmp = tempfile.mkstemp(dir=root)
        with os.fdopen(fd, "w") as f:
            f.write(f"{module.__file__}\nkernel_{i}\n")
        os.replace(tmp, os.path.join(root, ident))


def _build_kernels(kernels: list[tuple[list[str], str]], idents: list[str]) -> list[Callable]:
    """``kernels`` as one library (Inductor's own build for a single one), indexed under ``idents``."""
    from torch._inductor.codecache import CppPythonBindingsCodeCache

    if len(kernels) > 1:
        try:
            module = CppPythonBindingsCodeCache.load_async(_kernel_batch_source(kernels), "cpu")()
            fns = [getattr(module, f"kernel_{i}") for i in range(len(kernels))]
            _index_kernels(module, idents)
            return fns
        except Exception:  # Inductor's per-kernel build below is always a correct answer
            log.info("building %d C++ kernels one by one: their batch failed", len(kernels), exc_info=True)
    return [CppPythonBindingsCodeCache.load_pybinding(a, s) for a, s in kernels]


class _KernelBatch:
    """The C++ kernels one generated module (or one deferred block) asked for, resolved
    together on first need: from the index where an earlier batch built them, the rest
    built as one library."""

    def __init__(self) -> None:
        self.kernels: list[tuple[list[str], str]] = []
        self.fns: list[Callable] = []
        self.lock = threading.Lock()  # a pending kernel may first be called on any thread

    def add(self, argtypes, source: str) -> "_PendingKernel":
        self.kernels.append((list(argtypes), source))
        return _PendingKernel(self, len(self.kernels) - 1)

    def resolve(self) -> list[Callable]:
        """Every kernel added so far, as Inductor's callables (a deferred block may add more
        after a first call; those resolve on the next)."""
        with self.lock:
            return self._resolve()

    def _resolve(self) -> list[Callable]:
        fns, start = self.fns, len(self.fns)
        if start < len(self.kernels):
            idents = _kernel_idents(self.kernels[start:])
            fns += [_indexed_kernel(ident) for ident in idents]
            missing: dict[str, list[int]] = {}  # a kernel asked for twice builds once
            for i, ident in enumerate(idents, start):
                if fns[i] is None:
                    missing.setdefault(ident, []).append(i)
            if missing:
                built = _build_kernels([self.kernels[at[0]] for at in missing.values()], list(missing))
                for at, fn in zip(missing.values(), built):
                    for i in at:
                        fns[i] = fn
        return fns


class _PendingKernel:
    """Stands for kernel ``index`` of ``batch`` until its module's scope is patched."""

    __slots__ = ("batch", "index")

    def __init__(self, batch: _KernelBatch, index: int) -> None:
        self.batch, self.index = batch, index

    def __call__(self, *args):
        return self.batch.resolve()[self.index](*args)


def _patch_scope(scope: dict, batch: _KernelBatch) -> None:
    fns = batch.resolve()
    for name, value in list(scope.items()):
        if isinstance(value, _PendingKernel) and value.batch is batch:
            scope[name] = fns[value.index]


class _BatchState(threading.local):
    """What the current thread's ``batched_cpp_kernels`` blocks collect (other threads: nothing)."""

    depth = 0
    deferred: _KernelBatch | None = None
    scopes: list[dict]

    def __init__(self) -> None:
        self.scopes = []


_batch_state = _BatchState()
_hook_lock = threading.Lock()
_hook_users = 0  # threads inside a batched block; Inductor's methods are replaced while > 0
_hook_originals: tuple[Callable, Callable] | None = None


def _install_hooks() -> None:
    """Replaces ``AsyncCompile.cpp_pybinding`` and ``wait`` while any thread is in a batched
    block. Inductor has no per-compile hook for how a generated module builds its C++
    kernels (the module makes its own ``AsyncCompile``), so the class's methods are the only
    place; the replacements batch only calls made on a thread inside a block and hand every
    other call to Inductor's own method, unchanged."""
    global _hook_users, _hook_originals
    from torch._inductor.async_compile import AsyncCompile

    with _hook_lock:
        _hook_users += 1
        if _hook_users > 1:
            return
        own_pybinding, own_wait = AsyncCompile.cpp_pybinding, AsyncCompile.wait

        def cpp_pybinding(self, argtypes, source_code):
            state = _batch_state
            if not state.depth:  # another thread's compile: Inductor's own build
                return own_pybinding(self, argtypes, source_code)
            batch = state.deferred
            if batch is None:  # one batch per generated module (each makes its own AsyncCompile)
                batch = self.__dict__.setdefault("_graphshard_kernels", _KernelBatch())
            return batch.add(argtypes, source_code)

        def wait(self, scope):
            if (batch := self.__dict__.pop("_graphshard_kernels", None)) is not None:
                _patch_scope(scope, batch)
            elif _batch_state.depth and _batch_state.deferred is not None:  # patched when the block ends
                _batch_state.scopes.append(scope)
            return own_wait(self, scope)

        cpp_pybinding.graphshard_hook = wait.graphshard_hook = True
        _hook_originals = (own_pybinding, own_wait)
        AsyncCompile.cpp_pybinding, AsyncCompile.wait = cpp_pybinding, wait


def _remove_hooks() -> None:
    global _hook_users, _hook_originals
    from torch._inductor.async_compile import AsyncCompile

    with _hook_lock:
        _hook_users -= 1
        if _hook_users or _hook_originals is None:
            return
        if getattr(AsyncCompile.cpp_pybinding, "graphshard_hook", False):
            AsyncCompile.cpp_pybinding, AsyncCompile.wait = _hook_originals
        else:  # someone replaced them after graphshard did: theirs stay (they delegate to ours, which delegate on)
            log.warning("AsyncCompile.cpp_pybinding was replaced during a graphshard compile; left as it is")
        _hook_originals = None


def inductor_hooks_installed() -> bool:
    """Whether graphshard's kernel-batch hooks are in Inductor's ``AsyncCompile`` now."""
    from torch._inductor.async_compile import AsyncCompile

    return bool(getattr(AsyncCompile.cpp_pybinding, "graphshard_hook", False))


@contextlib.contextmanager
def batched_cpp_kernels(*, enabled: bool = True, defer: bool = False):
    """While active on this thread, each module Inductor generates here builds its C++ kernels
    as one library; with ``defer``, all modules generated in the block share one library,
    built at its end. Compiles on other threads are Inductor's own. ``enabled=False`` does
    nothing (``CompileConfig.batch_cpp_kernels``)."""
    if not enabled:
        yield
        return
    state = _batch_state
    if state.depth == 0:
        _install_hooks()
    opened = defer and state.deferred is None
    if opened:
        state.deferred, state.scopes = _KernelBatch(), []
    state.depth += 1
    try:
        yield
        if opened:  # a failed block leaves its kernels to build at their first call
            for scope in state.scopes:
                _patch_scope(scope, state.deferred)
    finally:
        state.depth -= 1
        if opened:
            state.deferred, state.scopes = None, []
        if state.depth == 0:
            _remove_hooks()
