"""Section 8: activation checkpointing's memory on one GPU (issue 29). ``benchmarks/bench_fsdp.py``
runs the benchmark transformer, 8 layers, world 1 (NCCL), with torch's AC on every block (full)
and without it. It runs graphshard against FSDP2 + ``torch.compile`` per block. Activations are
``cuda.max_memory_allocated`` during a step minus what is live before it, measured the same way
for both. Targets: full-AC activations at most FSDP2's, and the AC step overhead at most FSDP2's.

The benchmark's own table and ratios are kept in the report. On torch < 2.13 graphshard also
pays for the output's gradient, which autograd keeps for the whole backward there
(``docs/design/collectives.md``)."""

from __future__ import annotations

import json
import os
import sys
import tempfile

PEER = "fsdp2_compile_blocks"
VARIANTS = [f"{v}@{ac}" for ac in ("full", "none") for v in (PEER, "graphshard")]
# no waiting for an idle machine and no repeats of a contended run: the section's time is the device's
ONCE = ["--idle-wait", "0", "--retries", "0"]
ARGS = ["--layers", "8", "--reps", "1", "--warmup", "1", "--steps", "5", *ONCE]
DRY_ARGS = ["--layers", "2", "--reps", "1", "--warmup", "1", "--steps", "2", *ONCE]


def run(res, dry: bool) -> None:
    from check_common import REPO, child_env, fmt, run_launcher

    out_dir = tempfile.mkdtemp(prefix="gpu_check_ac_")
    cmd = [sys.executable, os.path.join(REPO, "benchmarks", "bench_fsdp.py"), "--variants", ",".join(VARIANTS),
           *(DRY_ARGS if dry else ARGS), "--out-dir", out_dir]
    res.line(f"`python benchmarks/bench_fsdp.py --variants {','.join(VARIANTS)} {' '.join(DRY_ARGS if dry else ARGS)}`")
    rc, out = run_launcher(cmd, child_env(dry), res.left_s() - 2)
    path = os.path.join(out_dir, "fsdp.json")
    runs = json.load(open(path))["runs"] if os.path.exists(path) else []
    by = {r["variant"]: r for r in runs if r.get("status") == "ok"}
    res.fig(rc=rc, runs=[{k: r.get(k) for k in ("variant", "step_s", "first_step_s", "activation_mib",
                                                  "peak_live_mib", "torch", "world")} for r in runs])
    res.table(["variant", "status", "step s", "first step s", "activation MiB", "peak live MiB"],
              [[r["variant"], r.get("status"), fmt(r.get("step_s")), fmt(r.get("first_step_s"), 1),
                fmt(r.get("activation_mib"), 1), fmt(r.get("peak_live_mib"), 1)] for r in runs])
    if rc is None:
        raise TimeoutError("the benchmark did not finish in the section's time")
    res.check("the benchmark exits 0 and every run is ok", rc == 0 and len(by) == len(VARIANTS),
              f"exit code {rc}; ok: {sorted(by)}")

    def ratio(metric: str, ac: str) -> float | None:
        mine, peer = by.get(f"graphshard@{ac}"), by.get(f"{PEER}@{ac}")
        return mine[metric] / peer[metric] if mine and peer and peer.get(metric) else None

    act = ratio("activation_mib", "full")
    over = None
    if all(f"{v}@{ac}" in by for v in ("graphshard", PEER) for ac in ("full", "none")):
        over = ((by["graphshard@full"]["step_s"] / by["graphshard@none"]["step_s"])
                / (by[f"{PEER}@full"]["step_s"] / by[f"{PEER}@none"]["step_s"]))
    res.fig(activation_ratio_full=act, ac_step_overhead_ratio=over)
    res.line(f"- full-AC activations, graphshard / FSDP2: {fmt(act)} (target <= 1.00); AC step overhead "
             f"(full / none), ours / theirs: {fmt(over)} (target <= 1.00)")
    if act is not None:
        res.check("full-AC activations at most FSDP2's", act <= 1.0, f"{act:.3f}x")
