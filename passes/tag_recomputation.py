"""tag_recomputation: what the backward recomputes, as the tags aot_autograd's partitioner reads.

Two facts decide it, and this pass writes both as ``node.meta["recompute"]`` (a
``CheckpointPolicy``) and ``node.meta["ac_graph_id"]`` (a region number):

Activation checkpointing (AC). Tracing a checkpointed function (``torch.utils.checkpoint``
without reentry, HF's ``gradient_checkpointing_enable()``, ``checkpoint_wrapper``, a plan's
`graphshard.Checkpoint`) tags every op it records with the region's policy:
``PREFER_RECOMPUTE`` under full AC, the policy function's choice under selective AC. The trace
numbers regions from a process-wide counter; the partitioner compares the numbers (a value a
region recomputes and a later region reads is saved, the boundary between two checkpointed
blocks), so this pass renumbers them 1, 2, ... in program order. Nodes the passes inserted
inside a region (a tensor-parallel all-reduce, a local view, a keyed random draw) were not
traced there and carry no tag: such a node (one without the trace's mark, `context.TRACED`) whose
every user is in region r, and which reads no other region, joins r. The user's own code outside
a region never joins one, though it feed one. A collective joins as recomputed under full AC (the
forward re-runs, as eager AC re-runs it) and as saved under selective AC (torchtitan's selective
policy saves what collectives produce: their outputs cost memory, their recomputation costs
communication).

Reshard after forward. FULL_SHARD units (``reshard_after_forward=True``) free their gathered
parameters after forward and gather them again in backward: their ``unshard`` nodes are
``MUST_RECOMPUTE``. SHARD_GRAD_OP units keep them: ``MUST_SAVE``. aot_autograd copies a tag onto
every node it traces the tagged node into (all-gather, wait, casts, views), so the backward
re-issues exactly the FULL_SHARD all-gathers, and a region's recomputation reads what they
gather. An ``unshard`` takes the highest number of the regions that read it (or a number of its
own), so the boundary rule above never saves gathered parameters.

The root unit (plan key ``""``) keeps its parameters whatever its spec says
(`ShardedParam.reshard_after_forward`), as FSDP2's root does: the backward starts with the
layers that ran last in the forward, typically the root's (the output head, a tied embedding),
so resharding it would only gather it again at once, an all-gather with nothing to hide under.
"""

from __future__ import annotations

import operator
import re

import torch.fx as fx
from torch.utils.checkpoint import CheckpointPolicy

from graphshard.ops import ops
from graphshard.passes.bucket_collectives import unshard_units
from graphshard.passes.context import TRACED, PassContext

RECOMPUTED = (CheckpointPolicy.PREFER_RECOMPUTE, CheckpointPolicy.MUST_RECOMPUTE)
_COLLECTIVES = frozenset(op.default for op in (ops.all_reduce, ops.all_gather, ops.reduce_scatter, ops.all_reduce_max,
                                                ops.all_gather_partial_grad, ops.all_to_all))
"""The forward collectives passes insert (``grad_all_reduce`` communicates in the backward only)."""


def tag_recomputation(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    gathered = _gathered(gm)
    regions = _number_regions(gm, gathered)
    if regions:
        _join_inserted(gm, gathered, _selective_regions(gm))
    _tag_unshards(gm, ctx, regions)
    return gm


def _gathered(gm: fx.GraphModule) -> set[fx.Node]:
    """The unshard nodes and the items of their results: tagged by the reshard policy, never by AC."""
    nodes = set()
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target == ops.unshard.default:
            nodes.add(node)
            nodes.update(u for u in node.users if u.target is operator.getitem)
    return nodes


def _number_regions(gm: fx.GraphModule, gathered: set[fx.Node]) -> int:
    """Renumbers the trace's AC regions 1, 2, ... in program order; returns how many there are.

    A checkpoint nested in another takes the outer region's number, as torch >= 2.13's trace
    gives it. torch 2.11 numbers it apart, and the partitioner then saves the values that cross
    the inner boundary (more saved bytes, fewer ops recomputed). Nested means: its ops lie within
    the outer region's, or it comes right after the outer region's last op and is inside the
    outer's module (a checkpoint that is the last thing its outer checkpointed function does).
    Merging is always numerically safe: it only lets the backward recompute more."""
    tagged = [(i, n) for i, n in enumerate(gm.graph.nodes)
              if n not in gathered and "ac_graph_id" in n.meta and "recompute" in n.meta]
    spans: dict = {}  # the trace's number -> [first index, last index, module FQNs]
    for i, node in tagged:
        span = spans.setdefault(node.meta["ac_graph_id"], [i, i, []])
        span[1] = i
        if (fqn := module_of(node)) is not None:
            span[2].append(fqn)
    roots: dict = {}  # outermost regions in program order -> [first, last, label]
    outer: dict = {}
    for raw in sorted(spans, key=lambda r: spans[r][0]):
        first, last, fqns = spans[raw]
        label = common_prefix(fqns)
        prev = next(reversed(roots), None)
        if prev is not None:
            p_first, p_last, p_label = roots[prev]
            inside = p_first <= first and last <= p_last
            trailing = bool(label and p_label) and label.startswith(p_label + ".")
            if inside or trailing:
                outer[raw] = prev
                roots[prev][1] = max(p_last, last)
                continue
        roots[raw] = [first, last, label]
    numbers = {raw: i for i, raw in enumerate(roots, 1)}
    for _, node in tagged:
        raw = node.meta["ac_graph_id"]
        node.meta["ac_graph_id"] = numbers[outer.get(raw, raw)]
    return len(roots)


def module_of(node: fx.Node) -> str | None:
    """The FQN of the innermost module ``node`` was traced in (from dynamo's ``nn_module_stack``)."""
    return innermost_module(node.meta.get("nn_module_stack"))


def innermost_module(stack: dict | None) -> str | None:
    """The FQN of a module stack's (``nn_module_stack``'s) innermost module; None for no stack."""
    return _fqn(list(stack.values())[-1][0]) if stack else None


def _fqn(path: str) -> str:
    """dynamo's module path (``L['self'].layers[0].attn``, ``L['self']._modules['layers']``, inside a
    checkpoint's body ``...layers[0].__dict__['_modules']['_checkpoint_wrapped_module']``) as an FQN."""
    path = re.sub(r"^L\['self'\]\.?", "", path).replace(".__dict__['_modules']", "._modules")
    path = re.sub(r"\._modules\['([^']+)'\]", r".\1", "." + path).lstrip(".")
    return re.sub(r"\[(\d+)\]", r".\1", path).lstrip(".")


def common_prefix(fqns: list[str]) -> str:
    """The longest dotted prefix the FQNs share ("" for none)."""
    if not fqns:
        return ""
    out = []
    for names in zip(*(f.split(".") for f in fqns)):
        if len(set(names)) != 1:
            break
        out.append(names[0])
    return ".".join(out)


def _selective_regions(gm: fx.GraphModule) -> set[int]:
    """Regions whose policy saved some op (selective AC): full AC recomputes every op."""
    return {n.meta["ac_graph_id"] for n in gm.graph.nodes
            if "ac_graph_id" in n.meta and n.meta.get("recompute") not in RECOMPUTED}


def _join_inserted(gm: fx.GraphModule, gathered: set[fx.Node], selective: set[int]) -> None:
    """Untagged nodes whose every user is in one region, reading no other region, join it. Users
    come after their producers, so one walk from the output back settles chains of such nodes."""
    for node in reversed(gm.graph.nodes):
        if (node.op != "call_function" or node in gathered or "recompute" in node.meta or not node.users
                or node.meta.get(TRACED)):
            continue
        users = {u.meta.get("ac_graph_id") if "recompute" in u.meta and u not in gathered else None for u in node.users}
        if len(users) != 1 or None in users:
            continue
        (region,) = users
        if any("recompute" in a.meta and a not in gathered and a.meta.get("ac_graph_id") != region
               for a in node.all_input_nodes):
            continue
        collective = node.target in _COLLECTIVES or (node.target is operator.getitem and node.args[0].target in _COLLECTIVES)
        save = collective and region in selective
        node.meta["recompute"] = CheckpointPolicy.MUST_SAVE if save else CheckpointPolicy.PREFER_RECOMPUTE
        node.meta["ac_graph_id"] = region


def _tag_unshards(gm: fx.GraphModule, ctx: PassContext, regions: int) -> None:
    for index, (unit, nodes) in enumerate(unshard_units(gm, ctx).items()):
        info = ctx.params[nodes[0].args[1][0]]
        if info.shard is None:  # replicated units gather nothing: no tag (a marker's, copied, would be stale)
            for node in nodes:
                for tagged in (node, *node.users):
                    tagged.meta.pop("recompute", None)
                    tagged.meta.pop("ac_graph_id", None)
            continue
        policy = CheckpointPolicy.MUST_RECOMPUTE if info.reshard_after_forward else CheckpointPolicy.MUST_SAVE
        for node in nodes:
            readers = [r for item in node.users for r in _readers(item)]
            number = max(readers, default=regions + 1 + index)
            for tagged in (node, *node.users):
                tagged.meta["recompute"] = policy
                tagged.meta["ac_graph_id"] = number
            node.meta.setdefault("custom", {})["graphshard_unit"] = unit


def _readers(node: fx.Node) -> list[int]:
    """The AC regions that read ``node``, directly or through untagged one-input ops (views, casts)."""
    found, todo = [], list(node.users)
    while todo:
        user = todo.pop()
        if "recompute" in user.meta and "ac_graph_id" in user.meta:
            found.append(user.meta["ac_graph_id"])
        elif len(user.all_input_nodes) == 1:
            todo.extend(user.users)
    return found
