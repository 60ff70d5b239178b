"""C++ kernels built together (``experimental.batched_cpp_kernels``, opt-in through
``CompileConfig.batch_cpp_kernels``): one library per generated module, one per deferred
block, found again through the kernel index, and Inductor's own per-kernel build whenever
the batch cannot take a kernel, on any other thread, and by default."""

import os
import tempfile
import threading
from unittest import mock

import pytest
import torch
from expecttest import TestCase

import graphshard
from _models import fsdp_plan, stack
from graphshard import _compat
from graphshard.compiler import experimental, inductor_cpu


def _two_kernels(x):
    # A matmul between two pointwise/reduction steps: a C++ kernel on each side.
    y = torch.tanh(x + 0.625)
    return torch.softmax((y @ y.t()) * 1.375, dim=-1), y


def _other_kernels(x):
    y = torch.sigmoid(x - 0.8125)
    return torch.cos(y.t() @ y) * 2.75, y


def _index(cache: str) -> dict[str, str]:
    """Kernel index entries: kernel identity -> library path."""
    root = os.path.join(cache, "graphshard_kernels")
    if not os.path.isdir(root):
        return {}
    out = {}
    for name in os.listdir(root):
        with open(os.path.join(root, name)) as f:
            out[name] = f.read().split("\n")[0]
    return out


def _compiled(fn, x, **batch):
    torch._dynamo.reset()
    with experimental.batched_cpp_kernels(**batch):
        return torch.compile(fn, backend="inductor")(x)


class KernelBatchTest(TestCase):
    def setUp(self):
        self.cache = tempfile.mkdtemp()
        patches = [mock.patch.dict(os.environ, {"TORCHINDUCTOR_CACHE_DIR": self.cache}),
                   _compat.inductor_config_patch(fx_graph_cache=False)]
        for p in patches:
            p.__enter__()
            self.addCleanup(p.__exit__, None, None, None)
        self.x = torch.randn(16, 40)

    def assert_matches(self, got, fn):
        for g, want in zip(got, fn(self.x), strict=True):
            torch.testing.assert_close(g, want)

    def test_one_library_per_module(self):
        self.assert_matches(_compiled(_two_kernels, self.x), _two_kernels)
        index = _index(self.cache)
        self.assertGreaterEqual(len(index), 2)  # every kernel of the module is indexed ...
        self.assertEqual(len(set(index.values())), 1)  # ... in one library

    def test_deferred_block_builds_once(self):
        torch._dynamo.reset()
        with experimental.batched_cpp_kernels(defer=True):
            a = torch.compile(_two_kernels, backend="inductor")
            b = torch.compile(_other_kernels, backend="inductor")
            # Each compile runs its graph once; the kernels it calls build early, the rest at the end.
            ga, gb = a(self.x), b(self.x)
        self.assert_matches(ga, _two_kernels)
        self.assert_matches(gb, _other_kernels)
        self.assert_matches(a(self.x), _two_kernels)
        self.assert_matches(b(self.x), _other_kernels)
        self.assertGreaterEqual(len(_index(self.cache)), 4)

    def test_deferred_block_without_calls_builds_one_library(self):
        from torch._inductor.compile_fx import compile_fx_inner

        decomp = _compat.inductor_decompositions()
        gms = [_compat.make_fx(fn, decomposition_table=decomp)(self.x) for fn in (_two_kernels, _other_kernels)]
        with experimental.batched_cpp_kernels(defer=True):
            compiled = [compile_fx_inner(gm, [self.x]) for gm in gms]
        index = _index(self.cache)
        self.assertGreaterEqual(len(index), 4)
        self.assertEqual(len(set(index.values())), 1)
        for c, fn in zip(compiled, (_two_kernels, _other_kernels)):
            self.assert_matches(c([self.x]), fn)

    def test_index_serves_a_second_compile(self):
        self.assert_matches(_compiled(_two_kernels, self.x), _two_kernels)
        built = []
        real = experimental._build_kernels
        with mock.patch.object(experimental, "_build_kernels", lambda ks, ids: built.append(len(ks)) or real(ks, ids)):
            self.assert_matches(_compiled(_two_kernels, self.x), _two_kernels)
        self.assertEqual(built, [])

    def test_falls_back_to_inductor_per_kernel_build(self):
        def unparsable(kernels):
            raise ValueError("kernel argument type 'bool' is not one the batch parses")

        with mock.patch.object(experimental, "_kernel_batch_source", unparsable):
            self.assert_matches(_compiled(_two_kernels, self.x), _two_kernels)
        self.assertEqual(_index(self.cache), {})

    def test_batch_source_names_each_kernel(self):
        src = 'extern "C" void kernel(const float* in_ptr0, float* out_ptr0, const int64_t ks0)\n{ }\n'
        text = experimental._kernel_batch_source([(["const float*", "float*", "const int64_t"], src)] * 2)
        self.assertIn("graphshard_k1::kernel_1(graphshard_arg_ptr<float*>(args, 0), "
                      "graphshard_arg_ptr<float*>(args, 1), graphshard_arg_int64(args, 2))", text)
        with pytest.raises(ValueError, match="'bool'"):
            experimental._kernel_batch_source([(["bool"], src)])


def _third_kernels(x):
    return torch.log1p(torch.abs(x) * 3.0625).sum(-1) - 0.4375


def _regions_compiled_with(record):
    """Patches ``_compat.inductor_compile_region`` to call ``record(is_backward)`` before each region."""
    compile_region = _compat.inductor_compile_region

    def recorded(gm, inputs, *, is_backward):
        record(is_backward)
        return compile_region(gm, inputs, is_backward=is_backward)

    return mock.patch.object(_compat, "inductor_compile_region", recorded)


def test_default_compile_patches_nothing():
    # Without the opt-ins, graphshard's compile leaves Inductor's classes and ISA check alone.
    from torch._inductor import config as inductor_config
    from torch._inductor.async_compile import AsyncCompile

    own = AsyncCompile.cpp_pybinding, AsyncCompile.wait
    seen, warmups = [], []
    with (_regions_compiled_with(lambda bw: seen.append(
            ((AsyncCompile.cpp_pybinding, AsyncCompile.wait) == own, inductor_config.cpp.vec_isa_ok))),
          mock.patch.object(inductor_cpu, "inductor_cpu_warmup", lambda: warmups.append(1))):
        model = stack()
        graphshard.compile(model, fsdp_plan(), lower="inductor")
        model(torch.randn(4, 8)).sum().backward()
    assert seen and set(seen) == {(True, None)}, seen
    assert warmups == []


def test_plain_compile_on_another_thread_gets_inductors_own_build():
    # graphshard compiles with batching on; while its first backward region compiles (the
    # backward compiles lazily, outside dynamo's compile lock), a plain torch.compile runs to
    # completion on another thread. Its kernels are built by Inductor, not collected into
    # graphshard's batch; graphshard's are.
    added = []
    add = experimental._KernelBatch.add

    def tracked_add(self, argtypes, source):
        added.append(threading.get_ident())
        return add(self, argtypes, source)

    other = {}

    def plain_compile():
        other["thread"] = threading.get_ident()
        x = torch.randn(16, 40)
        other["ok"] = torch.allclose(torch.compile(_third_kernels, backend="inductor")(x), _third_kernels(x))

    def on_region(is_backward):
        if is_backward and "thread" not in other:
            other["hooks"] = experimental.inductor_hooks_installed()
            t = threading.Thread(target=plain_compile)
            t.start()
            t.join()

    with mock.patch.object(experimental._KernelBatch, "add", tracked_add), _regions_compiled_with(on_region):
        model = stack()
        # program_cache=False: a program kept in the cache lowers its backward inside the forward's
        # compile, under dynamo's lock, which the other thread's compile would wait for
        graphshard.compile(model, fsdp_plan(), lower="inductor", batch_cpp_kernels=True, program_cache=False)
        model(torch.randn(4, 8)).sum().backward()
    assert other["hooks"] and other["ok"], other
    assert added and other["thread"] not in added
    assert threading.get_ident() in added
    assert not experimental.inductor_hooks_installed()
