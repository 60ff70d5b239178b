"""graphshard.model_parallel against TorchRec's DistributedModelParallel on the DLRM workload.

```
python benchmarks/bench_dmp.py --reps 3            # table + ratios, runs alternated
python benchmarks/bench_dmp.py --quick             # smoke run: 1 rep, fewer steps
```

DLRM with 8 tables (dim 64, ``--rows`` rows, one feature each), batch 512 per rank, all
tables under one sharding type per run (tw, rw, cw, dp), or the plan of graphshard's planner
(planned) or of TorchRec's planner (trplanned), run by both DMPs; fused row-wise Adagrad (see
``_dmp_worker.py``). By default each DMP runs TorchRec's training loop: ``DLRMTrain``, a
``CombinedOptimizer`` and its own ``TrainPipelineSparseDist`` (TorchRec's for TorchRec's DMP,
``graphshard.model_parallel``'s for graphshard's, which exchanges the next batch's ids during a
step as TorchRec's does; ``--loop torchrec_pipeline``: TorchRec's class for both;
``--loop plain``: forward, backward and step by hand). For each repetition and sharding type the two DMPs run back to
back, each its own ``torchrun``; ratios are medians over repetitions of same-repetition pairs.
Targets (printed beside the ratio, never asserted): step time at most TorchRec's on the CPU
(1.0x; the GPU's 0.8x needs a GPU run of the worker), bytes moved no more than TorchRec's.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402
import _launch  # noqa: E402

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_dmp_worker.py")
SHARDINGS = ("tw", "rw", "cw", "dp", "planned", "trplanned", "auto")
VARIANTS = ("torchrec", "graphshard")
TARGETS = {"step_s": 1.00, "bytes_per_step": 1.00, "peak_live_mib": None, "first_step_s": None}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--shardings", default=",".join(SHARDINGS))
    p.add_argument("--rows", type=int, default=100_000)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=30,
                   help="timed steps per run: at 20-30 ms a step on 2 cores, 10 left pairs 30%% apart")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out-dir", default=os.path.join(C.REPO, "bench_out"))
    p.add_argument("--timeout", type=float, default=1200)
    p.add_argument("--loop", choices=["pipeline", "torchrec_pipeline", "plain"], default="pipeline",
                   help="pipeline (default): TorchRec's training loop through each DMP's TrainPipelineSparseDist; "
                        "torchrec_pipeline: through TorchRec's class for both; "
                        "plain: forward, backward and step by hand")
    args = p.parse_args(argv)
    if args.quick:
        args.reps, args.warmup, args.steps = 1, 1, 3
    args.shardings = args.shardings.split(",")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    cores = os.cpu_count() or 1
    env = dict(os.environ, OMP_NUM_THREADS=str(max(1, cores // args.nproc)))
    hw = f"{args.nproc} CPU ranks x {env['OMP_NUM_THREADS']} thread(s) on {cores} cores (gloo); graphshard @ {C.git_revision()}"
    print(f"# DMP benchmark: {hw}", flush=True)
    records = []
    for rep in range(args.reps):
        for sharding in args.shardings:
            for variant in (VARIANTS if rep % 2 == 0 else VARIANTS[::-1]):  # alternate who goes first
                log = os.path.join(args.out_dir, "logs", f"dmp_{variant}_{sharding}_r{rep}.log")
                t0 = time.perf_counter()
                res = _launch.launch(WORKER, ["--variant", variant, "--sharding", sharding, "--rows", str(args.rows),
                                              "--warmup", str(args.warmup), "--steps", str(args.steps),
                                              "--loop", args.loop],
                                     nproc=args.nproc, env=env, log_path=log, timeout=args.timeout)
                res.update(variant=variant, sharding=sharding, rep=rep)
                records.append(res)
                msg = (f"step {res['step_s']:.4f}s bytes {res['bytes_per_step'] / 2**20:.2f} MiB peak "
                       f"{res['peak_live_mib']:.0f} MiB" if res.get("status") == "ok" else res.get("reason", "")[:200])
                print(f"  rep{rep} {sharding:2s} {variant:10s} {res.get('status')}: {msg} ({time.perf_counter() - t0:.0f}s)",
                      flush=True)

    def per_rep(variant, sharding, key):
        return [next((r.get(key) for r in records if r["variant"] == variant and r["sharding"] == sharding
                      and r["rep"] == rep and r.get("status") == "ok"), None) for rep in range(args.reps)]

    rows = []
    for sharding in args.shardings:
        plan = next((r.get("plan") for r in records if r["sharding"] == sharding and r.get("status") == "ok"), None)
        row = [f"{sharding} ({plan})" if sharding in ("planned", "trplanned", "auto") and plan else sharding]
        row.append(C.fmt(C.median(per_rep("graphshard", sharding, "est_ms")), 3))
        for variant in VARIANTS:
            row += [C.fmt(C.median(per_rep(variant, sharding, "step_s")), 4),
                    C.fmt(C.median(per_rep(variant, sharding, "first_step_s")), 2),
                    C.fmt((C.median(per_rep(variant, sharding, "bytes_per_step")) or 0) / 2**20, 2),
                    C.fmt(C.median(per_rep(variant, sharding, "peak_live_mib")), 0)]
        rows.append(row)
    table = C.markdown_table(["sharding", "est ms (cost model)", "TorchRec step (s)", "TorchRec 1st step (s)",
                              "TorchRec MiB moved", "TorchRec peak MiB", "graphshard step (s)", "graphshard 1st step (s)",
                              "graphshard MiB moved", "graphshard peak MiB"], rows)
    ratio_rows = []
    for sharding in args.shardings:
        for key, target in TARGETS.items():
            ratio = C.paired_ratio(per_rep("graphshard", sharding, key), per_rep("torchrec", sharding, key))
            cell = C.fmt(ratio, 2)
            if ratio is not None and target is not None:
                cell += f" (target <= {target:.2f}: {'met' if ratio <= target else 'MISSED'})"
            ratio_rows.append([sharding, key, cell])
    out = "\n".join([f"# graphshard DMP vs TorchRec DMP, DLRM 8 tables x {args.rows} rows, dim 64, batch 512/rank, "
                      f"{args.loop} loop: {hw}",
                     "", table, "", "## Ratios (graphshard / TorchRec, median of same-repetition pairs)", "",
                     C.markdown_table(["sharding", "metric", "ratio"], ratio_rows)])
    print("\n" + out)
    os.makedirs(args.out_dir, exist_ok=True)
    with open(os.path.join(args.out_dir, "dmp.md"), "w") as f:
        f.write(out + "\n")
    C.write_json(os.path.join(args.out_dir, "dmp.json"), {"args": vars(args), "hardware": hw, "records": records})
    return 0


if __name__ == "__main__":
    sys.exit(main())
