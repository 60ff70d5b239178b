"""kernels/triton_tbe.py: graphshard's Triton TBE against fbgemm's module and the torch reference.

The pooled output, and the weights and optimizer state after three fused-optimizer steps with
duplicate ids (in one bag, across bags, across two features of one table), match fbgemm's
``SplitTableBatchedEmbeddingBagsCodegen`` on the CPU (HOST placement) and the plain-torch
reference in ``kernels/tbe_reference.py``; one step also matches plain torch (``F.embedding_bag``,
autograd, ``torch.optim.Adagrad``), which needs neither fbgemm nor graphshard's reference, so the
GPU machine (no fbgemm) checks it too. Without a CUDA device the kernels run under Triton's
interpreter, which must be switched on before the kernel module is imported.
"""

from __future__ import annotations

import pytest
import torch

from _triton import import_kernel

triton_tbe = import_kernel("graphshard.kernels.triton_tbe")
from graphshard.kernels.tbe_reference import (  # noqa: E402
    TBELayout, TBEOptimizer, reference_forward, reference_update_,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SHAPES = [(30, 4), (20, 12), (40, 16)]  # one non-power-of-two dim
FEATURE_TABLES = [0, 0, 1, 2]  # features 0 and 1 share table 0 (a table's features side by side: fbgemm CPU needs it)
BATCH = 4
FBGEMM_OPTIMIZERS = {"sgd": "EXACT_SGD", "adagrad": "EXACT_ADAGRAD", "rowwise_adagrad": "EXACT_ROWWISE_ADAGRAD"}


def _batch(gen, layout, *, index_dtype=torch.int64, weighted=False, id_range=6, max_len=5):
    """A KJT-ordered batch: ids drawn from a few rows per table (duplicates everywhere), some empty bags."""
    lengths = torch.randint(0, max_len, (layout.num_features * BATCH,), generator=gen)
    lengths[1] = 0
    lengths[-1] = 0
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
    ids = torch.cat([
        torch.randint(0, min(id_range, layout.table_shapes[t][0]), (int(lengths[f * BATCH:(f + 1) * BATCH].sum()),),
                      generator=gen)
        for f, t in enumerate(layout.feature_tables)
    ])
    psw = torch.rand(ids.shape, generator=gen) + 0.5 if weighted else None
    to = lambda x: x.to(DEVICE) if x is not None else None  # noqa: E731
    return to(ids.to(index_dtype)), to(offsets.to(index_dtype)), to(psw)


def _layout(shapes=SHAPES, feature_tables=FEATURE_TABLES):
    return TBELayout.create(shapes, feature_tables, device=DEVICE)


def _weights(layout, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(layout.num_weights, generator=gen).to(dtype).to(DEVICE)


def _fbgemm(layout, weights, *, pooling="sum", optimizer=None):
    """fbgemm's CPU module over the same tables, holding a copy of ``weights``."""
    pytest.importorskip("fbgemm_gpu")
    pytest.importorskip("fbgemm_gpu")
    from graphshard.sparse.fused_tbe import fbgemm_types

    EmbOptimType, EmbeddingLocation, PoolingMode, ComputeDevice, TBE = fbgemm_types()
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import WeightDecayMode

    optimizer = optimizer or TBEOptimizer(kind="sgd")
    module = TBE([(r, d, EmbeddingLocation.HOST, ComputeDevice.CPU) for r, d in layout.table_shapes],
                 feature_table_map=list(layout.feature_tables), pooling_mode=getattr(PoolingMode, pooling.upper()),
                 optimizer=getattr(EmbOptimType, FBGEMM_OPTIMIZERS[optimizer.kind]),
                 learning_rate=optimizer.learning_rate, eps=optimizer.eps, weight_decay=optimizer.weight_decay,
                 weight_decay_mode=WeightDecayMode(optimizer.weight_decay_mode))
    with torch.no_grad():
        for t, view in enumerate(module.split_embedding_weights()):
            view.copy_(layout.table(weights, t).cpu())
    return module


def _assert_same_tables(layout, weights, state, optimizer, module, **tol):
    for t in range(len(layout.table_shapes)):
        torch.testing.assert_close(layout.table(weights, t).cpu(), module.split_embedding_weights()[t], **tol)
        if optimizer.kind != "sgd":
            torch.testing.assert_close(layout.table_state(state, optimizer, t).cpu(),
                                       module.split_optimizer_states()[t][0], **tol)


# ---------------------------------------------------------------------------------------------- forward
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64], ids=["int32", "int64"])
@pytest.mark.parametrize("weighted", [False, True], ids=["unweighted", "weighted"])
@pytest.mark.parametrize("pooling", ["sum", "mean"])
def test_forward_matches_fbgemm_and_reference(pooling, weighted, index_dtype):
    layout = _layout()
    weights = _weights(layout)
    module = _fbgemm(layout, weights, pooling=pooling)
    ids, offsets, psw = _batch(torch.Generator().manual_seed(1), layout, index_dtype=index_dtype, weighted=weighted)
    out = triton_tbe.tbe_forward(weights, layout, ids, offsets, psw, pooling=pooling)
    assert out.shape == (BATCH, layout.total_D) and out.dtype == torch.float32
    expected = module(ids.cpu(), offsets.cpu(), per_sample_weights=psw.cpu() if weighted else None)
    # fbgemm's CPU MEAN with per-sample weights is the weighted sum over the bag's length, as here
    torch.testing.assert_close(out.cpu(), expected.detach(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(out, reference_forward(weights, layout, ids, offsets, psw, pooling), rtol=1e-6, atol=1e-6)
    empty = (offsets[1:] == offsets[:-1]).view(len(FEATURE_TABLES), BATCH)
    for f, b in empty.nonzero().tolist():  # empty bags pool to zeros
        assert not out[b, layout.D_offsets[f]:layout.D_offsets[f + 1]].any()


def test_forward_long_bags_and_wide_rows():
    """Bags longer than a tile of ids and a row wider than the forward's column block (300 > 256)."""
    layout = _layout(shapes=[(8, 300), (12, 4)], feature_tables=[0, 1])
    weights = _weights(layout)
    ids, offsets, psw = _batch(torch.Generator().manual_seed(2), layout, weighted=True, max_len=70)
    tables = [layout.table(weights, t).cpu() for t in range(len(layout.table_shapes))]
    for pooling in ("sum", "mean"):
        out = triton_tbe.tbe_forward(weights, layout, ids, offsets, psw, pooling=pooling)
        torch.testing.assert_close(out.cpu(), _plain_torch_forward(layout, tables, ids, offsets, psw, pooling),
                                   rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(out, reference_forward(weights, layout, ids, offsets, psw, pooling),
                                   rtol=1e-5, atol=1e-5)


def test_forward_empty_batch():
    layout = _layout()
    offsets = torch.zeros(len(FEATURE_TABLES) * BATCH + 1, dtype=torch.long, device=DEVICE)
    out = triton_tbe.tbe_forward(_weights(layout), layout, torch.zeros(0, dtype=torch.long, device=DEVICE), offsets)
    assert out.shape == (BATCH, layout.total_D) and not out.any()


# ------------------------------------------------------------------------------------ fused backward
_EVERY_OPTIMIZER_AND_POOLING = pytest.mark.parametrize(
    "kind,weighted,pooling", [(k, w, p) for k in ("sgd", "adagrad", "rowwise_adagrad")
                              for w, p in ((False, "sum"), (True, "sum"), (False, "mean"))],
    ids=[f"{p}-{k}" for k in ("sgd", "adagrad", "rowwise_adagrad") for p in ("sum", "weighted_sum", "mean")])


def _train(layout, optimizer, *, weighted, pooling, index_dtype=torch.int64, steps=3, dtype=torch.float32,
           module=None, seed=3):
    """``steps`` forward + fused updates of the Triton TBE, the reference and (if given) fbgemm's module, checking
    the forward against both on the way; returns the three (weights, state) results."""
    weights = _weights(layout, dtype)
    state = layout.new_state(optimizer)
    ref_weights, ref_state = weights.clone(), state.clone()
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        ids, offsets, psw = _batch(gen, layout, index_dtype=index_dtype, weighted=weighted)
        grad = torch.randn(BATCH, layout.total_D, generator=gen).to(DEVICE)
        out = triton_tbe.tbe_forward(weights, layout, ids, offsets, psw, pooling=pooling)
        torch.testing.assert_close(out, reference_forward(weights, layout, ids, offsets, psw, pooling),
                                   rtol=1e-5, atol=1e-5)
        if module is not None:
            expected = module(ids.cpu(), offsets.cpu(), per_sample_weights=psw.cpu() if weighted else None)
            torch.testing.assert_close(out.cpu(), expected.detach(), rtol=1e-6, atol=1e-6)
            expected.backward(grad.cpu())
        triton_tbe.tbe_backward_update_(grad, weights, state, layout, ids, offsets, psw, pooling=pooling,
                                        optimizer=optimizer)
        reference_update_(grad, ref_weights, ref_state, layout, ids, offsets, psw, pooling, optimizer=optimizer)
    return weights, state, ref_weights, ref_state


@_EVERY_OPTIMIZER_AND_POOLING
def test_fused_update_matches_fbgemm_and_reference(kind, weighted, pooling):
    # (fbgemm's CPU backward ignores MEAN when given per-sample weights; that case is checked against the reference)
    layout = _layout()
    optimizer = TBEOptimizer(kind=kind, learning_rate=0.1, eps=1e-4)
    module = _fbgemm(layout, _weights(layout), pooling=pooling, optimizer=optimizer)
    weights, state, ref_weights, ref_state = _train(layout, optimizer, weighted=weighted, pooling=pooling,
                                                    index_dtype=torch.int32 if weighted else torch.int64,
                                                    module=module)
    _assert_same_tables(layout, weights, state, optimizer, module, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(weights, ref_weights, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(state, ref_state, rtol=1e-6, atol=1e-6)
    assert not torch.equal(weights, _weights(layout))


def _plain_torch_forward(layout, tables, ids, offsets, psw, pooling):
    """Each feature's ``F.embedding_bag`` over its table, side by side (plain torch). Weighted mean
    pooling, which ``embedding_bag`` does not take, is the weighted sum over the bag's length (fbgemm's
    definition, checked against fbgemm's forward in ``test_forward_matches_fbgemm_and_reference``)."""
    import torch.nn.functional as F

    ids, offsets = ids.cpu().long(), offsets.cpu().long()
    outs = []
    for f, t in enumerate(layout.feature_tables):
        lo, hi = int(offsets[f * BATCH]), int(offsets[(f + 1) * BATCH])
        local = offsets[f * BATCH:(f + 1) * BATCH] - lo
        weights = psw.cpu()[lo:hi] if psw is not None else None
        if weights is not None and pooling == "mean":
            lengths = (offsets[f * BATCH + 1:(f + 1) * BATCH + 1] - offsets[f * BATCH:(f + 1) * BATCH]).clamp(min=1)
            out = F.embedding_bag(ids[lo:hi], tables[t], local, mode="sum", per_sample_weights=weights)
            outs.append(out / lengths.unsqueeze(1).to(out.dtype))
        else:
            outs.append(F.embedding_bag(ids[lo:hi], tables[t], local, mode=pooling, per_sample_weights=weights))
    return torch.cat(outs, 1)


def _plain_torch_step(layout, weights, ids, offsets, psw, grad, pooling, optimizer):
    """One step in plain torch, independent of graphshard's reference and of fbgemm: the forward of
    ``_plain_torch_forward``, autograd for the dense gradient, then the optimizer's update (SGD by
    hand, torch.optim.Adagrad, row-wise Adagrad by hand: its state is the mean of g^2 per row), in fp32."""
    tables = [torch.nn.Parameter(layout.table(weights, t).detach().cpu().clone().float())
              for t in range(len(layout.table_shapes))]
    psw = psw.float() if psw is not None else None
    (_plain_torch_forward(layout, tables, ids, offsets, psw, pooling) * grad.cpu()).sum().backward()
    lr, eps = optimizer.learning_rate, optimizer.eps
    if optimizer.kind == "adagrad":
        opt = torch.optim.Adagrad(tables, lr=lr, eps=eps)
        opt.step()
        return [w.detach() for w in tables], [opt.state[w]["sum"] for w in tables]
    new, states = [], []
    with torch.no_grad():
        for w in tables:
            g = w.grad
            if optimizer.kind == "sgd":
                new.append(w - lr * g)
            else:
                st = (g * g).mean(1)
                states.append(st)
                new.append(w - lr * g / (st.sqrt() + eps).unsqueeze(1))
    return new, states


@pytest.mark.parametrize("kind", ["sgd", "adagrad", "rowwise_adagrad"])
@pytest.mark.parametrize("weighted,pooling", [(False, "sum"), (True, "sum"), (False, "mean"), (True, "mean")],
                         ids=["sum", "weighted_sum", "mean", "weighted_mean"])
def test_one_step_matches_plain_torch_autograd(kind, weighted, pooling):
    layout = _layout()
    optimizer = TBEOptimizer(kind=kind, learning_rate=0.1, eps=1e-4)
    weights, state = _weights(layout), layout.new_state(optimizer)
    gen = torch.Generator().manual_seed(5)
    ids, offsets, psw = _batch(gen, layout, weighted=weighted)
    grad = torch.randn(BATCH, layout.total_D, generator=gen).to(DEVICE)
    want_w, want_state = _plain_torch_step(layout, weights, ids, offsets, psw, grad, pooling, optimizer)
    triton_tbe.tbe_backward_update_(grad, weights, state, layout, ids, offsets, psw, pooling=pooling,
                                    optimizer=optimizer)
    for t in range(len(layout.table_shapes)):
        torch.testing.assert_close(layout.table(weights, t).cpu(), want_w[t], rtol=1e-5, atol=1e-6)
        if kind != "sgd":
            got = layout.table_state(state, optimizer, t).cpu()
            torch.testing.assert_close(got.reshape(want_state[t].shape), want_state[t], rtol=1e-5, atol=1e-6)
    assert not torch.equal(weights, _weights(layout))


@pytest.mark.parametrize("kind", ["sgd", "adagrad", "rowwise_adagrad"])
def test_fused_update_weighted_mean_matches_reference(kind):
    layout = _layout()
    optimizer = TBEOptimizer(kind=kind, learning_rate=0.1, eps=1e-4)
    weights, state, ref_weights, ref_state = _train(layout, optimizer, weighted=True, pooling="mean")
    torch.testing.assert_close(weights, ref_weights, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(state, ref_state, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("mode", [1, 2], ids=["L2", "decoupled"])
def test_rowwise_adagrad_weight_decay(mode):
    # every table shared by two features: fbgemm's CPU fast path for an unshared table drops weight decay
    layout = _layout(feature_tables=[0, 0, 1, 1, 2, 2])
    optimizer = TBEOptimizer(kind="rowwise_adagrad", learning_rate=0.1, eps=1e-4, weight_decay=0.05,
                             weight_decay_mode=mode)
    module = _fbgemm(layout, _weights(layout), optimizer=optimizer)
    weights, state, ref_weights, ref_state = _train(layout, optimizer, weighted=False, pooling="sum", module=module)
    _assert_same_tables(layout, weights, state, optimizer, module, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(weights, ref_weights, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(state, ref_state, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype,tol", [(torch.float16, 2e-3), (torch.bfloat16, 1.6e-2)], ids=["fp16", "bf16"])
@pytest.mark.parametrize("kind", ["sgd", "rowwise_adagrad"])
def test_low_precision_weights(kind, dtype, tol):
    """fp16 / bf16 weights: fp32 accumulation and update, rounded once per step (about one ulp apart at most)."""
    layout = _layout()
    optimizer = TBEOptimizer(kind=kind, learning_rate=0.1, eps=1e-4)
    weights, state, ref_weights, ref_state = _train(layout, optimizer, weighted=True, pooling="sum", dtype=dtype)
    assert weights.dtype == dtype
    torch.testing.assert_close(weights, ref_weights, rtol=tol, atol=tol)
    # one step against plain torch in fp32: the kernel rounds the fp32 update once
    gen = torch.Generator().manual_seed(6)
    start, step_state = _weights(layout, dtype), layout.new_state(optimizer)
    ids, offsets, psw = _batch(gen, layout, weighted=True)
    grad = torch.randn(BATCH, layout.total_D, generator=gen).to(DEVICE)
    want, _ = _plain_torch_step(layout, start, ids, offsets, psw, grad, "sum", optimizer)
    stepped = start.clone()
    triton_tbe.tbe_backward_update_(grad, stepped, step_state, layout, ids, offsets, psw, pooling="sum",
                                    optimizer=optimizer)
    for t in range(len(layout.table_shapes)):
        torch.testing.assert_close(layout.table(stepped, t).cpu().float(), want[t], rtol=tol, atol=tol)
    # the state never reads the low-precision weights (no weight decay): fp32 agreement
    torch.testing.assert_close(state, ref_state, rtol=1e-6, atol=1e-6)
    assert not torch.equal(weights, _weights(layout, dtype))


def test_hot_row_and_determinism():
    """One row in 3 features' bags 40+ times each (segments longer than a tile); two runs bitwise equal."""
    layout = _layout(shapes=[(5, 16), (7, 12)], feature_tables=[0, 0, 1])
    optimizer = TBEOptimizer(kind="rowwise_adagrad", learning_rate=0.1, eps=1e-4)
    gen = torch.Generator().manual_seed(4)
    ids, offsets, psw = _batch(gen, layout, weighted=True, id_range=2, max_len=30)
    grad = torch.randn(BATCH, layout.total_D, generator=gen).to(DEVICE)
    results = []
    for _ in range(2):
        weights, state = _weights(layout), layout.new_state(optimizer)
        triton_tbe.tbe_backward_update_(grad, weights, state, layout, ids, offsets, psw, optimizer=optimizer)
        results.append((weights, state))
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])
    assert int(torch.bincount(ids[offsets[0]:offsets[2 * BATCH]].long()).max()) > 32
    ref_weights, ref_state = _weights(layout), layout.new_state(optimizer)
    reference_update_(grad, ref_weights, ref_state, layout, ids, offsets, psw, optimizer=optimizer)
    torch.testing.assert_close(results[0][0], ref_weights, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(results[0][1], ref_state, rtol=1e-6, atol=1e-6)
    want_w, want_state = _plain_torch_step(layout, _weights(layout), ids, offsets, psw, grad, "sum", optimizer)
    for t in range(len(layout.table_shapes)):
        torch.testing.assert_close(layout.table(results[0][0], t).cpu(), want_w[t], rtol=1e-5, atol=1e-6)
        got = layout.table_state(results[0][1], optimizer, t).cpu()
        torch.testing.assert_close(got.reshape(want_state[t].shape), want_state[t], rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------------------------------- errors
def _args():
    layout = _layout()
    ids, offsets, psw = _batch(torch.Generator().manual_seed(5), layout, weighted=True)
    return layout, _weights(layout), ids, offsets, psw


@pytest.mark.parametrize("change,match", [
    (lambda a: {**a, "weights": a["weights"].double()}, "weights must be a 1-D fp32, fp16 or bf16"),
    (lambda a: {**a, "weights": a["weights"][:-1]}, "weights has 999 elements but the layout.s tables need 1000"),
    (lambda a: {**a, "indices": a["indices"].float()}, "indices must be a 1-D int32 or int64"),
    (lambda a: {**a, "offsets": a["offsets"][:-1]}, r"offsets has 16 entries; it needs features \* B \+ 1"),
    (lambda a: {**a, "per_sample_weights": a["per_sample_weights"][:-1]}, "per_sample_weights must be a float tensor"),
    (lambda a: {**a, "indices": a["indices"] + 30}, r"outside table 0's rows \[0, 30\)"),
    (lambda a: {**a, "offsets": a["offsets"] + 1}, "offsets must start at 0"),
    (lambda a: {**a, "pooling": "max"}, "pooling must be one of"),
    (lambda a: {**a, "layout": a["layout"].to("meta")}, "layout tensors are on meta but weights on"),
])
def test_launcher_errors(change, match):
    layout, weights, ids, offsets, psw = _args()
    args = change({"weights": weights, "layout": layout, "indices": ids, "offsets": offsets,
                   "per_sample_weights": psw, "pooling": "sum"})
    with pytest.raises(ValueError, match=match):
        triton_tbe.tbe_forward(**args)


def test_backward_errors():
    layout, weights, ids, offsets, psw = _args()
    opt = TBEOptimizer(kind="rowwise_adagrad")
    grad = torch.zeros(BATCH, layout.total_D, device=DEVICE)
    with pytest.raises(ValueError, match=r"grad_output must be a float tensor of shape \[B, total_D\] = \[4, 36\]"):
        triton_tbe.tbe_backward_update_(grad[:, 1:], weights, layout.new_state(opt), layout, ids, offsets, optimizer=opt)
    with pytest.raises(ValueError, match="rowwise_adagrad needs a contiguous 1-D fp32 state of 90 elements"):
        triton_tbe.tbe_backward_update_(grad, weights, torch.zeros(3, device=DEVICE), layout, ids, offsets, optimizer=opt)
    with pytest.raises(ValueError, match="optimizer must be a TBEOptimizer"):
        triton_tbe.tbe_backward_update_(grad, weights, weights, layout, ids, offsets, optimizer="sgd")
    with pytest.raises(ValueError, match="kind must be one of"):
        TBEOptimizer(kind="adam")
    with pytest.raises(NotImplementedError, match="weight_decay is supported only for rowwise_adagrad"):
        TBEOptimizer(kind="adagrad", weight_decay=0.1, weight_decay_mode=1)
    with pytest.raises(NotImplementedError, match="weight_decay_mode=5 is not supported"):
        TBEOptimizer(kind="rowwise_adagrad", weight_decay=0.1, weight_decay_mode=5)


@pytest.mark.skipif(DEVICE != "cpu", reason="CPU tensors without the interpreter")
def test_cpu_without_interpreter_is_refused(monkeypatch):
    layout, weights, ids, offsets, psw = _args()
    monkeypatch.setattr(triton_tbe, "interpreted", lambda: False)
    with pytest.raises(ValueError, match="set TRITON_INTERPRET=1 before importing graphshard.kernels.triton_tbe, "
                                         "or use a CUDA device"):
        triton_tbe.tbe_forward(weights, layout, ids, offsets)
