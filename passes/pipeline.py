"""The pass pipeline: one ordered list per stage, the reason for each position beside it."""

from __future__ import annotations

import collections
import os

import torch.fx as fx

from graphshard.ops.dense import compiling
from graphshard.passes.annotate_placements import annotate_placements
from graphshard.passes.bucket_collectives import bucket_collectives
from graphshard.passes.context import Pass, PassContext, log
from graphshard.passes.insert_collectives import insert_collectives
from graphshard.passes.localize_random import localize_random
from graphshard.passes.localize_shapes import localize_shapes
from graphshard.passes.relax_views import relax_views
from graphshard.passes.schedule_overlap import schedule_overlap
from graphshard.passes.shard_embeddings import shard_embeddings
from graphshard.passes.tag_recomputation import tag_recomputation

__all__ = ["Pass", "PassContext", "dump_graph", "op_counts", "post_partition_passes", "pre_autograd_passes", "run_passes"]


def pre_autograd_passes() -> list[Pass]:
    return [
        relax_views,          # first: no later step may depend on the first trace's strides
        annotate_placements,  # placements from the markers and plan, on the logical program
        insert_collectives,   # needs every node's placement; replaces markers with unshard / local shards
        localize_shapes,      # after insertion: rewrites logical sizes to per-rank sizes, re-derives meta["val"]
        localize_random,      # after localization: a random op's local and logical sizes are both known; emits per-rank draws
        shard_embeddings,     # on the per-rank program: a lookup's input and output are per-rank, its program has no logical form
        bucket_collectives,   # after localization: merges each unit's unshards into one collective
        tag_recomputation,    # last: tags the final nodes (AC regions, unshards) recompute/save for aot_autograd's partitioner
    ]


def post_partition_passes() -> list[Pass]:
    return [
        schedule_overlap,     # on the partitioned graphs, where all-gathers and reduce-scatters are explicit
    ]


def op_counts(gm: fx.GraphModule) -> collections.Counter:
    return collections.Counter(str(n.target) for n in gm.graph.nodes if n.op == "call_function")


def run_passes(gm: fx.GraphModule, ctx: PassContext, passes: list[Pass]) -> fx.GraphModule:
    with compiling(ctx.params):  # graphshard's ops traced by the passes read the bound parameters
        return _run(gm, ctx, passes)


def _run(gm: fx.GraphModule, ctx: PassContext, passes: list[Pass]) -> fx.GraphModule:
    for p in passes:
        before = op_counts(gm) if ctx.config.dump_graphs else None
        if before is not None:
            _dump(ctx, p.__name__, "before", gm)
        gm = p(gm, ctx)
        gm.graph.lint()
        if before is not None:
            after = op_counts(gm)
            diff = {k: after[k] - before[k] for k in set(before) | set(after) if after[k] != before[k]}
            _dump(ctx, p.__name__, "after", gm, diff)
            log.info("%s[%s]: op-count diff %s", p.__name__, ctx.stage, diff)
    gm.recompile()
    return gm


def dump_graph(ctx: PassContext, name: str, gm: fx.GraphModule) -> None:
    """With ``dump_graphs``: ``gm`` as a graph rewrite outside the pass lists left it (a backend
    stage: outlining, the in-place gathers of a graph lowered whole), numbered in the stage's
    sequence like a pass's dump."""
    if ctx.config.dump_graphs:
        _dump(ctx, name, "after", gm)


def _dump(ctx: PassContext, name: str, when: str, gm: fx.GraphModule, diff: dict | None = None) -> None:
    os.makedirs(ctx.config.dump_graphs, exist_ok=True)
    idx = ctx.dump_counter[(ctx.graph_index, ctx.stage)]
    if when == "after":
        ctx.dump_counter[(ctx.graph_index, ctx.stage)] += 1
    path = os.path.join(ctx.config.dump_graphs, f"g{ctx.graph_index}_{ctx.stage}_{idx:02d}_{name}_{when}.txt")
    with open(path, "w") as f:
        f.write(gm.print_readable(print_output=False, include_stride=False, include_device=False))
        tags = [f"#   {n.name}: {n.meta['recompute'].name} (region {n.meta.get('ac_graph_id')})"
                for n in gm.graph.nodes if "recompute" in n.meta]
        if tags:
            f.write("\n# recompute tags (aot_autograd's partitioner reads them):\n" + "\n".join(tags) + "\n")
        if diff is not None:
            f.write(f"\n# op-count diff: {diff}\n")
