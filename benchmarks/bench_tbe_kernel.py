"""graphshard's Triton TBE kernel against fbgemm's ``SplitTableBatchedEmbeddingBagsCodegen`` on one GPU.

```
python benchmarks/bench_tbe_kernel.py                    # full sweep (needs a CUDA GPU)
python benchmarks/bench_tbe_kernel.py --quick --check    # short sweep; outputs/updates checked first
python benchmarks/bench_tbe_kernel.py --allow-cpu-skip   # on a machine without CUDA: a note, exit 0
python benchmarks/bench_tbe_kernel.py --cpu-smoke        # this script's code path on the CPU (interpreter,
                                                         # fbgemm's CPU module, tiny sizes; no timing worth reading)
```

Per case (tables x rows, dim, pooling factor L; batch B, one feature per table, every bag L ids
drawn uniformly from its table): the forward (SUM pooling) and forward + backward with row-wise
Adagrad fused in, of ``tbe_forward`` / ``tbe_backward_update_`` and of fbgemm's module
(``EmbeddingLocation.DEVICE``, fp32 weights and output, ``BoundsCheckMode.NONE``; the Triton
launchers run with ``validate=False``: neither checks ids). Timing: ``triton.testing.do_bench``
(CUDA events, L2 flushed between runs, median). Throughput is lookups (ids) per second and the
bytes of the rows read (forward) or read + written (backward) per second; ``speedup`` is
fbgemm's time over Triton's (above 1: Triton is faster). ``--check`` first compares the pooled
output and, after one fused step, the touched rows and their state with fbgemm's (fp32:
rtol/atol 1e-5). Results: a markdown table on stdout and in ``<out>.md``, and JSON in ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)

from _common import fmt, git_revision, markdown_table, write_json  # noqa: E402


def _parse():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tables", type=int, default=8)
    p.add_argument("--rows", default="100000,1000000", help="rows per table, comma separated")
    p.add_argument("--dims", default="64,128,256")
    p.add_argument("--pooling", default="1,10,100", help="ids per bag")
    p.add_argument("--batch", type=int, default=2048)
    p.add_argument("--dtype", choices=["fp32", "fp16"], default="fp32", help="weights (output is fp32)")
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--quick", action="store_true", help="rows 100000, dims 64,256, pooling 1,10; short timing")
    p.add_argument("--check", action="store_true", help="compare with fbgemm before timing each case")
    p.add_argument("--out", default=os.path.join(REPO, "bench_out", "tbe_kernel.json"))
    p.add_argument("--allow-cpu-skip", action="store_true", help="exit 0 (with a note) when no CUDA device is found")
    p.add_argument("--cpu-smoke", action="store_true", help="run the code path on the CPU (Triton interpreter)")
    args = p.parse_args()
    ints = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731
    args.rows, args.dims, args.pooling = ints(args.rows), ints(args.dims), ints(args.pooling)
    if args.quick:
        args.rows, args.dims, args.pooling = [100_000], [64, 256], [1, 10]
    if args.cpu_smoke:
        args.tables, args.rows, args.dims, args.pooling, args.batch = 2, [50], [12, 16], [1, 3], 4
    return args


def _import_triton_tbe():
    try:
        from graphshard.kernels import triton_tbe
    except ImportError:  # a checkout that is not pip-installed: kernels/ is importable from the repository root
        sys.path.insert(0, REPO)
        from kernels import triton_tbe
    return triton_tbe


def _import_fbgemm():
    """fbgemm's module and enums, or the reason they are unavailable."""
    try:
        import fbgemm_gpu  # noqa: F401
        from fbgemm_gpu.split_embedding_configs import EmbOptimType, SparseType
        from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation, PoolingMode
        from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
            ComputeDevice, SplitTableBatchedEmbeddingBagsCodegen,
        )
        try:
            from fbgemm_gpu.split_table_batched_embeddings_ops_common import BoundsCheckMode
        except ImportError:
            from fbgemm_gpu.split_table_batched_embeddings_ops_training import BoundsCheckMode
    except Exception as e:  # noqa: BLE001
        return None, f"{type(e).__name__}: {e}"
    return dict(EmbOptimType=EmbOptimType, SparseType=SparseType, EmbeddingLocation=EmbeddingLocation,
                PoolingMode=PoolingMode, ComputeDevice=ComputeDevice, TBE=SplitTableBatchedEmbeddingBagsCodegen,
                BoundsCheckMode=BoundsCheckMode, version=getattr(fbgemm_gpu, "__version__", "?")), None


WEIGHT_DTYPES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}
"""``--dtype`` names -> torch dtypes (bf16 is for callers such as ``scripts/gpu_check``; the CLI takes fp32, fp16)."""


class Case:
    """One (tables x rows, dim, pooling) configuration: the Triton TBE's tensors and fbgemm's module,
    holding the same weights, and one batch of ids."""

    def __init__(self, args, tbe, fb, rows: int, dim: int, pooling: int, device):
        import torch

        self.torch, self.tbe, self.fb = torch, tbe, fb
        self.rows, self.dim, self.pooling, self.batch, self.tables = rows, dim, pooling, args.batch, args.tables
        dtype = getattr(torch, WEIGHT_DTYPES[args.dtype])
        self.layout = tbe.TBELayout.create([(rows, dim)] * self.tables, list(range(self.tables)), device=device)
        self.optimizer = tbe.TBEOptimizer(kind="rowwise_adagrad", learning_rate=args.lr, eps=1e-8)
        gen = torch.Generator(device=device).manual_seed(0)
        self.weights = (torch.rand(self.layout.num_weights, generator=gen, device=device) * 0.02 - 0.01).to(dtype)
        self.state = self.layout.new_state(self.optimizer)
        n = self.tables * self.batch * pooling
        self.ids = torch.randint(0, rows, (n,), generator=gen, device=device)
        self.offsets = torch.arange(0, n + 1, pooling, device=device)
        self.grad = torch.randn(self.batch, self.layout.total_D, generator=gen, device=device)
        self.module = None
        if fb is not None:
            on_gpu = device.type == "cuda"
            self.module = fb["TBE"](
                [(rows, dim, fb["EmbeddingLocation"].DEVICE if on_gpu else fb["EmbeddingLocation"].HOST,
                  fb["ComputeDevice"].CUDA if on_gpu else fb["ComputeDevice"].CPU)] * self.tables,
                optimizer=fb["EmbOptimType"].EXACT_ROWWISE_ADAGRAD, learning_rate=args.lr, eps=1e-8,
                pooling_mode=fb["PoolingMode"].SUM, weights_precision=getattr(fb["SparseType"], args.dtype.upper()),
                output_dtype=fb["SparseType"].FP32, stochastic_rounding=False,
                bounds_check_mode=fb["BoundsCheckMode"].NONE,
                **({"device": device} if on_gpu else {}),
            )
            with torch.no_grad():
                for t, view in enumerate(self.module.split_embedding_weights()):
                    view.copy_(self.layout.table(self.weights, t))

    # the four timed functions
    def triton_forward(self):
        return self.tbe.tbe_forward(self.weights, self.layout, self.ids, self.offsets, validate=False)

    def triton_step(self):
        self.triton_forward()
        self.tbe.tbe_backward_update_(self.grad, self.weights, self.state, self.layout, self.ids, self.offsets,
                                      optimizer=self.optimizer, validate=False)

    def fbgemm_forward(self):
        with self.torch.no_grad():
            return self.module(self.ids, self.offsets)

    def fbgemm_step(self):
        self.module(self.ids, self.offsets).backward(self.grad)

    def check(self) -> dict:
        """Pooled output, then one fused step: touched rows and their state, against fbgemm."""
        torch = self.torch
        out, expected = self.triton_forward(), self.fbgemm_forward()
        fwd_err = (out - expected.float()).abs().max().item()
        torch.testing.assert_close(out, expected.float(), rtol=1e-5, atol=1e-5)
        self.triton_step()
        self.fbgemm_step()
        w_err = s_err = 0.0
        per_table = self.batch * self.pooling
        for t in range(self.tables):
            touched = self.ids[t * per_table:(t + 1) * per_table].unique()
            mine = self.layout.table(self.weights, t)[touched].float()
            theirs = self.module.split_embedding_weights()[t][touched].float()
            w_err = max(w_err, (mine - theirs).abs().max().item())
            torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-5)
            s_mine = self.layout.table_state(self.state, self.optimizer, t)[touched]
            s_theirs = self.module.split_optimizer_states()[t][0].view(-1)[touched]
            s_err = max(s_err, (s_mine - s_theirs).abs().max().item())
            torch.testing.assert_close(s_mine, s_theirs, rtol=1e-5, atol=1e-5)
        return {"forward_max_abs_err": fwd_err, "weights_max_abs_err": w_err, "state_max_abs_err": s_err}


def traffic(case: Case) -> dict:
    """The bytes every bandwidth figure here counts, for one forward and one fused step of ``case``:
    the forward reads each id's row (weights' dtype) and writes the fp32 ``[B, total_D]`` output; the
    step adds the backward, which reads the fp32 gradient row of each id, then reads and writes each
    unique (table, row) once with its row-wise state (4 bytes read + 4 written)."""
    n, dim, tables = case.ids.numel(), case.dim, case.tables
    elt = case.weights.element_size()
    unique = sum(int(case.ids[t * n // tables:(t + 1) * n // tables].unique().numel()) for t in range(tables))
    fwd_bytes = n * dim * elt + case.batch * case.layout.total_D * 4
    step_bytes = fwd_bytes + n * dim * 4 + unique * (2 * dim * elt + 8)
    return {"lookups": n, "unique_rows": unique, "fwd_bytes": fwd_bytes, "step_bytes": step_bytes}


def _timer(device, quick: bool):
    if device.type == "cuda":
        import triton.testing

        warmup, rep = (10, 40) if quick else (25, 200)
        return lambda fn: triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median")

    def cpu_time(fn):  # --cpu-smoke only: exercises the code path
        fn()
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3

    return cpu_time


def main() -> int:
    args = _parse()
    if args.cpu_smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # before the kernels are imported
    import torch

    if not torch.cuda.is_available() and not args.cpu_smoke:
        msg = "bench_tbe_kernel.py needs a CUDA GPU (Triton kernels vs fbgemm's CUDA TBE); none found"
        if args.allow_cpu_skip:
            print(f"{msg}: skipped (--allow-cpu-skip)")
            return 0
        print(f"error: {msg}. Run it on a GPU machine, or pass --allow-cpu-skip (or --cpu-smoke).", file=sys.stderr)
        return 2
    device = torch.device("cpu" if args.cpu_smoke else "cuda")
    try:
        import triton

        tbe = _import_triton_tbe()
    except ImportError as e:
        print(f"error: Triton is needed ({e}); pip install 'triton==3.6.0'", file=sys.stderr)
        return 2
    fb, fb_missing = _import_fbgemm()
    if fb is None:
        print(f"note: fbgemm_gpu unavailable ({fb_missing}); timing the Triton kernels alone", file=sys.stderr)
        if args.check:
            print("error: --check needs fbgemm_gpu", file=sys.stderr)
            return 2
    bench = _timer(device, args.quick)
    records = []
    cases = [(r, d, p) for r in args.rows for d in args.dims for p in args.pooling]
    for i, (rows, dim, pooling) in enumerate(cases):
        case = Case(args, tbe, fb, rows, dim, pooling, device)
        rec = {"tables": args.tables, "rows": rows, "dim": dim, "pooling": pooling, "batch": args.batch,
               "dtype": args.dtype, "lookups": case.ids.numel()}
        if args.check:
            rec["check"] = case.check()
        rec["triton_fwd_ms"] = bench(case.triton_forward)
        rec["triton_step_ms"] = bench(case.triton_step)
        if fb is not None:
            rec["fbgemm_fwd_ms"] = bench(case.fbgemm_forward)
            rec["fbgemm_step_ms"] = bench(case.fbgemm_step)
        moved = traffic(case)
        n, fwd_bytes, step_bytes = moved["lookups"], moved["fwd_bytes"], moved["step_bytes"]
        for who in ("triton", "fbgemm"):
            if f"{who}_fwd_ms" in rec:
                rec[f"{who}_fwd_Mlookups_s"] = n / rec[f"{who}_fwd_ms"] / 1e3
                rec[f"{who}_fwd_GBs"] = fwd_bytes / rec[f"{who}_fwd_ms"] / 1e6
                rec[f"{who}_step_GBs"] = step_bytes / rec[f"{who}_step_ms"] / 1e6
        if fb is not None:
            rec["fwd_speedup"] = rec["fbgemm_fwd_ms"] / rec["triton_fwd_ms"]
            rec["step_speedup"] = rec["fbgemm_step_ms"] / rec["triton_step_ms"]
        records.append(rec)
        print(f"[{i + 1}/{len(cases)}] rows {rows} dim {dim} L {pooling}: triton fwd {fmt(rec['triton_fwd_ms'])} ms, "
              f"step {fmt(rec['triton_step_ms'])} ms" + (f"; fbgemm fwd {fmt(rec['fbgemm_fwd_ms'])} ms, step "
                                                         f"{fmt(rec['fbgemm_step_ms'])} ms" if fb else ""), flush=True)
        del case
        if device.type == "cuda":
            torch.cuda.empty_cache()

    headers = ["tables x rows", "dim", "L", "triton fwd ms", "fbgemm fwd ms", "fwd speedup", "triton fwd GB/s",
               "triton step ms", "fbgemm step ms", "step speedup", "triton step GB/s"]
    if args.check:
        headers.append("check max err (fwd / w / state)")
    table = []
    for r in records:
        row = [f"{r['tables']} x {r['rows']}", r["dim"], r["pooling"], r["triton_fwd_ms"], r.get("fbgemm_fwd_ms"),
               r.get("fwd_speedup"), r["triton_fwd_GBs"], r["triton_step_ms"], r.get("fbgemm_step_ms"),
               r.get("step_speedup"), r["triton_step_GBs"]]
        if args.check:
            c = r["check"]
            row.append(f"{c['forward_max_abs_err']:.1e} / {c['weights_max_abs_err']:.1e} / {c['state_max_abs_err']:.1e}")
        table.append(row)
    device_name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu (interpreter smoke run)"
    header = (f"## Triton TBE vs fbgemm ({device_name}; batch {args.batch}, {args.dtype} weights, SUM pooling, "
              f"step = forward + backward with row-wise Adagrad; speedup = fbgemm ms / triton ms)")
    md = "\n".join([header, "", markdown_table(headers, table)])
    print("\n" + md)
    meta = {"device": device_name, "torch": torch.__version__, "triton": triton.__version__,
            "fbgemm_gpu": fb["version"] if fb else None, "fbgemm_unavailable": fb_missing,
            "git": git_revision(), "args": {k: v for k, v in vars(args).items()}}
    write_json(args.out, {**meta, "records": records})
    with open(os.path.splitext(args.out)[0] + ".md", "w") as f:
        f.write(md + "\n\n" + json.dumps(meta, indent=1) + "\n")
    print(f"\nwrote {args.out} and {os.path.splitext(args.out)[0]}.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
