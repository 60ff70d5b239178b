"""Every ``graphshard::`` custom op, by family.

- ``dense``: the parameter marker (``param``, ``unshard``) and the collectives the passes insert,
  with their autograd formulas and decompositions into ``_c10d_functional`` collectives;
- ``rng``: ``random_bits``, the counter-based draws that follow placements;
- ``sparse``: the logical embedding lookups (``embedding_bags``, ``embedding_seqs``),
  ``scale_grad`` and ``check_ids``;
- ``region``: the placeholder of a repeated block's call while the backend traces to ATen;
- ``kjt``: the KeyedJaggedTensor permute and bucketize of the sharded lookup program;
- ``tbe_fbgemm``: fbgemm's CPU table-batched embedding with the optimizer fused into its backward;
- ``tbe_triton``: graphshard's Triton TBE (imported on demand: it needs Triton, and on the CPU
  ``TRITON_INTERPRET=1`` before it is imported).

Importing this package registers every family but ``tbe_triton``. ``ops`` is the op namespace
(``torch.ops.graphshard``).
"""

import torch

from graphshard.ops import dense, kjt, region, rng, sparse, tbe_fbgemm  # noqa: F401  (register the ops)

ops = torch.ops.graphshard
