"""Small FX helpers shared by passes."""

from __future__ import annotations

import re
from typing import Any, Iterator

import torch
import torch.fx as fx
from torch.distributed.tensor import Partial, Placement, Replicate, Shard

aten = torch.ops.aten
R = Replicate()


def val(node: Any):
    return node.meta.get("val") if isinstance(node, fx.Node) else None


def is_tensor_node(node: Any) -> bool:
    return isinstance(node, fx.Node) and isinstance(node.meta.get("val"), torch.Tensor)


def tensor_args(node: fx.Node) -> Iterator[tuple[int | str, fx.Node]]:
    """(position or kwarg name, node) for every tensor-valued direct argument (lists flattened as 'i.j')."""
    for i, a in enumerate(node.args):
        if is_tensor_node(a):
            yield i, a
        elif isinstance(a, (list, tuple)):
            for j, b in enumerate(a):
                if is_tensor_node(b):
                    yield f"{i}.{j}", b
    for k, a in node.kwargs.items():
        if is_tensor_node(a):
            yield k, a


def fmt_placement(p: Placement) -> str:
    if getattr(p, "per_rank", False):  # annotate_placements.LOCAL: each rank's piece, handed on as it is
        return "local"
    if hasattr(p, "split_factor"):
        return f"S({p.dim}/{p.split_factor})"
    if isinstance(p, Shard):
        return f"S({p.dim})"
    if isinstance(p, Partial):
        return "P" if p.reduce_op == "sum" else f"P({p.reduce_op})"
    return "R"


def fmt_placements(pl) -> str:
    if pl is None:
        return "-"
    if isinstance(pl, list):
        return "[" + ", ".join(fmt_placements(p) for p in pl) + "]"
    return "{" + ", ".join(f"{a}: {fmt_placement(p)}" for a, p in pl.items()) + "}"


def _drop_noise(text: str) -> str:
    """Drops blank lines, file/line comments and "No stacktrace" notes from printed graphs."""
    lines = []
    for line in text.splitlines():
        line = line.replace(" No stacktrace found for following nodes", "")
        line = re.sub(r" File: .*$", "", line) if line.lstrip().startswith("#") else line  # a node's source line
        if line.strip() in ("", "#", "# No stacktrace found for following nodes") or line.strip().startswith("# File:"):
            continue
        lines.append(line)
    return "\n".join(lines)


def normalized_graph(gm: fx.GraphModule, replacements: dict[str, str] | None = None) -> str:
    """``print_readable`` without strides, devices or file comments: stable text for golden tests."""
    text = gm.print_readable(print_output=False, include_stride=False, include_device=False)
    text = _drop_noise(text)
    text = re.sub(r"'m\d+/", "'", text)
    for old, new in (replacements or {}).items():
        text = text.replace(old, new)
    return text + "\n"
