"""The torch.compile backend: ``torch.compile(model, backend="graphshard")``.

Dynamo hands over a graph in torch IR whose sharded parameters are inputs read through the
``graphshard::param`` marker: the local shards graphshard's call wrapper fed the getters
(`storage.feeding_local_shards`), or, in a model compiled by name, DTensor inputs read through
``to_local()``. The backend

1. moves any DTensor boundary outside the graph (the compiled callable takes local shards;
   ``to_local`` runs eagerly, so gradients land on the DTensors);
2. traces the graph to ATen with fake tensors of logical shape, each distinct repeated block's
   body once (`aten_trace`), and puts each parameter marker's key back;
3. runs the pre-autograd passes (logical program -> per-rank SPMD program);
4. hands the result to aot_autograd, whose partitioner honours the resharding
   tags, runs the post-partition passes on the forward and backward graphs, and
   lowers them with Inductor (or runs them as FX with ``lower="eager"``).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import os
import re
import time
import warnings

from dataclasses import dataclass
from typing import Callable

import torch
import torch.fx as fx
from torch.distributed.tensor import DTensor, Replicate

from graphshard import _compat
from graphshard.compiler import collective_check, compile_share, grad_sync, inductor_cpu, outline, program_cache, recompute
from graphshard.compiler.aten_trace import trace_to_aten
from graphshard.compiler.regions import inline_regions
from graphshard.report import GraphReport, add_compute, collective_kind
from graphshard.compiler.lowering import fuse_packed_gathers, lower_regions, plan_regions, whole_graph_reason
from graphshard.config import CompileConfig
from graphshard.ops import ops
from graphshard.ops.dense import compiling, decompositions
from graphshard.ops.rng import KeyStream
from graphshard.ops.sparse import lookup_args
from graphshard.params import resolve
from graphshard.passes.pipeline import PassContext, post_partition_passes, pre_autograd_passes, run_passes
from graphshard.passes.no_sync_programs import root_reductions
from graphshard.passes.relax_views import relax_views
from graphshard.sharding import ShardedModel, is_traced_key, model_for_key

log = logging.getLogger(__name__)
_graph_ids = itertools.count()


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
    t0 = time.perf_counter()
    prepared = prepare(gm, example_inputs, config, models)
    t1 = time.perf_counter()
    if prepared.dtensor_positions:
        prepared.ctx.report.notes.append(
            f"{len(prepared.dtensor_positions)} parameter input(s) reached dynamo as DTensors (a model compiled by "
            "name, or a separately sharded submodule): dynamo checks each one's spec and mesh in Python at every "
            "call; graphshard.compile and the frontends hand dynamo plain local shards")
    traced = run_passes(prepared.graph, prepared.ctx, pre_autograd_passes())
    t2 = time.perf_counter()
    dtensor_outputs = _dtensor_outputs(traced, prepared.ctx)
    random_inputs = _random_inputs(prepared.ctx)
    fake_inputs = prepared.fake_inputs + _added_inputs(traced, len(prepared.fake_inputs))
    ac_regions = recompute.regions(traced)  # before outlining, which moves the tagged nodes into bodies
    outlined = _outline(traced, prepared.ctx)
    prepared.ctx.report.outlined = outlined
    with compiling(prepared.ctx.params), outline.timing(outlined):
        compiled = _aot_compile(traced, fake_inputs, prepared.ctx, outlined, ac_regions)
    times = prepared.ctx.report.compile_seconds
    times.update(trace_to_aten=t1 - t0, pre_autograd_passes=t2 - t1)
    if "program_load" not in times:  # a program loaded from the cache (`program_cache`) skipped aot_autograd
        times["aot_autograd"] = (time.perf_counter() - t2 - times.get("outline", 0) - times.get("forward_lowering", 0)
                                 - times.get("backward_lowering", 0))
    prepared.ctx.report.backend_seconds = time.perf_counter() - t0
    if not prepared.dtensor_positions and not dtensor_outputs and random_inputs is None:
        return _first_run_timed(compiled, prepared.ctx.report)
    positions = prepared.dtensor_positions

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

    return _first_run_timed(run, prepared.ctx.report)


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


@dataclass
class Prepared:
    """A dynamo graph traced to logical ATen, with the context the passes need."""

    graph: fx.GraphModule
    ctx: PassContext
    fake_inputs: list
    dtensor_positions: list[int]


def prepare(gm: fx.GraphModule, example_inputs, config: CompileConfig,
            models: tuple[ShardedModel, ...] = ()) -> Prepared:
    """Traces ``gm`` to logical ATen and builds its pass context from ``models`` (the sharded models
    the backend is bound to; by name, none: found from the graph's keys)."""
    calls, bodies = inline_regions(gm, keep_calls=True)
    dtensor_positions = _strip_dtensor_boundary(gm, example_inputs)
    fake_mode = _compat.fake_mode_of(example_inputs)
    fake_inputs = [_fake_local(x, fake_mode) for x in example_inputs]
    if any(lookup_args(n) for g in gm.modules() if isinstance(g, fx.GraphModule) for n in g.graph.nodes):
        # a sequence lookup's output sizes are the data's
        _compat.allow_data_dependent_sizes(fake_mode)
    traced, aten_bodies = trace_to_aten(gm, fake_inputs, fake_mode)
    _resolve_traced_keys(traced, example_inputs, [n.target for n in gm.graph.find_nodes(op="placeholder")], models)
    markers = _nodes(traced, ops.param.default)
    layouts = _nodes(traced, ops.layout.default)
    bound = bool(models)
    models = _models_of([n.args[1] for n in markers + layouts], models)
    params = {k: p for m in models for k, p in m.params.items()}
    frame = _compat.dynamo_frame()
    report = GraphReport(index=len(models[0].explain) if models else next(_graph_ids), frame=frame,
                         frame_compile=sum(r.frame == frame for r in models[0].explain) if models else 0,
                         dynamo_bodies=(calls, len(bodies), aten_bodies))
    if models:
        models[0].explain.append(report)
    model_parallel, group_axes = _axes(markers, layouts, params, models)
    ctx = PassContext(
        config=config, models=models, params=params, model_parallel=model_parallel, group_axes=group_axes,
        meshes={axis: mesh for m in reversed(models) for axis, mesh in m.meshes().items()},
        sparse=_sparse_collections(traced, models, by_name=not bound), input_units=_input_units(traced, markers, params),
        input_requires_grad=[isinstance(x, torch.Tensor) and x.requires_grad for x in example_inputs],
        fake_mode=fake_mode, graph_index=report.index, report=report)
    return Prepared(traced, ctx, fake_inputs, dtensor_positions)


def _nodes(gm: fx.GraphModule, target) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target == target]


def _models_of(keys: list[str], bound: tuple[ShardedModel, ...]) -> tuple[ShardedModel, ...]:
    """The bound models, then those of the keys no bound model owns (a model compiled by name, or a
    separately sharded submodule inside a compiled model): resolved once, here, at the entry."""
    models = list(bound)
    for key in dict.fromkeys(keys):
        if any(m.owns(key) for m in models):
            continue
        model = model_for_key(key)
        if model is None:
            raise _no_live_model(repr(key))
        models.append(model)
    return tuple(models)


def _no_live_model(what: str) -> ValueError:
    return ValueError(f"the graph reads {what}, a parameter or layout of no live sharded model: the model it "
                      "belonged to was freed, or the graph was captured before graphshard.shard; compile "
                      "the model graphshard sharded")


def _axes(markers: list[fx.Node], layouts: list[fx.Node], params: dict, models) -> tuple[dict, dict]:
    """The model-parallel axes the graph uses (by name) and the c10d group of every axis it uses."""
    model_parallel, group_axes = {}, {}
    for key in dict.fromkeys(n.args[1] for n in markers):
        info = params[key]
        for axis, _ in info.model_parallel:
            model_parallel[axis.name] = axis
        for axis in [info.shard, *info.replicate, *(a for a, _ in info.model_parallel)]:
            if axis is not None:
                group_axes[axis.name] = axis.group_name
    for node in layouts:  # a module with declared layouts but no sharded parameter of its own
        axis = node.args[2]
        owner = next(m for m in models if m.owns(node.args[1]))
        if axis not in model_parallel:
            model_parallel[axis] = owner.axes[axis]
            group_axes[axis] = model_parallel[axis].group_name
    return model_parallel, group_axes


def _sparse_collections(gm: fx.GraphModule, models: tuple[ShardedModel, ...], by_name: bool) -> dict:
    """The embedding collections the graph looks up, by key (``shard_embeddings`` expands them): the
    models' own; compiled by name, a graph that reads no dense parameter finds them by key."""
    keys = [a[4] for a in map(lookup_args, gm.graph.nodes) if a is not None]
    owned = {c.layout.key: c for m in models for c in m.collections}
    missing = [k for k in keys if k not in owned]
    if missing and not by_name:
        raise ValueError(f"the graph looks up the embedding collection(s) {missing}, which the compiled model's "
                         "ShardedModel does not hold: shard the embedding modules with the model (a ShardEmbedding "
                         "spec in its Plan, or DistributedModelParallel), not separately")
    if missing:
        owned.update({k: resolve(k) for k in missing})
    return {k: owned[k] for k in keys}


def _strip_dtensor_boundary(gm: fx.GraphModule, example_inputs) -> list[int]:
    """Rewires ``p.to_local()`` to the placeholder itself; returns the DTensor input positions.
    A DTensor passed into a higher-order op's body (activation checkpointing's
    ``tag_activation_checkpoint``: dynamo lifts the parameters a checkpointed function reads into
    its body's inputs; a repeated block's ``invoke_subgraph`` body) is rewired inside that body the
    same way, once for a body its calls share."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    positions = [i for i, (ph, x) in enumerate(zip(placeholders, example_inputs)) if isinstance(x, DTensor)]
    _strip_to_local(gm, [placeholders[i] for i in positions])
    return positions


def _strip_to_local(gm: fx.GraphModule, dtensors: list[fx.Node], in_body: bool = False) -> None:
    """Replaces each ``to_local()`` of the ``dtensors`` nodes (of ``gm``) by the node itself,
    following them into the bodies of the checkpointed and region calls they are passed to."""
    bodies: dict[str, set[int]] = {}  # body attribute -> its inputs that are DTensors, by position
    for ph in dtensors:
        for user in list(ph.users):
            if _compat.is_plain_to_local(user):
                user.replace_all_uses_with(ph)
                gm.graph.erase_node(user)
                continue
            called = _body_call(gm, user)
            if called is None or ph in user.kwargs.values():
                raise NotImplementedError(
                    f"{'input of a checkpointed body' if in_body else 'graph input'} {ph.target!r} is a DTensor used directly by node {user.name!r} ({user.target}); "
                    "graphshard compiles parameters read through the module attribute (read it as module.<name>), "
                    "and follows them into activation-checkpointed functions (torch.utils.checkpoint) and repeated "
                    "blocks' bodies, not into other higher-order ops"
                )
            name, operands = called
            bodies.setdefault(name, set()).update(i for i, a in enumerate(operands) if a is ph)
    held = set(dtensors)
    for node in gm.graph.nodes:  # a body its calls share: every call passes a DTensor where one does
        called = _body_call(gm, node)
        if called is not None and called[0] in bodies:
            plain = [i for i in bodies[called[0]] if called[1][i] not in held]
            if plain:
                raise NotImplementedError(
                    f"node {node.name!r} calls the body {called[0]!r} with a plain tensor at operand {plain[0]}, where "
                    "another call passes a DTensor parameter; graphshard strips the DTensor boundary of a body once "
                    "for all its calls. Report it: dynamo shares a body only between calls of the same input types")
    for name, positions in bodies.items():
        body = getattr(gm, name)
        inputs = [n for n in body.graph.nodes if n.op == "placeholder"]
        _strip_to_local(body, [inputs[i] for i in sorted(positions)], in_body=True)
    gm.recompile()


def _resolve_traced_keys(gm: fx.GraphModule, example_inputs, names: list[str], models: tuple[ShardedModel, ...]) -> None:
    """Puts in each marker traced with its model's key only (`sharding.traced_key`) the key of the
    parameter it reads: found from the graph input the marker reads (through views), the DTensor
    parameter or the local shard graphshard's call wrapper handed dynamo for it
    (`storage.feeding_local_shards`). ``names`` are dynamo's names of the inputs, for errors."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    index = {ph: i for i, ph in enumerate(placeholders)}
    keys = _ParamKeys(models)
    traced = [n for n in gm.graph.nodes if _is_marker(n) and is_traced_key(n.args[1])]
    for marker in traced:
        source = outline.view_base(marker.args[0])
        value = example_inputs[index[source]] if source in index else None
        if not isinstance(value, torch.Tensor):
            raise ValueError(
                f"node {marker.name!r} reads graphshard's parameter marker ({marker.args[1]!r}) of "
                f"{names[index[source]] if source in index else source.name!r}, "
                "which is not a sharded parameter the graph takes as input: the marker is graphshard's own, read only "
                "through a sharded module's parameter attribute"
            )
        marker.update_arg(1, keys.of(marker.args[1], value, marker, names[index[source]]))
    if traced:
        gm.recompile()


class _ParamKeys:
    """Parameter keys by the DTensor object or the local shard fed for it, per model, built on first use."""

    def __init__(self, models: tuple[ShardedModel, ...]):
        self.models, self.by_model = models, {}

    def of(self, traced: str, tensor, node: fx.Node, read: str) -> str:
        model = next((m for m in self.models if m.owns(traced)), None) or model_for_key(traced)
        if model is None:
            raise _no_live_model(f"{traced!r} (input {read!r})")
        if model.model_id not in self.by_model:
            self.by_model[model.model_id] = model.keys_by_object()
        key = self.by_model[model.model_id].get(id(tensor))
        if key is None:
            raise ValueError(
                f"node {node.name!r} reads a tensor through graphshard's parameter marker ({traced!r}) that is no "
                "parameter a module of its sharded model holds, nor its local shard: the marker is graphshard's own, "
                "read only through a sharded module's parameter attribute"
            )
        return key


def _is_marker(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target in (ops.param.default, ops.param)


_BODY_OPS = ("tag_activation_checkpoint", "wrap")
"""Higher-order ops called as ``op(body, *inputs)``: the body's inputs are the call's operands."""


def _body_call(gm: fx.GraphModule, node: fx.Node) -> tuple[str, tuple] | None:
    """(body attribute, operands) of a checkpointed call (``tag_activation_checkpoint(body,
    *inputs)``, or dynamo's plain ``wrap``) or a region call (``invoke_subgraph(body, identifier,
    *inputs)``) whose operands are its body's inputs one for one; None for any other node."""
    if node.op != "call_function" or not _compat.is_higher_order_op(node.target):
        return None
    region = _compat.HAS_INVOKE_SUBGRAPH and node.target is _compat.invoke_subgraph_op()
    if not (region or getattr(node.target, "__name__", None) in _BODY_OPS) or not node.args:
        return None
    first = node.args[0]
    body = getattr(gm, first.target, None) if isinstance(first, fx.Node) and first.op == "get_attr" else None
    if not isinstance(body, fx.GraphModule):
        return None
    operands = node.args[2:] if region else node.args[1:]
    inputs = [n for n in body.graph.nodes if n.op == "placeholder"]
    return (first.target, operands) if len(inputs) == len(operands) else None


def _fake_local(x, fake_mode):
    """The fake of graph input ``x``: of a DTensor's local shard, or of a plain tensor (a local shard
    graphshard's call wrapper fed included), made in the backend's fake mode: dynamo hands backends
    a fake mode of their own, which shares only the shape environment, so dynamo's fakes of the
    inputs are not reused here."""
    if isinstance(x, DTensor):
        return _compat.fake_local(x, fake_mode)
    if isinstance(x, torch.Tensor) and not isinstance(x, _compat.FakeTensor):
        x = fake_mode.from_tensor(x)
    return x


def _input_units(gm: fx.GraphModule, markers: list[fx.Node], params: dict) -> list:
    """For each graph input: the unit of the parameter it is the local shard of, or of the
    parameters it holds (a flat unit's parameter, which the markers read through views);
    None for data."""
    units = {}
    for n in markers:  # a flat parameter's view (slice, view) back to the input
        units[outline.view_base(n.args[0])] = params[n.args[1]].layout.unit
    return [units.get(n) for n in gm.graph.nodes if n.op == "placeholder"]


def _outline(gm: fx.GraphModule, ctx: PassContext) -> outline.Outlined:
    """With ``trace_once``, the repeated units outlined into shared bodies (`outline.outline_units`)."""
    if not ctx.config.trace_once:
        return outline.Outlined()
    start = time.perf_counter()
    outlined = outline.outline_units(gm, ctx.params, ctx.input_requires_grad)  # inputs passes added: no grad
    ctx.report.compile_seconds["outline"] = time.perf_counter() - start
    if outlined.units:
        ctx.report.notes.append(f"trace once: {outlined.describe()}")
    return outlined


def _aot_compile(gm: fx.GraphModule, fake_inputs, ctx: PassContext, outlined: outline.Outlined,
                 ac_regions: dict[int, str]):
    partitioned = False  # the post-partition passes ran when the joint graph was partitioned
    ahead: dict = {}     # the backward's regions, compiled with the forward's
    compiled: dict = {}  # regions this rank compiled, by (is_backward, key)
    config = ctx.config
    share = compile_share.shared_compile(config.share_compile)
    # the local ranks split Inductor's ISA check before the first C++ kernel (the shortcut checks one)
    isa_share = (inductor_cpu.IsaShare(share) if config.lower == "inductor" and share is not None
                 and not config.fast_isa_check else None)
    # the program's name on every rank: the model (sharded in the same order everywhere), the code
    # dynamo compiled it from, and which compile of that code it is
    program = collective_check.Program(f"m{ctx.models[0].model_id}" if ctx.models else "graph",
                                       ctx.report.frame or f"graph {ctx.report.index}", ctx.report.frame_compile)

    def partition(joint: fx.GraphModule, joint_inputs, **kwargs):
        nonlocal partitioned, ahead
        base = (_compat.inductor_partition_fn if config.lower == "inductor"
                else _compat.min_cut_rematerialization_partition)
        body = not joint_inputs and outlined.calls  # an outlined body's joint: aot_autograd partitions it first
        inputs = [n.meta.get("val") for n in joint.graph.find_nodes(op="placeholder")] if body else joint_inputs
        if (config.lower == "inductor" and config.fast_isa_check
                and any(x.device.type == "cpu" for x in _tensors(inputs))):
            inductor_cpu.inductor_cpu_warmup()  # overlaps the partition (see the function)
        if isa_share is not None:
            isa_share.start(_tensors(inputs))  # overlaps the partition (`inductor_cpu.IsaShare`)
        if body:
            start = time.perf_counter()
            try:
                return recompute.partition_body(joint, base, kwargs, outlined)
            finally:
                outlined.partition_seconds += time.perf_counter() - start
        untagged = recompute.without_checkpointing(joint) if ac_regions else None  # before base: it edits the tags
        fw, bw = base(joint, joint_inputs, **kwargs)
        # lazy code generation: the passes recompile them, and regional lowering never runs them as code
        # (aot_autograd's lazy backward deep-copies the backward, which regenerates a plain module's code)
        fw, bw = (_compat.lazy_graph_module(outline.inline_calls(g, outlined)) for g in (fw, bw))
        if ac_regions:
            ctx.report.recompute = recompute.account(fw, bw, untagged, ac_regions, base, joint_inputs, kwargs,
                                                      ctx.report, outlined)
        ctx.stage = "forward"
        fw = run_passes(fw, ctx, post_partition_passes())
        ctx.stage = "backward"
        bw = run_passes(bw, ctx, post_partition_passes())
        partitioned = True
        if (config.lower == "inductor" and config.regional and share is not None
                and whole_graph_reason(fw) is None and whole_graph_reason(bw) is None):
            ahead = plan_regions(bw, is_backward=True)[3]
        return fw, bw

    cache_off = program_cache.supported(config) if config.program_cache else None
    use_cache = config.program_cache and cache_off is None
    if cache_off:
        ctx.report.notes.append(f"program cache: not used: {cache_off}")
        log.info("graphshard: program cache not used: %s", cache_off)
    added = program_cache.ReportDelta(ctx.report) if use_cache else None
    user_tag = _compat.cache_key_tag()  # the program's key tag is aot_autograd's only, not its regions'
    lower_variant = functools.partial(_lower_variant, config=config, share=share, compiled=compiled)

    def checked(fn: Callable, by_group: dict | None, stage: str) -> Callable:
        if by_group is None:
            return fn
        check = collective_check.CollectiveCheck(
            by_group, program, stage, report=functools.partial(ctx.report.collective_check.__setitem__, stage))
        return collective_check.wrap(fn, check)

    def stage_compiler(stage: str):
        def compile_graph(g: fx.GraphModule, inputs):
            with _compat.with_cache_key_tag(user_tag):
                return lower_stage(g, inputs)

        def lower_stage(g: fx.GraphModule, inputs):
            start = time.perf_counter()
            ctx.stage = stage
            is_backward = stage == "backward"
            kept = None  # the backward graph kept with a stored program, for no_sync's programs
            if not partitioned:  # an inference graph: aot_autograd compiles it without partitioning
                g = run_passes(outline.inline_calls(g, outlined), ctx, post_partition_passes())
            # read before lowering: Inductor rewrites the graph it compiles (in-place collectives)
            by_group = collective_check.fingerprint(g) if collective_check.enabled(config) else None
            if isa_share is not None and (checked_here := isa_share.seconds(_tensors(inputs))):
                ctx.report.notes.append(inductor_cpu.ISA_SPLIT_NOTE + inductor_cpu.describe_isa_checks(checked_here))
            if config.lower == "eager":
                compiled_fn = _as_fx(g, inputs)
            elif config.regional and not _whole_graph(g, stage, ctx):
                with _compat.inductor_config_patch(**_INDUCTOR_SETTINGS, **_cpu_settings(inputs, config),
                                                   compile_threads=compile_share.compile_threads()):
                    compiled_fn, order, counts = lower_regions(
                        g, is_backward=is_backward, share=share, ahead=ahead if stage == "forward" else None,
                        compiled=compiled, batch=config.batch_cpp_kernels)
                ctx.report.lowered_order[stage] = order
                ctx.report.regions[stage] = counts
                if config.dump_graphs:
                    with open(os.path.join(config.dump_graphs, f"g{ctx.report.index}_{stage}_regions.txt"), "w") as f:
                        f.write(compiled_fn.describe() + "\n")
            else:
                if use_cache and is_backward and partitioned and _grad_sync_roots(g, ctx):
                    # no_sync's source as partitioned: Inductor's lowering of a whole graph leaves it unpicklable
                    kept = _compat.graph_to_bytes(g, program_cache.BACKWARD_META)
                with _compat.inductor_config_patch(**_INDUCTOR_SETTINGS, **_cpu_settings(inputs, config)):
                    g = fuse_packed_gathers(g)
                    compiled_fn = compile_share.shared_whole_graph(share, g, inputs, is_backward, lambda: _whole_graph_compile(
                        g, inputs, is_backward, config.batch_cpp_kernels))
                _record_lowered(compiled_fn, stage, ctx)
            ctx.report.compile_seconds[f"{stage}_lowering"] = time.perf_counter() - start
            lowered = compiled_fn
            if is_backward and partitioned and (roots := _grad_sync_roots(g, ctx)):
                ctx.report.notes.append(f"no_sync: backward programs without the {len(roots)} data-parallel gradient "
                                        "reduction(s) and with the accumulated gradients added, each built and lowered "
                                        "on first use")
                compiled_fn = grad_sync.GradSync(compiled_fn, lambda: (g, roots, list(inputs)), ctx.models, lower_variant,
                                                 dump=_variant_dump(ctx))
                kept = g if kept is None else kept
            compiled_fn = checked(compiled_fn, by_group, stage)
            if not use_cache:
                return compiled_fn
            return program_cache.StageProgram(stage, lowered, compiled_fn, by_group=by_group, backward=kept,
                                              report=added.take(), seconds=time.perf_counter() - start,
                                              signature=program_cache.signature(inputs))

        return compile_graph

    def rebuild(stored: program_cache.StageProgram) -> None:
        """A program loaded from the cache, with graphshard's wrappers and report put back."""
        program_cache.apply_delta(ctx.report, stored.report)
        fn = stored.lowered
        if stored.backward is not None:
            fn = grad_sync.GradSync(fn, lambda: _stored_backward(stored, ctx), ctx.models, lower_variant,
                                    dump=_variant_dump(ctx))
        fn = checked(fn, stored.by_group if collective_check.enabled(config) else None, stored.stage)
        stored.run = program_cache.verified(fn, stored.signature, stored.stage, ctx.report.index)

    decomps = dict(decompositions())
    if config.lower == "inductor":
        decomps = {**_compat.inductor_decompositions(), **decomps}
    fw_compiler, bw_compiler = stage_compiler("forward"), stage_compiler("backward")
    settings: contextlib.AbstractContextManager = contextlib.nullcontext()
    if use_cache:
        fw_compiler = _compat.serializable_compiler(program_cache.StageProgram, fw_compiler)
        bw_compiler = _compat.serializable_compiler(program_cache.StageProgram, bw_compiler)
        tag = program_cache.key_tag(gm, ctx, _process_rank())
        settings = _compat.program_cache_settings(f"{user_tag}/{tag}" if user_tag else tag,
                                                  program_cache.CACHEABLE_FUNCTIONS)
        outcome = program_cache.Outcome()
    with _no_dropped_gradients(), settings, program_cache.loading(rebuild):
        result = _compat.aot_module_simplified(
            gm,
            fake_inputs,
            fw_compiler=fw_compiler,
            bw_compiler=bw_compiler,
            partition_fn=partition,
            decompositions=decomps,
        )
    if use_cache:
        note, hit = outcome.describe()
        ctx.report.notes.append(note)
        log.info("graphshard: graph %d: %s", ctx.report.index, note)
        if hit:
            ctx.report.compile_seconds["program_load"] = time.perf_counter() - outcome.start
    return result


_NO_DERIVATIVE = "autograd kernel was not registered"


@contextlib.contextmanager
def _no_dropped_gradients():
    """aot_autograd differentiates the ATen graph. An op there with no derivative of its own (a
    custom op whose gradient lives only in a C++ autograd wrapper the ATen trace went below, as
    fbgemm's ``permute_pooled_embs_auto_grad`` around ``permute_pooled_embs``) gets no gradient:
    torch's autograd fallback only warns, and the parameters behind it silently stop training.
    That warning is an error here, naming the op."""
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=f".*{_NO_DERIVATIVE}")
        try:
            yield
        except (UserWarning, RuntimeError) as e:
            if _NO_DERIVATIVE not in str(e):
                raise
            raise NotImplementedError(
                f"the compiled program differentiates an op with no derivative, so the tensors before it would get no "
                f"gradient: {str(e).split('. ')[0]}. graphshard traced below an autograd wrapper that holds the "
                "op's gradient; register the op's derivative (torch.library.register_autograd) or report it"
            ) from e


def _process_rank() -> tuple[int, int] | None:
    """(rank, world size) of this process's default group, if any."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return None
    return torch.distributed.get_rank(), torch.distributed.get_world_size()


def _grad_sync_roots(bw: fx.GraphModule, ctx: PassContext) -> list[fx.Node]:
    """The backward's data-parallel gradient reductions ``graphshard.no_sync`` skips (`grad_sync`):
    with any, the backward runs as a `grad_sync.GradSync`, which selects a program without them."""
    if not ctx.models:
        return []
    mp_groups = {axis.group_name for axis in ctx.model_parallel.values()}
    params = {i for i, unit in enumerate(ctx.input_units) if unit is not None}
    return root_reductions(bw, mp_groups, params)


def _stored_backward(stored: program_cache.StageProgram, ctx: PassContext) -> tuple[fx.GraphModule, list, list]:
    """A loaded backward program's graph, for ``no_sync``'s programs: its roots found again."""
    bw = stored.backward_graph()
    inputs = [ph.meta["val"] for ph in bw.graph.find_nodes(op="placeholder")]
    return bw, _grad_sync_roots(bw, ctx), inputs


def _variant_dump(ctx: PassContext) -> Callable[[str, fx.GraphModule], None] | None:
    """With ``dump_graphs``: writes a ``no_sync`` program (`graphshard.passes.no_sync_programs`) when it is built."""
    folder = ctx.config.dump_graphs
    if not folder:
        return None

    def dump(name: str, g: fx.GraphModule) -> None:
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, f"g{ctx.report.index}_backward_no_sync_{name}.txt"), "w") as f:
            f.write(g.print_readable(print_output=False, include_stride=False, include_device=False))

    return dump


def _lower_variant(g: fx.GraphModule, inputs: list, *, config: CompileConfig, share, compiled: dict):
    """Lowers a backward program derived from the partitioned one (`grad_sync`): with its own
    facts, never aot_autograd's (which describe the graph it partitioned, not this one)."""
    if config.lower == "eager":
        return _as_fx(g, inputs)
    with _compat.inductor_config_patch(**_INDUCTOR_SETTINGS, **_cpu_settings(inputs, config),
                                       compile_threads=compile_share.compile_threads()):
        if config.regional and whole_graph_reason(g) is None:
            return lower_regions(g, is_backward=True, share=share, compiled=compiled, batch=config.batch_cpp_kernels,
                                 report_strides=False)[0]
        with inductor_cpu.batched_cpp_kernels(enabled=config.batch_cpp_kernels):
            return _compat.inductor_compile_region(fuse_packed_gathers(g), inputs, is_backward=True)


def _as_fx(g: fx.GraphModule, inputs: list) -> Callable:
    """``lower="eager"``: the partitioned graph run as FX, its views relaxed to reshapes first
    (`relax_views`). aot_autograd traced it with each op's fake kernel, and some eager kernels return
    other strides (CPU BatchNorm over a transposed input returns a contiguous output where its fake
    kernel keeps the input's strides), so a ``view`` valid for the traced strides raises at run time;
    ``torch.compile(backend="aot_eager")`` raises on the same program. Inductor plans strides itself."""
    relax_views(g, None)
    g.recompile()
    return _compat.boxed_nop(g, inputs)


def _whole_graph_compile(g: fx.GraphModule, inputs, is_backward: bool, batch: bool):
    with inductor_cpu.batched_cpp_kernels(enabled=batch):  # its C++ kernels as one library (opt-in)
        return _compat.inductor_compile_inner(g, inputs, is_backward=is_backward)


def _cpu_settings(inputs, config: CompileConfig) -> dict:
    """Inductor settings for a graph that computes on the CPU: with ``fast_isa_check``, the
    vector-ISA check done (``inductor_cpu.inductor_cpu_settings``); none by default."""
    if config.fast_isa_check and any(x.device.type == "cpu" for x in _tensors(inputs)):
        return inductor_cpu.inductor_cpu_settings()
    return {}


def _tensors(values) -> list[torch.Tensor]:
    """The tensors in ``values``, which may nest lists and tuples (the joint graph's inputs are
    ``(primals, tangents)``)."""
    if isinstance(values, torch.Tensor):
        return [values]
    if isinstance(values, (list, tuple)):
        return [t for v in values for t in _tensors(v)]
    return []


def _whole_graph(g: fx.GraphModule, stage: str, ctx: PassContext) -> bool:
    reason = whole_graph_reason(g)
    if reason:
        ctx.report.notes.append(f"{stage} graph lowered whole, not by region: {reason}")
    return reason is not None


def _record_lowered(compiled, stage: str, ctx: PassContext) -> None:
    """Puts the collective order of Inductor's generated code in the report (and the code in dumps)."""
    source = getattr(compiled, "source_code", None)
    if not source:
        return
    ctx.report.lowered_order[stage] = lowered_collective_order(source)
    if ctx.config.dump_graphs:
        with open(os.path.join(ctx.config.dump_graphs, f"g{ctx.report.index}_{stage}_inductor.py"), "w") as f:
            f.write(source)


_LOWERED_CALL = re.compile(r"^\s*(?:(?P<out>\w+) = )?torch\.ops\."
                           r"(?:_c10d_functional\.(?P<op>\w+)|graphshard\.pack_gather)\.default\((?P<arg>\w+)?")
"""A collective in Inductor's generated code: a functional collective, or the in-place gather
(`lowering.fuse_packed_gathers`), which starts an ``all_gather_into_tensor``."""
_LOWERED_ITEM = re.compile(r"^\s*(?P<out>\w+) = (?P<of>\w+)\[\d+\]\s*$")
_LOWERED_COMPUTE = re.compile(r"^\s*extern_kernels\.(mm|addmm|bmm|baddbmm)\(")


def lowered_collective_order(source: str) -> list[str]:
    """Collective starts, waits and matmuls in the order Inductor's generated ``call`` issues
    them; the waits on a coalesced collective's outputs count as one, as in the FX listing."""
    events: list[str] = []
    coalesced: set[str] = set()   # buffers a coalesced collective returns
    item_of: dict[str, str] = {}  # buffer picked out of one -> that collective's buffer
    waited: set[str] = set()
    body = source.split("def call(", 1)[-1]
    for line in body.splitlines():
        m = _LOWERED_CALL.match(line)
        if m:
            op = m["op"] or "all_gather_into_tensor"
            if op.endswith("_coalesced") and m["out"]:
                coalesced.add(m["out"])
            if op == "wait_tensor" and m["arg"] in item_of:
                if item_of[m["arg"]] in waited:
                    continue
                waited.add(item_of[m["arg"]])
            events.append(collective_kind(op))
        elif (item := _LOWERED_ITEM.match(line)) and item["of"] in coalesced:
            item_of[item["out"]] = item["of"]
        elif _LOWERED_COMPUTE.match(line):
            add_compute(events)
    return events


# Inductor must keep the collective order that schedule_overlap chose.
_INDUCTOR_SETTINGS = dict(reorder_for_locality=False, reorder_for_peak_memory=False)
