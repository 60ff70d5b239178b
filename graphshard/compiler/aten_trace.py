"""The dynamo graph traced to logical ATen, each distinct region body once.

``make_fx`` costs about a millisecond and a half a node: most of the backend's trace of a deep
model. When dynamo hands over a repeated block as one body called once per block
(`regions.mark_repeated_units`), the trace goes through each distinct body once:

* the outer graph is traced as it is, except that each call of a body becomes, in the ATen
  graph, the placeholder op ``graphshard::region(body, operands)`` (`graphshard.ops.region`),
  whose outputs have the body's output metadata and differentiability. The ops after a block
  see the same tensors, down to ``requires_grad``, as in the flat trace.
* the first call of a body with a given operand metadata (shapes, strides, dtypes, devices,
  ``requires_grad``) traces the body with those operands, inside the same ``make_fx`` session
  and with the same grad mode: the grad facts of the real call, as the flat trace has them
  (`trace_to_aten`). Calls with the same metadata reuse the trace.
* each placeholder is replaced by a copy of its body's ATen nodes (`regions.inline_call`), and
  the nodes are renamed in order as ``make_fx`` names them, so the result is the flat trace's
  graph node for node, which ``tests/test_regions.py`` checks.

A declared layout traced without its module (``m<id>/?:in0``) is named from its module stack
before the trace, and each copy after its own block (`_name_layouts`).

A copy's nodes share the traced body's node meta (the fake values among it); nothing in the
passes keys on a fake value's identity. The markers in a body carry their model's key
(`sharding.traced_key`); the backend puts each copy's parameter key back afterwards, from the
DTensor its call passes (`prepare._resolve_traced_keys`).
"""

from __future__ import annotations

import itertools

import torch
import torch.fx as fx

from graphshard import _compat
from graphshard.compiler import regions
from graphshard.ops import ops
from graphshard.ops.dense import layout_world
from graphshard.ops.region import region_outputs
from graphshard.passes.context import BLOCK, TRACED
from graphshard.passes.tag_recomputation import innermost_module
from graphshard.sharding import is_traced_key


def trace_to_aten(gm: fx.GraphModule, fake_inputs, fake_mode) -> tuple[fx.GraphModule, int]:
    """``gm`` as ATen, traced with the grad facts of the real call, and the distinct bodies traced.

    The grad facts are the grad mode dynamo compiles for and inputs that require grad as the real
    ones do. Composite ops pick their kernels by these facts (attention picks a fused kernel only
    for a mask that needs no gradient), and aot_autograd traces the result again with autograd on:
    a kernel chosen as if nothing needed a gradient then has no derivative for what does. Autograd,
    recording as it goes, detaches the outputs some ops save for their backward (``_softmax``);
    those detaches have no reader and are dropped (aot_autograd records its own). Each ATen node
    keeps the stack trace of the dynamo node it came from, and no other node meta (`_StackTraces`).
    The ``invoke_subgraph`` calls left in ``gm`` (`regions.inline_regions` with ``keep_calls``)
    trace their body once per distinct operand metadata (the module docstring)."""
    _name_layouts(gm)
    bodies = _Bodies()
    with fake_mode, region_outputs(bodies.outputs):
        traced = _compat.make_fx(_StackTraces(gm, bodies).run, tracing_mode="real")(*fake_inputs)
    if bodies.traces:
        traced = bodies.expand(traced)  # a new module, its code generated once, the detaches dropped
    else:
        _drop_detaches(traced.graph)
        traced.recompile()
    for node in traced.graph.nodes:
        node.meta[TRACED] = True
    return traced, len(bodies.traces)


def _drop_detaches(graph: fx.Graph) -> None:
    for node in reversed(graph.nodes):
        if _unread_detach(node):
            graph.erase_node(node)


def _unread_detach(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target is torch.ops.aten.detach.default and not node.users


class _StackTraces(fx.Interpreter):
    """Runs a dynamo graph under ``make_fx`` and gives the ATen nodes each of its nodes records the
    user's stack trace of that node: the source line the collective check and ``explain`` name.
    Only ``stack_trace``: torch's ``preserve_node_meta`` would also carry module stacks and
    activation-checkpointing tags into the graph the passes read. aot_autograd carries the stack
    traces on into the forward and backward graphs. An ``invoke_subgraph`` call goes to ``bodies``
    (`_Bodies.call`)."""

    def __init__(self, gm: fx.GraphModule, bodies: _Bodies | None):
        super().__init__(gm)
        self.bodies = bodies
        self.stack: dict | None = None  # the module stack of the node being run

    def run_node(self, n: fx.Node):
        self.stack = n.meta.get("nn_module_stack")  # a region call's is its copy's (`_Bodies.call`)
        graph, trace = _compat.proxy_trace_graph(), n.meta.get("stack_trace")
        if graph is None or not trace:
            return super().run_node(n)
        last = next(reversed(graph.nodes), None)
        out = super().run_node(n)
        for node in reversed(graph.nodes):
            if node is last:
                break
            node.meta.setdefault("stack_trace", trace)
        return out

    def call_function(self, target, args, kwargs):
        if self.bodies is not None and _compat.HAS_INVOKE_SUBGRAPH and target is _compat.invoke_subgraph_op():
            return self.bodies.call(args[0], args[2:], self.stack)
        return super().call_function(target, args, kwargs)


_LAYOUT = (ops.layout, ops.layout.default)
_NAMED = (*_LAYOUT, ops.to_local, ops.to_local.default)  # nodes whose ``where`` names their module


def _name_layouts(gm: fx.GraphModule) -> None:
    """Names in each declared layout traced without its module (``m<id>/?:in0``, `storage._BoundIO`)
    the module again: the innermost module of the node's module stack (the root has none), in
    ``gm`` and the bodies of its higher-order calls (a checkpoint's body is traced by its own
    operator, not by `_StackTraces`). A shared body names the block dynamo traced it in; its copies
    are pointed at their own blocks when they are inlined (`_relocate_layout_names`)."""
    for g in gm.modules():
        if not isinstance(g, fx.GraphModule):
            continue
        named = False
        for node in list(g.graph.nodes):
            if node.op == "call_function" and node.target in _NAMED and is_traced_key(node.args[1].rpartition(":")[0]):
                traced, _, place = node.args[1].rpartition(":")
                module = innermost_module(node.meta.get("nn_module_stack")) or ""
                node.update_arg(1, f"{traced.partition('/')[0]}/{module}:{place}")
                named = True
            if node.op == "call_function" and node.target in _LAYOUT and _from_local(g.graph, node):
                named = True
        if named:
            g.recompile()


def _from_local(g: fx.Graph, node: fx.Node) -> bool:
    """Puts a ``graphshard::from_local`` before a declared layout whose fake, while dynamo traced,
    had the logical shape of a graph input that is each rank's piece (`ops.dense._layout_fake`):
    the ATen trace then gives the code after it the shapes dynamo traced it with."""
    x = node.args[0]
    traced, given = x.meta.get("example_value"), node.meta.get("example_value")
    if not (isinstance(traced, torch.Tensor) and isinstance(given, torch.Tensor)) or traced.shape == given.shape:
        return False
    world = layout_world(node.args[1], node.args[2])
    with g.inserting_before(node):
        local = g.call_function(ops.from_local.default, (x, *node.args[1:4], world))
    local.meta.update({k: v for k, v in node.meta.items() if k != "example_value"})
    local.meta["example_value"] = given
    node.update_arg(0, local)
    return True


def _relocate_layout_names(copies: list[fx.Node], origin: dict | None, call: dict | None) -> None:
    """Points the declared layouts of a body's copy at the block of its call, as
    `regions.relocate_module_stacks` does the module stacks: the body named the block it was
    traced in."""
    old, new = innermost_module(origin), innermost_module(call)
    if old is None or new is None or old == new:
        return
    for node in copies:
        if node.op == "call_function" and node.target in _NAMED:
            head, _, rest = node.args[1].partition("/")
            if rest == old or rest.startswith((f"{old}.", f"{old}:")):
                node.update_arg(1, f"{head}/{new}{rest[len(old):]}")


class _Bodies:
    """The ATen traces of a graph's region bodies, by body and operand metadata."""

    def __init__(self):
        self.traces: dict[str, tuple[fx.GraphModule, list[tuple]]] = {}  # name -> (ATen body, its outputs)
        self.names: dict[tuple, str] = {}
        self.stacks: list[dict | None] = []  # each call's module stack, in order
        self.origins: dict[str, dict | None] = {}  # each traced body's call's
        self._ids = itertools.count()

    def call(self, body: fx.GraphModule, operands: tuple, stack: dict | None) -> list[torch.Tensor]:
        key = (id(body), tuple(_metadata(x) for x in operands))
        name = self.names.get(key)
        if name is None:
            outputs = []  # the body's outputs as its trace computes them: with their autograd facts,
            # which the graph's meta values (detached snapshots) do not keep

            def run(*args):
                outputs.append(_StackTraces(body, None).run(*args))
                return outputs[-1]

            traced = _compat.reenter_make_fx(run)(*operands)
            values = _flat(outputs[0])
            if not all(isinstance(v, torch.Tensor) for v in values):
                raise NotImplementedError(
                    "a region body gives a value that is not a tensor; graphshard traces such a body at each call "
                    "(regions.inline_regions leaves only calls whose outputs are tensors)")
            name = f"body{next(self._ids)}"
            self.names[key] = name
            self.traces[name] = (traced, [_metadata(v) for v in values])
            self.origins[name] = regions.traced_at(body, stack)
        self.stacks.append(stack)
        return torch.ops.graphshard.region(name, list(operands))

    def outputs(self, name: str) -> list[tuple]:
        return self.traces[name][1]

    def expand(self, gm: fx.GraphModule) -> fx.GraphModule:
        """``gm`` with each placeholder call replaced by a copy of its body, renamed as ``make_fx``
        names a flat trace's nodes."""
        regions_used = {n.meta["ac_graph_id"] for g in [gm, *(t for t, _ in self.traces.values())]
                        for n in g.graph.nodes if "ac_graph_id" in n.meta}
        fresh = itertools.count(max(regions_used, default=0) + 1)
        calls = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is torch.ops.graphshard.region.default]
        for node, stack in zip(calls, self.stacks, strict=True):  # the trace recorded them in graph order
            copies = regions.inline_call(gm, node, self.traces[node.args[0]][0], node.args[1])
            block = innermost_module(stack)
            if block:
                for copy in copies:
                    copy.meta[BLOCK] = block
            _own_checkpoint_regions(copies, fresh)
            regions.relocate_module_stacks(copies, self.origins[node.args[0]], stack)
            _relocate_layout_names(copies, self.origins[node.args[0]], stack)
        return _renamed(gm)


def _own_checkpoint_regions(copies: list[fx.Node], fresh) -> None:
    """Gives a body's copy checkpoint regions of its own, as a flat trace numbers each block's
    checkpoint apart: the partitioner reads a region's bounds from its number
    (``ac_graph_id``, renumbered in program order by ``tag_recomputation``)."""
    numbers: dict = {}
    for node in copies:
        if "ac_graph_id" in node.meta:
            raw = node.meta["ac_graph_id"]
            if raw not in numbers:
                numbers[raw] = next(fresh)
            node.meta["ac_graph_id"] = numbers[raw]


def _metadata(x) -> tuple:
    if not isinstance(x, torch.Tensor):
        raise NotImplementedError(f"a region call passes {type(x).__name__}, not a tensor; graphshard traces such a "
                                  "call's body at each call (regions.inline_regions keeps only tensor operands)")
    return tuple(x.shape), tuple(x.stride()), x.dtype, x.device, x.requires_grad


def _flat(value) -> list:
    return [v for item in value for v in _flat(item)] if isinstance(value, (tuple, list)) else [value]


def _renamed(gm: fx.GraphModule) -> fx.GraphModule:
    """``gm``'s graph rebuilt in order with the names ``make_fx`` gives (an op's overload packet,
    numbered): a body's copies took their names from the body. The detaches nothing reads are
    dropped after they took their names, as the flat trace drops them."""
    graph = fx.Graph(owning_module=gm)
    env: dict[fx.Node, fx.Node] = {}
    for node in gm.graph.nodes:
        if node.op == "call_function":
            packet = getattr(node.target, "overloadpacket", None)
            new = graph.create_node("call_function", node.target, fx.map_arg(node.args, env.__getitem__),
                                    fx.map_arg(node.kwargs, env.__getitem__),
                                    name=packet.__name__ if packet is not None else None, type_expr=node.type)
            new.meta = dict(node.meta)
            env[node] = new
            if _unread_detach(node):
                graph.erase_node(new)
        else:
            env[node] = graph.node_copy(node, env.__getitem__)
    return _compat.lazy_graph_module(gm, graph, class_name=type(gm).__name__)  # the passes edit it before it runs
