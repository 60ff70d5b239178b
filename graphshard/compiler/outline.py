"""Trace once per distinct unit: repeated units outlined into one shared body for aot_autograd.

aot_autograd's joint trace, Inductor's joint-graph passes and the min-cut partition cost
about 0.75 s a layer on the benchmark transformer (2 CPU ranks), most of the first step's
growth with depth. Identical FSDP units (a model's repeated blocks) give identical per-rank
programs once the pre-autograd passes have run: the same ops on shards and activations of
the same shapes. Here, before aot_autograd, each unit's segment of the graph (from its
``graphshard::unshard`` to the next unit's; with tensor parallelism alone, which gathers
nothing, from a block's first node to the next block's, as the trace to ATen marked them)
is keyed by its structure; segments that share a
key are replaced by ``invoke_subgraph`` calls of one body, so aot_autograd traces the joint
of that body once, and partitions it once (`torch._higher_order_ops.invoke_subgraph`: the
autograd and partition caches are keyed by the call's identifier). After the partition,
`inline_calls` puts the partitioned bodies back in place, so the post-partition passes
(``schedule_overlap``: prefetch across unit boundaries) and the regional lowering see the
flat graphs they always see.

The body holds its unit's ``unshard`` with the first unit's parameter keys. The keys only
name the parameters whose layout the op's decomposition, fake implementation and backward
read; the segments of one key have layouts that are equal except for the FQN (the key
includes every layout fact), so the first unit's stand for all. The one per-unit fact the
partitioned graphs keep, the ``graphshard_unit`` annotation that ``schedule_overlap`` and
``explain`` read, is rewritten to each call's own unit when the bodies are inlined.

The last block's segment runs on into the model's tail; when its beginning is a repeated body,
that beginning is a call of it and the tail stays in line (`_share_prefix`). Not outlined (each
is traced as before, and ``explain`` notes how many units were shared): a segment whose
structure no other segment shares (the root's, which holds the embeddings), one that writes one
of its inputs, one that would return a view of its own input (which ``invoke_subgraph``
refuses), one with a data-dependent size, one whose checkpointed random op would have its
generator's state threaded through the graphs off the CPU (`_seeded_off_cpu`), and a checkpointed
block whose output code outside checkpointing reads, the last one (`_hands_on_recomputable`).
A unit's segment begins with its block's first node where that comes before its gather (a norm's
steps before its weight, `_begin_at_blocks`). What every call of a body would make alike from inputs
they all share (HF Llama's float attention mask) is made once before the calls and read by each
(`_hoist_shared`), as the flat trace's CSE makes it once.

Activation checkpointing is outlined like the rest: the body's partition recomputes what its tags
say, and ``explain``'s account adds each body's saved bytes without the tags (`Outlined.ac_saved`).
"""

from __future__ import annotations

import collections
import contextlib
import contextvars
import hashlib
import operator
import time
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from graphshard import _compat
from graphshard.ops import ops
from graphshard.passes.context import BLOCK
from graphshard.passes.tag_recomputation import module_of

BODY = "graphshard_body"
"""``meta`` key of a node that `inline_calls` put back: the body (attribute name) it was copied
from, so that the lowering can say what each shared body cost."""

_CALL = "graphshard_outlined_call"
"""``meta["custom"]`` key of an outlined call: its index in `Outlined.calls` (aot_autograd
carries ``custom`` onto the nodes it traces from a node, forward and backward)."""


@dataclass
class Call:
    units: list[str]            # the units of the segment, in order (the body's stand for the first call's)
    regions: list[int]          # its partitioner regions (``ac_graph_id``), in order of first use
    body: str                   # the body's attribute name on the outer graph module


@dataclass
class Outlined:
    """What `outline_units` did: the calls, and per body its units' order (the first call's)."""

    calls: list[Call] = field(default_factory=list)
    bodies: dict[str, Call] = field(default_factory=dict)       # body attribute -> the call whose nodes it copies
    units: int = 0                                              # units the graph gathers
    unavailable: str | None = None                              # why nothing was outlined, if not for lack of repeats
    identifiers: dict[str, str] = field(default_factory=dict)   # invoke_subgraph identifier -> body attribute
    seconds: dict[str, float] = field(default_factory=dict)     # body attribute -> time in its calls while
                                                                # aot_autograd traced (its one joint trace,
                                                                # and each call's reuse of it)
    partition_seconds: float = 0.0                              # the bodies' partitions (once each)
    ac_saved: dict[str, tuple[int, int]] = field(default_factory=dict)  # body attribute -> bytes its forward
                                                                # saves, with its checkpointing tags and without
    in_line: collections.Counter = field(default_factory=collections.Counter)  # why repeated units stayed in line
    hoisted: int = 0                                            # values the calls of a body share, made once
                                                                # outside it (`_hoist_shared`)

    @property
    def shared(self) -> dict[str, int]:
        """Body attribute -> the calls of it."""
        return dict(collections.Counter(c.body for c in self.calls))

    def describe(self) -> str:
        """``explain``'s line: which units share a traced body, and how many were traced alone."""
        if self.unavailable:
            return f"not on {self.unavailable}: every unit traced on its own"
        shared = self.shared
        alone = self.units - len(self.calls)
        why = "".join(f"; {n} in line: {reason}" for reason, n in self.in_line.items())
        if not shared:
            return f"no repeated units: {alone} unit(s) traced on their own{why}"
        parts = ", ".join(f"{self.bodies[b].units[0] or '<root>'} x{n}" for b, n in shared.items())
        bodies = "1 body" if len(shared) == 1 else f"{len(shared)} bodies"
        once = f"; {self.hoisted} value(s) every call reads made once before the calls" if self.hoisted else ""
        return f"{len(self.calls)} units traced as {bodies} ({parts}), {alone} on their own{once}{why}"


def outline_units(gm: fx.GraphModule, params: dict, input_requires_grad: list[bool]) -> Outlined:
    """Replaces the segments of ``gm`` that repeat one structure by ``invoke_subgraph`` calls of a
    shared body (in place); returns what it did for `inline_calls`."""
    outlined = Outlined()
    if not _compat.HAS_INVOKE_SUBGRAPH:
        outlined.unavailable = f"torch {torch.__version__} (it needs 2.13's invoke_subgraph pairing)"
        return outlined
    segments = _segments(gm, params)
    outlined.units = len(segments)
    if _symbolic(gm):
        outlined.unavailable = "a graph with symbolic sizes (a recompile for a new input shape)"
        return outlined
    grad = _requires_grad(gm, input_requires_grad)
    groups: dict[str, list[_Segment]] = {}
    keys = [_key(seg, params, grad, outlined.in_line) for seg in segments]
    for seg, key in zip(segments, keys):
        if key is not None:
            groups.setdefault(key, []).append(seg)
    for seg, key in zip(segments, keys):
        if key is None or len(groups[key]) == 1:
            _share_prefix(seg, key, groups, params, grad)
    for segs in groups.values():
        kept = [seg for seg in segs if not _hands_on_recomputable(seg)]
        if len(segs) > 1 and len(kept) < len(segs):
            outlined.in_line["the last checkpointed block, whose output the code after it would keep"] += len(segs) - len(kept)
        segs[:] = kept
    replaced: dict[fx.Node, fx.Node] = {}  # a replaced segment's output -> the item of its call
    for key, segs in groups.items():
        if len(segs) < 2:
            continue
        for seg in segs:  # an input an earlier group's call gives now: the body is built from what its nodes read
            seg.inputs = [replaced.get(n, n) for n in seg.inputs]
        outlined.hoisted += _hoist_shared(gm, segs)
        body = _body(segs[0])
        name = f"_graphshard_unit_body_{len(outlined.bodies)}"
        gm.add_submodule(name, body)
        identifier = f"graphshard_{key[:16]}"
        outlined.identifiers[identifier] = name
        for seg in segs:
            seg.inputs = [replaced.get(n, n) for n in seg.inputs]  # and one this group's calls before it give
            call = Call(seg.units, _regions(seg), name)
            replaced.update(_replace(gm, seg, name, identifier, len(outlined.calls)))
            outlined.calls.append(call)
            outlined.bodies.setdefault(name, call)
    gm.graph.lint()
    gm.recompile()
    return outlined


_TIMING: contextvars.ContextVar[Outlined | None] = contextvars.ContextVar("graphshard_outline_timing", default=None)


@contextlib.contextmanager
def timing(outlined: Outlined):
    """Within the context, the time aot_autograd spends in each body's calls adds up in
    ``outlined.seconds`` (explain's compile time per distinct unit)."""
    token = _TIMING.set(outlined)
    try:
        yield
    finally:
        _TIMING.reset(token)


def call_body(body: fx.GraphModule, identifier: str, *operands):
    """An outlined call as the graph runs it (`_compat.call_invoke_subgraph`), timed per body."""
    outlined = _TIMING.get()
    if outlined is None or identifier not in outlined.identifiers:
        return _compat.call_invoke_subgraph(body, identifier, *operands)
    start = time.perf_counter()
    try:
        return _compat.call_invoke_subgraph(body, identifier, *operands)
    finally:
        name = outlined.identifiers[identifier]
        outlined.seconds[name] = outlined.seconds.get(name, 0.0) + time.perf_counter() - start


def inline_calls(gm: fx.GraphModule, outlined: Outlined) -> fx.GraphModule:
    """Puts the partitioned bodies of ``gm``'s ``invoke_subgraph`` calls back in place, each node
    annotated with its call's own unit. The graph's code is left to the post-partition passes that
    always follow (`run_passes` checks the graph after each pass and regenerates the code once):
    generating it here too cost 0.35 s a graph at 32 layers."""
    if not outlined.calls:
        return gm
    graph = gm.graph
    for node in list(graph.nodes):
        if not (node.op == "call_function" and node.target is _compat.invoke_subgraph_op()):
            continue
        body: fx.GraphModule = getattr(gm, node.args[0].target)
        call = _call_of(node, outlined)
        env = dict(zip(body.graph.find_nodes(op="placeholder"), node.args[2:]))
        with graph.inserting_before(node):
            for inner in body.graph.nodes:
                if inner.op in ("placeholder", "output"):
                    continue
                new = graph.node_copy(inner, lambda n: env[n])
                new.meta = {**inner.meta, BODY: call.body}
                _reannotate(new, outlined.bodies[call.body], call)
                env[inner] = new
        results = body.graph.find_nodes(op="output")[0].args[0]
        for user in list(node.users):
            if user.op == "call_function" and user.target is operator.getitem:
                user.replace_all_uses_with(env[results[user.args[1]]])
                graph.erase_node(user)
        if node.users:
            raise AssertionError(f"outlined call {node.name} is read other than by item: {list(node.users)}")
        attr = node.args[0]
        graph.erase_node(node)
        if not attr.users:
            graph.erase_node(attr)
    for name, _ in list(gm.named_children()):
        if not any(n.op == "get_attr" and n.target == name for n in graph.nodes):
            delattr(gm, name)
    graph.eliminate_dead_code()
    concrete_rng_states(gm)
    return gm


def concrete_rng_states(gm: fx.GraphModule) -> None:
    """Gives the CPU generator states a partitioned body saves for its recomputed random ops their
    size. The partitioner wraps such an op (attention is one, whatever its dropout) in
    ``run_and_save_rng_state``, whose state the forward returns and the backward's
    ``run_with_rng_state`` restores. In a body that state is a real tensor met while the outer graph
    is traced, so its fake value came out with a symbolic size (``u8[s21]``), which would send the
    whole backward to Inductor as one dynamic-shape graph. Its size is the generator's, always."""
    save, restore = _compat.rng_state_ops()
    states = [n for n in gm.graph.find_nodes(op="call_function", target=operator.getitem)
              if n.args[1] == 0 and getattr(n.args[0], "target", None) is save]
    states += [n for n in gm.graph.find_nodes(op="placeholder")
               if n.users and all(u.target is restore and u.args[0] is n for u in n.users)]
    for node in states:
        v = node.meta.get("val")
        if isinstance(v, torch.Tensor) and v.device.type == "cpu" and not _concrete(v):
            with _compat.outside_fake_mode():
                real = torch.get_rng_state()
            node.meta["val"] = v.fake_mode.from_tensor(real, static_shapes=True)


# ---- segments ------------------------------------------------------------------------------

@dataclass
class _Segment:
    nodes: list[fx.Node]
    units: list[str]
    inputs: list[fx.Node] = field(default_factory=list)
    outputs: list[fx.Node] = field(default_factory=list)


def _segments(gm: fx.GraphModule, params: dict) -> list[_Segment]:
    """The graph cut before each unit's first ``unshard``: a unit's segment runs from its gather
    up to the next unit's. A graph that gathers nothing (tensor parallelism alone) is cut before
    each block's first node instead (`_unit_start`)."""
    by_block = not any(gm.graph.find_nodes(op="call_function", target=ops.unshard.default))
    segments: list[_Segment] = []
    current: _Segment | None = None
    seen: set[str] = set()
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output", "get_attr"):
            continue
        unit = _unit_start(node, params, by_block)
        if unit is not None and unit not in seen:
            seen.add(unit)
            current = _Segment([], [unit])
            segments.append(current)
        if current is not None:
            current.nodes.append(node)
    if not by_block:
        _begin_at_blocks(segments)
    return [_with_boundary(seg) for seg in segments]


def _begin_at_blocks(segments: list[_Segment]) -> None:
    """Moves the nodes that end a segment but were traced in the next unit's module (a norm's
    steps before its weight, which come before the unit's gather) to the next unit's segment.
    Cut at the gather, a block's body would end with the next block's first steps and hand their
    value on, and the next call keeps it for its backward beside the block's output it was made
    from, where the flat partition recomputes it (one activation a block: HF Llama's normalized
    input, with or without activation checkpointing)."""
    for prev, seg in zip(segments, segments[1:]):
        unit = seg.units[0]
        moved: list[fx.Node] = []
        while unit and len(prev.nodes) > 1 and _traced_in(prev.nodes[-1], unit):
            moved.append(prev.nodes.pop())
        seg.nodes[:0] = reversed(moved)


def _traced_in(node: fx.Node, unit: str) -> bool:
    """Whether ``node`` was traced in ``unit``'s module: by dynamo's module stack, or for a node copied
    from a block's shared body, which carries no stack unless checkpointing pointed it at its own
    layer (`regions.traced_at`), by the block it was copied for (``BLOCK``)."""
    module = module_of(node) or node.meta.get(BLOCK)
    return module is not None and (module == unit or module.startswith(unit + "."))


def _unit_start(node: fx.Node, params: dict, by_block: bool) -> str | None:
    """The unit whose segment ``node`` would begin: an ``unshard``'s unit, or by block, the block
    whose shared body dynamo traced the node in (``BLOCK``, set by the trace to ATen; nodes the
    passes inserted have none and stay in the segment they follow)."""
    if by_block:
        return node.meta.get(BLOCK)
    if node.op == "call_function" and node.target == ops.unshard.default:
        return params[node.args[1][0]].layout.unit
    return None


def _with_boundary(seg: _Segment) -> _Segment:
    """``seg`` with its inputs (the values it reads from before it, in order of first use) and its
    outputs (its values read after it)."""
    inside = set(seg.nodes)
    seg.inputs = list(dict.fromkeys(a for n in seg.nodes for a in n.all_input_nodes if a not in inside))
    seg.outputs = [n for n in seg.nodes if any(u not in inside for u in n.users)]
    return seg


def _share_prefix(seg: _Segment, key: str | None, groups: dict, params: dict, grad: dict) -> None:
    """A segment no other shares whose beginning is a repeated body (the last block, which runs
    on into the model's tail): that beginning joins the body's group, the rest stays in line."""
    for other, segs in groups.items():
        if len(segs) < 2:  # not a body (or left empty when its one segment joined another's)
            continue
        size = len(segs[0].nodes)
        if size >= len(seg.nodes):
            continue
        prefix = _with_boundary(_Segment(seg.nodes[:size], seg.units))
        if _key(prefix, params, grad) == other:
            if key is not None:
                groups[key].remove(seg)
            segs.append(prefix)
            return


def _hoist_shared(gm: fx.GraphModule, segs: list[_Segment]) -> int:
    """Takes out of a group's segments the values each makes alike from what every call reads alike
    (HF Llama's float attention mask, a ``where`` of the boolean mask the model makes once): the first
    segment's stay before its call and every call reads them; the others' are erased. In the flat
    graph CSE makes such a value once; in a body each call made its own, and its backward kept it
    (0.5 MiB a layer at the benchmark's sizes). Returns how many values the calls now read.

    Such a value is a deterministic op's single tensor, not checkpointed (a recomputed one costs no
    memory, and stays where its tags put it), made from inputs that are one node for every call and
    from other such values; a constant (no input) or a view moves only to feed one. The bodies stay
    as they were where a call would then write an input or return a view of one."""
    first = segs[0]
    shared = {n for i, n in enumerate(first.inputs) if all(s.inputs[i] is n for s in segs[1:])}
    if not shared:
        return 0
    outputs = set(first.outputs)
    candidates: dict[fx.Node, None] = {}  # in order
    reads_shared: set[fx.Node] = set()
    for node in first.nodes:
        if (node in outputs or _checkpointed(node) or not isinstance(node.meta.get("val"), torch.Tensor)
                or not isinstance(node.target, torch._ops.OpOverload) or node.target._schema.is_mutable
                or torch.Tag.nondeterministic_seeded in node.target.tags
                or not all(a in shared or a in candidates for a in node.all_input_nodes)):
            continue
        candidates[node] = None
        if any(a in shared or a in reads_shared for a in node.all_input_nodes):
            reads_shared.add(node)
    moved: set[fx.Node] = set()
    for node in reversed(candidates):  # a view of a shared input moves only to feed what moves: it costs nothing
        if (all(u in moved for u in node.users) if node.target.is_view
                else node in reads_shared or any(u in moved for u in node.users)):
            moved.add(node)
    for node in candidates:  # and what it feeds then stays too
        if node in moved and not all(a in shared or a in moved for a in node.all_input_nodes):
            moved.discard(node)
    read = {n for n in moved if any(u not in moved for u in n.users)}
    kept = [n for n in first.nodes if n not in moved]
    if (not read or any(_mutates_input(n, shared | read) for n in kept)
            or any(view_base(o) in read for o in first.outputs)):
        return 0
    at = [i for i, n in enumerate(first.nodes) if n in moved]
    for seg in segs[1:]:
        mine = [seg.nodes[i] for i in at]
        for own, theirs in zip(mine, (first.nodes[i] for i in at)):
            own.replace_all_uses_with(theirs)
        for own in reversed(mine):
            gm.graph.erase_node(own)
        gone = set(mine)
        seg.nodes = [n for n in seg.nodes if n not in gone]
        _with_boundary(seg)
    first.nodes = kept
    _with_boundary(first)
    return len(read)


def _hands_on_recomputable(seg: _Segment) -> bool:
    """Whether a checkpointed value the segment makes is read by code that is not checkpointed
    (the model's tail reads the last block's output). As a call's result, that value is one the
    reader's backward keeps; the flat partition recomputes it with the rest of its region instead
    (a norm after the last block saves its input). Kept in line, such a block costs one block's
    trace and saves nothing more than the flat program; the blocks before it read into checkpointed
    code, whose recomputation needs its input saved either way."""
    return any(_checkpointed(out) and any(u.op != "output" and not _checkpointed(u) for u in out.users)
               for out in seg.outputs)


def _checkpointed(node: fx.Node) -> bool:
    """Whether ``node`` is in a checkpointed region (a unit's gather carries the partitioner's tag too)."""
    return "recompute" in node.meta and not _is_gather(node)


def _requires_grad(gm: fx.GraphModule, input_requires_grad: list[bool]) -> dict[fx.Node, bool]:
    """Whether each node's value can require grad: it reads an input that does (an upper bound,
    which is all a body's key needs: calls of one body must agree on it). Inputs past the list's
    end (the keys passes added) need none."""
    out: dict[fx.Node, bool] = {}
    flags = iter(input_requires_grad)
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            out[node] = next(flags, False)
        else:
            out[node] = any(out.get(a, False) for a in node.all_input_nodes)
    return out


def _key(seg: _Segment, params: dict, grad: dict, in_line: collections.Counter | None = None) -> str | None:
    """The segment's structure, or None when it cannot be outlined: its ops and their arguments
    by position, its inputs' metadata, the layouts its unshards gather (without the FQN) and the
    partitioner's tags, relative to the segment. A reason worth ``explain``'s note is counted in
    ``in_line``."""
    if not seg.outputs:
        return None
    inputs = set(seg.inputs)
    index = {n: f"i{i}" for i, n in enumerate(seg.inputs)}
    index.update({n: f"n{i}" for i, n in enumerate(seg.nodes)})
    regions: dict = {}
    parts = []
    for i, inp in enumerate(seg.inputs):
        v = inp.meta.get("val")
        if not isinstance(v, torch.Tensor) or not _concrete(v):
            return None
        parts.append((i, tuple(v.shape), tuple(v.stride()), v.dtype, v.device.type, grad.get(inp, False)))
    for node in seg.nodes:
        if node.op != "call_function":
            return None
        if _mutates_input(node, inputs):
            return None
        vals = node.meta.get("val")
        if not all(_concrete(v) for v in (vals if isinstance(vals, (list, tuple)) else [vals])
                   if isinstance(v, (torch.Tensor, torch.SymInt))):
            return None  # a data-dependent size (a sparse all-to-all's): one call's symbols are not another's
        if _seeded_off_cpu(node):
            if in_line is not None:
                in_line[f"a checkpointed random op ({node.target}) off the CPU"] += 1
            return None
        args = fx.node.map_arg((node.args, node.kwargs), lambda a: index[a])
        if node.target == ops.unshard.default:
            args = (args[0][0], tuple(_layout_fact(params[k]) for k in node.args[1]))
        tag = node.meta.get("recompute")
        region = node.meta.get("ac_graph_id")
        parts.append((str(node.target), repr(args), getattr(tag, "name", None),
                      regions.setdefault(region, len(regions)) if region is not None else None,
                      "graphshard_unit" in (node.meta.get("custom") or {})))
    parts.append(tuple(index[o] for o in seg.outputs))
    for out in seg.outputs:
        if not isinstance(out.meta.get("val"), torch.Tensor) or view_base(out) in inputs:
            return None  # invoke_subgraph returns fresh tensors only
    return hashlib.sha256(repr(parts).encode()).hexdigest()


def _seeded_off_cpu(node: fx.Node) -> bool:
    """A recomputed op tagged random (attention is, whatever its dropout) on a device whose generator
    torch's partitioner threads through the partitioned graphs as inputs of their own
    (``graphsafe_rng_functionalization``, CUDA's): inputs a shared body's call does not pass, so the
    segment stays in line. On the CPU the partitioner saves the generator's state as a tensor the
    forward returns (`concrete_rng_states`)."""
    tag = getattr(node.meta.get("recompute"), "name", "")
    if not tag.endswith("RECOMPUTE") or not _checkpointed(node):
        return False
    if torch.Tag.nondeterministic_seeded not in getattr(node.target, "tags", ()):
        return False
    vals = node.meta.get("val")
    return any(isinstance(v, torch.Tensor) and v.device.type != "cpu"
               for v in (vals if isinstance(vals, (list, tuple)) else [vals]))


def _concrete(v) -> bool:
    dims = (*v.shape, *v.stride()) if isinstance(v, torch.Tensor) else (v,)
    return all(_compat.is_concrete_int(d) for d in dims)


def _symbolic(gm: fx.GraphModule) -> bool:
    """Whether an input has a symbolic size: a body traced for one call's symbols need not fit another's."""
    vals = (ph.meta.get("val") for ph in gm.graph.find_nodes(op="placeholder"))
    return any(isinstance(v, (torch.Tensor, torch.SymInt)) and not _concrete(v) for v in vals)


def _is_gather(node: fx.Node) -> bool:
    """An ``unshard`` or an item of one (``tag_recomputation`` tags both for the partitioner)."""
    if node.target is operator.getitem:
        node = node.args[0]
    return node.op == "call_function" and node.target == ops.unshard.default


def _layout_fact(p) -> tuple:
    """Everything about a sharded parameter that its unshard's decomposition and backward read,
    but its name."""
    return (p.logical_shape, p.dtype, p.param_dtype, p.reduce_dtype, repr(p.shard), repr(p.replicate),
            repr(p.model_parallel), p.reshard_after_forward, repr(p.slot), repr(p.layout.placements))


def view_base(node: fx.Node) -> fx.Node:
    """The value ``node`` is a view of (through a chain of views), or ``node`` itself."""
    while isinstance(node.target, torch._ops.OpOverload) and node.target.is_view:
        node = node.args[0]
    return node


def _mutates_input(node: fx.Node, inputs: set[fx.Node]) -> bool:
    """Whether ``node`` writes one of the segment's inputs (or a view of one): ``invoke_subgraph``
    refuses a body that does. An in-place op on the segment's own values (an MoE's ``index_put_``
    into a buffer it made) is functionalized inside the body like anywhere else."""
    if not isinstance(node.target, torch._ops.OpOverload) or not node.target._schema.is_mutable:
        return False
    for i, arg in enumerate(node.target._schema.arguments):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        value = node.args[i] if i < len(node.args) else node.kwargs.get(arg.name)
        written = value if isinstance(value, (list, tuple)) else [value]
        if any(isinstance(w, fx.Node) and view_base(w) in inputs for w in written):
            return True
    return False


# ---- bodies and calls ----------------------------------------------------------------------

def _body(seg: _Segment) -> fx.GraphModule:
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for i, inp in enumerate(seg.inputs):
        env[inp] = graph.placeholder(f"arg{i}")
        env[inp].meta = {k: v for k, v in inp.meta.items() if k == "val"}
    for node in seg.nodes:
        env[node] = graph.node_copy(node, lambda n: env[n])
        env[node].meta = {**node.meta}
    for out in seg.outputs:
        # invoke_subgraph reads which outputs need a gradient from their "val"; the pre-autograd trace's
        # fake values do not say it (they were traced without autograd), so it runs the body to find out
        env[out].meta.pop("val", None)
    graph.output(tuple(env[o] for o in seg.outputs))
    return fx.GraphModule(torch.nn.Module(), graph)


def _replace(gm: fx.GraphModule, seg: _Segment, body: str, identifier: str, index: int) -> dict:
    graph = gm.graph
    last, inside = seg.nodes[-1], set(seg.nodes)
    with graph.inserting_after(last):
        attr = graph.get_attr(body)
    with graph.inserting_after(attr):
        call = graph.call_function(call_body, (attr, identifier, *seg.inputs))
    call.meta["custom"] = {_CALL: index}
    call.meta["val"] = tuple(o.meta.get("val") for o in seg.outputs)
    at, items = call, {}
    for i, out in enumerate(seg.outputs):
        with graph.inserting_after(at):
            item = graph.call_function(operator.getitem, (call, i))
        item.meta = {**out.meta}
        out.replace_all_uses_with(item, delete_user_cb=lambda u: u not in inside)
        at = items[out] = item
    for node in reversed(seg.nodes):
        graph.erase_node(node)
    return items


def _call_of(node: fx.Node, outlined: Outlined) -> Call:
    """The outlined call ``node`` (a forward or backward call of a partitioned body) was traced from."""
    index = (node.meta.get("custom") or {}).get(_CALL)
    if index is None:  # its nodes would keep the first call's units: a wrong schedule, never silently
        raise AssertionError(f"{node.name} ({node.args[1]}) does not say which outlined call it was traced from")
    return outlined.calls[index]


def body_of_regions(outlined: Outlined, regions) -> str | None:
    """The body whose checkpointed regions (``ac_graph_id``, the first call's) are ``regions``: how a
    body's joint, which aot_autograd partitions by the call's identifier alone, is told apart."""
    ids = {r for r in regions if r is not None}
    return next((name for name, call in outlined.bodies.items() if ids and ids <= set(call.regions)), None)


def _regions(seg: _Segment) -> list[int]:
    return list(dict.fromkeys(n.meta["ac_graph_id"] for n in seg.nodes if "ac_graph_id" in n.meta))


def _reannotate(node: fx.Node, body: Call, call: Call) -> None:
    """Gives an inlined node its call's unit and partitioner region where it has the body's."""
    custom = node.meta.get("custom")
    if custom and custom.get("graphshard_unit") in body.units:
        node.meta["custom"] = {**custom, "graphshard_unit": call.units[body.units.index(custom["graphshard_unit"])]}
    if node.meta.get("ac_graph_id") in body.regions:
        node.meta["ac_graph_id"] = call.regions[body.regions.index(node.meta["ac_graph_id"])]
