"""graphshard: a sharding compiler for PyTorch training.

``graphshard.compile(model, plan)`` shards a model's parameters over a
DeviceMesh and compiles forward and backward into per-rank programs with the
collectives the plan implies, scheduled to overlap compute, lowered by Inductor.

The frontends live in ``graphshard/frontends/``; their public import paths are
``graphshard.fsdp``, ``graphshard.tensor_parallel`` and ``graphshard.model_parallel``.
"""

import sys as _sys

from graphshard.api import compile, explain, shard
from graphshard.checkpointing import Checkpoint
from graphshard.compiler.collective_check import CollectiveMismatch
from graphshard.compiler.grad_sync import no_sync
from graphshard.config import CompileConfig
from graphshard.frontends import fsdp, model_parallel, tensor_parallel
from graphshard.plan import FullyShard, Plan, Replicate, ShardEmbedding, ShardParams, StridedShard
from graphshard.planning.auto_plan import auto_plan

# ``import graphshard.fsdp.wrap`` finds the frontend's modules themselves (one module object per
# file, so classes and isinstance checks are shared), not copies loaded under a second name.
for _name in [n for n in _sys.modules if n.startswith("graphshard.frontends.")]:
    _sys.modules["graphshard." + _name.removeprefix("graphshard.frontends.")] = _sys.modules[_name]
del _name

__all__ = ["Plan", "Checkpoint", "FullyShard", "Replicate", "ShardParams", "StridedShard", "ShardEmbedding", "CompileConfig", "shard",
           "compile", "explain", "no_sync", "auto_plan", "fsdp", "tensor_parallel", "model_parallel",
           "CollectiveMismatch"]
