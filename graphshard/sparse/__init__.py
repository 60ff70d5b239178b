"""Sharded embeddings: table layouts, the per-rank lookup program, fused fbgemm TBE state.

TorchRec's types (``EmbeddingBagCollection``, ``KeyedJaggedTensor``, sharding plans) are
handled in ``graphshard.sparse.torchrec``; TorchRec is an optional dependency.
"""

from graphshard.sparse.layout import CollectionLayout, TableLayout, TableShard

__all__ = ["CollectionLayout", "TableLayout", "TableShard"]
