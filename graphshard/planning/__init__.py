"""Planning: choosing a layout before anything is sharded.

- `auto_plan`: dense units and embedding tables placed together in one memory budget
  (``graphshard.auto_plan``).
- `embedding_planner`: TorchRec's ``EmbeddingShardingPlanner`` API over graphshard's cost model
  (``graphshard.model_parallel.EmbeddingShardingPlanner``).
- `cost`: the cost model both use (docs/cost-model.md).
"""
