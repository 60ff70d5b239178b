"""tag_resharding: reshard after forward, as a recompute policy.

FULL_SHARD units (``reshard_after_forward=True``) free their gathered
parameters after forward and gather them again in backward: their ``unshard``
nodes are tagged ``MUST_RECOMPUTE``. SHARD_GRAD_OP units keep them: tagged
``MUST_SAVE``. aot_autograd copies the tag onto every node it traces the
``unshard`` into (all-gather, wait, casts, views), and the min-cut partitioner
honours it, so the backward graph re-issues exactly the FULL_SHARD all-gathers.

The root unit (plan key ``""``) keeps its parameters whatever its spec says
(`ShardedParam.reshard_after_forward`), as
FSDP2's root does: the backward starts with the layers that ran last in the
forward, typically the root's (the output head, a tied embedding), so resharding
it would only gather it again at once, an all-gather with nothing to hide under.
"""

from __future__ import annotations

import torch.fx as fx
from torch.utils.checkpoint import CheckpointPolicy

from graphshard.passes.bucket_collectives import unshard_units
from graphshard.passes.context import PassContext


def tag_resharding(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    for graph_id, (unit, nodes) in enumerate(unshard_units(gm, ctx).items()):
        info = ctx.params[nodes[0].args[1][0]]
        if info.shard is None:
            continue  # replicated units gather nothing
        policy = CheckpointPolicy.MUST_RECOMPUTE if info.reshard_after_forward else CheckpointPolicy.MUST_SAVE
        for node in nodes:
            node.meta["recompute"] = policy
            node.meta["ac_graph_id"] = graph_id
            node.meta.setdefault("custom", {})["graphshard_unit"] = unit
            for user in node.users:
                user.meta["recompute"] = policy
                user.meta["ac_graph_id"] = graph_id
    return gm
