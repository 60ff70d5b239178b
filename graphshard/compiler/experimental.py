"""Experimental, off by default: the one place graphshard replaces Inductor's methods.

``CompileConfig.batch_cpp_kernels`` (default False): while `batched_cpp_kernels` is active on a
thread, Inductor's ``AsyncCompile.cpp_pybinding`` and ``wait`` are replaced class-wide (the hooks
act only for threads inside a batched block; the originals are put back when the last one leaves)
and ``CppPythonBindingsCodeCache._load_library_inner`` loads a batch's library. Every private name
it reaches is declared in `graphshard._api_probe` (``_BATCH``), and ``tests/test_kernel_batch.py``
runs it on the installed torch, checking the hooks are gone after each block. Kept out of the
default path because it depends on how Inductor's generated modules call into ``AsyncCompile``,
which torch may change in any release (docs/design/compile-time.md).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import tempfile
import threading
from typing import Callable

import torch

from graphshard import _compat

log = logging.getLogger(__name__)


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
    return os.path.join(_compat.inductor_cache_dir(), "graphshard_kernels")


def _kernel_idents(kernels: list[tuple[list[str], str]]) -> list[str]:
    """Index keys: the kernel with what else decides its build (torch, vector ISA, Inductor's
    configuration as its FX graph cache hashes it)."""
    isa = _compat.inductor_cpu_vec_isa().pick_vec_isa()
    context = hashlib.sha256(f"{torch.__version__}\0{isa}\0".encode() + _compat.inductor_config().get_hash())
    idents = []
    for argtypes, source in kernels:
        h = context.copy()
        h.update("\0".join([*argtypes, source]).encode())
        idents.append(h.hexdigest())
    return idents


def _indexed_kernel(ident: str) -> Callable | None:
    """The kernel ``ident`` from a library an earlier batch built, if the index has it."""
    CppPythonBindingsCodeCache = _compat.inductor_cpp_bindings()
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
    CppPythonBindingsCodeCache = _compat.inductor_cpp_bindings()
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
    AsyncCompile = _compat.inductor_async_compile()
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
    AsyncCompile = _compat.inductor_async_compile()
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
    AsyncCompile = _compat.inductor_async_compile()
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
