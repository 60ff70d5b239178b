"""graphshard/ops/tbe_triton.py: ``FusedTBE(kernel="triton")`` (TorchRec's ``compute_kernel="fused_triton"``)
against ``FusedTBE(kernel="fbgemm")`` on the same tables, ids and fused optimizer.

The Triton op reads and updates the buffers fbgemm's module built (tables and optimizer state in
fbgemm's layout), so after three steps the pooled outputs, weights and optimizer state agree,
eagerly and compiled with Inductor (the op's in-place update kept in the compiled backward).
They agree to rounding, not bitwise: the kernels sum a row's gradients in different orders.
"""

from __future__ import annotations

import pytest
import torch

from _triton import import_kernel

import_kernel("graphshard.ops.tbe_triton")
pytest.importorskip("fbgemm_gpu")  # the Triton op is compared with fbgemm's kernel on the same tables
pytest.importorskip("fbgemm_gpu")
from graphshard.sparse.fused_tbe import fbgemm_types  # noqa: E402

EmbOptimType = fbgemm_types()[0]
from graphshard.sparse.fused_tbe import FusedTBE, TBESlot  # noqa: E402

SHAPES = [(10, 4), (6, 8)]
SLOTS = [TBESlot(0, "t0/f0"), TBESlot(0, "t0/f2"), TBESlot(1, "t1/f1")]  # two features share table 0


def _batch(gen, batch=3):
    lengths = torch.randint(0, 4, (len(SLOTS) * batch,), generator=gen)
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
    ids = torch.cat([torch.randint(0, SHAPES[s.table][0], (int(lengths[f * batch:(f + 1) * batch].sum()),), generator=gen)
                     for f, s in enumerate(SLOTS)])
    return ids, offsets, torch.rand(ids.shape, generator=gen) + 0.5


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "inductor"])
@pytest.mark.parametrize("optimizer", ["EXACT_SGD", "EXACT_ADAGRAD", "EXACT_ROWWISE_ADAGRAD"])
def test_triton_kernel_matches_fbgemm_kernel(optimizer, compiled):
    fused = {"optimizer": getattr(EmbOptimType, optimizer), "learning_rate": 0.1, "eps": 1e-6}
    torch.manual_seed(0)
    fb = FusedTBE(SHAPES, SLOTS, fused_params=fused, row_offsets=[0, 0], grad_scale=0.5)
    tr = FusedTBE(SHAPES, SLOTS, fused_params=fused, row_offsets=[0, 0], grad_scale=0.5, kernel="triton")
    with torch.no_grad():
        tr.weights.copy_(fb.weights)
    head = torch.nn.Linear(16, 1)
    lookups = [torch.compile(m.lookup, backend="inductor", fullgraph=True) if compiled else m.lookup for m in (fb, tr)]
    gen = torch.Generator().manual_seed(1)
    for step in range(3):
        ids, offsets, psw = _batch(gen)
        psw = psw if step == 2 else None  # per-sample weights on the last step
        outs = [lookup(ids, offsets, psw) for lookup in lookups]
        torch.testing.assert_close(outs[1], outs[0], atol=1e-6, rtol=1e-6)
        for out in outs:
            (head(out) ** 2).sum().backward()
        torch.testing.assert_close(tr.weights, fb.weights, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(tr.momentum, fb.momentum, atol=1e-6, rtol=1e-6)
    assert not torch.equal(tr.weights, FusedTBE(SHAPES, SLOTS, fused_params=fused, row_offsets=[0, 0]).weights)
    assert tr.weights.grad is None  # fused: no dense gradient


def test_triton_kernel_refuses_max_norm():
    fused = {"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.1, "max_norm": 1.0}
    with pytest.raises(NotImplementedError, match="max_norm=1.0: graphshard's Triton TBE has no max_norm"):
        FusedTBE(SHAPES, SLOTS, fused_params=fused, row_offsets=[0, 0], kernel="triton")


@pytest.mark.parametrize("optimizer", ["EXACT_SGD", "EXACT_ADAGRAD", "EXACT_ROWWISE_ADAGRAD"])
def test_triton_state_is_fbgemm_layout_without_fbgemm(optimizer):
    # FusedTBE(kernel="triton") builds its buffers itself (no fbgemm): the same layout, optimizer
    # settings and defaults as fbgemm's module, so checkpoints and TorchRec's views agree
    fused = {"optimizer": getattr(EmbOptimType, optimizer), "learning_rate": 0.1}
    fb = FusedTBE(SHAPES, SLOTS, fused_params=fused, row_offsets=[0, 0])
    tr = FusedTBE(SHAPES, SLOTS, fused_params=fused, row_offsets=[0, 0], kernel="triton")
    named = FusedTBE(SHAPES, SLOTS, fused_params={**fused, "optimizer": optimizer.lower()[len("exact_"):]},
                     row_offsets=[0, 0], kernel="triton")
    for mine in (tr, named):
        assert (mine.optimizer, mine.optim_args, mine.total_D) == (fb.optimizer, fb.optim_args, fb.total_D)
        assert float(mine.lr) == pytest.approx(float(fb.lr))
        assert mine.weights.shape == fb.weights.shape and mine.momentum.shape == fb.momentum.shape
        assert torch.count_nonzero(mine.momentum) == 0 == torch.count_nonzero(fb.momentum)
        for t in range(len(SHAPES)):
            assert mine.table(t).data_ptr() - mine.weights.data_ptr() == fb.table(t).data_ptr() - fb.weights.data_ptr()
            if fb.state(t) is not None:
                assert (mine.state(t).data_ptr() - mine.momentum.data_ptr()
                        == fb.state(t).data_ptr() - fb.momentum.data_ptr())
