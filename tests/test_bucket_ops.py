"""The ops around a unit's gradient reduction (``graphshard::pack_grads``,
``graphshard::pack_grads_peers``, ``graphshard::unpack_reduced``): their layout against a hand-written torch reference, with
sizes that are no multiples of 4, 8 or 16, eagerly and under Inductor.

``unpack_reduced``'s outputs are new tensors, as its fake impl says: Inductor assumes such
outputs start at an aligned address (and checks it in the code it generates), which views of
one bucket at a parameter's odd offset broke (whole-graph lowering of a Linear(7, 13) failed
with "Expect the tensor to be 16 bytes aligned"; ``tests/test_multirank.py``'s ``odd`` cases
train through it).
"""

from __future__ import annotations

import pytest
import torch

from graphshard.ops import ops

SIZES = [(13, 7), (13,), (5, 13), (5,), (1,)]  # a Linear(7, 13), a Linear(13, 5), a one-element parameter


def _chunks(g: torch.Tensor, world: int) -> list[torch.Tensor]:
    """DTensor's Shard(0) pieces of ``g``, each padded with zeros to the first one's rows (plain torch)."""
    rows = -(-g.shape[0] // world)
    padded = torch.cat([g, g.new_zeros(rows * world - g.shape[0], *g.shape[1:])])
    return list(padded.reshape(world, -1))


@pytest.mark.parametrize("world", [2, 3])
def test_pack_grads_is_rank_major(world):
    torch.manual_seed(0)
    grads = [torch.randn(s) for s in SIZES]
    numels = [-(-s[0] // world) * (s[1] if len(s) > 1 else 1) for s in SIZES]
    buf = ops.pack_grads(grads, world, numels, torch.float32).view(world, -1)
    for r in range(world):
        expected = torch.cat([_chunks(g, world)[r] for g in grads])
        assert torch.equal(buf[r], expected), r


@pytest.mark.parametrize("world", [2, 3, 4])
def test_pack_grads_peers_splits_off_this_ranks_row(world):
    # gloo's all-to-all form: the other ranks' rows in rank order (what this rank sends), and
    # its own row (what it keeps), each padded as DTensor's Shard(0) pieces
    torch.manual_seed(0)
    grads = [torch.randn(s) for s in SIZES]
    numels = [-(-s[0] // world) * (s[1] if len(s) > 1 else 1) for s in SIZES]
    for rank in range(world):
        peers, own = ops.pack_grads_peers(grads, world, rank, numels, torch.float32)
        rows = [torch.cat([_chunks(g, world)[r] for g in grads]) for r in range(world)]
        assert torch.equal(own, rows[rank]), rank
        assert torch.equal(peers.view(world - 1, -1), torch.stack(rows[:rank] + rows[rank + 1:])), rank
        assert peers.untyped_storage().data_ptr() != own.untyped_storage().data_ptr(), "two buffers"


def test_unpack_reduced_averages_the_kept_row_in():
    # the received rows (world - 1 of them) and the row this rank kept: the mean of all world
    numels, keep = [49, 7, 39, 3], [49, 6, 39, 2]
    starts = [sum(numels[:i]) for i in range(len(numels))]
    torch.manual_seed(0)
    recv, own = torch.randn(3, sum(numels)), torch.randn(sum(numels))
    mean = torch.cat([recv, own[None]]).mean(0)
    expected = [mean[s:s + k] for s, k in zip(starts, keep)]

    def cut(b, o):
        return ops.unpack_reduced(b.view(-1), 3, numels, keep, o)

    for got in (cut(recv, own), torch.compile(cut, backend="inductor", fullgraph=True)(recv, own)):
        for g, e in zip(got, expected):
            assert torch.isfinite(g).all()
            torch.testing.assert_close(g, e, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_unpack_reduced_with_odd_sizes(dtype):
    # rows=3: an all-to-all's result (each row one rank's copy of this rank's shard), averaged
    # here; rows=1: a reduce-scatter's, copied
    numels, keep = [49, 7, 39, 3], [49, 6, 39, 2]
    starts = [sum(numels[:i]) for i in range(len(numels))]
    tol = dict(rtol=1e-2, atol=1e-2) if dtype == torch.bfloat16 else dict(rtol=1e-6, atol=1e-6)
    for rows in (3, 1):
        buf = torch.randn(rows, sum(numels)).to(dtype)
        mean = buf.float().mean(0).to(dtype)
        expected = [mean[s:s + k] * 2 for s, k in zip(starts, keep)]

        def cut(b):
            return [p * 2 for p in ops.unpack_reduced(b.view(-1), rows, numels, keep)]

        eager = ops.unpack_reduced(buf.view(-1), rows, numels, keep)
        storages = {p.untyped_storage().data_ptr() for p in eager}
        assert len(storages) == len(eager) and all(p.storage_offset() == 0 for p in eager), "new tensors"
        for got in (cut(buf), torch.compile(cut, backend="inductor", fullgraph=True)(buf)):
            assert len(got) == len(expected)
            for g, e in zip(got, expected):
                assert g.dtype == dtype and torch.isfinite(g.float()).all()
                torch.testing.assert_close(g, e, **tol)
