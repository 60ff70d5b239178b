"""The wrapper APIs people already train with, as frontends of the one compiler: each builds a
``Plan`` and a ``CompileConfig`` and calls ``graphshard.api.compile_sharded``.

- ``fsdp``: torch's FSDP1 ``FullyShardedDataParallel`` and its wrapping policies;
- ``tensor_parallel``: ``parallelize_module`` with torch's styles, and ``loss_parallel``;
- ``model_parallel``: TorchRec's ``DistributedModelParallel`` and its planner.

Their public import paths are ``graphshard.fsdp``, ``graphshard.tensor_parallel`` and
``graphshard.model_parallel`` (``graphshard/__init__.py`` names them).
"""
