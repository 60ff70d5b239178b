"""Section 2: graphshard's Triton TBE (``kernels/triton_tbe.py``) against the torch reference
(``kernels/tbe_reference.py``), then its bandwidth as a fraction of the GPU's, both on CUDA.

Correctness: every combination of SUM / MEAN pooling, unweighted / per-sample weighted, fp32 / bf16
weights: the pooled output, and for each fused optimizer (sgd, adagrad, rowwise_adagrad) the
weights and state after one step, against the reference run on CPU copies. Ids are drawn from a
few rows per table (duplicates in a bag, across bags, across two features of one table) and some
bags are empty. Tolerances: fp32 values (outputs, fp32 weights, every state) rtol = atol = 1e-5;
bf16 weights rtol 1e-2, atol 1e-5: the kernel and the reference both update in fp32 and round to
nearest, so they may differ by the last bf16 step (8 significant bits: 2^-8 = 3.9e-3 relative);
1e-2 allows about 2.5 steps.

Bandwidth: ``benchmarks/bench_tbe_kernel.py``'s ``Case`` (tables of uniform random ids, one
feature per table) and its bytes-moved accounting (``traffic``), timed with its timer
(``triton.testing.do_bench``, median), against a device-to-device ``copy_`` of a large buffer
(bytes read + written / time) measured in the same run. Targets: forward >= 65% and fused
backward (row-wise Adagrad) >= 35% of the copy's bandwidth.
"""

from __future__ import annotations

import types

FWD_TARGET, BWD_TARGET = 0.65, 0.35
OPTIMIZERS = ("sgd", "adagrad", "rowwise_adagrad")
TOL = {"fp32": dict(rtol=1e-5, atol=1e-5), "bf16": dict(rtol=1e-2, atol=1e-5)}

GPU = dict(shapes=[(1000, 128), (600, 128), (800, 64)], features=[0, 0, 1, 2], batch=64, max_len=12, id_range=40,
           copy_bytes=1 << 30, tables=8, rows=1_000_000, dim=128, bench_batch=4096,
           bench_cases=[("fp32", 10), ("fp32", 100), ("bf16", 100)], case_s=10)
DRY = dict(shapes=[(30, 16), (20, 12), (40, 8)], features=[0, 0, 1, 2], batch=4, max_len=5, id_range=6,
           copy_bytes=16 << 20, tables=2, rows=50, dim=16, bench_batch=4,
           bench_cases=[("fp32", 3), ("bf16", 10)], case_s=20)


def _batch(torch, gen, layout, cfg, weighted: bool):
    """A KJT-ordered batch (CPU tensors): ``offsets`` of features * B bags, some empty, ids from a
    few rows of each feature's table."""
    B = cfg["batch"]
    lengths = torch.randint(0, cfg["max_len"], (layout.num_features * B,), generator=gen)
    lengths[1] = lengths[-1] = 0
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
    ids = torch.cat([torch.randint(0, min(cfg["id_range"], layout.table_shapes[t][0]),
                                   (int(lengths[f * B:(f + 1) * B].sum()),), generator=gen)
                     for f, t in enumerate(layout.feature_tables)])
    psw = torch.rand(ids.shape, generator=gen) + 0.5 if weighted else None
    grad = torch.randn(B, layout.total_D, generator=gen)
    return ids, offsets, psw, grad


def compare_case(torch, tbe, ref, dev, layout_cpu, layout, w0, batch, pooling: str, tol_w: dict) -> dict:
    """name -> (kernel's value, reference's value, tolerance): the pooled output, then the weights
    and state after one fused step of each optimizer, from the same starting weights ``w0``."""
    ids, offsets, psw, grad = batch
    to = lambda x: None if x is None else x.to(dev)  # noqa: E731
    out = tbe.tbe_forward(w0.to(dev), layout, to(ids), to(offsets), to(psw), pooling=pooling)
    expect = ref.reference_forward(w0, layout_cpu, ids, offsets, psw, pooling=pooling)
    values = {"forward": (out.cpu(), expect, TOL["fp32"])}
    for kind in OPTIMIZERS:
        opt = ref.TBEOptimizer(kind=kind, learning_rate=0.05, eps=1e-8)
        w, st = w0.clone().to(dev), layout.new_state(opt)
        tbe.tbe_backward_update_(to(grad), w, st, layout, to(ids), to(offsets), to(psw), pooling=pooling,
                                 optimizer=opt)
        w_ref, st_ref = w0.clone(), layout_cpu.new_state(opt)
        ref.reference_update_(grad, w_ref, st_ref, layout_cpu, ids, offsets, psw, pooling=pooling, optimizer=opt)
        values[f"{kind} w"] = (w.cpu().float(), w_ref.float(), tol_w)
        if kind != "sgd":
            values[f"{kind} state"] = (st.cpu(), st_ref, TOL["fp32"])
    return values


def correctness(res, torch, tbe, ref, dev, cfg) -> None:
    from check_common import max_abs_diff, one_line, table_lines

    layout_cpu = ref.TBELayout.create(cfg["shapes"], cfg["features"])
    layout = layout_cpu.to(dev)
    gen = torch.Generator().manual_seed(0)
    headers = ["case (weights, per-sample weights, pooling)", "forward"] + [
        f"{k} {v}" for k in OPTIMIZERS for v in ("w", "state") if (k, v) != ("sgd", "state")]
    rows, failed = [], []
    res.line(f"Correctness vs the torch reference, max abs error per value ({len(cfg['shapes'])} tables "
             f"{cfg['shapes']}, features -> tables {cfg['features']}, B={cfg['batch']}, bags of 0..{cfg['max_len'] - 1} "
             f"ids from {cfg['id_range']} rows per table; w = weights and state after one fused step; fp32 values "
             "rtol=atol=1e-5; bf16 weights rtol 1e-2, atol 1e-5):")
    for dtype_name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        w0 = torch.randn(layout.num_weights, generator=gen).to(dtype)
        for weighted in (False, True):
            batch = _batch(torch, gen, layout, cfg, weighted)
            for pooling in ("sum", "mean"):
                case = f"{dtype_name} {'weighted' if weighted else 'unweighted'} {pooling}"
                try:
                    values = compare_case(torch, tbe, ref, dev, layout_cpu, layout, w0, batch, pooling, TOL[dtype_name])
                except Exception as e:  # noqa: BLE001 - one combination failing must not hide the others
                    rows.append([case, f"ERROR {one_line(f'{type(e).__name__}: {e}', 160)}"]
                                + [""] * (len(headers) - 2))
                    failed.append(f"{case}: {type(e).__name__}")
                else:
                    row = [case]
                    for what, (got, want, tol) in values.items():
                        ok = bool(torch.isfinite(got).all()) and torch.allclose(got, want, **tol)
                        row.append(f"{max_abs_diff(got, want):.1e}" + ("" if ok else " MISMATCH"))
                        if not ok:
                            failed.append(f"{case}: {what}")
                    rows.append(row)
                res.block("correctness", table_lines(headers, rows))
    compared = len(rows) * (len(headers) - 1)
    res.fig(correctness={"compared": compared, "mismatches": failed})
    res.check(f"Triton TBE matches the reference ({compared} comparisons)", not failed, "; ".join(failed[:8]))


def copy_bandwidth(torch, timer, dev, nbytes: int) -> float:
    """GB/s of ``dst.copy_(src)`` on ``nbytes``, counting the bytes read and written."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=dev).fill_(1)
    dst = torch.empty_like(src)
    ms = timer(lambda: dst.copy_(src))
    del src, dst
    return 2 * nbytes / ms / 1e6


def bandwidth(res, torch, tbe, dev, cfg) -> None:
    import bench_tbe_kernel as bench

    from check_common import table_lines

    timer = bench._timer(dev, quick=True)
    fb, missing = bench._import_fbgemm()
    if fb is None:
        fb_line = "fbgemm: not installed" if missing.startswith("ModuleNotFoundError") else f"fbgemm: {missing}"
    elif dev.type == "cuda" and getattr(__import__("fbgemm_gpu"), "__variant__", "cuda") == "cpu":
        fb, fb_line = None, "fbgemm: CPU build only (no CUDA TBE), not compared"
    else:
        fb_line = f"fbgemm {fb['version']}: timed beside"
    copy_gbs = copy_bandwidth(torch, timer, dev, cfg["copy_bytes"])
    res.fig(copy_GBs=copy_gbs, fbgemm=fb_line)
    res.line(f"Bandwidth: device copy of {cfg['copy_bytes'] / 2**30:.2f} GiB: {copy_gbs:.0f} GB/s (read + written); "
             f"{fb_line}. Targets: forward >= {FWD_TARGET:.0%}, fused backward >= {BWD_TARGET:.0%} of the copy.")
    rows, records = [], []
    for dtype, pooling in cfg["bench_cases"]:
        res.need(cfg["case_s"])
        args = types.SimpleNamespace(tables=cfg["tables"], batch=cfg["bench_batch"], dtype=dtype, lr=0.01)
        case = bench.Case(args, tbe, fb, cfg["rows"], cfg["dim"], pooling, dev)
        moved = bench.traffic(case)
        fwd_ms = timer(case.triton_forward)

        def backward():
            tbe.tbe_backward_update_(case.grad, case.weights, case.state, case.layout, case.ids, case.offsets,
                                     optimizer=case.optimizer, validate=False)

        bwd_ms = timer(backward)
        step_ms = timer(case.triton_step)
        parts = backward_parts(torch, tbe, timer, case, bwd_ms)
        bwd_bytes = moved["step_bytes"] - moved["fwd_bytes"]
        rec = {"dtype": dtype, "pooling": pooling, **moved, "fwd_ms": fwd_ms, "bwd_ms": bwd_ms, "step_ms": step_ms,
               "bwd_parts_ms": parts,
               "fwd_GBs": moved["fwd_bytes"] / fwd_ms / 1e6, "bwd_GBs": bwd_bytes / bwd_ms / 1e6,
               "step_GBs": moved["step_bytes"] / step_ms / 1e6}
        rec["fwd_frac"], rec["bwd_frac"] = rec["fwd_GBs"] / copy_gbs, rec["bwd_GBs"] / copy_gbs
        fb_cell = []
        if fb is not None:
            try:
                rec["fbgemm_fwd_ms"], rec["fbgemm_step_ms"] = timer(case.fbgemm_forward), timer(case.fbgemm_step)
                fb_cell = [f"{rec['fbgemm_fwd_ms']:.3f} / {rec['fbgemm_step_ms']:.3f}"]
            except Exception as e:  # noqa: BLE001 - e.g. no bf16 in fbgemm's CPU kernels
                rec["fbgemm_error"] = f"{type(e).__name__}: {e}"[:300]
                fb_cell = [f"n/a ({type(e).__name__})"]
        records.append(rec)
        res.fig(bandwidth=records)
        rows.append([f"{cfg['tables']} x {cfg['rows']} x {cfg['dim']}", dtype, pooling, cfg["bench_batch"],
                     f"{fwd_ms:.3f}", f"{rec['fwd_GBs']:.0f}", f"{rec['fwd_frac']:.0%}",
                     f"{bwd_ms:.3f}", f"{rec['bwd_GBs']:.0f}", f"{rec['bwd_frac']:.0%}",
                     f"{step_ms:.3f}", f"{rec['step_GBs'] / copy_gbs:.0%}"] + fb_cell)
        del case
        if dev.type == "cuda":
            torch.cuda.empty_cache()
        met = {f"{r['dtype']} L={r['pooling']}": (r["fwd_frac"] >= FWD_TARGET, r["bwd_frac"] >= BWD_TARGET)
               for r in records}
        res.fig(targets_met=met)
        res.block("bandwidth", table_lines(
            ["tables x rows x dim", "weights", "L", "B", "fwd ms", "fwd GB/s", f"fwd/copy (>= {FWD_TARGET:.0%})",
             "bwd ms", "bwd GB/s", f"bwd/copy (>= {BWD_TARGET:.0%})", "fwd+bwd ms", "fwd+bwd/copy"]
            + (["fbgemm fwd / fwd+bwd ms"] if fb is not None else []), rows) + [
            "bwd = `tbe_backward_update_` alone (row-wise Adagrad fused: sort, segment sums, update); bytes as "
            "`bench_tbe_kernel.traffic` counts them (rows read per id, output written; backward: fp32 gradient rows "
            "per id, each unique row read + written with its state).",
            "targets met (fwd, bwd): " + ", ".join(f"{k}: {'yes' if f else 'no'}, {'yes' if b else 'no'}"
                                                   for k, (f, b) in met.items()),
            "", "The backward's parts (ms; update kernel = backward - ids sorted):", ""]
            + table_lines(["weights", "L", "ids sorted (keys, sort, segments)", "sort of int32 keys",
                           "sort of int64 keys", "update kernel"],
                          [[r["dtype"], r["pooling"]] + [f"{r['bwd_parts_ms'][k]:.3f}" for k in
                                                         ("sorted_ids", "sort_int32", "sort_int64", "update")]
                           for r in records]))


def backward_parts(torch, tbe, timer, case, bwd_ms: float) -> dict:
    """Milliseconds of the fused backward's parts: ``tbe.sorted_ids`` (bags, keys, the stable sort,
    segment ends), a stable sort of the same number of int32 and of int64 keys alone, and the
    update kernel (``bwd_ms``, the whole backward's time, less ``sorted_ids``')."""
    n = case.ids.numel()
    keys = torch.randint(0, case.layout.total_rows, (n,), dtype=torch.int32, device=case.ids.device)
    wide = keys.long()
    prep = timer(lambda: tbe.sorted_ids(case.layout, case.ids, case.offsets, case.batch))
    out = {"sorted_ids": prep, "sort_int32": timer(lambda: torch.sort(keys, stable=True)),
           "sort_int64": timer(lambda: torch.sort(wide, stable=True))}
    out["update"] = bwd_ms - prep
    return out


def run(res, dry: bool) -> None:
    import torch

    from check_common import device

    from graphshard.kernels import tbe_reference as ref, triton_tbe as tbe

    dev = device(dry)
    cfg = DRY if dry else GPU
    res.fig(interpreted=tbe.interpreted())
    with res.part("correctness"):
        correctness(res, torch, tbe, ref, dev, cfg)
    with res.part("bandwidth"):
        bandwidth(res, torch, tbe, dev, cfg)
