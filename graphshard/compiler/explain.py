"""What the compiler did, per compiled graph: ``graphshard.explain(model)``."""

from __future__ import annotations

import functools
import logging
import time
from dataclasses import dataclass
from typing import Callable

import torch.nn as nn

from graphshard.report import GraphReport

log = logging.getLogger("graphshard")


def timing_compiles(reports: list[GraphReport]) -> Callable[[Callable], Callable]:
    """A wrap for a sharded model's compiled call (`_compat.wrap_compiled_call`). In a call that
    compiled graphs (``reports``, the model's explain list, grew), the call's time less each new
    graph's backend and first run is dynamo's own: its trace of the frame, its guards, and any
    code of the frame it runs eagerly between graphs. It is kept as the first new graph's
    ``compile_seconds["dynamo"]``. Other calls pay a length test and a clock read."""
    def wrap(call: Callable) -> Callable:
        @functools.wraps(call)
        def compiled_call(*args, **kwargs):
            before = len(reports)
            start = time.perf_counter()
            try:
                return call(*args, **kwargs)
            finally:
                new = reports[before:]
                if new:
                    spent = sum(r.backend_seconds + r.first_run_seconds for r in new)
                    new[0].compile_seconds["dynamo"] = max(time.perf_counter() - start - spent, 0.0)

        return compiled_call

    return wrap


@dataclass
class ModelFallback:
    """A fallback of a whole compiled call, not of one graph: explain prints it before the graphs
    (kept in the model's ``preamble``)."""

    what: str

    def format(self) -> str:
        return f"fallbacks (model): {self.what}"


def noting_eager_calls(state, name: str) -> Callable[[Callable], Callable]:
    """A wrap for a sharded model's compiled call that makes dynamo's whole-call fallback loud: a call
    that returns with no graph compiled for the model (``state.explain`` empty) ran its forward
    eagerly: dynamo hit the frame's recompile or cache limit, or skipped it. Logged once, listed by
    ``explain`` among the model's fallbacks. (A frame skipped inside a call that did compile is an
    eager region, recorded at its first parameter read: `storage._record_eager_read`.) Other calls
    pay a list test."""
    noted = []

    def wrap(call: Callable) -> Callable:
        @functools.wraps(call)
        def compiled_call(*args, **kwargs):
            out = call(*args, **kwargs)
            if not state.explain and not noted:
                noted.append(ModelFallback(
                    f"{name} (model m{state.model_id}) ran its forward eagerly: dynamo compiled no graph for its "
                    "call (the frame reached torch._dynamo.config.recompile_limit or cache_size_limit, or dynamo "
                    "skipped it; TORCH_LOGS=recompiles,graph_breaks says which). Its parameters are gathered whole "
                    "at each read and their gradients reduced eagerly"))
                state.preamble.append(noted[0])
                log.warning("graphshard: %s", noted[0].what)
            return out

        return compiled_call

    return wrap


def explain(model) -> str:
    """Returns (and prints) the report of every graph graphshard compiled for ``model``."""
    from graphshard.storage import state_of

    state = state_of(model)
    if state is None and isinstance(getattr(model, "module", None), nn.Module):  # a wrapper (DMP): its module
        state = state_of(model.module)
    if state is None:
        raise ValueError(f"{type(model).__name__} was not sharded by graphshard; call graphshard.compile first")
    parts = (["plan notes:"] + [f"  {n}" for n in state.plan.notes] if state.plan.notes else [])
    parts += [p.format() for p in state.preamble]
    if state.dynamo_regions:
        parts += ["repeated units (dynamo):"] + [f"  {line}" for line in state.dynamo_regions.lines]
    if state.checkpointing:
        parts += ["activation checkpointing (plan):"] + [f"  {line}" for line in state.checkpointing]
    if not state.explain and not any(isinstance(p, ModelFallback) for p in state.preamble):
        parts.append("graphshard: no graph compiled yet; run a step first")
    else:
        parts.extend(r.format() for r in state.explain)
    parts += _eager_regions(state)
    text = "\n".join(parts)
    print(text)
    return text


def _eager_regions(state) -> list[str]:
    """The units (or parameters outside units) read in frames run eagerly inside a compiled call, with
    how many of their parameters were read and where the first was."""
    if not state.eager_reads:
        return []
    by_unit: dict[str, list[str]] = {}
    for key, where in state.eager_reads.items():
        info = state.params[key]
        name = f"unit {info.layout.unit!r}" if info.layout.unit is not None else repr(info.fqn)
        by_unit.setdefault(name, []).append(f"{info.fqn} in {where}")
    lines = ["fallbacks (model): eager regions (frames run without compiling inside the compiled call: each parameter gathered "
             "whole at its read, its gradient reduced eagerly; TORCH_LOGS=graph_breaks says why dynamo skipped them):"]
    lines += [f"  {name}: {len(reads)} parameter(s), first {reads[0]}" for name, reads in by_unit.items()]
    return lines
