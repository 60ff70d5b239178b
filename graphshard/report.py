"""What the compiler records of each compiled graph (`GraphReport`), and the names its order
listings use: the one module the passes, the compiler and ``explain`` all read, below each of
them (`tests/test_layout.py`: ``passes/`` never imports ``compiler/``)."""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any

import torch.fx as fx


@dataclass
class CollectiveRecord:
    kind: str          # all_gather, reduce_scatter, all_reduce, ...
    axis: str          # mesh axis
    nbytes: int        # bytes of the (per-rank) input buffer
    cause: str         # the parameter(s) or node that made it necessary
    stage: str         # pre_autograd (inserted), forward, backward (lowered)


@dataclass
class GraphReport:
    index: int
    frame: str | None = None  # the code dynamo compiled it from (_compat.dynamo_frame)
    frame_compile: int = 0    # which compile of that code: graphs of this model compiled from it before
    collectives: list[CollectiveRecord] = field(default_factory=list)
    units: dict[str, list[str]] = field(default_factory=dict)        # unit -> parameter FQNs
    order: dict[str, list[str]] = field(default_factory=dict)        # stage -> collective/compute order
    schedule: dict[str, str] = field(default_factory=dict)           # stage -> prefetch settings that gave it
    lowered_order: dict[str, list[str]] = field(default_factory=dict)  # stage -> order in generated code
    regions: dict[str, dict[str, int]] = field(default_factory=dict)  # stage -> regional lowering counts
    fallbacks: list[str] = field(default_factory=list)
    sparse: list[str] = field(default_factory=list)  # sharded embedding collections: tables, sharding, kernels
    notes: list[str] = field(default_factory=list)
    compile_seconds: dict[str, float] = field(default_factory=dict)  # phase -> seconds
    backend_seconds: float = 0.0    # the whole backend call for this graph
    first_run_seconds: float = 0.0  # the compiled graph's first run (the call that compiled it)
    recompute: dict = field(default_factory=dict)  # activation checkpointing (compiler.recompute.summary)
    collective_check: dict[str, str] = field(default_factory=dict)  # stage -> what the ranks compared, its cost
    outlined: Any = None  # what trace once shared (`outline.Outlined`), for the compile time per distinct unit
    dynamo_bodies: tuple[int, int, int] = (0, 0, 0)  # blocks dynamo stamped out from a traced body, the distinct
    # bodies, and the bodies' traces to ATen (`aten_trace`: one per distinct body and operand metadata)

    def format(self) -> str:
        lines = [f"graph {self.index}" + (f" ({self.frame}, compile {self.frame_compile})" if self.frame else "") + ":"]
        if self.sparse:
            lines.append("  sharded embeddings:")
            lines.extend(f"    {line}" for line in self.sparse)
        if self.units:
            lines.append("  units:")
            for unit, fqns in self.units.items():
                lines.append(f"    {unit or '<root>'}: {len(fqns)} parameters ({', '.join(fqns[:4])}{', ...' if len(fqns) > 4 else ''})")
        titles = {"pre_autograd": "inserted", "forward": "forward graph", "backward": "backward graph"}
        for stage in ("pre_autograd", "forward", "backward"):
            recs = [c for c in self.collectives if c.stage == stage]
            if not recs:
                continue
            lines.append(f"  collectives ({titles[stage]}):")
            for c in recs:
                lines.append(f"    {c.kind:<15} axis={c.axis:<4} {_fmt_bytes(c.nbytes):>10}  for {c.cause}")
        for stage, order in self.order.items():
            if stage in self.schedule:
                lines.append(f"  scheduling ({stage}): {self.schedule[stage]}")
            lines.append(f"  order after scheduling ({stage}): {' -> '.join(order)}")
        for stage, order in self.lowered_order.items():
            lines.append(f"  order in lowered code ({stage}): {' -> '.join(order)}")
        for stage, c in self.regions.items():
            lines.append(f"  regions ({stage}): {c['regions']}, {c['compiled']} compiled by Inductor, "
                         f"{c['eager']} run as ATen calls")
        if self.recompute:
            r = self.recompute
            lines.append(f"  activation checkpointing: {r['regions']} region(s); the forward saves "
                         f"{_fmt_bytes(r['saved_bytes'])} for the backward ({_fmt_bytes(r['saved_bytes_without_ac'])} "
                         "without checkpointing)")
            for label, ops in r["per_region"].items():
                top = ", ".join(f"{op} x{n}" for op, n in sorted(ops.items(), key=lambda kv: -kv[1])[:6])
                lines.append(f"    {label}: recomputes {sum(ops.values())} ops ({top}{', ...' if len(ops) > 6 else ''})")
        for stage, line in self.collective_check.items():
            lines.append(f"  collectives compared across ranks ({stage}): {line}")
        lines.append(f"  fallbacks: {'; '.join(self.fallbacks) if self.fallbacks else 'none'}")
        if self.compile_seconds:
            lines.append("  compile time: " + ", ".join(f"{k} {v:.2f}s" for k, v in self.compile_seconds.items()))
        lines += self.per_distinct_unit()
        for note in self.notes:
            lines.append(f"  note: {note}")
        return "\n".join(lines)

    def per_distinct_unit(self) -> list[str]:
        """Each body trace once shared: the units that reuse it, its one trace and partition, and the
        regions its inlined copies lowered to (instances, and the distinct ones compiled on this rank,
        with their time); then the same for what was traced in line."""
        outlined = self.outlined
        if outlined is None or not outlined.calls:
            return []
        lines = ["  compile time per distinct unit (the regions each lowered to, and how many distinct ones "
                 "this rank compiled):"]
        calls, bodies, aten = self.dynamo_bodies
        if calls:
            lines.append(f"    dynamo: {calls} blocks from {bodies} traced bod{'y' if bodies == 1 else 'ies'}, "
                         f"traced to ATen {_times(aten)}")
        loaded = "program_load" in self.compile_seconds  # from the program cache: nothing traced, partitioned or lowered
        for name in outlined.shared:
            units = [c.units[0] or "<root>" for c in outlined.calls if c.body == name]
            done = "loaded with the program" if loaded else f"traced once in {outlined.seconds.get(name, 0.0):.2f}s"
            lines.append(f"    {units[0]}, reused by {len(units)} units ({_short_list(units)}): {done}; "
                         f"{self._lowered(name, loaded)}")
        if not loaded:
            lines.append(f"    the shared bodies' partitions (once each): {outlined.partition_seconds:.2f}s")
        lines.append(f"    in line (the units on their own, the model's head and tail): {self._lowered(None, loaded)}")
        return lines

    def _lowered(self, body: str | None, loaded: bool = False) -> str:
        seconds, parts = 0.0, []
        for stage, counts in self.regions.items():
            mine = counts.get("bodies", {}).get(body)
            if mine is None:
                continue
            seconds += mine["seconds"]
            if mine["regions"]:
                parts.append(f"{stage} {mine['regions']} regions from {mine['compiled']} compiled")
        done = "lowered by the compile that stored the program" if loaded else f"lowered in {seconds:.2f}s"
        return done + (f" ({', '.join(parts)})" if parts else "")


def _short_list(names: list[str], head: int = 3) -> str:
    return ", ".join(names) if len(names) <= head + 1 else f"{', '.join(names[:head])}, ..., {names[-1]}"


def collective_kind(op_name: str) -> str:
    """An order listing's name for a ``_c10d_functional`` op: ``all_gather_into_tensor`` (and
    its ``_coalesced`` form) -> ``all_gather``, ``reduce_scatter_tensor`` -> ``reduce_scatter``,
    ``all_to_all_single`` -> ``all_to_all``, ``wait_tensor`` -> ``wait``."""
    if op_name == "wait_tensor":
        return "wait"
    return (op_name.replace("_coalesced", "").replace("_into_tensor", "").replace("_tensor", "")
            .replace("_single", ""))


def collective_of_wait(wait: fx.Node) -> fx.Node:
    """The collective a ``wait_tensor`` node waits on: its argument, or the coalesced
    collective whose output the argument picks (order listings show one wait for it)."""
    src = wait.args[0]
    return src.args[0] if src.op == "call_function" and src.target is operator.getitem else src


def add_compute(events: list[str]) -> None:
    """Appends one compute event to an order listing, folding runs: compute, compute x2, ..."""
    if events and events[-1].startswith("compute"):
        count = 1 if events[-1] == "compute" else int(events[-1][len("compute x"):])
        events[-1] = f"compute x{count + 1}"
    else:
        events.append("compute")


def _fmt_bytes(n) -> str:
    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

    try:
        n = int(n)
    except GuardOnDataDependentSymNode:  # sized by the data (ids per batch): shown symbolically
        return f"{n} B"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def _times(n: int) -> str:
    return {1: "once", 2: "twice"}.get(n, f"{n} times")
