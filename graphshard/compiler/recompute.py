"""What activation checkpointing made the compiled backward recompute, for ``explain``.

Read from aot_autograd's partition: the joint graph's checkpointed regions (the tags
``passes/tag_recomputation.py`` wrote, copied by aot_autograd onto every traced node), the
forward ops the backward graph holds again (the recomputation), and the bytes the forward
saves for the backward, with the checkpointing and, partitioned once more without its tags,
without it.
"""

from __future__ import annotations

import collections
import math

import torch
import torch.fx as fx

from graphshard.passes.tag_recomputation import RECOMPUTED, common_prefix, module_of


def _from_checkpointing(node: fx.Node) -> bool:
    """Whether ``node`` carries a checkpointed region's tag (not a unit's reshard tag, whose nodes
    aot_autograd traced from an ``unshard`` annotated with its unit)."""
    return "recompute" in node.meta and "graphshard_unit" not in node.meta.get("custom", {})


def regions(joint: fx.GraphModule) -> dict[int, str]:
    """The checkpointed regions of the joint graph: region number -> a label (its module, where known)."""
    found: dict[int, list[str]] = {}
    for node in joint.graph.nodes:
        if node.op == "call_function" and _from_checkpointing(node):
            found.setdefault(node.meta.get("ac_graph_id"), []).append(module_of(node))
    return {r: common_prefix([m for m in mods if m is not None]) or f"region {r}" for r, mods in found.items()}


def without_checkpointing(joint: fx.GraphModule) -> fx.GraphModule:
    """A copy of ``joint`` whose checkpointed regions carry no tags (the units' reshard tags stay)."""
    graph = fx.Graph()
    out = graph.graph_copy(joint.graph, {})
    graph.output(out)
    for node in graph.nodes:
        if _from_checkpointing(node):
            node.meta.pop("recompute", None)
            node.meta.pop("ac_graph_id", None)
    return fx.GraphModule(joint, graph)


def saved_bytes(fw: fx.GraphModule, num_fwd_outputs: int) -> int:
    """Bytes the forward graph saves for the backward (its outputs after the user's), counting
    the tensors whose sizes are known when compiling (a lookup's rows depend on the batch's ids)."""
    out = next(n for n in reversed(fw.graph.nodes) if n.op == "output")
    return sum(_nbytes(v) for v in out.args[0][num_fwd_outputs:])


def _nbytes(node) -> int:
    v = node.meta.get("val") if isinstance(node, fx.Node) else None
    if not isinstance(v, torch.Tensor):
        return 0
    try:
        return int(math.prod(int(s) for s in v.shape)) * v.dtype.itemsize
    except (TypeError, RuntimeError, ValueError):  # a size that depends on the data
        return 0


def summary(fw: fx.GraphModule, bw: fx.GraphModule, num_fwd_outputs: int, saved_without: int,
            labels: dict[int, str]) -> dict:
    """What ``explain`` prints: per region, the forward ops the backward recomputes; the saved bytes."""
    per_region: dict[int, collections.Counter] = {r: collections.Counter() for r in labels}
    for node in bw.graph.nodes:
        if node.op == "call_function" and _from_checkpointing(node) and node.meta.get("recompute") in RECOMPUTED:
            per_region.setdefault(node.meta.get("ac_graph_id"), collections.Counter())[_op_name(node)] += 1
    return {
        "regions": len(labels),
        "ops": sum(sum(c.values()) for c in per_region.values()),
        "per_region": {labels.get(r, f"region {r}"): dict(c) for r, c in sorted(per_region.items())},
        "saved_bytes": saved_bytes(fw, num_fwd_outputs),
        "saved_bytes_without_ac": saved_without,
    }


def _op_name(node: fx.Node) -> str:
    target = node.target
    return getattr(target, "__name__", str(target)).split(".")[0]
