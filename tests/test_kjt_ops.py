"""graphshard/ops/kjt.py: graphshard's torch KJT ops against a hand-written reference (plain
Python over lists) and, where fbgemm is installed, against fbgemm's ops they stand in for."""

from __future__ import annotations

import pytest
import torch

from graphshard.ops.kjt import KJTOps

TORCH = KJTOps(fbgemm=False)


def _kjt(gen, features=3, batch=4, rows=20, dtype=torch.int64):
    lengths = torch.randint(0, 4, (features, batch), generator=gen).to(dtype)
    values = torch.randint(0, rows, (int(lengths.sum()),), generator=gen).to(dtype)
    weights = torch.rand(values.shape, generator=gen)
    return lengths, values, weights


def _bags(lengths2d, values):
    """[feature][sample] -> list of ids (the KJT read by hand)."""
    out, at = [], 0
    for f in range(lengths2d.shape[0]):
        row = []
        for n in lengths2d[f].tolist():
            row.append(values[at:at + n].tolist())
            at += n
        out.append(row)
    return out


def _permute_reference(index, lengths2d, values, weights):
    ids, ws = _bags(lengths2d, values), _bags(lengths2d, weights)
    out_l = [[len(b) for b in ids[f]] for f in index]
    out_v = [v for f in index for b in ids[f] for v in b]
    out_w = [w for f in index for b in ws[f] for w in b]
    return out_l, out_v, out_w


def _bucketize_reference(lengths, values, blocks, buckets, weights):
    """fbgemm's block bucketization by hand: per bucket, feature, sample, the ids that go there."""
    features = len(blocks)
    batch = lengths.numel() // features
    ids, ws = _bags(lengths.view(features, batch), values), _bags(lengths.view(features, batch), weights)
    out = [[[[] for _ in range(batch)] for _ in range(features)] for _ in range(buckets)]
    where = []  # per input id: (bucket, feature, sample, index within the output bag)
    for f in range(features):
        for b in range(batch):
            for i, w in zip(ids[f][b], ws[f][b]):
                blk = blocks[f]
                p, local = (i // blk, i % blk) if i < blk * buckets else (i % buckets, i // buckets)
                where.append((p, f, b, len(out[p][f][b])))
                out[p][f][b].append((local, w))
    lengths_out = [len(out[p][f][b]) for p in range(buckets) for f in range(features) for b in range(batch)]
    flat = [x for p in range(buckets) for f in range(features) for b in range(batch) for x in out[p][f][b]]
    starts, at = {}, 0
    for p in range(buckets):
        for f in range(features):
            for b in range(batch):
                starts[(p, f, b)] = at
                at += len(out[p][f][b])
    position = [starts[(p, f, b)] + k for p, f, b, k in where]
    return lengths_out, [v for v, _ in flat], [w for _, w in flat], position


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_permute_matches_reference(dtype):
    gen = torch.Generator().manual_seed(0)
    lengths, values, weights = _kjt(gen, dtype=dtype)
    for rows in ([2, 0], [1, 1, 2, 0], [0]):  # a subset, repeats, one feature
        index = torch.tensor(rows, dtype=torch.int32)
        exp_l, exp_v, exp_w = _permute_reference(rows, lengths, values, weights)
        for total in (None, len(exp_v)):
            out_l, out_v, out_w = TORCH.permute(index, lengths, values, weights, total)
            assert out_l.tolist() == exp_l and out_v.tolist() == exp_v and out_l.dtype == out_v.dtype == dtype
            assert out_w.tolist() == pytest.approx(exp_w)
        _, _, none = TORCH.permute(index, lengths, values, None)
        assert none is None


@pytest.mark.parametrize("sequence", [False, True])
def test_bucketize_matches_reference(sequence):
    gen = torch.Generator().manual_seed(1)
    lengths, values, weights = _kjt(gen, features=3, batch=5, rows=23)
    values[0] = 40  # past the last block (23 rows in 3 blocks of 8): fbgemm sends it to 40 % 3 as 40 // 3
    blocks = [8, 8, 12]
    exp = _bucketize_reference(lengths.reshape(-1), values, blocks, 3, weights)
    bl, bv, bw, pos = TORCH.bucketize(lengths.reshape(-1), values, torch.tensor(blocks), 3, weights, sequence)
    assert bl.tolist() == exp[0] and bv.tolist() == exp[1] and bw.tolist() == pytest.approx(exp[2])
    assert (pos.tolist() == exp[3]) if sequence else pos is None


def test_offsets():
    lengths = torch.tensor([2, 0, 3, 1], dtype=torch.int32)
    out = TORCH.offsets(lengths)
    assert out.tolist() == [0, 2, 2, 5, 6] and out.dtype == torch.int32


def test_fake_sizes_are_unbacked_where_the_data_decides():
    from torch.fx.experimental.symbolic_shapes import ShapeEnv, free_unbacked_symbols
    from torch._subclasses.fake_tensor import FakeTensorMode

    gen = torch.Generator().manual_seed(2)
    lengths, values, weights = _kjt(gen)
    with FakeTensorMode(shape_env=ShapeEnv()) as mode:
        fl, fv, fw = (mode.from_tensor(t) for t in (lengths, values, weights))
        index = torch.tensor([1, 0])
        pl, pv, pw = torch.ops.graphshard.kjt_permute(index, fl, fv, fw)
        assert tuple(pl.shape) == (2, 4) and free_unbacked_symbols(pv.shape[0]) and pw.shape == pv.shape
        _, sv, _ = torch.ops.graphshard.kjt_permute(index, fl, fv, None, 7)
        assert sv.shape[0] == 7
        bl, bv, bw, pos = torch.ops.graphshard.kjt_bucketize(fl.reshape(-1), fv, torch.tensor([8, 8, 8]), 2, fw, True)
        assert bl.shape[0] == 24 and bv.shape == fv.shape == bw.shape == pos.shape


def test_same_as_fbgemm():
    pytest.importorskip("fbgemm_gpu")
    fb = KJTOps(fbgemm=True)
    gen = torch.Generator().manual_seed(3)
    lengths, values, weights = _kjt(gen, features=4, batch=6, rows=30)
    index = torch.tensor([3, 1, 1], dtype=torch.int32)
    for a, b in zip(TORCH.permute(index, lengths, values, weights), fb.permute(index, lengths, values, weights)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    _same_bucketize(fb, lengths, values, torch.tensor([8, 8, 8, 8]), 4, weights)
    torch.testing.assert_close(TORCH.offsets(lengths.reshape(-1)), fb.offsets(lengths.reshape(-1)), rtol=0, atol=0)


def test_int32_ids_bucketize_the_same_with_either_implementation():
    # TorchRec's RandomRecDataset gives int32 lengths and ids; the program's block sizes are int64
    pytest.importorskip("fbgemm_gpu")
    fb = KJTOps(fbgemm=True)
    gen = torch.Generator().manual_seed(5)
    lengths, values, weights = _kjt(gen, features=3, batch=4, rows=24)
    lengths, values = lengths.to(torch.int32), values.to(torch.int32)
    _same_bucketize(fb, lengths, values, torch.tensor([8, 8, 8], dtype=torch.int64), 3, weights)


def _same_bucketize(fb, lengths, values, blocks, buckets, weights):
    """graphshard's torch bucketize and fbgemm's give the same outputs, pooled and sequence."""
    for sequence in (False, True):
        mine = TORCH.bucketize(lengths.reshape(-1), values, blocks, buckets, weights, sequence)
        theirs = fb.bucketize(lengths.reshape(-1), values, blocks, buckets, weights, sequence)
        for a, b in zip(mine, theirs, strict=True):
            assert (a is None) == (b is None)
            if a is not None:
                torch.testing.assert_close(a, b.to(a.dtype), rtol=0, atol=0)
