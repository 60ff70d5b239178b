"""Names and shard helpers shared by graphshard's ``FullyShardedDataParallel`` and its state-dict
and optimizer-state methods."""

from __future__ import annotations

import torch

from graphshard.ops.dense import local_chunk
from graphshard.sharding import ShardedParam

WRAPPED = "_fsdp_wrapped_module"
"""The attribute a wrapper holds its module under (torch's name, so FQNs match)."""


CHECKPOINT_WRAPPED = "_checkpoint_wrapped_module"
"""The attribute torch's ``checkpoint_wrapper`` holds its module under; its state dict leaves it out."""


def clean_fqn(fqn: str) -> str:
    """``fqn`` without the wrappers' ``_fsdp_wrapped_module.`` and ``_checkpoint_wrapped_module.``
    components (the user's FQN, as torch's FSDP1 and ``checkpoint_wrapper`` name state-dict keys)."""
    for name in (WRAPPED, CHECKPOINT_WRAPPED):
        fqn = fqn.replace(name + ".", "").replace("." + name, "").replace(name, "")
    return fqn


def local_of_full(full: torch.Tensor, info: ShardedParam) -> torch.Tensor:
    """This rank's shard of a full (logical) parameter, as graphshard stores it."""
    assert not info.model_parallel, "graphshard.fsdp shards over data-parallel axes only"
    if info.shard is None:
        return full
    return local_chunk(full, 0, info.shard.world, info.shard.rank)
