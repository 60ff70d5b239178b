"""TorchRec's ``DistributedModelParallel``, compiled by graphshard.

Switch one import and keep the TorchRec model, plan and training loop::

    from graphshard.frontends.model_parallel import DistributedModelParallel as DMP
    model = DMP(dlrm, env=ShardingEnv.from_process_group(pg), device=torch.device("cpu"), plan=plan,
                sharders=[EmbeddingBagCollectionSharder(fused_params={"optimizer": EmbOptimType.EXACT_SGD,
                                                                      "learning_rate": 0.1})])

Plans, sharders, ``ShardingEnv`` and ``KeyedJaggedTensor`` are TorchRec's own types
(TorchRec is an optional dependency: ``pip install graphshard[torchrec]``). TorchRec's training
pipelines drive the DMP as they are; ``TrainPipelineSparseDist`` here takes the same arguments and
also exchanges the next batch's ids while a step runs, as TorchRec's does for its own DMP.
"""

from graphshard.frontends.model_parallel._dmp import DistributedModelParallel, FullyShardDense
from graphshard.frontends.model_parallel._pipeline import TrainPipelineSparseDist
from graphshard.planning.embedding_planner import EmbeddingShardingPlanner

__all__ = ["DistributedModelParallel", "EmbeddingShardingPlanner", "FullyShardDense", "TrainPipelineSparseDist"]
