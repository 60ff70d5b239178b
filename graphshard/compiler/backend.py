"""The torch.compile backend: ``torch.compile(model, backend="graphshard")``, and every frontend's.

`_compile` is the whole backend, a sequence of stages, each a function with what it reads and writes:

1. `prepare.prepare`: dynamo's graph with its DTensor boundary moved outside it;
2. `prepare.trace`: traced to logical ATen, with the pass context built from the sharded models;
3. the pre-autograd passes (`passes.pipeline.pre_autograd_passes`): the per-rank SPMD program;
4. `outline`: with ``trace_once``, repeated units outlined into shared bodies (`outline.outline_units`);
5. `aot.compile_joint`: aot_autograd differentiates it; `aot.Compilation.partition` partitions
   (honouring the recompute tags) and runs the post-partition passes, `aot.Compilation.lower` lowers
   each graph with Inductor (or runs it as FX with ``lower="eager"``), and the listed wrappers
   (`aot.STAGE_WRAPPERS`: ``no_sync``'s programs, the collective check) and the program cache go
   around each program;
6. `call_boundary`: what the compiled callable does around the program per call (DTensor inputs'
   local shards, the random key, DTensor outputs).
"""

from __future__ import annotations

import functools
import time
from typing import Callable

import torch
import torch.fx as fx
from torch.distributed.tensor import DTensor, Replicate

from graphshard import _compat
from graphshard.compiler import aot, outline, recompute
from graphshard.compiler.prepare import Prepared, prepare, trace
from graphshard.config import CompileConfig
from graphshard.ops.dense import compiling
from graphshard.ops.rng import KeyStream
from graphshard.passes.pipeline import PassContext, dump_graph, pre_autograd_passes, run_passes
from graphshard.report import GraphReport
from graphshard.sharding import ShardedModel


def graphshard_backend(gm: fx.GraphModule, example_inputs, options: dict | None = None, *,
                       config: CompileConfig | None = None, models: tuple[ShardedModel, ...] = ()):
    """Dynamo backend entry point: bound to a model and config by `make_backend` (every frontend), or
    registered as ``"graphshard"`` by entry point (``torch.compile(model, backend="graphshard",
    options={...})``), where the models are found from the graph's keys (`prepare`)."""
    try:
        return _compile(gm, example_inputs, config or CompileConfig(**(options or {})), tuple(models))
    except _compat.FAKE_TENSOR_FALLBACK_ERRORS as e:
        # dynamo turns these into a graph break and runs the graph eagerly, unsharded by any pass:
        # a silent fallback. graphshard stops with the reason instead.
        raise RuntimeError(
            f"graphshard could not trace this graph ({type(e).__name__}: {e}); an op without a fake "
            "implementation, or with data-dependent output sizes the graph cannot hold. dynamo would run the "
            "graph eagerly instead; graphshard refuses that silent fallback"
        ) from e


def make_backend(model: ShardedModel, config: CompileConfig) -> Callable:
    """The dynamo backend that compiles ``model`` (a sharded model's `ShardedModel`) with ``config``."""
    return functools.partial(graphshard_backend, config=config, models=(model,))


def _compile(gm: fx.GraphModule, example_inputs, config: CompileConfig, models: tuple[ShardedModel, ...]):
    """The backend's stages in order (the module's docstring lists them)."""
    t0 = time.perf_counter()
    prepared = trace(prepare(gm, example_inputs), config, models)
    ctx = prepared.ctx
    t1 = time.perf_counter()
    if prepared.dtensor_positions:
        ctx.report.notes.append(
            f"{len(prepared.dtensor_positions)} parameter input(s) reached dynamo as DTensors (a model compiled by "
            "name, or a separately sharded submodule): dynamo checks each one's spec and mesh in Python at every "
            "call; graphshard.compile and the frontends hand dynamo plain local shards")
    spmd = run_passes(prepared.graph, ctx, pre_autograd_passes())
    t2 = time.perf_counter()
    boundary = call_boundary(spmd, prepared)
    fake_inputs = prepared.fake_inputs + _added_inputs(spmd, len(prepared.fake_inputs))
    ac_regions = recompute.regions(spmd)  # before outlining, which moves the tagged nodes into bodies
    outlined = outline_stage(spmd, ctx)
    with compiling(ctx.params), outline.timing(outlined):
        compiled = aot.compile_joint(spmd, fake_inputs, ctx, outlined, ac_regions)
    times = ctx.report.compile_seconds
    times.update(trace_to_aten=t1 - t0, pre_autograd_passes=t2 - t1)
    if "program_load" not in times:  # a program loaded from the cache (`program_cache`) skipped aot_autograd
        times["aot_autograd"] = (time.perf_counter() - t2 - times.get("outline", 0) - times.get("forward_lowering", 0)
                                 - times.get("backward_lowering", 0))
    ctx.report.backend_seconds = time.perf_counter() - t0
    return _first_run_timed(boundary(compiled), ctx.report)


def outline_stage(gm: fx.GraphModule, ctx: PassContext) -> outline.Outlined:
    """Stage 4. With ``trace_once``, rewrites ``gm`` in place: each repeated unit becomes a call of
    one shared body (`outline.outline_units`), so aot_autograd differentiates and partitions each
    distinct body once; returns what was outlined (empty otherwise), also kept in the report."""
    outlined = outline.Outlined()
    if ctx.config.trace_once:
        start = time.perf_counter()
        outlined = outline.outline_units(gm, ctx.params, ctx.input_requires_grad)  # inputs passes added: no grad
        ctx.report.compile_seconds["outline"] = time.perf_counter() - start
        if outlined.units:
            ctx.report.notes.append(f"trace once: {outlined.describe()}")
            dump_graph(ctx, "outline_units", gm)
    ctx.report.outlined = outlined
    return outlined


def call_boundary(spmd: fx.GraphModule, prepared: Prepared) -> Callable[[Callable], Callable]:
    """Stage 6. Reads the per-rank program's declared outputs and random inputs; returns what wraps
    the compiled program per call: the local shards of DTensor inputs taken, the per-call random key
    and coordinates appended (`localize_random`), outputs declared ``use_local_output=False``
    wrapped as DTensors. Identity when there is none of these."""
    positions = prepared.dtensor_positions
    dtensor_outputs = _dtensor_outputs(spmd, prepared.ctx)
    random_inputs = _random_inputs(prepared.ctx)
    if not positions and not dtensor_outputs and random_inputs is None:
        return lambda compiled: compiled

    def around(compiled: Callable) -> Callable:
        def run(*args):
            args = list(args)
            if positions:
                for i, local in zip(positions, _compat.local_tensors([args[i] for i in positions])):
                    args[i] = local
            if random_inputs is not None:
                args.extend(random_inputs())
            outs = compiled(*args)
            if not dtensor_outputs:
                return outs
            outs = list(outs)
            for i, wrap in dtensor_outputs.items():
                outs[i] = wrap(outs[i])
            return outs

        return run

    return around


def _first_run_timed(fn: Callable, report: GraphReport) -> Callable:
    """``fn`` (what the backend returns to dynamo), with its first call's seconds kept in ``report``:
    the model's compiled call subtracts them, with the backend's, from the call that compiled, and
    what is left is dynamo's own time (`explain.timing_compiles`). Later calls pay one Python call
    and a flag test."""
    pending = True

    @functools.wraps(fn)  # keeps the calling convention dynamo reads from fn (``_boxed_call``)
    def call(*args):
        nonlocal pending
        if not pending:
            return fn(*args)
        pending = False
        start = time.perf_counter()
        try:
            return fn(*args)
        finally:
            report.first_run_seconds = time.perf_counter() - start

    return call


def _dtensor_outputs(gm: fx.GraphModule, ctx: PassContext) -> dict:
    """Graph outputs that are declared module outputs with ``use_local_output=False``: the caller
    gets them as DTensors over the model-parallel axes, built from the compiled local values."""
    out_node = next(n for n in gm.graph.nodes if n.op == "output")
    wraps = {}
    for i, (placements, local) in (out_node.meta.get("output_layouts") or {}).items():
        if local:
            continue
        axes = [a for a, p in placements.items() if p != Replicate()]
        if len(axes) != 1:
            raise NotImplementedError(
                f"graph output {i} is sharded over several model-parallel axes {axes} with use_local_output=False; "
                "graphshard returns DTensor outputs over one axis: set use_local_output=True there"
            )
        shape = out_node.args[0][i].meta["logical_shape"]
        stride = torch.empty(shape, device="meta").stride()
        wraps[i] = functools.partial(DTensor.from_local, device_mesh=ctx.meshes[axes[0]],
                                     placements=[placements[axes[0]]], run_check=False, shape=shape, stride=stride)
    return wraps


def _random_inputs(ctx: PassContext) -> KeyStream | None:
    """The per-call key and coordinates of a graph whose random ops localize_random rewrote
    (its seed is agreed over the model-parallel groups at the graph's first call)."""
    draws = ctx.random
    if draws is None:
        return None
    meshes = [ctx.meshes[axis] for axis in draws.agree_over]  # none: each rank draws its own (recomputed ops)
    return KeyStream(draws, [ctx.model_parallel[axis].rank for axis in draws.coord_axes],
                     [mesh.get_group() for mesh in meshes],
                     torch.device(meshes[0].device_type) if meshes else draws.device)


def _added_inputs(gm: fx.GraphModule, known: int) -> list:
    """Fake values of the inputs passes added after the ``known`` ones dynamo passes."""
    return [n.meta["val"] for n in gm.graph.nodes if n.op == "placeholder"][known:]
