"""Random draws that follow placements: each rank computes its part of the LOGICAL random tensor.

The rule (the one DTensor's RNG tracker keeps): a value replicated over a model-parallel mesh
axis gets the same random values on every rank of that axis; a value sharded over it gets
independent values per shard; each data-parallel rank keeps its own stream.

graphshard keeps it with a counter-based generator instead of a generator state per rank:
``graphshard::random_bits`` gives 32 random bits per element that are a pure function of

- the call's *key*, a graph input: seeded once per compiled graph, at its first call, from the
  default generator of the first rank of the model-parallel group (a broadcast), new per call,
  so every rank of a model-parallel group sees the same key and each data-parallel rank the
  key of its own group (its own stream);
- the random op's number in the graph (its *salt*);
- the element's linear index in the logical (single-device) tensor.

A rank holding a shard computes the logical indices of its elements from its coordinate on
the sharding axis (a graph input, so the code is the same on every rank and the regional
lowering shares it), so every shard gets exactly the logical tensor's values for its part:
replicated values agree, shards never repeat each other, and a sharded program draws the same
values as the same program on one rank. The values are a function of the inputs, not of a
generator's state, so a recompute in the backward (resharding after forward, activation
checkpointing) sees the forward's values whatever the partitioner decides.

The bits come from two rounds of a 32-bit integer hash (Wellons' "lowbias32" constants, from
his hash-prospector, public domain) over (key, salt, index), written with int64 ATen ops whose
products stay below 2**63 (no overflow anywhere), so Inductor fuses them into the consumer's
kernel on any backend and eager mode computes the same bits. It is a statistical generator for
dropout masks and noise, not a cryptographic one (tests/test_localize_random.py checks
uniformity and independence).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.distributed as dist

from graphshard import _compat

lib = torch.library.Library("graphshard", "FRAGMENT")
lib.define("random_bits(Tensor key, Tensor[] coords, int salt, SymInt[] size, SymInt[] logical_size, "
           "int[] shards) -> Tensor")

_M32 = 0xFFFFFFFF
_M64 = 0xFFFFFFFFFFFFFFFF
_C1, _C2 = 0x21F0AAAD, 0x735A2D97  # lowbias32's multipliers; both < 2**31, so x * C < 2**63 for x < 2**32


def mix32(x):
    """A 32-bit integer hash (lowbias32) of ``x`` in [0, 2**32): a Python int or an int64 tensor."""
    x = x ^ (x >> 16)
    x = (x * _C1) & _M32
    x = x ^ (x >> 15)
    x = (x * _C2) & _M32
    return x ^ (x >> 15)


def random_bits(key: torch.Tensor, coords: Sequence[torch.Tensor], salt: int, size: Sequence[int],
                logical_size: Sequence[int], shards: Sequence[int]) -> torch.Tensor:
    """int64 values in [0, 2**32), of shape ``size``: the bits of this rank's part of the logical
    tensor of shape ``logical_size`` for random op ``salt`` under the call's ``key``.

    ``shards`` holds one (dim, coordinate index, chunk, split factor) quadruple per sharded
    dim: the dim holds, ``split factor`` times over, this rank's piece of ``chunk`` elements per
    rank (torch.chunk layout) starting at ``coords[coordinate index] * chunk``.
    """
    index = logical_index(coords, size, logical_size, shards, key.device)
    a, b = _op_keys(key, salt)
    return mix32(mix32(((index & _M32) + a) & _M32) ^ (index >> 32) ^ b)


def _op_keys(key: torch.Tensor, salt: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Two 32-bit keys for op ``salt`` under the call's 63-bit ``key``, each a function of all of
    the key's bits and the salt, neither a function of the other (so no element's bits are the
    same under every key). The constants are SHA-256's first initial hash words."""
    lo, hi = key & _M32, key >> 32
    s = mix32((salt * 0x9E3779B9 + 1) & _M32)
    a = mix32(mix32(lo ^ 0x6A09E667) ^ hi ^ s)
    b = mix32(mix32(hi ^ 0xBB67AE85) ^ lo ^ s ^ 0x3C6EF372)
    return a, b


def logical_index(coords, size, logical_size, shards, device) -> torch.Tensor:
    """The linear index in the logical (contiguous) tensor of every element of this rank's part."""
    sharded = {shards[i]: tuple(shards[i + 1:i + 4]) for i in range(0, len(shards), 4)}
    n = len(size)
    index = torch.zeros((), dtype=torch.int64, device=device)
    stride = 1
    for d in reversed(range(n)):
        j = torch.arange(size[d], dtype=torch.int64, device=device)
        if d in sharded:
            coord, chunk, factor = sharded[d]
            start = coords[coord] * chunk
            if factor == 1:
                j = j + start
            elif size[d] > 0:  # ``factor`` blocks of the local piece, each within a block of logical_size // factor
                piece, block = size[d] // factor, logical_size[d] // factor
                j = (j // piece) * block + j % piece + start
        index = index + (j * stride).view([-1] + [1] * (n - 1 - d))
        stride = stride * logical_size[d]
    return index


@torch.library.impl(lib, "random_bits", "CompositeExplicitAutograd")
def _random_bits_eager(key, coords, salt, size, logical_size, shards):
    return random_bits(key, coords, salt, size, logical_size, shards)


@torch.library.register_fake("graphshard::random_bits")
def _random_bits_fake(key, coords, salt, size, logical_size, shards):
    return key.new_empty(size)


def decompositions() -> dict:
    """aot_autograd decomposes ``random_bits`` into its ATen ops (fused by Inductor)."""
    return {torch.ops.graphshard.random_bits.default: random_bits}


# --------------------------------------------------------------------------------------------
# Run time: the key and coordinate inputs of a graph with rewritten random ops.
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RandomDraws:
    """What ``localize_random`` rewrote in a graph, and what the graph then reads per call."""

    device: torch.device
    """Where the random values are made (the key and coordinate inputs live there)."""
    agree_over: tuple[str, ...]
    """The model-parallel axes: every rank of a group spanning them uses the same key."""
    coord_axes: tuple[str, ...]
    """The axes whose coordinate is a graph input, in input order (those that shard a draw)."""
    count: int
    """How many random ops now draw by logical index."""


class KeyStream:
    """The per-call inputs of one compiled graph: a fresh key, then this rank's coordinates.

    At the graph's first call the base seed is drawn from this rank's default (CPU) generator,
    so it follows the user's ``torch.manual_seed`` (and advances that generator by one draw, as
    the first random op of an eager step would), and broadcast over each model-parallel axis
    from its first rank: every rank of a model-parallel group then holds the seed of the group's
    first rank, and each data-parallel rank (another group) keeps its own. Not at compile time:
    dynamo restores torch's RNG state after each compile, so two graphs of one model (a graph
    break) would draw the same seed. The first call is collective over those groups; every rank
    of them runs the graph (SPMD), so every rank reaches it.
    """

    def __init__(self, draws: RandomDraws, coords: Sequence[int], groups: Sequence[dist.ProcessGroup],
                 comm_device: torch.device):
        self._groups, self._comm_device = list(groups), comm_device
        self._coords = [torch.full((), c, dtype=torch.int64, device=draws.device) for c in coords]
        self._device = draws.device
        self._calls = itertools.count()
        self.base: int | None = None

    def _agree(self) -> int:
        with _compat.outside_fake_mode():
            seed = torch.randint(0, 2**62, (), dtype=torch.int64).to(self._comm_device)
            for group in self._groups:
                dist.broadcast(seed, group=group, group_src=0)
            return int(seed.item())

    def key(self, call: int) -> int:
        """The key of call number ``call``: SplitMix64 of the stream position, 63 bits."""
        x = (self.base + (call + 1) * 0x9E3779B97F4A7C15) & _M64
        x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
        x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
        return (x ^ (x >> 31)) >> 1

    def __call__(self) -> list[torch.Tensor]:
        if self.base is None:
            self.base = self._agree()
        key = torch.full((), self.key(next(self._calls)), dtype=torch.int64, device=self._device)
        return [key, *self._coords]
