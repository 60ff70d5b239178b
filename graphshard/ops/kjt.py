"""The KeyedJaggedTensor ops of the sharded lookup program, from fbgemm or in plain torch.

The program (``program.py``, ``sequence.py``) reorders and splits a KJT's ids with three ops,
which fbgemm provides (``permute_2D_sparse_data``, ``block_bucketize_sparse_features``,
``asynchronous_complete_cumsum``) for the devices its build has kernels for: its CPU build, the
one this project installs, has no CUDA kernels, and the GPU machine has no fbgemm at all. So
graphshard has its own, in torch, with fbgemm's semantics:

- ``graphshard::kjt_permute``: features ``permute`` (repeats allowed) of a ``[features, batch]``
  lengths table, with their ids and weights;
- ``graphshard::kjt_bucketize``: each id sent to the row block (bucket) that holds it and made
  local to it, the lengths ``[buckets * features * batch]`` bucket-major; with ``sequence``, the
  permutation back to the ids' order;
- the complete cumulative sum of lengths (offsets) is one ``cumsum`` in the graph.

The first two are graph ops (their output sizes depend on the ids: the fake impls give unbacked
sizes, as fbgemm's do), implemented with torch ops on whatever device the ids are on, and run
eagerly inside the compiled program like fbgemm's. ``kjt_ops(kernel)`` picks the set a
collection's program uses: fbgemm's beside fbgemm's TBE (``kernel="fbgemm"``, CPU), graphshard's
beside the Triton TBE (``kernel="triton"``): that program never imports fbgemm.
"""

from __future__ import annotations

import torch

lib = torch.library.Library("graphshard", "FRAGMENT")
lib.define("kjt_permute(Tensor permute, Tensor lengths, Tensor values, Tensor? weights=None, SymInt? total=None) "
           "-> (Tensor, Tensor, Tensor?)")
lib.define("kjt_bucketize(Tensor lengths, Tensor indices, Tensor block_sizes, int buckets, Tensor? weights=None, "
           "bool sequence=False) -> (Tensor, Tensor, Tensor?, Tensor?)")


def _segments(lengths: torch.Tensor, total: int) -> torch.Tensor:
    """The segment (0 .. lengths.numel() - 1) each of ``total`` items belongs to."""
    return torch.repeat_interleave(torch.arange(lengths.numel(), device=lengths.device), lengths, output_size=total)


def _exclusive_cumsum(x: torch.Tensor) -> torch.Tensor:
    return x.cumsum(0) - x


def _kjt_permute(permute, lengths, values, weights=None, total=None):
    """``lengths[permute]`` (``[len(permute), batch]``) and the selected features' ids (and
    weights), feature after feature in ``permute``'s order."""
    per_feature = lengths.sum(1)
    starts = _exclusive_cumsum(per_feature)
    index = permute.long()
    picked = per_feature[index]
    n = int(picked.sum()) if total is None else int(total)
    segment = _segments(picked, n)  # the output feature each selected id belongs to
    within = torch.arange(n, device=values.device) - _exclusive_cumsum(picked)[segment]
    positions = starts[index][segment] + within
    return (lengths.index_select(0, index), values.index_select(0, positions),
            weights.index_select(0, positions) if weights is not None else None)


def _kjt_permute_fake(permute, lengths, values, weights=None, total=None):
    n = torch.library.get_ctx().new_dynamic_size() if total is None else total
    return (lengths.new_empty(permute.shape[0], lengths.shape[1]), values.new_empty(n),
            weights.new_empty(n) if weights is not None else None)


def _kjt_bucketize(lengths, indices, block_sizes, buckets, weights=None, sequence=False):
    """fbgemm's ``block_bucketize_sparse_features`` (no positions, one batch size): id ``i`` of a
    feature with blocks of ``b`` rows goes to bucket ``i // b`` as ``i % b`` (an id past the last
    block, ``i >= b * buckets``, to bucket ``i % buckets`` as ``i // buckets``, as fbgemm does); a
    bucket's ids keep their order. Returns the lengths ``[buckets * features * batch]``, the ids,
    the weights, and with ``sequence`` the position in the output of each input id."""
    bags, n = lengths.numel(), indices.numel()
    batch = bags // block_sizes.numel()
    bag = _segments(lengths, n)
    block = block_sizes.to(indices.dtype)[bag // batch]
    inside = indices < block * buckets
    bucket = torch.where(inside, indices // block, indices % buckets)
    local = torch.where(inside, indices % block, indices // buckets)
    key = bucket.long() * bags + bag
    new_lengths = torch.zeros(buckets * bags, dtype=lengths.dtype, device=lengths.device)
    new_lengths.index_add_(0, key, torch.ones_like(key, dtype=lengths.dtype))
    order = torch.sort(key, stable=True).indices
    position = None
    if sequence:
        position = torch.empty_like(order).index_copy_(0, order, torch.arange(n, device=order.device))
    return (new_lengths, local.index_select(0, order),
            weights.index_select(0, order) if weights is not None else None, position)


def _kjt_bucketize_fake(lengths, indices, block_sizes, buckets, weights=None, sequence=False):
    n = indices.shape[0]
    return (lengths.new_empty(buckets * lengths.shape[0]), indices.new_empty(n),
            weights.new_empty(n) if weights is not None else None,
            indices.new_empty(n, dtype=torch.int64) if sequence else None)


for _name, _impl, _fake in (("kjt_permute", _kjt_permute, _kjt_permute_fake),
                            ("kjt_bucketize", _kjt_bucketize, _kjt_bucketize_fake)):
    torch.library.impl(lib, _name, "CompositeExplicitAutograd")(_impl)
    torch.library.register_fake(f"graphshard::{_name}")(_fake)


class KJTOps:
    """One implementation of the program's three KJT ops (``kjt_ops`` picks it)."""

    def __init__(self, fbgemm: bool):
        self.fbgemm = fbgemm
        if fbgemm:
            import fbgemm_gpu  # noqa: F401  (registers torch.ops.fbgemm)

    def permute(self, index: torch.Tensor, lengths2d: torch.Tensor, values: torch.Tensor,
                weights: torch.Tensor | None, total=None):
        """(lengths ``[len(index), batch]``, ids, weights) of the KJT's features ``index``."""
        if self.fbgemm:
            return torch.ops.fbgemm.permute_2D_sparse_data(index, lengths2d, values, weights, total)
        return torch.ops.graphshard.kjt_permute(index, lengths2d, values, weights, total)

    def bucketize(self, lengths: torch.Tensor, values: torch.Tensor, block_sizes: torch.Tensor, buckets: int,
                  weights: torch.Tensor | None, sequence: bool = False):
        """(lengths ``[buckets * features * batch]``, local ids, weights, position of each input id
        in the output (``sequence``; else None))."""
        if self.fbgemm:  # fbgemm wants the block sizes in the ids' dtype (TorchRec's datasets give int32 ids)
            bl, bv, bw, _, position = torch.ops.fbgemm.block_bucketize_sparse_features(
                lengths, values, False, sequence, block_sizes.to(values.dtype), buckets, weights)
            return bl, bv, bw, position
        return torch.ops.graphshard.kjt_bucketize(lengths, values, block_sizes, buckets, weights, sequence)

    def offsets(self, lengths: torch.Tensor) -> torch.Tensor:
        """``[0, l0, l0 + l1, ...]``: the bags' offsets of ``lengths``."""
        if self.fbgemm:
            return torch.ops.fbgemm.asynchronous_complete_cumsum(lengths)
        return torch.cat([lengths.new_zeros(1), lengths.cumsum(0, dtype=lengths.dtype)])


def kjt_ops(kernel: str) -> KJTOps:
    """The KJT ops of a collection whose TBE kernel is ``kernel`` ("fbgemm" or "triton")."""
    return KJTOps(fbgemm=kernel == "fbgemm")
