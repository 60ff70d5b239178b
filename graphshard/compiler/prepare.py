"""The backend's first two stages: `prepare` (dynamo's graph made ready to trace) and `trace` (the
graph traced to logical ATen, with the pass context built from the sharded models).

Dynamo hands over a graph in torch IR whose sharded parameters are inputs read through the
``graphshard::param`` marker: the local shards graphshard's call wrapper fed the getters
(`storage.feeding_local_shards`), or, in a model compiled by name, DTensor inputs read through
``to_local()``.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
import torch.fx as fx
from torch.distributed.tensor import DTensor

from graphshard import _compat
from graphshard.compiler import outline
from graphshard.compiler.aten_trace import trace_to_aten
from graphshard.compiler.regions import inline_regions
from graphshard.config import CompileConfig
from graphshard.ops import ops
from graphshard.ops.sparse import lookup_args
from graphshard.params import resolve
from graphshard.passes.pipeline import PassContext
from graphshard.report import GraphReport
from graphshard.sharding import ShardedModel, is_traced_key, model_for_key

_graph_ids = itertools.count()


@dataclass
class Entry:
    """Dynamo's graph, its regions inlined and its DTensor boundary moved outside it, with fakes of
    its inputs in the backend's fake mode."""

    graph: fx.GraphModule
    example_inputs: list
    fake_inputs: list
    fake_mode: object
    dtensor_positions: list[int]  # inputs that reach dynamo as DTensors: the compiled call takes their local shards
    dynamo_bodies: tuple[int, int]  # region calls dynamo stamped out, and their distinct bodies


@dataclass
class Prepared:
    """A dynamo graph traced to logical ATen, with the context the passes need."""

    graph: fx.GraphModule
    ctx: PassContext
    fake_inputs: list
    dtensor_positions: list[int]


def prepare(gm: fx.GraphModule, example_inputs) -> Entry:
    """Stage 1. Reads dynamo's graph and example inputs; rewrites the graph in place: the repeated
    blocks' region calls inlined (their bodies kept for the trace to ATen: `regions.inline_regions`),
    each DTensor input's ``to_local()`` replaced by the input (`_strip_dtensor_boundary`: the compiled
    callable takes local shards; ``to_local`` runs eagerly, so gradients land on the DTensors).
    Returns it with fakes of the inputs' local values."""
    calls, bodies = inline_regions(gm, keep_calls=True)
    dtensor_positions = _strip_dtensor_boundary(gm, example_inputs)
    fake_mode = _compat.fake_mode_of(example_inputs)
    fake_inputs = [_fake_local(x, fake_mode) for x in example_inputs]
    if any(lookup_args(n) for g in gm.modules() if isinstance(g, fx.GraphModule) for n in g.graph.nodes):
        # a sequence lookup's output sizes are the data's
        _compat.allow_data_dependent_sizes(fake_mode)
    return Entry(gm, list(example_inputs), fake_inputs, fake_mode, dtensor_positions, (calls, len(bodies)))


def trace(entry: Entry, config: CompileConfig, models: tuple[ShardedModel, ...] = ()) -> Prepared:
    """Stage 2. Reads the prepared graph; returns it traced to logical ATen with fake tensors of
    logical shape (each distinct repeated block's body once: `aten_trace`), each parameter marker
    holding its parameter's key, and the pass context built from ``models`` (the sharded models the
    backend is bound to; by name, none: found from the graph's keys). Appends the graph's
    `GraphReport` to the first model's explain list."""
    gm, example_inputs = entry.graph, entry.example_inputs
    traced, aten_bodies = trace_to_aten(gm, entry.fake_inputs, entry.fake_mode)
    _resolve_traced_keys(traced, example_inputs, [n.target for n in gm.graph.find_nodes(op="placeholder")], models)
    markers = _nodes(traced, ops.param.default)
    layouts = _nodes(traced, ops.layout.default)
    bound = bool(models)
    models = _models_of([n.args[1] for n in markers + layouts], models)
    params = {k: p for m in models for k, p in m.params.items()}
    frame = _compat.dynamo_frame()
    report = GraphReport(index=len(models[0].explain) if models else next(_graph_ids), frame=frame,
                         frame_compile=sum(r.frame == frame for r in models[0].explain) if models else 0,
                         dynamo_bodies=(*entry.dynamo_bodies, aten_bodies))
    if models:
        models[0].explain.append(report)
    model_parallel, group_axes = _axes(markers, layouts, params, models)
    ctx = PassContext(
        config=config, models=models, params=params, model_parallel=model_parallel, group_axes=group_axes,
        meshes={axis: mesh for m in reversed(models) for axis, mesh in m.meshes().items()},
        sparse=_sparse_collections(traced, models, by_name=not bound), input_units=_input_units(traced, markers, params),
        input_requires_grad=[isinstance(x, torch.Tensor) and x.requires_grad for x in example_inputs],
        fake_mode=entry.fake_mode, graph_index=report.index, report=report)
    return Prepared(traced, ctx, entry.fake_inputs, entry.dtensor_positions)


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
