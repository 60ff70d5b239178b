"""Golden-graph helpers: run graphshard's pipeline pass by pass on a fake process group."""

from __future__ import annotations

import glob
import os
import tempfile

import torch
import torch.fx as fx

import graphshard
from graphshard.compiler.prepare import prepare, trace
from graphshard.config import CompileConfig
from graphshard.passes._graph import fmt_placements, normalized_graph
from graphshard.passes.pipeline import pre_autograd_passes, run_passes


class _Captured(Exception):
    """Raised by the capturing backend: the graph is what the test wants, not its run."""


def capture_dynamo(model: torch.nn.Module, *inputs) -> tuple[fx.GraphModule, list]:
    """dynamo's graph of ``model(*inputs)`` and its example inputs, without running the graph. On the
    fake process group a collective's output is whatever torch's fake backend leaves there (torch
    2.11 leaves it unwritten), so running a graph whose sizes come from an all-to-all would read
    uninitialized memory: the capturing backend stops the call instead."""
    captured = {}

    def backend(gm, example_inputs):
        captured["gm"], captured["inputs"] = gm, list(example_inputs)
        raise _Captured

    try:
        torch.compile(model, backend=backend, fullgraph=True)(*inputs)
    except Exception:
        if "gm" not in captured:
            raise
    return captured["gm"], captured["inputs"]


def graph_after(model, plan, inputs, upto: str, *, config: CompileConfig | None = None, placements=False,
                after_shard=None) -> str:
    """Shards ``model`` (then calls ``after_shard(model)``, if given) and returns the normalized graph
    right after pass ``upto``."""
    graphshard.shard(model, plan)
    if after_shard is not None:
        after_shard(model)
    gm, example_inputs = capture_dynamo(model, *inputs)
    prepared = trace(prepare(gm, example_inputs), config or CompileConfig(lower="eager"), (model._graphshard,))
    passes = pre_autograd_passes()
    names = [p.__name__ for p in passes]
    assert upto in names, f"unknown pass {upto!r}; passes are {names}"
    g = run_passes(prepared.graph, prepared.ctx, passes[: names.index(upto) + 1])
    return render(g, plan, placements=placements)


def render(g: fx.GraphModule, plan, *, placements=False) -> str:
    groups = {}
    for axis in plan.mesh.mesh_dim_names:
        groups[f"'{plan.mesh.get_group(axis).group_name}'"] = f"'{axis}'"
    text = normalized_graph(g, groups)
    if placements:
        lines = [f"{n.name}: {fmt_placements(n.meta.get('placement'))}" for n in g.graph.nodes
                 if n.op not in ("output",) and n.meta.get("placement") is not None]
        text += "\n".join(lines) + "\n"
    return text


def compiled_stages(model, plan, inputs, *, loss_fn=lambda out: out.sum(), **compile_kwargs) -> dict[str, str]:
    """Compiles with lower='eager', runs forward and backward, returns the normalized
    forward/backward graphs after schedule_overlap and the explain report. The graphs are the
    flat trace's unless ``trace_once=True`` is passed: outlining repeated units renames the nodes
    it puts back, and test_outline.py checks that it changes nothing else that matters."""
    compile_kwargs.setdefault("trace_once", False)
    with tempfile.TemporaryDirectory() as d:
        graphshard.compile(model, plan, lower="eager", dump_graphs=d, **compile_kwargs)
        loss_fn(model(*inputs)).backward()
        out = {}
        for stage in ("forward", "backward"):
            files = sorted(glob.glob(os.path.join(d, f"g0_{stage}_*_schedule_overlap_after.txt")))
            assert files, f"no {stage} graph was dumped"
            with open(files[-1]) as f:
                text = f.read()
            out[stage] = _strip_dump(text, plan)
        return out


def _strip_dump(text: str, plan) -> str:
    import re

    from graphshard.passes._graph import _drop_noise

    text = text.split("\n# recompute tags")[0]  # the dump's listing of the partitioner's tags (the graph shows them)
    text = _drop_noise("\n".join(l for l in text.splitlines() if not l.startswith("# op-count diff")))
    text = re.sub(r"'m\d+/", "'", text)
    for axis in plan.mesh.mesh_dim_names:
        text = text.replace(f"'{plan.mesh.get_group(axis).group_name}'", f"'{axis}'")
    return text + "\n"
