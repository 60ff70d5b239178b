"""Mesh axes as c10d sees them, the sizes of a sharded dim's pieces, and the key -> parameter map
that only the eager implementations of the marker ops read (`graphshard.sharding` holds the rest)."""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass


@dataclass(frozen=True)
class AxisGroup:
    """One mesh axis as c10d sees it."""

    name: str
    group_name: str
    world: int
    rank: int
    backend: str = ""
    """The c10d backend that runs this axis's collectives on the mesh's device ("gloo", "nccl", ...)."""
    collectives: str = "auto"
    """The plan's choice of collective forms (`Plan`'s ``collectives``): ``"auto"`` picks them by
    ``backend``; ``"nccl"`` uses NCCL's forms whatever the backend."""

    @property
    def _gloo_forms(self) -> bool:
        return self.backend == "gloo" and self.collectives == "auto"

    @property
    def scatter_by_all_to_all(self) -> bool:
        """Lower a reduce-scatter as an all-to-all and a local sum of the received rows.

        gloo has no reduce-scatter of its own: c10d runs it as an all-reduce of the whole
        buffer, which moves twice the bytes a reduce-scatter needs and costs twice the CPU.
        An all-to-all moves exactly a reduce-scatter's bytes (see docs/design/collectives.md)."""
        return self._gloo_forms

    @property
    def gather_coalesced(self) -> bool:
        """Gather a unit's parameters with one coalesced all-gather (an output per parameter)
        instead of a packed bucket, an all-gather into one buffer and a copy-out.

        gloo's all-gather into one tensor is not zero-copy: its worker thread gathers into a
        flat temporary of the whole result and copies it out, so the bucket path copies the
        gathered bytes twice after the transfer. The coalesced all-gather's worker copies
        them once, straight into each parameter's output, and reads the shards in place
        (see docs/design/collectives.md). NCCL gathers in place: one bucket is its fastest form."""
        return self._gloo_forms


def local_size(n: int, placement, world: int, rank: int) -> int:
    """Size of ``rank``'s piece of a dim of size ``n`` sharded by ``placement`` (a ``Shard``, or a
    ``StridedShard``: its piece of each of the ``split_factor`` blocks)."""
    blocks = getattr(placement, "split_factor", 1)
    return blocks * chunk_size(n // blocks, world, rank)


def chunk_size(n: int, world: int, rank: int) -> int:
    """Size of ``rank``'s piece when ``n`` is split as ``torch.chunk`` (and DTensor's Shard) split it."""
    c = math.ceil(n / world) if n else 0
    return max(0, min(c, n - c * rank))


_KEYS: "weakref.WeakValueDictionary[str, object]" = weakref.WeakValueDictionary()


def remember(key: str, obj) -> None:
    """Makes ``obj`` (a `graphshard.sharding.ShardedParam` or a
    `graphshard.sparse.collection.SparseCollection`) resolvable by its key while it lives."""
    _KEYS[key] = obj


def resolve(key: str):
    """The parameter or embedding collection a marker's key names. For the eager implementations
    of graphshard's marker ops, and for a graph compiled by backend name (which is bound to no
    model): a compile reads its parameters from the model it is bound to."""
    try:
        return _KEYS[key]
    except KeyError:
        raise ValueError(
            f"graphshard key {key!r} is unknown: the model it belonged to was freed or never sharded"
        ) from None
