"""What activation checkpointing made the compiled backward recompute, for ``explain``.

Read from aot_autograd's partition: the joint graph's checkpointed regions (the tags
``passes/tag_recomputation.py`` wrote, copied by aot_autograd onto every traced node), the
forward ops the backward graph holds again (the recomputation), and the bytes the forward
saves for the backward, with the checkpointing and, partitioned once more without its tags,
without it.
"""

from __future__ import annotations

import collections
import logging
import math
import operator
import time

import torch
import torch.fx as fx

from graphshard.compiler import outline
from graphshard.passes.tag_recomputation import RECOMPUTED, common_prefix, module_of

log = logging.getLogger(__name__)


def _from_checkpointing(node: fx.Node) -> bool:
    """Whether ``node`` carries a checkpointed region's tag (not a unit's reshard tag, whose nodes
    aot_autograd traced from an ``unshard`` annotated with its unit; before aot_autograd, the
    ``unshard``'s items carry the tag without the annotation)."""
    if "recompute" not in node.meta:
        return False
    source = node.args[0] if node.target is operator.getitem and isinstance(node.args[0], fx.Node) else node
    return not any("graphshard_unit" in n.meta.get("custom", {}) for n in (node, source))


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
    the tensors whose sizes are known when compiling (a lookup's rows depend on the batch's ids),
    each value once: the inlined calls of a shared body each save what they read, and consecutive
    calls read one value (the block between them's output, the attention mask)."""
    out = next(n for n in reversed(fw.graph.nodes) if n.op == "output")
    return sum(_nbytes(v) for v in dict.fromkeys(out.args[0][num_fwd_outputs:]))


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


def partition_body(joint: fx.GraphModule, base, kwargs, outlined: outline.Outlined):
    """An outlined body's partition. A body with checkpointed regions is partitioned once more
    without their tags, for ``explain``'s saved bytes without AC: the outer joint's second partition
    reuses the tagged body's, which aot_autograd caches by the call's identifier."""
    found = regions(joint)  # before base, which tags collectives to be saved
    name = outline.body_of_regions(outlined, found) if found else None
    untagged = without_checkpointing(joint) if name is not None else None
    fw, bw = base(joint, [], **kwargs)
    if untagged is not None:
        try:
            outlined.ac_saved[name] = (saved_bytes(fw, kwargs["num_fwd_outputs"]),
                                       saved_bytes(base(untagged, [], **kwargs)[0], kwargs["num_fwd_outputs"]))
        except Exception as e:  # noqa: BLE001 - an account for explain must not fail the compile
            log.warning("graphshard: no saved bytes without AC for %s (%s: %s)", name, type(e).__name__, e)
    return fw, bw


def account(fw, bw, untagged, labels: dict[int, str], base, joint_inputs, kwargs, report,
            outlined: outline.Outlined) -> dict:
    """``explain``'s account of activation checkpointing: what the backward recomputes and the bytes
    saved for it, with and without (the joint graph partitioned once more without the AC tags; an
    outlined body's part of that from its own second partition, once per call). An account that
    fails is logged and left out; the compile goes on."""
    start = time.perf_counter()
    try:
        saved_without = saved_bytes(base(untagged, joint_inputs, **kwargs)[0], kwargs["num_fwd_outputs"])
        for call in outlined.calls:
            if call.body in outlined.ac_saved:
                with_ac, without_ac = outlined.ac_saved[call.body]
                saved_without += without_ac - with_ac
            elif any(r in labels for r in call.regions):
                raise RuntimeError(f"no saved bytes without AC for the outlined body {call.body}")
        out = summary(fw, bw, kwargs["num_fwd_outputs"], saved_without, labels)
    except Exception as e:  # noqa: BLE001 - an account for explain must not fail the compile
        log.warning("graphshard: no activation-checkpointing account for explain (%s: %s)", type(e).__name__, e)
        report.notes.append(f"activation checkpointing: no account of saved bytes ({type(e).__name__})")
        return {}
    report.compile_seconds["ac_accounting"] = time.perf_counter() - start
    return out
