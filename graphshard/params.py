"""Per-parameter facts shared by storage, ops and passes.

Every sharded parameter has a `ParamInfo` in a process-wide registry, keyed by a
string that the graph ops carry (``"<model id>/<canonical fqn>"``), so a graph
node can name its parameter without holding Python objects.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Placement, Shard

from graphshard.plan import FullyShard, ParamLayout, StridedShard


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
        An all-to-all moves exactly a reduce-scatter's bytes (see docs/design.md)."""
        return self._gloo_forms

    @property
    def gather_coalesced(self) -> bool:
        """Gather a unit's parameters with one coalesced all-gather (an output per parameter)
        instead of a packed bucket, an all-gather into one buffer and a copy-out.

        gloo's all-gather into one tensor is not zero-copy: its worker thread gathers into a
        flat temporary of the whole result and copies it out, so the bucket path copies the
        gathered bytes twice after the transfer. The coalesced all-gather's worker copies
        them once, straight into each parameter's output, and reads the shards in place
        (see docs/design.md). NCCL gathers in place: one bucket is its fastest form."""
        return self._gloo_forms


@dataclass(frozen=True)
class ParamInfo:
    key: str
    fqn: str
    layout: ParamLayout
    logical_shape: tuple[int, ...]
    dtype: torch.dtype
    mesh: DeviceMesh
    shard: AxisGroup | None            # data-parallel axis the parameter is sharded over (FullyShard)
    replicate: tuple[AxisGroup, ...]   # data-parallel axes it is replicated over (grads all-reduced)
    model_parallel: tuple[tuple[AxisGroup, Placement], ...]  # model-parallel axes and placements

    # ---- data-parallel storage (the tensor as seen before the dp all-gather) ----
    @property
    def dp_full_shape(self) -> tuple[int, ...]:
        """Shape after the data-parallel gather: logical, with model-parallel sharding applied."""
        shape = list(self.logical_shape)
        for axis, pl in self.model_parallel:
            if isinstance(pl, (Shard, StridedShard)):
                shape[pl.dim] = local_size(shape[pl.dim], pl, axis.world, axis.rank)
        return tuple(shape)

    @property
    def chunk_rows(self) -> int:
        """Rows of dim 0 per data-parallel shard, padded (torch.chunk semantics)."""
        assert self.shard is not None
        return math.ceil(self.dp_full_shape[0] / self.shard.world) if self.dp_full_shape else 1

    @property
    def row_numel(self) -> int:
        return math.prod(self.dp_full_shape[1:])

    @property
    def local_rows(self) -> int:
        assert self.shard is not None
        return chunk_size(self.dp_full_shape[0], self.shard.world, self.shard.rank)

    @property
    def param_dtype(self) -> torch.dtype:
        spec = self.layout.unit_spec
        return (spec.param_dtype if spec is not None else None) or self.dtype

    @property
    def reduce_dtype(self) -> torch.dtype:
        spec = self.layout.unit_spec
        return (spec.reduce_dtype if spec is not None else None) or self.param_dtype

    @property
    def reshard_after_forward(self) -> bool:
        """Whether the gathered parameter is freed after forward and gathered again in backward:
        FULL_SHARD, except in the root unit (``""``), which keeps it whatever its spec says, as
        FSDP2's root does (the backward needs the root's output head first)."""
        spec = self.layout.unit_spec
        return isinstance(spec, FullyShard) and spec.reshard_after_forward and self.layout.unit != ""


def local_size(n: int, placement, world: int, rank: int) -> int:
    """Size of ``rank``'s piece of a dim of size ``n`` sharded by ``placement`` (a ``Shard``, or a
    ``StridedShard``: its piece of each of the ``split_factor`` blocks)."""
    blocks = getattr(placement, "split_factor", 1)
    return blocks * chunk_size(n // blocks, world, rank)


def chunk_size(n: int, world: int, rank: int) -> int:
    """Size of ``rank``'s piece when ``n`` is split as ``torch.chunk`` (and DTensor's Shard) split it."""
    c = math.ceil(n / world) if n else 0
    return max(0, min(c, n - c * rank))


_REGISTRY: "weakref.WeakValueDictionary[str, ParamInfo]" = weakref.WeakValueDictionary()
_KEEPALIVE: dict[int, list[ParamInfo]] = {}


def register(infos: list[ParamInfo], owner: object) -> None:
    """Registers ``infos`` for as long as ``owner`` (the sharded model) lives."""
    _KEEPALIVE[id(owner)] = infos
    weakref.finalize(owner, _KEEPALIVE.pop, id(owner), None)
    for info in infos:
        _REGISTRY[info.key] = info


def lookup(key: str) -> ParamInfo:
    try:
        return _REGISTRY[key]
    except KeyError:
        raise ValueError(
            f"graphshard parameter {key!r} is unknown: the model it belonged to was freed or never sharded"
        ) from None
