"""Regional lowering: the scheduled graph runs as a short program of communication
steps and compute regions, and each distinct compute region is compiled once.

After ``schedule_overlap`` a forward or backward graph alternates between
communication (all-gathers, waits, reduce-scatters, the pack/unpack copies around
them) and compute. Compiling the whole graph with Inductor costs time that grows
with depth: every layer's kernels are generated, and the fusions that cross layer
boundaries make the layers' kernels differ, so each is compiled by the C++
compiler again. Here the graph is cut at its communication ops instead:

* a *region* is a maximal run of compute nodes between two communication steps;
* regions are keyed by their structure and input metadata; the layers of a model
  give the same few keys, and each key is compiled by Inductor once and reused;
* a region made only of views and library calls (matmuls, attention), for which
  Inductor would generate no kernel, runs as plain ATen calls;
* a region that begins with another region's whole computation (the last layer,
  which runs on into the model's tail or returns fewer values) is cut after it and
  runs as that region;
* two regions that begin with the same long computation and then differ (the first
  layer's backward against the others') are both cut after it, so it compiles once;
* communication steps run as they would in Inductor's generated code (the same
  functional-collective calls), in the scheduled order, so the overlap the
  schedule chose is kept by construction.

Values die at their last use, as in generated code: the runner drops its own
reference before a step runs, and a compiled region receives its inputs boxed,
so Inductor frees each one inside the region after its last read. An all-reduce
whose input (and every alias of it) has no later reader runs in place, as
Inductor's reinplacing runs it in a graph it lowers whole (`in_place_all_reduces`).
"""

from __future__ import annotations

import collections
import hashlib
import operator
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

import torch
import torch.fx as fx

from graphshard import _compat
from graphshard.compiler import experimental, program_cache
from graphshard.report import add_compute, collective_kind, collective_of_wait
from graphshard.compiler.outline import BODY
from graphshard.ops.dense import gather_in_place, pack_into_slot

COMMUNICATION_NAMESPACES = frozenset({"_c10d_functional", "graphshard"})
_MATMULS = frozenset({"mm", "addmm", "bmm", "baddbmm"})
_LIBRARY_CALLS = _MATMULS | {
    "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention_for_cpu_backward",
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_backward",
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_efficient_attention_backward",
}
_VIEWS = frozenset({
    "view", "_unsafe_view", "reshape", "t", "transpose", "permute", "expand", "detach", "alias",
    "squeeze", "unsqueeze", "slice", "select", "as_strided", "split", "split_with_sizes", "unbind",
})


def _aten_name(node: fx.Node) -> str | None:
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        return target._schema.name.split("::")[-1]
    return None


def whole_graph_reason(gm: fx.GraphModule) -> str | None:
    """Why ``gm`` must be lowered whole, or None when regional lowering applies.

    * symbolic sizes: a region's sizes may depend on symbols that only another
      region's inputs bind;
    * a region would hand on a non-tensor value (a tuple an op returned, read by
      ``getitem`` after a communication step): a compiled region returns tensors.
    """
    for ph in gm.graph.find_nodes(op="placeholder"):
        v = ph.meta.get("val")
        dims = (*v.shape, *v.stride()) if isinstance(v, torch.Tensor) else (v,)
        if not all(_compat.is_concrete_int(d) for d in dims if isinstance(d, (int, torch.SymInt))):
            return f"input {ph.name} has symbolic sizes"
    # Cutting a region after another's computation (``split_regions``) keeps its outputs
    # among the two regions' own, so the plain cut at communication steps is enough here.
    for step in _cut_at_communication(gm.graph, constant_nodes(gm.graph)):
        if isinstance(step, Region):
            for o in step.outputs:
                if not isinstance(o.meta.get("val"), torch.Tensor):
                    return f"region output {o.name} is not a tensor"
    return None


def is_communication(node: fx.Node) -> bool:
    """Collectives, waits, the custom copy ops that feed or unpack them, and views of graph
    inputs that only shape a collective's input (a shard flattened for a coalesced
    all-gather): a region of such views would compute nothing."""
    if node.op != "call_function":
        return False
    return _communication_op(node) or (
        _aten_name(node) in _VIEWS and _feeds_only_communication(node) and _reads_only_inputs_or_communication(node))


def _communication_op(node: fx.Node) -> bool:
    """A collective, wait or custom copy op (or an item of one's result); views not included."""
    if node.op != "call_function":
        return False
    if node.target is operator.getitem:
        return _communication_op(node.args[0])
    return getattr(node.target, "namespace", None) in COMMUNICATION_NAMESPACES


def _feeds_only_communication(view: fx.Node) -> bool:
    """Every use of ``view`` is communication, or a view that feeds only communication; the
    pieces of a view that returns several (``split``) are judged by their own uses. Looks
    only at users, so a chain of views is walked once, forward."""
    users = [w for u in view.users for w in (u.users if u.target is operator.getitem else [u])]
    return bool(users) and all(_communication_op(u) or (_aten_name(u) in _VIEWS and _feeds_only_communication(u))
                               for u in users)


def _reads_only_inputs_or_communication(view: fx.Node) -> bool:
    """Every input of ``view`` is a graph input, communication, or a view of those. Looks only
    at inputs, so a chain of views is walked once, backward."""
    def source(a: fx.Node) -> bool:
        if a.op == "placeholder" or _communication_op(a):
            return True
        if a.op == "call_function" and a.target is operator.getitem:
            return source(a.args[0])
        return _aten_name(a) in _VIEWS and _reads_only_inputs_or_communication(a)

    return all(source(a) for a in view.all_input_nodes)


_FACTORIES = frozenset({"full", "iota", "arange", "zeros", "ones", "scalar_tensor"})


def constant_nodes(graph: fx.Graph) -> dict[fx.Node, tuple]:
    """Tensors made from nothing but their arguments (``full``, ``iota``, ...) and views of
    them: cheap to remake, and Inductor folds them into the loops that read them. Each maps
    to a sort key that depends only on what it computes, so that regions lay their
    constants out the same way wherever in the graph they sit."""
    constants: dict[fx.Node, tuple] = {}
    for n in graph.nodes:
        if n.op != "call_function":
            continue
        name, ins = _aten_name(n), n.all_input_nodes
        if (not ins and name in _FACTORIES) or (ins and name in _VIEWS and all(a in constants for a in ins)):
            depth = 1 + max((constants[a][0] for a in ins), default=0)
            args = fx.map_arg((n.args, n.kwargs), lambda a: constants[a][1])
            constants[n] = (depth, f"{n.target}{args}")
    return constants


def _generated_ops(nodes: list[fx.Node]) -> int:
    """How many of ``nodes`` Inductor would generate code for. Views and library calls
    (matmuls, attention) it only calls as they are. A region with at most one such op
    runs its ATen calls directly: one op is already one kernel, with nothing to fuse."""
    return sum(n.target is not operator.getitem and _aten_name(n) not in _VIEWS | _LIBRARY_CALLS for n in nodes)


@dataclass(eq=False)
class Region:
    nodes: list[fx.Node]
    inputs: list[fx.Node]
    outputs: list[fx.Node]
    own: list[fx.Node] = field(default_factory=list)  # the graph's nodes it was cut from
    key: tuple = ()  # set when the region is compiled
    _module: fx.GraphModule | None = field(default=None, init=False, repr=False)
    _signature: tuple | None = field(default=None, init=False, repr=False)

    @property
    def matmuls(self) -> int:
        return sum(_aten_name(n) in _MATMULS for n in self.nodes)

    @property
    def generated(self) -> int:
        return _generated_ops(self.nodes)

    def module(self) -> fx.GraphModule:
        """The region as its own graph (``region_module``), built once."""
        if self._module is None:
            self._module = region_module(self)
        return self._module

    def signature(self) -> tuple:
        """The key the region compiles under (`region_key`)."""
        if self._signature is None:
            self._signature = region_key(self)
        return self._signature


def split_regions(graph: fx.Graph) -> list[fx.Node | Region]:
    """The graph as a sequence of communication nodes and compute regions, in graph order
    (placeholders and the output node excluded)."""
    constants = constant_nodes(graph)
    return _share_prefixes(_reuse_prefixes(_cut_at_communication(graph, constants), constants), constants)


def _cut_at_communication(graph: fx.Graph, constants: dict[fx.Node, tuple]) -> list[fx.Node | Region]:
    body = [n for n in graph.nodes if n.op not in ("placeholder", "output")]
    steps: list[fx.Node | Region] = []
    current: list[fx.Node] = []

    def close() -> None:
        region = _region(current, constants)
        # Constants that later regions remake for themselves leave nothing to run here.
        if region.outputs or not all(n in constants for n in region.nodes):
            steps.append(region)
        current.clear()

    for node in body:
        if is_communication(node):
            if current:
                close()
            steps.append(node)
        else:
            current.append(node)
    if current:
        close()
    return steps


def _reuse_prefixes(steps: list[fx.Node | Region], constants: dict[fx.Node, tuple]) -> list[fx.Node | Region]:
    """Cuts a region that begins with the whole computation of another region, as the last
    layer's does when the model's tail (final norm, output projection) follows it with no
    communication between, or when it returns fewer values (nothing reads the residual
    stream after the last layer): its first part then runs as the other region, and only
    the tail is new. The cut is made only where the first part's key equals the other
    region's, so the computation is the same; it gives up the fusion of the layer's last
    kernel with the tail's first, and saves compiling the layer's region again."""
    patterns = _compiled_by_key(steps)
    if len(patterns) < 2:
        return steps
    by_size = sorted(patterns.values(), key=lambda r: -len(_body(r, constants)))
    out: list[fx.Node | Region] = []
    for step in steps:
        parts = None
        if isinstance(step, Region) and step.generated > 1:
            parts = next((p for pattern in by_size if pattern.signature() != step.signature()
                          for p in [_cut_after(step, pattern, constants)] if p), None)
        out.extend(parts or [step])
    return out


def _share_prefixes(steps: list[fx.Node | Region], constants: dict[fx.Node, tuple],
                    min_share: float = 0.75) -> list[fx.Node | Region]:
    """Cuts two regions of different keys that begin with the same long computation after
    it, so that it compiles once and only the two short tails differ. The first layer's
    backward is the case: the partitioner saves other values for that layer's first norm
    (the embeddings' sum, from which it recomputes the normalised input, where the other
    layers save the normalised input itself), so the region's last few nodes differ from
    the other layers' and the whole layer would otherwise be compiled twice. The cut is
    made only where the shared part is at least ``min_share`` of the smaller region's
    generated ops and has the same key in both; it gives up the fusion across the cut."""
    bodies = {key: _body(region, constants) for key, region in _compiled_by_key(steps).items()}
    cuts: dict[tuple, int] = {}
    keys = list(bodies)
    for i, ka in enumerate(keys):
        for kb in keys[i + 1:]:
            if ka in cuts or kb in cuts:
                continue
            a, b = bodies[ka], bodies[kb]
            n = next((j for j, (x, y) in enumerate(zip(a, b)) if x.target != y.target), min(len(a), len(b)))
            if n in (len(a), len(b)) or _generated_ops(a[:n]) < min_share * min(_generated_ops(a), _generated_ops(b)):
                continue
            if _region(a[:n], constants).signature() == _region(b[:n], constants).signature():
                cuts[ka] = cuts[kb] = n
    if not cuts:
        return steps
    out: list[fx.Node | Region] = []
    for step in steps:
        n = cuts.get(step.signature()) if isinstance(step, Region) and step.generated > 1 else None
        if n is None:
            out.append(step)
            continue
        out += [_region(_body(step, constants)[:n], constants), _after(step, n, constants)]
    return out


def _compiled_by_key(steps: list[fx.Node | Region]) -> dict[tuple, Region]:
    """The first region of each key among those Inductor compiles (more than one generated op)."""
    regions: dict[tuple, Region] = {}
    for step in steps:
        if isinstance(step, Region) and step.generated > 1:
            regions.setdefault(step.signature(), step)
    return regions


def _body(region: Region, constants: dict[fx.Node, tuple]) -> list[fx.Node]:
    return [n for n in region.own if n not in constants]


def _after(region: Region, n: int, constants: dict[fx.Node, tuple]) -> Region:
    """The rest of ``region`` after the first ``n`` nodes of its body, with the constants it made."""
    return _region([m for m in region.own if m in constants] + _body(region, constants)[n:], constants)


def _cut_after(region: Region, pattern: Region, constants: dict[fx.Node, tuple]) -> list[Region] | None:
    """``region`` as [the part that computes what ``pattern`` computes, the rest], or None.
    With no rest, the region is the pattern's computation with fewer outputs read (the
    last layer, whose hand-on values have no reader) and runs as the pattern."""
    body, head = _body(region, constants), _body(pattern, constants)
    if len(body) < len(head) or [n.target for n in body[: len(head)]] != [n.target for n in head]:
        return None
    first = _region(body[: len(head)], constants)
    # The first part returns what the pattern returns (a value the layer hands on, such as
    # the residual stream, may have no later use here: the runner drops it at once).
    position = {n: i for i, n in enumerate(head)}
    if not all(o in position for o in pattern.outputs):
        return None
    outputs = [body[position[o]] for o in pattern.outputs]
    if not set(first.outputs) <= set(outputs):
        return None
    first = Region(first.nodes, first.inputs, outputs, own=first.own)
    if first.signature() != pattern.signature():
        return None
    rest = _after(region, len(head), constants)
    return [first, rest] if rest.outputs or len(body) > len(head) else [first]


def _region(nodes: list[fx.Node], constants: dict[fx.Node, tuple]) -> Region:
    """A region over ``nodes``. Constants it reads, whichever step made them, it makes
    itself, first and in a fixed order (Inductor inlines them): a constant shared by the
    layers (an attention mask's fill value, a view of positions) then neither flows between
    regions nor makes the first layer's region differ from the others'. A constant leaves
    the region that made it only for a communication step or the graph's output."""
    own_order, own = nodes, set(nodes)
    made: set[fx.Node] = set()
    todo = [c for n in nodes for c in (n, *n.all_input_nodes) if c in constants]
    while todo:
        c = todo.pop()
        if c not in made:
            made.add(c)
            todo.extend(c.all_input_nodes)
    nodes = sorted(made, key=constants.__getitem__) + [n for n in nodes if n not in made]
    inside = set(nodes)
    inputs: dict[fx.Node, None] = {}
    for n in nodes:
        for a in n.all_input_nodes:
            if a not in inside:
                inputs[a] = None

    def leaves(n: fx.Node) -> bool:
        if n in made:
            return n in own and any(u.op == "output" or is_communication(u) for u in n.users)
        return any(u not in inside for u in n.users)

    return Region(nodes, list(inputs), [n for n in nodes if leaves(n)], own=list(own_order))


def region_module(region: Region) -> fx.GraphModule:
    """The region as its own graph, with fresh node names, so that two regions of the same
    structure print the same code (and share an FX graph cache entry across runs)."""
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for i, inp in enumerate(region.inputs):
        ph = g.placeholder(f"arg{i}")
        ph.meta = dict(inp.meta)
        env[inp] = ph
    for n in region.nodes:
        new = g.create_node(n.op, n.target, fx.map_arg(n.args, env.__getitem__),
                            fx.map_arg(n.kwargs, env.__getitem__))
        new.meta = {k: v for k, v in n.meta.items() if k in ("val", "tensor_meta", "stack_trace")}
        env[n] = new
    g.output(tuple(env[o] for o in region.outputs))
    return fx.GraphModule(torch.nn.Module(), g)


def region_key(region: Region) -> tuple:
    """Structure and input metadata: equal keys compute the same function of the same kinds of
    inputs. Read from the nodes (ops, arguments with values as positions, outputs), as
    `region_module`'s code would print them, without generating that code: regions are keyed by
    the hundred while only one per key is compiled. Plain strings and numbers, the same in
    every process (`RegionWork.digest`)."""
    position = {n: i for i, n in enumerate(region.inputs)}
    position.update((n, len(position) + i) for i, n in enumerate(region.nodes))

    def arg(a):
        if isinstance(a, fx.Node):
            return ("%", position[a])
        if isinstance(a, (list, tuple)):
            return (type(a).__name__, *map(arg, a))
        if isinstance(a, dict):
            return ("dict", *((k, arg(v)) for k, v in a.items()))
        return repr(a)

    body = tuple((n.op, _target_name(n.target), arg(n.args), arg(n.kwargs)) for n in region.nodes)
    metas = []
    for inp in region.inputs:
        v = inp.meta.get("val")
        metas.append((tuple(map(int, v.shape)), tuple(map(int, v.stride())), v.dtype, str(v.device))
                     if isinstance(v, torch.Tensor) else repr(v))
    return (body, tuple(position[o] for o in region.outputs), tuple(metas))


def _target_name(target) -> str:
    if isinstance(target, (torch._ops.OpOverload, str)):
        return str(target)
    return f"{getattr(target, '__module__', '')}.{getattr(target, '__qualname__', repr(target))}"


class RegionalProgram:
    """A boxed callable (``fn(args: list)``) that runs the steps of a lowered graph."""

    _boxed_call = True  # aot_autograd's calling convention: one list of inputs, cleared by the callee

    def __init__(self, graph: fx.Graph, steps: list[fx.Node | Region], compiled: dict[tuple, Callable],
                 is_backward: bool = False):
        self.is_backward = is_backward
        self.output_strides: list | None = None  # reported to aot_autograd (`lower_regions`), again on a load
        placeholders = list(graph.find_nodes(op="placeholder"))
        out_node = next(n for n in graph.nodes if n.op == "output")
        slot: dict[fx.Node, int] = {n: i for i, n in enumerate(placeholders)}
        for step in steps:
            for n in (step.outputs if isinstance(step, Region) else [step]):
                slot[n] = len(slot)
        self.n_inputs = len(placeholders)
        self.n_slots = len(slot)

        last_use: dict[fx.Node, int] = {}
        for i, step in enumerate(steps):
            for a in (step.inputs if isinstance(step, Region) else step.all_input_nodes):
                last_use[a] = i
        kept = set(out_node.all_input_nodes)
        dying: list[list[int]] = [[] for _ in steps]
        for n, i in last_use.items():
            if n not in kept:
                dying[i].append(slot[n])
        used = last_use.keys() | kept

        self.program: list[tuple] = []
        self.listing: list[str] = []
        names: dict[tuple, str] = {}
        eager: dict[tuple, Callable] = {}  # eager regions of one structure run one module's code
        for step in steps:
            if isinstance(step, Region) and step.key:
                names.setdefault(step.key, f"r{len(names)}")
        in_place = {gather: InPlaceGather(*gather.args[1:3]) for gather in packed_gathers(graph)}
        packs = {gather.args[0]: run for gather, run in in_place.items()}
        reduced_in_place = in_place_all_reduces(graph, steps)
        for i, step in enumerate(steps):
            if isinstance(step, Region):
                ops = ", ".join(_short(n) for n in step.nodes if _aten_name(n) not in _VIEWS and n.target is not operator.getitem)
                how = f"region {names[step.key]}" if step.key else "eager"
                unread = sum(o not in used for o in step.outputs)
                outs = f"{len(step.outputs)} out" + (f", {unread} unread" if unread else "")
                self.listing.append(f"{how}({len(step.inputs)} in, {outs}): {ops or 'views'}")
                if step.key:
                    fn = compiled[step.key]
                else:
                    if step.signature() not in eager:
                        eager[step.signature()] = EagerRegion(step.module())
                    fn = eager[step.signature()]
                # An output nothing reads (a region reused for its computation) is dropped at once.
                self.program.append(("region", fn, [slot[a] for a in step.inputs],
                                     [slot[o] if o in used else None for o in step.outputs], dying[i]))
            else:
                fn = step.target
                if step in packs:
                    fn = packs[step].pack
                elif step in in_place:
                    fn = in_place[step].gather
                elif step in reduced_in_place:
                    fn = all_reduce_in_place
                self.listing.append(_short(step) + (" (in place)" if fn is not step.target else ""))
                args = fx.map_arg((step.args, step.kwargs), lambda a: _Slot(slot[a]))
                self.program.append(("call", fn, args, slot[step], dying[i]))
        self.outputs = fx.map_arg(out_node.args[0], lambda a: _Slot(slot[a]))

    def describe(self) -> str:
        """One line per step: communication calls by op, regions by their compiled key."""
        return "\n".join(self.listing)

    def __getstate__(self) -> dict:
        """The program as data (`program_cache.stored_steps`)."""
        return {**self.__dict__, "program": program_cache.stored_steps(self.program)}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self.program = program_cache.loaded_steps(self.program, self.is_backward)

    def __call__(self, args: list) -> Any:
        env: list[Any] = [None] * self.n_slots
        env[: self.n_inputs] = args
        args.clear()
        for kind, fn, ins, outs, dying in self.program:
            if kind == "region":
                boxed = [env[i] for i in ins]
                for d in dying:
                    env[d] = None
                for o, v in zip(outs, fn(boxed)):
                    if o is not None:
                        env[o] = v
            else:
                a, kw = _resolve(ins, env)
                for d in dying:
                    env[d] = None
                env[outs] = fn(*a, **kw)
        return _resolve(self.outputs, env)


def packed_gathers(graph: fx.Graph) -> list[fx.Node]:
    """The ``all_gather_into_tensor`` nodes whose input is a ``graphshard::pack`` that nothing else
    reads (a unit's gather in NCCL's form), in graph order. Both are communication steps
    (`is_communication`), so a regional program runs each of them as a call of its own."""
    return [n for n in graph.find_nodes(op="call_function", target=_compat.c10d.all_gather_into_tensor.default)
            if n.args[0].target is torch.ops.graphshard.pack.default and len(n.args[0].users) == 1]


def fuse_packed_gathers(gm: fx.GraphModule) -> fx.GraphModule:
    """Each packed gather as one ``graphshard::pack_gather`` (`ops.dense`: the gather in place),
    for a graph Inductor lowers whole. Run after every reader of the graph's collectives (the
    collective check, the order listings): the op still starts an all-gather that the graph's
    ``wait_tensor`` waits on, and explain's order of the generated code counts it as one."""
    for gather in packed_gathers(gm.graph):
        pack = gather.args[0]
        with gm.graph.inserting_before(gather):
            fused = gm.graph.call_function(torch.ops.graphshard.pack_gather.default, (*pack.args, *gather.args[1:3]))
        fused.meta.update(gather.meta)
        gather.replace_all_uses_with(fused)
        gm.graph.erase_node(gather)
        gm.graph.erase_node(pack)
    gm.recompile()
    return gm


def in_place_all_reduces(graph: fx.Graph, steps: list[fx.Node | Region]) -> set[fx.Node]:
    """The functional ``all_reduce`` steps that may overwrite their input: those whose input
    is computed by the graph (not a graph input, not a collective's result, not a constant
    the regions remake) and neither it nor any view of the same buffer is read after the
    step or returned. Tensor parallelism's reductions of partial sums are the case: the
    functional op copies each into a new buffer first (a 2 MiB copy per block and reduction
    in the benchmark transformer). Aliases are followed as `_returns_alias` says, so a view,
    a reshape or a split's piece counts as the buffer."""
    step_of: dict[fx.Node, int] = {}
    for i, step in enumerate(steps):
        for n in (step.nodes if isinstance(step, Region) else [step]):
            step_of.setdefault(n, i)  # a remade constant sits in several regions: keep the first
    remade = {n for step in steps if isinstance(step, Region) for n in step.nodes if n not in step.own}
    out: set[fx.Node] = set()
    for i, step in enumerate(steps):
        if isinstance(step, Region) or step.target is not _compat.c10d.all_reduce.default:
            continue
        base = step.args[0]
        while isinstance(base, fx.Node) and base.op == "call_function" and _returns_alias(base):
            base = base.args[0] if base.args else None
        if (not isinstance(base, fx.Node) or base.op != "call_function" or _communication_op(base)
                or base in remade or base not in step_of):
            continue
        buffer, stack = {base}, [base]  # the base and every view of it
        while stack:
            for u in stack.pop().users:
                if u not in buffer and u.op == "call_function" and _returns_alias(u):
                    buffer.add(u)
                    stack.append(u)
        readers = [u for n in buffer for u in n.users if u not in buffer and u is not step]
        if all(n in step_of and step_of[n] < i for n in buffer) and all(
                u.op != "output" and step_of.get(u, i) < i for u in readers):
            out.add(step)
    return out


def _returns_alias(node: fx.Node) -> bool:
    """Whether ``node``'s result may share its first input's buffer: an ATen op whose schema
    marks a returned tensor as an alias (views, ``split``'s pieces) or that is a view without
    saying so (``_unsafe_view``, ``reshape``), an item of such an op's result, or anything
    whose schema is unknown."""
    if node.target is operator.getitem:
        return isinstance(node.args[0], fx.Node) and _returns_alias(node.args[0])
    if isinstance(node.target, torch._ops.OpOverload):
        return _aten_name(node) in _VIEWS or any(r.alias_info is not None for r in node.target._schema.returns)
    return True


def all_reduce_in_place(x: torch.Tensor, op: str, group_name: str) -> torch.Tensor:
    """The regional program's run of a functional all-reduce picked by `in_place_all_reduces`:
    the in-place form on the input itself (the graph's ``wait_tensor`` waits on it). A
    non-contiguous input, which the functional op would have copied anyway, keeps that form."""
    if not x.is_contiguous():
        return _compat.c10d.all_reduce(x, op, group_name)
    return _compat.c10d.all_reduce_(x, op, group_name)


class InPlaceGather:
    """The regional program's run of a packed gather's two steps, in place (`ops.dense`'s
    `pack_into_slot` and `gather_in_place`). The graph keeps the functional pair, so the passes,
    the goldens and the collective check see the same program; only its run changes."""

    def __init__(self, world: int, group_name: str, rank: int | None = None):
        self.world, self.group_name = world, group_name
        self._rank = rank  # this process's rank in the group: looked up at the first run

    def __getstate__(self) -> dict:
        return {"world": self.world, "group_name": self.group_name, "_rank": None}  # another rank may load it

    def rank(self) -> int:
        if self._rank is None:
            self._rank = _compat.group_rank(self.group_name)
        return self._rank

    def pack(self, xs: list[torch.Tensor], numels: list[int], dtype: torch.dtype) -> torch.Tensor:
        return pack_into_slot(xs, numels, dtype, self.world, self.rank())

    def gather(self, buf: torch.Tensor, world: int, group_name: str) -> torch.Tensor:
        return gather_in_place(buf, world, self.rank(), group_name)


def _short(node: fx.Node) -> str:
    if node.target is operator.getitem:
        return f"getitem {node.args[1]}"
    return _aten_name(node) or str(node.target)


class _Slot:
    __slots__ = ("index",)

    def __init__(self, index: int):
        self.index = index


def _resolve(template, env: list):
    if isinstance(template, _Slot):
        return env[template.index]
    if isinstance(template, (tuple, list)):
        return type(template)(_resolve(t, env) for t in template)
    if isinstance(template, dict):
        return {k: _resolve(v, env) for k, v in template.items()}
    return template


class EagerRegion:
    """A region with nothing to generate (views, library calls): its ATen calls run directly. Pickles
    as its graph module (its code)."""

    def __init__(self, module: fx.GraphModule):
        self.module = module
        self.forward = module.forward

    def __call__(self, boxed: list):
        outs = self.forward(*boxed)
        boxed.clear()
        return outs

    def __getstate__(self) -> dict:
        return {"module": self.module}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["module"])


@dataclass
class RegionWork:
    """One distinct region to compile: its module, example inputs, cost (ops Inductor
    generates code for) and which graph it belongs to."""

    module: fx.GraphModule
    inputs: list
    cost: int
    is_backward: bool
    key: tuple = ()
    body: str | None = None  # the trace-once body its first region was inlined from (`region_body`)

    def compile(self, *, batch: bool = False) -> Callable:
        with experimental.batched_cpp_kernels(enabled=batch):  # its C++ kernels as one library (opt-in)
            return _compat.inductor_compile_region(self.module, self.inputs, is_backward=self.is_backward)

    def digest(self) -> str:
        """The region's identity across processes (what it computes, on which inputs, in
        which graph): the name local ranks claim it under (``compile_share.SharedCompile``)."""
        return hashlib.sha256(repr((self.is_backward, self.key)).encode()).hexdigest()


def plan_regions(gm: fx.GraphModule, *, is_backward: bool,
                 ) -> tuple[list[fx.Node | Region], list[str], dict[str, int], dict[tuple, RegionWork]]:
    """``gm`` cut into steps, with the order of communication and compute they run, region
    counts for the report, and the distinct regions to compile by key."""
    steps = split_regions(gm.graph)
    order: list[str] = []
    counts: dict = {"regions": 0, "compiled": 0, "eager": 0, "bodies": {}}
    work: dict[tuple, RegionWork] = {}
    waited: set[fx.Node] = set()
    for step in steps:
        if not isinstance(step, Region):
            name = _aten_name(step) or str(step.target)
            if getattr(step.target, "namespace", None) == "_c10d_functional":
                if name == "wait_tensor":
                    src = collective_of_wait(step)
                    if src in waited:  # a coalesced collective's waits are one event
                        continue
                    waited.add(src)
                order.append(collective_kind(name))
            continue
        counts["regions"] += 1
        body = region_body(step)
        per_body = _body_counts(counts, body)
        per_body["regions"] += 1
        for _ in range(step.matmuls):
            add_compute(order)
        generated = step.generated
        if generated <= 1:
            counts["eager"] += 1
            continue
        step.key = step.signature()
        if step.key not in work:
            rgm = step.module()
            work[step.key] = RegionWork(rgm, [ph.meta["val"] for ph in rgm.graph.find_nodes(op="placeholder")],
                                        generated, is_backward, step.key, body)
            per_body["compiled"] += 1
    counts["compiled"] = len(work)
    return steps, order, counts, work


def _body_counts(counts: dict, body: str | None) -> dict:
    """``counts``' entry for ``body``: its regions in this graph, the distinct ones among them this
    graph compiles, and the Inductor time of those this rank compiled in this call."""
    return counts["bodies"].setdefault(body, {"regions": 0, "compiled": 0, "seconds": 0.0})


def region_body(region: Region) -> str | None:
    """The trace-once body (`outline.BODY`) at least half of the region's nodes were inlined from,
    if any: explain's compile time per distinct unit."""
    (body, n), = collections.Counter(node.meta.get(BODY) for node in region.nodes).most_common(1)
    return body if 2 * n >= len(region.nodes) else None


class CompileShare(Protocol):
    """How local ranks split compile work (``compile_share.SharedCompile``)."""

    def claim(self, digest: str) -> bool: ...
    def done(self, digest: str) -> None: ...
    def wait(self, digest: str, deadline: float) -> bool: ...
    def deadline(self) -> float: ...


def lower_regions(gm: fx.GraphModule, *, is_backward: bool, share: CompileShare | None = None,
                  ahead: dict[tuple, RegionWork] | None = None,
                  compiled: dict[tuple, Callable] | None = None, batch: bool = False,
                  report_strides: bool = True) -> tuple[Callable, list[str], dict[str, int]]:
    """Compiles ``gm`` region by region with Inductor. Returns the boxed callable, the
    order of communication and compute it runs, and region counts for the report.

    ``share``, when given, splits the compile work between the local ranks: going through
    the regions largest first (by the ops Inductor generates code for), a rank compiles each
    one it wins the claim of (``share.claim``, keyed by the region's content), so a rank that
    starts late, or draws a small region, takes more; it marks them done once their kernels
    are built, then waits (bounded) for each region of this graph another rank claimed, and
    loads it from the shared on-disk cache. No rank waits for a region nobody claimed, so a
    graph that only one rank compiles (a recompile, a rank-dependent branch) compiles there
    alone. ``ahead`` are another graph's regions (the backward's, known once the joint graph
    is partitioned), claimed after this graph's: the ranks compile them in this phase, and
    the backward finds them done. ``compiled`` (by ``(is_backward, key)``) keeps what this
    rank compiled for a later graph of the same compile. ``batch``: C++ kernels built as one
    library per block (``CompileConfig.batch_cpp_kernels``). ``report_strides``: tell
    aot_autograd the output strides (only for the graph it partitioned).
    """
    steps, order, counts, work = plan_regions(gm, is_backward=is_backward)
    compiled = {} if compiled is None else compiled

    def compile_timed(w: RegionWork) -> Callable:
        start = time.perf_counter()
        fn = w.compile(batch=batch)
        _body_counts(counts, w.body)["seconds"] += time.perf_counter() - start
        return fn

    todo = sorted(work.values(), key=lambda w: -w.cost)
    if share is not None:
        todo += sorted((w for k, w in (ahead or {}).items() if k not in work), key=lambda w: -w.cost)
        mine: list[str] = []
        try:
            with experimental.batched_cpp_kernels(enabled=batch, defer=True):  # one C++ build for all it claims
                for w in todo:
                    if (w.is_backward, w.key) not in compiled and share.claim(w.digest()):
                        mine.append(w.digest())
                        compiled[(w.is_backward, w.key)] = compile_timed(w)
        finally:
            for digest in mine:  # done (or failed): no rank waits for it any longer
                share.done(digest)
    deadline = share.deadline() if share is not None else 0.0
    with experimental.batched_cpp_kernels(enabled=batch, defer=True):  # the rest (all of it without ``share``)
        for w in work.values():
            if (w.is_backward, w.key) not in compiled:
                if share is not None:
                    share.wait(w.digest(), deadline)  # claimed by another rank: its result is in the cache
                compiled[(w.is_backward, w.key)] = compile_timed(w)
    program = RegionalProgram(gm.graph, steps, {k: compiled[(is_backward, k)] for k in work}, is_backward)
    if report_strides:  # a graph aot_autograd partitioned (not one derived from it afterwards)
        program.output_strides = _compat.graph_output_strides(gm)
        _compat.report_output_strides(program.output_strides)
    return program, order, counts
