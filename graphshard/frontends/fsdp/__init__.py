"""torch's FSDP1 API (``torch.distributed.fsdp.FullyShardedDataParallel``), compiled by graphshard.

Switch one import and keep the training and checkpointing code::

    from graphshard.frontends.fsdp import FullyShardedDataParallel as FSDP, ShardingStrategy, MixedPrecision
    from graphshard.frontends.fsdp.wrap import ModuleWrapPolicy

The configuration types are torch's own (``ShardingStrategy``, ``MixedPrecision``,
``StateDictType``, ...), so code that builds them from ``torch.distributed.fsdp`` works too.
"""

from torch.distributed.fsdp import (
    BackwardPrefetch,
    CPUOffload,
    FullOptimStateDictConfig,
    FullStateDictConfig,
    LocalOptimStateDictConfig,
    LocalStateDictConfig,
    MixedPrecision,
    OptimStateKeyType,
    ShardedOptimStateDictConfig,
    ShardedStateDictConfig,
    ShardingStrategy,
    StateDictSettings,
    StateDictType,
)

from graphshard.frontends.fsdp import wrap
from graphshard.frontends.fsdp._wrapper import FullyShardedDataParallel

__all__ = [
    "FullyShardedDataParallel",
    "ShardingStrategy",
    "BackwardPrefetch",
    "MixedPrecision",
    "CPUOffload",
    "StateDictType",
    "FullStateDictConfig",
    "ShardedStateDictConfig",
    "LocalStateDictConfig",
    "FullOptimStateDictConfig",
    "ShardedOptimStateDictConfig",
    "LocalOptimStateDictConfig",
    "StateDictSettings",
    "OptimStateKeyType",
    "wrap",
]
