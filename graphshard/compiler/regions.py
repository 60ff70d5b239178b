"""Dynamo traces each distinct repeated unit once.

With ``trace_once`` (the default), `mark_repeated_units` gives every unit whose module class
repeats a forward marked ``torch.compiler.nested_compile_region``, on a subclass of its own (the
user's class is not touched). Dynamo then traces one block and stamps its body out for every
block that passes the body's guards under its own sources; a block that does not is traced again,
so a mark never changes what runs. It can do that because a traced marker carries its model's
key, not the parameter's FQN (`sharding.traced_key`): a block's trace reads no value that names
the block.

The backend inlines the bodies dynamo hands over (`inline_regions`) before anything else, so
the passes, the scheduler and ``outline`` (which traces a body to ATen and differentiates it once)
see the graph a flat trace gives. The backend puts each marker's key back from the DTensor it
reads (`backend._strip_dtensor_boundary`).

A unit is not marked when graphshard wraps its forward (declared layouts, a plan's
`Checkpoint`, the root), when its parameters live in a flat parameter (the marker there reads
the unit's slot, which names the block), or when the user marked its forward already.
"""

from __future__ import annotations

import copy
import logging
import operator

import torch
import torch.fx as fx
import torch.nn as nn

from graphshard import _compat
from graphshard.sharding import ShardedModel

log = logging.getLogger("graphshard")

_WRAPPED = ("_graphshard_io", "_graphshard_checkpoint", "_graphshard_root")
_region_classes: dict[tuple[type, int], type] = {}


def mark_repeated_units(root: nn.Module, state: ShardedModel) -> list[str]:
    """Marks the forward of each unit of ``root`` whose class repeats (see the module docstring);
    returns one line per class for ``explain``, marked or why not."""
    if not _compat.HAS_INVOKE_SUBGRAPH:
        return [f"dynamo traces every block: torch {torch.__version__} has no nested_compile_region reuse (2.13)"]
    by_class: dict[type, list[tuple[str, nn.Module]]] = {}
    for fqn in state.units:
        if fqn:
            mod = root.get_submodule(fqn)
            by_class.setdefault(type(mod), []).append((fqn, mod))
    notes = []
    for cls, units in by_class.items():
        if len(units) < 2:
            continue
        reason = _unmarkable(cls, units, state)
        first = units[0][0]
        if reason:
            notes.append(f"{first} x{len(units)}: dynamo traces each ({reason})")
            log.info("graphshard: dynamo traces each of the %d units like %s: %s", len(units), first, reason)
            continue
        region = _region_class(cls, len(units))
        for _, mod in units:
            mod.__class__ = region
        notes.append(f"{first} x{len(units)}: dynamo traces one and reuses its trace where its guards hold")
    return notes


def _unmarkable(cls: type, units: list[tuple[str, nn.Module]], state: ShardedModel) -> str | None:
    if getattr(cls, "_graphshard_region", False):
        return None
    if hasattr(cls.forward, "__marked_compile_region_fn__"):
        return "its forward is a nested_compile_region of the user's"
    for fqn, mod in units:
        if fqn in state.flat:
            return "its parameters live in a flat parameter"
        wrapped = [k for k in _WRAPPED if k in mod.__dict__]
        if wrapped:
            return "graphshard wraps its forward (declared layouts or a plan's Checkpoint)"
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


def inline_regions(gm: fx.GraphModule) -> tuple[int, set[str]]:
    """Replaces each ``invoke_subgraph`` call of ``gm`` by a copy of its body's nodes (a body's own
    attributes, the bodies of calls inside it, copied onto ``gm``), here and in the bodies of other
    higher-order calls; returns the calls inlined and the identifiers of the bodies they called."""
    if not _compat.HAS_INVOKE_SUBGRAPH:
        return 0, set()
    hop = _compat.invoke_subgraph_op()
    inlined, bodies, attrs = 0, set(), set()
    for node in gm.graph.nodes:  # the bodies of other higher-order ops (activation checkpointing's) first
        if node.op == "get_attr" and isinstance(getattr(gm, node.target, None), fx.GraphModule) and not any(
                u.op == "call_function" and u.target is hop for u in node.users):
            calls, inner = inline_regions(getattr(gm, node.target))
            inlined, bodies = inlined + calls, bodies | inner
    while True:
        calls = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is hop]
        if not calls:
            break
        for call in calls:
            bodies.add(call.args[1])  # the identifier dynamo gave the body
            attrs.add(call.args[0].target)
            _inline(gm, call)
            inlined += 1
    if inlined:
        for node in list(gm.graph.nodes):
            if node.op == "get_attr" and not node.users:
                gm.graph.erase_node(node)
        read = {n.target for n in gm.graph.nodes if n.op == "get_attr"}
        for name in attrs - read:  # the inlined bodies (a body's own bodies are its graph's to keep)
            delattr(gm, name)
        gm.recompile()
    return inlined, bodies


def _inline(gm: fx.GraphModule, call: fx.Node) -> None:
    body = getattr(gm, call.args[0].target)
    operands = call.args[2:]
    env: dict[fx.Node, object] = {}
    inputs = [n for n in body.graph.nodes if n.op == "placeholder"]
    if len(inputs) != len(operands) or call.kwargs:
        raise NotImplementedError(f"invoke_subgraph call {call.name!r} passes {len(operands)} operands to a body of "
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
            if node.op == "get_attr":
                env[node] = gm.graph.get_attr(_copy_attr(gm, body, node.target))
                continue
            env[node] = gm.graph.node_copy(node, lambda n: env[n])
    results = [env[o] if isinstance(o, fx.Node) else o
               for o in (outputs if isinstance(outputs, (tuple, list)) else [outputs])]
    for user in list(call.users):
        if not (user.op == "call_function" and user.target is operator.getitem):
            raise NotImplementedError(f"invoke_subgraph call {call.name!r} is read by {user.name!r} other than by "
                                      "index; graphshard inlines calls read item by item")
        user.replace_all_uses_with(results[user.args[1]])
        gm.graph.erase_node(user)
    gm.graph.erase_node(call)


def _copy_attr(gm: fx.GraphModule, body: fx.GraphModule, target: str) -> str:
    value = body
    for part in target.split("."):
        value = getattr(value, part)
    name = _free_name(gm, target.replace(".", "_"))
    if isinstance(value, fx.GraphModule):  # a body of a call inside: a copy per call site, as dynamo gives
        gm.add_submodule(name, copy.deepcopy(value))  # them (the boundary pass rewrites bodies in place)
    elif isinstance(value, nn.Module):
        gm.add_submodule(name, value)
    else:
        setattr(gm, name, value)
    return name


def _free_name(gm: fx.GraphModule, base: str) -> str:
    name, i = base, 0
    while hasattr(gm, name):
        i += 1
        name = f"{base}_{i}"
    return name
