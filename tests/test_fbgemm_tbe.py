"""graphshard/ops/tbe_fbgemm.py: graphshard's TBE op against fbgemm's own module and the torch reference.

Same tables, same ids, same fused optimizer: the pooled output, the updated weights and the
optimizer state after three steps equal fbgemm's ``SplitTableBatchedEmbeddingBagsCodegen``
bitwise, eagerly and compiled with Inductor (the backward's in-place update is kept in the
compiled backward graph).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("fbgemm_gpu")
from graphshard.sparse.fused_tbe import FusedTBE, TBESlot, fbgemm_types, reference_lookup  # noqa: E402

EmbOptimType, EmbeddingLocation, PoolingMode, ComputeDevice, TBE = fbgemm_types()

SHAPES = [(10, 4), (6, 8)]
SLOTS = [TBESlot(0, "t0/f0"), TBESlot(0, "t0/f2"), TBESlot(1, "t1/f1")]  # two features share table 0


def _batch(gen, slots=SLOTS, shapes=SHAPES, batch=3):
    lengths = torch.randint(0, 4, (len(slots) * batch,), generator=gen)
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
    ids = torch.cat([torch.randint(0, shapes[s.table][0], (int(lengths[f * batch:(f + 1) * batch].sum()),), generator=gen)
                     for f, s in enumerate(slots)])
    return ids, offsets


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "inductor"])
@pytest.mark.parametrize("optimizer", ["EXACT_SGD", "EXACT_ADAGRAD", "EXACT_ROWWISE_ADAGRAD"])
def test_matches_fbgemm_module(optimizer, compiled):
    fused = {"optimizer": getattr(EmbOptimType, optimizer), "learning_rate": 0.1, "eps": 1e-6}
    torch.manual_seed(0)
    mine = FusedTBE(SHAPES, SLOTS, fused_params=fused, row_offsets=[0, 0])
    ref = TBE([(r, d, EmbeddingLocation.HOST, ComputeDevice.CPU) for r, d in SHAPES],
              feature_table_map=[s.table for s in SLOTS], pooling_mode=PoolingMode.SUM, **fused)
    with torch.no_grad():
        ref.weights_host.copy_(mine.weights)
    head = torch.nn.Linear(16, 1)
    lookup = torch.compile(mine.lookup, backend="inductor", fullgraph=True) if compiled else mine.lookup
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        ids, offsets = _batch(gen)
        tables = [mine.table(t).clone() for t in range(len(SHAPES))]
        out = lookup(ids, offsets)
        expected = ref(ids, offsets)
        torch.testing.assert_close(out, reference_lookup(tables, SLOTS, ids, offsets, None, "sum"))
        assert torch.equal(out, expected)
        (head(out) ** 2).sum().backward()
        (head(expected) ** 2).sum().backward()
        assert torch.equal(mine.weights, ref.weights_host)
        if mine.momentum.numel():
            assert torch.equal(mine.momentum, ref.momentum1_host)
    assert mine.weights.grad is None and ref.weights_host.grad is None  # fused: no dense gradient


def test_per_sample_weights_and_views():
    torch.manual_seed(0)
    mine = FusedTBE(SHAPES, SLOTS, fused_params={"optimizer": EmbOptimType.EXACT_SGD, "learning_rate": 0.5},
                    row_offsets=[0, 0])
    gen = torch.Generator().manual_seed(2)
    ids, offsets = _batch(gen)
    psw = torch.rand(ids.shape, generator=gen)
    tables = [mine.table(t).clone().requires_grad_() for t in range(2)]
    expected = reference_lookup(tables, SLOTS, ids, offsets, psw, "sum")
    out = mine.lookup(ids, offsets, psw)
    torch.testing.assert_close(out, expected)
    grad = torch.randn_like(out)
    out.backward(grad)
    expected.backward(grad)
    for t in range(2):  # SGD: the new table is the old one minus lr times the torch gradient
        torch.testing.assert_close(mine.table(t), (tables[t] - 0.5 * tables[t].grad).detach())
    assert mine.state(0) is None


def test_out_of_range_id_names_the_feature():
    mine = FusedTBE(SHAPES, SLOTS, fused_params={}, row_offsets=[0, 100])
    with pytest.raises(ValueError, match=r"id 111 of t1/f1 is outside the table's rows \(this rank holds rows 100..105\)"):
        mine.lookup(torch.tensor([0, 1, 11]), torch.tensor([0, 1, 2, 3]))


def test_slots_must_group_tables():
    with pytest.raises(ValueError, match="each table's features together"):
        FusedTBE(SHAPES, [TBESlot(0, "a"), TBESlot(1, "b"), TBESlot(0, "c")], fused_params={}, row_offsets=[0, 0])
