"""graphshard: a sharding compiler for PyTorch training.

``graphshard.compile(model, plan)`` shards a model's parameters over a
DeviceMesh and compiles forward and backward into per-rank programs with the
collectives the plan implies, scheduled to overlap compute, lowered by Inductor.
"""

from graphshard.api import compile, explain, shard
from graphshard.planning.auto_plan import auto_plan
from graphshard.config import CompileConfig
from graphshard.grad_sync import no_sync
from graphshard.plan import FullyShard, Plan, Replicate, ShardEmbedding, ShardParams, StridedShard

__all__ = ["Plan", "FullyShard", "Replicate", "ShardParams", "StridedShard", "ShardEmbedding", "CompileConfig", "shard",
           "compile", "explain", "no_sync", "auto_plan"]
