"""localize_random: random ops draw the logical tensor's values by element index (fake process group, world 4).

The golden graph shows dropout on a sharded value (the column-parallel hidden units) and on a
replicated one (after the row-parallel all-reduce) drawing ``graphshard::random_bits`` from the
per-call key, the sharded one with this rank's coordinate on "tp". The unit tests pin what the
multi-rank tests rely on: a shard's bits are the logical tensor's bits at its elements, the
bits are uniform and independent, and every distribution the pass emits has its moments.
Multi-rank training with differently seeded ranks is in tests/test_multirank.py (rng cases).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from expecttest import TestCase

import graphshard
from _golden import graph_after
from _models import mesh1d, seeded
from graphshard.ops.rng import KeyStream, RandomDraws, random_bits
from graphshard.tensor_parallel import ColwiseParallel, RowwiseParallel
from graphshard.testing.models import DropoutMLP


def tp_plan():
    return graphshard.Plan(mesh1d("tp"), {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})


class TestGoldenGraphs(TestCase):
    def test_dropout_on_sharded_and_replicated_values(self):
        text = graph_after(seeded(DropoutMLP, 16, 32, 0.25), tp_plan(), (torch.randn(2, 3, 16),), "localize_random")
        self.assertExpectedInline(text, """\
class <lambda>(torch.nn.Module):
    def forward(self, arg0_1: "f32[2, 3, 16]", arg1_1: "f32[8, 16]", arg2_1: "f32[8]", arg3_1: "f32[16, 8]", arg4_1: "f32[16]", rng_key: "i64[]", rng_coord_tp: "i64[]"):
        to_partial_default: "f32[16]" = torch.ops.graphshard.to_partial.default(arg4_1, 0);  arg4_1 = None
        alias_default: "f32[8, 16]" = torch.ops.aten.alias.default(arg1_1);  arg1_1 = None
        alias_default_1: "f32[8]" = torch.ops.aten.alias.default(arg2_1);  arg2_1 = None
        view: "f32[6, 16]" = torch.ops.aten.reshape.default(arg0_1, [6, 16]);  arg0_1 = None
        t: "f32[16, 8]" = torch.ops.aten.t.default(alias_default);  alias_default = None
        addmm: "f32[6, 8]" = torch.ops.aten.addmm.default(alias_default_1, view, t);  alias_default_1 = view = t = None
        view_1: "f32[2, 3, 8]" = torch.ops.aten.reshape.default(addmm, [2, 3, 8]);  addmm = None
        gelu: "f32[2, 3, 8]" = torch.ops.aten.gelu.default(view_1);  view_1 = None
        random_bits_default: "i64[2, 3, 8]" = torch.ops.graphshard.random_bits.default(rng_key, [rng_coord_tp], 0, [2, 3, 8], [2, 3, 32], [2, 0, 8, 1]);  rng_coord_tp = None
        bitwise_right_shift_tensor_scalar: "i64[2, 3, 8]" = torch.ops.aten.bitwise_right_shift.Tensor_Scalar(random_bits_default, 8);  random_bits_default = None
        _to_copy_default: "f32[2, 3, 8]" = torch.ops.aten._to_copy.default(bitwise_right_shift_tensor_scalar, dtype = torch.float32);  bitwise_right_shift_tensor_scalar = None
        mul_tensor: "f32[2, 3, 8]" = torch.ops.aten.mul.Tensor(_to_copy_default, 5.960464477539063e-08);  _to_copy_default = None
        lt_scalar: "b8[2, 3, 8]" = torch.ops.aten.lt.Scalar(mul_tensor, 0.75);  mul_tensor = None
        _to_copy_default_1: "f32[2, 3, 8]" = torch.ops.aten._to_copy.default(lt_scalar, dtype = torch.float32);  lt_scalar = None
        div_: "f32[2, 3, 8]" = torch.ops.aten.div_.Scalar(_to_copy_default_1, 0.75);  _to_copy_default_1 = None
        mul: "f32[2, 3, 8]" = torch.ops.aten.mul.Tensor(gelu, div_);  gelu = div_ = None
        alias_default_2: "f32[16, 8]" = torch.ops.aten.alias.default(arg3_1);  arg3_1 = None
        view_2: "f32[6, 8]" = torch.ops.aten.reshape.default(mul, [6, 8]);  mul = None
        t_1: "f32[8, 16]" = torch.ops.aten.t.default(alias_default_2);  alias_default_2 = None
        addmm_1: "f32[6, 16]" = torch.ops.aten.addmm.default(to_partial_default, view_2, t_1);  to_partial_default = view_2 = t_1 = None
        view_3: "f32[2, 3, 16]" = torch.ops.aten.reshape.default(addmm_1, [2, 3, 16]);  addmm_1 = None
        all_reduce_default: "f32[2, 3, 16]" = torch.ops.graphshard.all_reduce.default(view_3, 'tp', 4);  view_3 = None
        random_bits_default_1: "i64[2, 3, 16]" = torch.ops.graphshard.random_bits.default(rng_key, [], 2, [2, 3, 16], [2, 3, 16], []);  rng_key = None
        bitwise_right_shift_tensor_scalar_1: "i64[2, 3, 16]" = torch.ops.aten.bitwise_right_shift.Tensor_Scalar(random_bits_default_1, 8);  random_bits_default_1 = None
        _to_copy_default_2: "f32[2, 3, 16]" = torch.ops.aten._to_copy.default(bitwise_right_shift_tensor_scalar_1, dtype = torch.float32);  bitwise_right_shift_tensor_scalar_1 = None
        mul_tensor_1: "f32[2, 3, 16]" = torch.ops.aten.mul.Tensor(_to_copy_default_2, 5.960464477539063e-08);  _to_copy_default_2 = None
        lt_scalar_1: "b8[2, 3, 16]" = torch.ops.aten.lt.Scalar(mul_tensor_1, 0.75);  mul_tensor_1 = None
        _to_copy_default_3: "f32[2, 3, 16]" = torch.ops.aten._to_copy.default(lt_scalar_1, dtype = torch.float32);  lt_scalar_1 = None
        div__1: "f32[2, 3, 16]" = torch.ops.aten.div_.Scalar(_to_copy_default_3, 0.75);  _to_copy_default_3 = None
        mul_1: "f32[2, 3, 16]" = torch.ops.aten.mul.Tensor(all_reduce_default, div__1);  all_reduce_default = div__1 = None
        return (mul_1,)
""")

    def test_attention_dropout_on_heads(self):
        # SDPA's math path on the CPU draws its dropout mask on [b, heads, s, s]; heads are sharded.
        class Attn(nn.Module):
            def __init__(self):
                super().__init__()
                self.wq, self.wk, self.wv = (nn.Linear(16, 16, bias=False) for _ in range(3))
                self.wo = nn.Linear(16, 16, bias=False)

            def forward(self, x):
                b, s, _ = x.shape
                q, k, v = (w(x).view(b, s, 4, 4).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
                out = F.scaled_dot_product_attention(q, k, v, dropout_p=0.1, is_causal=True)
                return self.wo(out.transpose(1, 2).reshape(b, s, 16))

        plan = graphshard.Plan(mesh1d("tp"), {"w[qkv]": ColwiseParallel(), "wo": RowwiseParallel()})
        text = graph_after(seeded(Attn), plan, (torch.randn(2, 8, 16),), "localize_random")
        self.assertIn("random_bits.default(rng_key, [rng_coord_tp], 0, [2, 1, 8, 8], [2, 4, 8, 8], [1, 0, 1, 1])", text)
        self.assertNotIn("bernoulli", text)

    def test_data_parallel_graph_is_untouched(self):
        # No model-parallel axis: every rank already draws its own stream (the rule's data-parallel part).
        model = seeded(lambda: nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5)))
        plan = graphshard.Plan(mesh1d("dp"), {"": graphshard.FullyShard()})
        text = graph_after(model, plan, (torch.randn(2, 8),), "localize_random")
        self.assertIn("bernoulli_", text)
        self.assertNotIn("random_bits", text)


# ---------------------------------------------------------------- the bits
def _key(v: int) -> torch.Tensor:
    return torch.tensor(v, dtype=torch.int64)


@pytest.mark.parametrize("logical,dim,world", [((6, 10), 1, 4), ((5, 3, 4), 0, 2), ((7,), 0, 4)])
def test_each_shard_holds_the_logical_tensors_bits(logical, dim, world):
    full = random_bits(_key(12345), [], 3, logical, logical, [])
    chunk = -(-logical[dim] // world)
    pieces = []
    for rank in range(world):
        size = list(logical)
        size[dim] = max(0, min(chunk, logical[dim] - chunk * rank))
        pieces.append(random_bits(_key(12345), [_key(rank)], 3, size, logical, [dim, 0, chunk, 1]))
    assert torch.equal(torch.cat(pieces, dim), full)


def test_strided_shard_holds_the_logical_tensors_bits():
    # [b * heads, s] with heads sharded 2 ways: each rank holds heads/2 of every batch row's heads.
    b, heads, s = 3, 4, 5
    full = random_bits(_key(7), [], 0, [b * heads, s], [b * heads, s], []).view(b, heads, s)
    for rank in range(2):
        mine = random_bits(_key(7), [_key(rank)], 0, [b * heads // 2, s], [b * heads, s], [0, 0, 2, b])
        assert torch.equal(mine.view(b, heads // 2, s), full[:, 2 * rank:2 * rank + 2])


def test_bits_are_uniform_and_independent():
    n = 1 << 16
    a = random_bits(_key(1), [], 0, [n], [n], [])
    assert int(a.min()) >= 0 and int(a.max()) < 2**32
    bits = torch.stack([(a >> i) & 1 for i in range(32)]).float().mean(1)
    assert (bits - 0.5).abs().max() < 0.01, bits  # every bit is a fair coin (4 sigma ~ 0.008)
    u = a.double() / 2**32
    counts = torch.bincount((u * 256).long(), minlength=256).double()
    chi2 = ((counts - n / 256) ** 2 / (n / 256)).sum().item()
    assert chi2 < 255 + 5 * math.sqrt(2 * 255), chi2
    others = {  # neighbours, another op of the call, the next call, the element 2**32 further on
        "next element": u.roll(1),
        "other salt": random_bits(_key(1), [], 2, [n], [n], []).double() / 2**32,
        "next key": random_bits(_key(2), [], 0, [n], [n], []).double() / 2**32,
    }
    for name, v in others.items():
        corr = torch.corrcoef(torch.stack([u, v]))[0, 1].item()
        assert abs(corr) < 0.02, (name, corr)  # 4 sigma at n = 65536 is 0.016
    high = random_bits(_key(1), [_key(1)], 0, [1, 8], [2, 2**32], [0, 0, 1, 1])  # indices 2**32 + j
    assert (high[0] != a[:8]).all()
    over_keys = torch.stack([random_bits(_key(k), [], 0, [1], [1], []) for k in range(4096)]).view(-1)
    bits = torch.stack([(over_keys >> i) & 1 for i in range(32)]).float().mean(1)
    assert (bits - 0.5).abs().max() < 0.04, bits  # element 0 under 4096 keys: no fixed bits (4 sigma ~ 0.03)


def test_key_stream_follows_the_seed_and_advances_per_call():
    draws = RandomDraws(device=torch.device("cpu"), agree_over=("tp",), coord_axes=("tp",), count=1)

    def stream(seed):
        torch.manual_seed(seed)
        s = KeyStream(draws, [3], [], torch.device("cpu"))
        return s, s()

    (s1, first), (s2, first2), (s3, _) = stream(0), stream(0), stream(1)
    assert s1.base == s2.base != s3.base
    second = s1()
    assert int(first[1]) == 3 and int(first[0]) != int(second[0])
    assert int(first[0]) == int(first2[0])
    assert all(0 <= s1.key(i) < 2**63 for i in range(100))
    # the first call draws the seed from torch's generator: a second graph (a graph break) gets another
    torch.manual_seed(0)
    a, b = KeyStream(draws, [3], [], torch.device("cpu")), KeyStream(draws, [3], [], torch.device("cpu"))
    a(), b()
    assert a.base != b.base


# ---------------------------------------------------------------- the distributions
class Draws(nn.Module):
    """A column-parallel layer (so the graph has a "tp" axis) and one replicated draw of each kind."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        n = 20000
        ones = torch.ones(n, device=x.device)
        return (self.fc(x), torch.rand(n), torch.randn(n), torch.randint(3, 10, (n,)),
                torch.empty(n).uniform_(-2, 6), torch.empty(n).normal_(2.0, 3.0), torch.bernoulli(ones * 0.3),
                F.dropout(ones, 0.25, True), torch.randn(n, dtype=torch.float64), torch.rand(n, dtype=torch.bfloat16))


def test_each_random_op_keeps_its_distribution():
    model = seeded(Draws)
    graphshard.compile(model, graphshard.Plan(mesh1d("tp"), {"fc": ColwiseParallel()}), lower="eager")
    with torch.no_grad():
        _, rand, randn, randint, uniform, normal, bern, drop, randn64, rand16 = model(torch.randn(2, 4))
    report = model._graphshard.explain[0]
    assert report.fallbacks == [] and any("random ops: 9" in n for n in report.notes), report.format()
    assert 0 <= rand.min() and rand.max() < 1 and abs(rand.mean() - 0.5) < 0.01
    assert abs(randn.mean()) < 0.03 and abs(randn.std() - 1) < 0.03
    assert randint.dtype == torch.int64 and randint.min() == 3 and randint.max() == 9
    assert torch.bincount(randint - 3).min() > 20000 / 7 * 0.9
    assert -2 <= uniform.min() and uniform.max() < 6 and abs(uniform.mean() - 2) < 0.1
    assert abs(normal.mean() - 2) < 0.1 and abs(normal.std() - 3) < 0.1
    assert set(bern.unique().tolist()) == {0.0, 1.0} and abs(bern.mean() - 0.3) < 0.015
    assert torch.equal(drop.unique(), torch.tensor([0.0, 1 / 0.75])) and abs((drop == 0).float().mean() - 0.25) < 0.015
    assert randn64.dtype == torch.float64 and abs(randn64.std() - 1) < 0.03
    assert rand16.dtype == torch.bfloat16 and rand16.max() < 1
    again = model(torch.randn(2, 4))
    assert not torch.equal(again[1], rand)  # a new key per call


def test_unsupported_random_op_is_a_listed_fallback_or_strict_error():
    class Perm(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            return self.fc(x)[torch.randperm(x.shape[0])]

    plan = graphshard.Plan(mesh1d("tp"), {"fc": ColwiseParallel()})
    model = seeded(Perm)
    graphshard.compile(model, plan, lower="eager")
    model(torch.randn(3, 4))
    (msg,) = model._graphshard.explain[0].fallbacks
    assert "randperm" in msg and "drawn from each rank's own generator" in msg
    torch._dynamo.reset()
    strict = seeded(Perm)
    graphshard.compile(strict, plan, lower="eager", strict=True)
    with pytest.raises(Exception, match="random op aten.randperm.default at node"):
        strict(torch.randn(3, 4))


def test_graphs_of_one_model_draw_different_streams():
    # A graph break splits the model into two graphs; each draws its own stream seed at its first
    # call. Drawn at compile time, both seeds came from the same generator state (dynamo restores
    # it after each compile) and the two dropouts below drew the same mask.
    class TwoGraphs(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            first = F.dropout(torch.ones(64, 64), 0.5, True) + self.fc(x).sum()
            torch._dynamo.graph_break()
            return first, F.dropout(torch.ones(64, 64), 0.5, True) + self.fc(x).sum()

    model = seeded(TwoGraphs)
    graphshard.compile(model, graphshard.Plan(mesh1d("tp"), {"fc": ColwiseParallel()}), lower="eager")
    with torch.no_grad():
        first, second = model(torch.randn(2, 4))
    assert len(model._graphshard.explain) == 2
    assert not torch.equal(first == first[0, 0], second == second[0, 0])


def test_dynamic_batch():
    # A new batch size recompiles with a symbolic batch: the draw's size comes from the tensor.
    model = seeded(DropoutMLP, 16, 32, 0.5)
    graphshard.compile(model, tp_plan(), lower="eager")
    for b in (2, 3, 5):
        out = model(torch.randn(b, 3, 16))
        out.sum().backward()
        assert out.shape == (b, 3, 16)
