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

# Functional collectives (the ops Inductor knows how to issue asynchronously).
c10d = torch.ops._c10d_functional

from torch._guards import detect_fake_mode  # noqa: E402
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode  # noqa: E402
from torch.fx.experimental.proxy_tensor import make_fx  # noqa: E402
from torch._functorch.aot_autograd import aot_module_simplified  # noqa: E402
from torch._functorch.partitioners import min_cut_rematerialization_partition  # noqa: E402


def fake_mode_of(example_inputs) -> FakeTensorMode:
    mode = detect_fake_mode(example_inputs)
    if mode is None:
        mode = FakeTensorMode(allow_non_fake_inputs=True)
    return mode


def inductor_decompositions() -> dict:
    from torch._inductor.decomposition import select_decomp_table

    return dict(select_decomp_table())


def inductor_partition_fn(gm: torch.fx.GraphModule, joint_inputs, **kwargs):
    """Inductor's partitioner: its joint-graph passes (pattern rewrites such as the fused
    attention kernel), then the min-cut partition that honours recompute tags."""
    from torch._inductor.compile_fx import partition_fn

    return partition_fn(gm, joint_inputs, **kwargs)


def inductor_compile_inner(gm: torch.fx.GraphModule, example_inputs, *, is_backward: bool) -> Callable:
    """Inductor's compiler for an already partitioned ATen forward or backward graph."""
    from torch._inductor.compile_fx import compile_fx_inner

    return compile_fx_inner(gm, example_inputs, is_backward=is_backward)


def inductor_compile_region(gm: torch.fx.GraphModule, example_inputs, *, is_backward: bool) -> Callable:
    """Inductor's compiler for one region of a forward or backward graph, inside aot_autograd's
    compiler call: the region's output strides are kept out of the strides aot_autograd
    records for the whole graph (``report_output_strides`` reports those)."""
    from torch._guards import TracingContext
    from torch._inductor.compile_fx import compile_fx_inner

    with TracingContext.report_output_strides():
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

    return bool(config.fx_graph_cache)


def inductor_config_patch(**kwargs) -> contextlib.AbstractContextManager:
    from torch._inductor import config

    return config.patch(**kwargs)


def inductor_cpu_warmup() -> None:
    """Starts, on a daemon thread, the check Inductor makes before its first C++ kernel:
    which vector ISAs the compiler can build (a few seconds of gcc, cached per process
    and on disk). Started when compilation begins, it overlaps tracing instead of
    delaying the first region."""
    import threading

    from torch._inductor.cpu_vec_isa import valid_vec_isa_list

    threading.Thread(target=valid_vec_isa_list, name="graphshard-inductor-warmup", daemon=True).start()


def outside_fake_mode() -> contextlib.AbstractContextManager:
    """Suspends the active FakeTensorMode, if any. Backend compilers run under aot_autograd's
    fake mode, where a c10d call on a tensor it creates (``barrier`` makes one) would be
    faked too and return at once without communicating."""
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


def local_tensors(dtensors: list) -> tuple[torch.Tensor, ...]:
    """``[d.to_local() for d in dtensors]`` with one autograd node for all of them."""
    if not dtensors:
        return ()
    return _LocalTensors.apply(*dtensors)
