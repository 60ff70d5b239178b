"""Dynamo traces each distinct repeated unit once.

With ``trace_once`` (the default), `mark_repeated_units` gives every unit whose module class
repeats a forward marked ``torch.compiler.nested_compile_region``, on a subclass of its own (the
user's class is not touched). Dynamo then traces one block and stamps its body out for every
block that passes the body's guards under its own sources; a block that does not is traced again,
so a mark never changes what runs. It can do that because a traced marker carries its model's
key, not the parameter's FQN (`sharding.traced_key`): a block's trace reads no value that names
the block.

The backend traces each distinct body dynamo hands over to ATen once (`aten_trace`) and inlines
its copies there (calls nested in other bodies are inlined before, `inline_regions`), so the
passes, the scheduler and ``outline`` (which differentiates a unit's body once) see the graph a
flat trace gives. The backend puts each marker's key back from the DTensor it reads
(`prepare._resolve_traced_keys`).

A plan without data-parallel units (tensor parallelism alone) marks the children of a
``ModuleList`` that declare layouts or hold tensor-parallel parameters. A declared layout is traced
without its module too (`storage._BoundIO`); the
trace to ATen names it again from its module stack (`aten_trace`). A unit is not marked when
graphshard wraps its forward with more than its layouts (a plan's `Checkpoint`, the root), when
its parameters live in a flat parameter (the marker there reads the unit's slot, which names the block), or
when the user marked its forward already. Dynamo cannot capture every block as a region (a block that
keeps a view of its input for later, as some HF attention layers do, is refused): when it fails on
a marked model's first call, graphshard unmarks the units and traces the call again, flat, and
``explain`` says why (`retrying_unmarked`).
"""

from __future__ import annotations

import copy
import functools
import logging
import operator

import torch
import torch.fx as fx
import torch.nn as nn

from typing import Callable

from graphshard import _compat
from graphshard.sharding import ShardedModel

log = logging.getLogger("graphshard")

_WRAPPED = ("_graphshard_checkpoint", "_graphshard_root")  # declared layouts are traced without the module
_region_classes: dict[tuple[type, int], type] = {}


class RegionMarks:
    """The units `mark_repeated_units` marked, one line per repeated class for ``explain``, and the
    way back: `unmark` when dynamo cannot capture a marked region."""

    def __init__(self):
        self.lines: list[str] = []
        self.marked: list[nn.Module] = []
        self.units: list = []  # the marked modules' unit records (`sharding.ShardedUnit.body`)

    def __bool__(self) -> bool:
        return bool(self.lines)

    def unmark(self, error: BaseException) -> None:
        """Gives every marked unit its class back and records why (the first line of ``error``)."""
        for mod in self.marked:
            mod.__class__ = type(mod).__bases__[0]
        for unit in self.units:
            unit.body = None
        self.marked, self.units = [], []
        why = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
        self.lines = [f"dynamo traces every block: it could not capture a marked region whole ({why[:300]}); "
                      "graphshard unmarked the units and traced the call again"]
        log.warning("graphshard: %s", self.lines[0])


def mark_repeated_units(root: nn.Module, state: ShardedModel) -> RegionMarks:
    """Marks the forward of each unit of ``root`` whose class repeats (see the module docstring)."""
    marks = RegionMarks()
    if not _compat.HAS_INVOKE_SUBGRAPH:
        marks.lines.append(f"dynamo traces every block: torch {torch.__version__} has no nested_compile_region "
                           "reuse (2.13)")
        return marks
    for cls, units in _repeated(root, state).items():
        if len(units) < 2:
            continue
        reason = _unmarkable(cls, units, state)
        first = units[0][0]
        if reason:
            marks.lines.append(f"{first} x{len(units)}: dynamo traces each ({reason})")
            log.info("graphshard: dynamo traces each of the %d units like %s: %s", len(units), first, reason)
            continue
        region = _region_class(cls, len(units))
        body = f"{cls.__qualname__} x{len(units)}"
        for fqn, mod in units:
            mod.__class__ = region
            marks.marked.append(mod)
            if fqn in state.units:
                state.units[fqn].body = body
                marks.units.append(state.units[fqn])
        marks.lines.append(f"{first} x{len(units)}: dynamo traces one and reuses its trace where its guards hold")
    return marks


def _repeated(root: nn.Module, state: ShardedModel) -> dict[type, list[tuple[str, nn.Module]]]:
    """The units of ``root`` by class. A plan without data-parallel units (tensor parallelism alone)
    has none; its units here are then the children of a ``ModuleList`` that declare layouts or hold
    parameters sharded over a model-parallel axis (a model's blocks), as torch's regional
    compilation takes them, outermost lists only."""
    by_class: dict[type, list[tuple[str, nn.Module]]] = {}
    for fqn in state.units:
        if fqn:
            mod = root.get_submodule(fqn)
            by_class.setdefault(type(mod), []).append((fqn, mod))
    if state.units:
        return by_class
    lists = [(fqn, mod) for fqn, mod in root.named_modules() if isinstance(mod, nn.ModuleList)]
    for fqn, mod in lists:
        if any(fqn.startswith(f"{outer}.") for outer, blocks in lists if len(blocks) > 1):
            continue  # inside a block of an outer list (an MoE layer's experts): the block is the unit
        for name, child in mod.named_children():
            if any(_tensor_parallel(m, state) for m in child.modules()):
                by_class.setdefault(type(child), []).append((f"{fqn}.{name}" if fqn else name, child))
    return by_class


def _tensor_parallel(mod: nn.Module, state: ShardedModel) -> bool:
    """Whether ``mod`` declares layouts or holds a parameter sharded over a model-parallel axis."""
    markers = mod.__dict__.get("_graphshard_markers", {})
    return "_graphshard_io" in mod.__dict__ or any(state.params[key].model_parallel for key, _ in markers.values())


def retrying_unmarked(marks: RegionMarks, compiled_graphs: Callable[[], int]):
    """A wrap for a model's compiled call: when dynamo fails to trace a call before graphshard has
    compiled any graph of the model (nothing of the call has run: a marked region dynamo cannot
    capture whole, such as a block that stores a view of its input), the units are unmarked and the
    call traced again, flat. An error after a graph was compiled is raised as it is: part of the
    call may have run."""
    def wrap(call):
        @functools.wraps(call)
        def compiled_call(*args, **kwargs):
            if not marks.marked:
                return call(*args, **kwargs)
            before = compiled_graphs()
            try:
                return call(*args, **kwargs)
            except _compat.DYNAMO_TRACE_ERRORS as e:
                if compiled_graphs() != before:
                    raise
                marks.unmark(e)
            return call(*args, **kwargs)

        return compiled_call

    return wrap


def _unmarkable(cls: type, units: list[tuple[str, nn.Module]], state: ShardedModel) -> str | None:
    if getattr(cls, "_graphshard_region", False):
        return None
    if hasattr(cls.forward, "__marked_compile_region_fn__"):
        return "its forward is a nested_compile_region of the user's"
    for fqn, mod in units:
        if fqn in state.units and state.units[fqn].flat is not None:
            return "its parameters live in a flat parameter"
        if any(k in mod.__dict__ for k in _WRAPPED):
            return "graphshard wraps its forward (a plan's Checkpoint, or the root)"
    return None


def _region_class(cls: type, units: int) -> type:
    """``cls`` with its forward marked; one per class and unit count. ``max_reuse_entries`` is the
    unit count: blocks whose guards all differ are each traced, never refused."""
    key = (cls, units)
    region = _region_classes.get(key)
    if region is None:
        forward = torch.compiler.nested_compile_region(cls.forward, max_reuse_entries=units)
        region = type(cls.__name__, (cls,), {"forward": forward, "_graphshard_region": True,
                                             "_graphshard_base": getattr(cls, "_graphshard_base", cls),
                                             "__module__": cls.__module__})
        _region_classes[key] = region
    return region


def inline_regions(gm: fx.GraphModule, keep_calls: bool = False) -> tuple[int, set[str]]:
    """Replaces each ``invoke_subgraph`` call of ``gm`` by a copy of its body's nodes (a body's own
    attributes, the bodies of calls inside it, copied onto ``gm``), here and in the bodies of other
    higher-order calls; returns the calls and the identifiers of the bodies they call. With
    ``keep_calls``, the calls of ``gm`` itself whose operands and outputs are all tensors stay
    (`aten_trace` traces each distinct body once and inlines them in ATen), and only the calls
    inside their bodies are inlined."""
    if not _compat.HAS_INVOKE_SUBGRAPH:
        return 0, set()
    hop = _compat.invoke_subgraph_op()
    count, bodies, attrs, seen = 0, set(), set(), set()
    for node in gm.graph.nodes:  # the bodies of other higher-order ops (activation checkpointing's) first
        body = getattr(gm, node.target, None) if node.op == "get_attr" else None
        if not isinstance(body, fx.GraphModule) or node.target in seen:
            continue
        called = any(u.op == "call_function" and u.target is hop for u in node.users)
        if not called or keep_calls:
            seen.add(node.target)  # a kept body is shared by its calls: inside it once
            calls, inner = inline_regions(body)
            count, bodies = count + calls, bodies | inner
    calls = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is hop]
    kept = [n for n in calls if keep_calls and _tensors_only(n)]
    for call in kept:
        bodies.add(call.args[1])
    count += len(kept)
    while True:
        calls = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is hop and n not in kept]
        if not calls:
            break
        for call in calls:
            bodies.add(call.args[1])  # the identifier dynamo gave the body
            attrs.add(call.args[0].target)
            body, stack = getattr(gm, call.args[0].target), call.meta.get("nn_module_stack")
            origin = traced_at(body, stack)
            copies = inline_call(gm, call, body, call.args[2:])
            relocate_module_stacks(copies, origin, stack)
            count += 1
    if count > len(kept):
        for node in list(gm.graph.nodes):
            if node.op == "get_attr" and not node.users:
                gm.graph.erase_node(node)
        read = {n.target for n in gm.graph.nodes if n.op == "get_attr"}
        for name in attrs - read:  # the inlined bodies (a body's own bodies are its graph's to keep)
            delattr(gm, name)
        gm.recompile()
    return count, bodies


def _tensors_only(call: fx.Node) -> bool:
    """A call whose operands and body outputs are all tensors (dynamo's example values say)."""
    if call.kwargs or not all(isinstance(a, fx.Node) and _is_tensor(a) for a in call.args[2:]):
        return False
    return all(u.op == "call_function" and u.target is operator.getitem and _is_tensor(u) for u in call.users)


def _is_tensor(node: fx.Node) -> bool:
    return isinstance(node.meta.get("example_value"), torch.Tensor)


def inline_call(gm: fx.GraphModule, call: fx.Node, body: fx.GraphModule, operands) -> list[fx.Node]:
    """Replaces ``call`` (read item by item) by a copy of ``body``'s nodes, its inputs bound to
    ``operands``; returns the copies."""
    env: dict[fx.Node, object] = {}
    inputs = [n for n in body.graph.nodes if n.op == "placeholder"]
    if len(inputs) != len(operands) or call.kwargs:
        raise NotImplementedError(f"region call {call.name!r} passes {len(operands)} operands to a body of "
                                  f"{len(inputs)} inputs; graphshard inlines calls whose operands are the body's inputs")
    env.update(zip(inputs, operands))
    outputs = ()
    with gm.graph.inserting_before(call):
        for node in body.graph.nodes:
            if node.op == "placeholder":
                continue
            if node.op == "output":
                outputs = node.args[0]
                break
            if node.op == "get_attr":  # its value and meta (a constant's fake value: outline's key reads it)
                env[node] = gm.graph.get_attr(_copy_attr(gm, body, node.target))
                env[node].meta = copy.copy(node.meta)
                continue
            env[node] = gm.graph.node_copy(node, lambda n: env[n])
    results = [env[o] if isinstance(o, fx.Node) else o
               for o in (outputs if isinstance(outputs, (tuple, list)) else [outputs])]
    for user in list(call.users):
        if not (user.op == "call_function" and user.target is operator.getitem):
            raise NotImplementedError(f"region call {call.name!r} is read by {user.name!r} other than by "
                                      "index; graphshard inlines calls read item by item")
        user.replace_all_uses_with(results[user.args[1]])
        gm.graph.erase_node(user)
    gm.graph.erase_node(call)
    return [v for k, v in env.items() if k.op != "placeholder"]


def traced_at(body: fx.GraphModule, stack: dict | None) -> dict | None:
    """The module stack of the call dynamo traced ``body`` at, as its nodes name it: their stacks'
    first entries, as many as the call's ``stack`` has. A body is traced once and shared by every
    call whose guards hold, also across the bodies of other calls (each layer's checkpoint body
    calls the one region body traced in the first layer), so a call's own stack does not say it."""
    if not stack:
        return stack
    for node in body.graph.nodes:
        own = node.meta.get("nn_module_stack")
        if own and len(own) >= len(stack):
            return dict(list(own.items())[:len(stack)])
    return stack


def relocate_module_stacks(copies: list[fx.Node], origin: dict | None, call: dict | None) -> None:
    """Points the module stacks (``nn_module_stack``) of a body's copies at the block of their call:
    the body records the block dynamo traced it in (``origin``, that call's stack), and a flat trace
    would name each block's own modules (``layers.2.attn``, not ``layers.0.attn``). The stacks
    name what ``explain`` and the checkpoint-region numbering (`tag_recomputation`) read."""
    if not origin or not call or origin == call or len(origin) != len(call):
        return
    swap = dict(zip(origin, call.items()))  # the call site's entries, one for one
    (_, (old, _)), (_, (new, _)) = list(origin.items())[-1], list(call.items())[-1]
    for node in copies:
        stack = node.meta.get("nn_module_stack")
        if not stack:
            continue
        moved = {}
        for key, (path, cls) in stack.items():
            if key in swap:
                key, (path, cls) = swap[key]
            elif path.startswith(old) and path[len(old):len(old) + 1] in (".", "["):
                path = new + path[len(old):]
            moved[key] = (path, cls)
        node.meta["nn_module_stack"] = moved


def _copy_attr(gm: fx.GraphModule, body: fx.GraphModule, target: str) -> str:
    value = body
    for part in target.split("."):
        value = getattr(value, part)
    name = _free_name(gm, target.replace(".", "_"))
    if isinstance(value, fx.GraphModule):  # a body of a call inside: a copy per call site, as dynamo gives
        gm.add_submodule(name, copy.deepcopy(value))  # them (the boundary pass rewrites bodies in place)
    elif isinstance(value, nn.Module):
        gm.add_submodule(name, value)
    elif isinstance(value, torch.Tensor) and not isinstance(value, nn.Parameter):
        gm.register_buffer(name, value, persistent=False)  # a traced constant, as make_fx keeps one
    else:
        setattr(gm, name, value)
    return name


def _free_name(gm: fx.GraphModule, base: str) -> str:
    name, i = base, 0
    while hasattr(gm, name):
        i += 1
        name = f"{base}_{i}"
    return name
