"""Side-by-side tensor-parallel benchmark: graphshard against torch's ``parallelize_module``, eager and compiled.

    python benchmarks/bench_tp.py                      # TP on 2 ranks: table, bytes per step, ratios (2 reps)
    python benchmarks/bench_tp.py --quick              # smoke run: 1 rep, 1 warmup + 3 timed steps
    python benchmarks/bench_tp.py --loss-parallel      # logits stay vocab-sharded, loss under loss_parallel()
    python benchmarks/bench_tp.py --fsdp-tp            # also FSDP + TP on 4 ranks (dp 2 x tp 2), 2 layers

The driver launches one ``torchrun`` per (part, variant, repetition) running
``_tp_worker.py``, so every run starts from a fresh process (peak RSS is per
run, compile caches are cold). Runs are interleaved A B C A B C: the machine
drifts between launches, and ratios are taken between runs of the same
repetition, then the median over repetitions. See README.md.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402
import _launch  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "_tp_worker.py")

# part -> default variants, subject, peers {variant: target name}
PARTS = {
    "tp": {
        "variants": ("torch_tp_eager", "torch_tp_compile", "graphshard_tp"),
        "subject": "graphshard_tp",
        "peers": {"torch_tp_eager": "eager", "torch_tp_compile": "compile"},
        "title": "Tensor parallel",
    },
    "fsdp_tp": {
        "variants": ("torch_fsdp_tp", "graphshard_fsdp_tp"),
        "subject": "graphshard_fsdp_tp",
        "peers": {"torch_fsdp_tp": "eager", "torch_fsdp_tp_compile": "compile"},
        "title": "FSDP + tensor parallel",
    },
}

# (metric, peer kind) -> target for subject / peer (printed beside the ratios, never asserted)
TARGETS = {
    ("step_s", "eager"): 0.80,
    ("step_s", "compile"): 1.00,
    ("comm_mib", "eager"): 1.00,
    ("comm_mib", "compile"): 1.00,
}
RATIO_KEYS = (("step_s", "step time"), ("comm_mib", "bytes/step"), ("ttfs_s", "setup+1st step"),
              ("rss_mib", "peak RSS"))

METRICS = [  # key, column header
    ("step_s", "step s (median)"),
    ("first_step_s", "1st step s"),
    ("ttfs_s", "setup+1st s"),
    ("comm_mib", "comm MiB/step"),
    ("comm_calls", "collectives/step"),
    ("rss_mib", "peak RSS MiB"),
    ("other_cpu_pct", "other CPU %"),
]
LOSS_TOL = 1e-4


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=4, help="depth of the TP part")
    p.add_argument("--reps", type=int, default=None, help="repetitions per variant (default 2; --quick: 1)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps after the first (default 2; --quick: 1)")
    p.add_argument("--steps", type=int, default=None, help="timed steps (default 10; --quick: 3)")
    p.add_argument("--quick", action="store_true", help="smoke run: fewer steps and one repetition")
    p.add_argument("--variants", default=None,
                   help=f"comma list for the TP part (default {','.join(PARTS['tp']['variants'])})")
    p.add_argument("--loss-parallel", action="store_true",
                   help="output ColwiseParallel(use_local_output=False), loss and backward under loss_parallel()")
    p.add_argument("--nproc", type=int, default=2, help="ranks of the TP part (the tp mesh size)")
    p.add_argument("--batch", type=int, default=16, help="sequences every rank feeds (TP part)")
    p.add_argument("--fsdp-tp", action="store_true", help="also run FSDP + TP (4 ranks by default)")
    p.add_argument("--fsdp-tp-only", action="store_true", help="run only the FSDP + TP part")
    p.add_argument("--fsdp-tp-layers", type=int, default=2)
    p.add_argument("--fsdp-tp-nproc", type=int, default=4, help="ranks of the FSDP + TP part (dp = nproc / tp)")
    p.add_argument("--fsdp-tp-tp", type=int, default=2, help="tp mesh size in the FSDP + TP part")
    p.add_argument("--fsdp-tp-batch", type=int, default=8, help="sequences per dp rank (FSDP + TP part)")
    p.add_argument("--fsdp-tp-warmup", type=int, default=None, help="default 1")
    p.add_argument("--fsdp-tp-steps", type=int, default=None, help="default 4; --quick: 2")
    p.add_argument("--fsdp-tp-variants", default=None,
                   help=f"comma list (default {','.join(PARTS['fsdp_tp']['variants'])}; torch_fsdp_tp_compile "
                        "is also available)")
    p.add_argument("--threads", type=int, default=1, help="CPU threads per rank (torch.set_num_threads)")
    C.add_runner_args(p, "tp*.json")
    a = p.parse_args(argv)
    a.reps = a.reps or (1 if a.quick else 2)
    a.warmup = a.warmup if a.warmup is not None else (1 if a.quick else 2)
    a.steps = a.steps or (3 if a.quick else 10)
    a.fsdp_tp_warmup = a.fsdp_tp_warmup if a.fsdp_tp_warmup is not None else 1
    a.fsdp_tp_steps = a.fsdp_tp_steps or (2 if a.quick else 4)
    a.variants = [v.strip() for v in a.variants.split(",")] if a.variants else list(PARTS["tp"]["variants"])
    a.fsdp_tp_variants = ([v.strip() for v in a.fsdp_tp_variants.split(",")] if a.fsdp_tp_variants
                          else list(PARTS["fsdp_tp"]["variants"]))
    a.parts = (["tp"] if not a.fsdp_tp_only else []) + (["fsdp_tp"] if a.fsdp_tp or a.fsdp_tp_only else [])
    return a


def part_config(args, part: str) -> dict:
    """Variants, ranks, depth and step counts of one part."""
    if part == "tp":
        return {"variants": args.variants, "nproc": args.nproc, "layers": args.layers, "batch": args.batch,
                "warmup": args.warmup, "steps": args.steps, "extra": []}
    return {"variants": args.fsdp_tp_variants, "nproc": args.fsdp_tp_nproc, "layers": args.fsdp_tp_layers,
            "batch": args.fsdp_tp_batch, "warmup": args.fsdp_tp_warmup, "steps": args.fsdp_tp_steps,
            "extra": ["--tp", str(args.fsdp_tp_tp)]}


def launch_env(args) -> tuple[dict[str, str], str]:
    import torch

    env = dict(os.environ)
    if torch.cuda.is_available():
        return env, f"{torch.cuda.device_count()}x {torch.cuda.get_device_name(0)} (nccl)"
    env["OMP_NUM_THREADS"] = str(args.threads)
    return env, f"CPU ranks x {args.threads} thread(s) on {os.cpu_count()} cores (gloo)"


def run_one(args, part: str, variant: str, rep: int, env: dict[str, str], attempt: int) -> dict:
    """One ``torchrun`` of the worker, with a progress bar fed by its ``@@progress`` lines."""
    from tqdm import tqdm

    cfg = part_config(args, part)
    worker_args = ["--variant", variant, "--layers", str(cfg["layers"]), "--batch", str(cfg["batch"]),
                   "--warmup", str(cfg["warmup"]), "--steps", str(cfg["steps"]), "--threads", str(args.threads),
                   *cfg["extra"], *(["--loss-parallel"] if args.loss_parallel else [])]
    tag = f"{variant} L{cfg['layers']} rep{rep}" + (f" retry{attempt}" if attempt else "")
    bar = tqdm(total=1 + cfg["warmup"] + cfg["steps"], desc="  " + tag, position=1, leave=False, dynamic_ncols=True)

    def on_progress(done: int, total: int, phase: str) -> None:
        bar.total, bar.n = total, done
        bar.set_postfix_str(phase, refresh=True)

    bar.set_postfix_str("waiting for an idle machine", refresh=True)
    waited = _launch.wait_for_idle(args.idle_wait) if args.idle_wait > 0 else 0.0
    name = (f"tp_{variant}_L{cfg['layers']}" + ("_lp" if args.loss_parallel else "") + f"_r{rep}"
            + (f"_a{attempt}" if attempt else ""))
    log = os.path.join(args.out_dir, "logs", name + ".log")
    with _launch.CpuMonitor() as mon:
        res = _launch.launch(WORKER, worker_args, nproc=cfg["nproc"], env=env, timeout=args.timeout,
                             fresh_compile_cache=not args.warm_cache, on_progress=on_progress, log_path=log)
    bar.close()
    res.update(part=part, variant=variant, layers=cfg["layers"], rep=rep, attempt=attempt,
               other_cpu_pct=mon.other_pct, steal_pct=mon.steal_pct, idle_wait_s=waited)
    if res["status"] == "ok":
        res["ttfs_s"] = res["setup_s"] + res["first_step_s"]
        res["_msg"] = (f"{tag:34s} step {res['step_s']:.3f}s  1st {res['first_step_s']:.1f}s  comm "
                       f"{res['comm_mib']:.1f} MiB/{res['comm_calls']} calls ({res['comm_check']})  RSS "
                       f"{res['rss_mib']:.0f} MiB  loss {res['losses'][-1]:.5f}  "
                       f"other CPU {C.fmt(res['other_cpu_pct'], 0)}%")
    else:
        res["_msg"] = f"{tag:34s} {res['status']}: {res.get('reason', '')}"
    return res


def run_all(args, env: dict[str, str]) -> list[dict]:
    """Launch every (part, rep, variant) run in interleaved order (each part's reps alternate A B C A B C).

    A run measured while other jobs took more than ``--max-other-cpu`` % of the
    machine is repeated (up to ``--retries`` times); the least contended
    attempt is kept, and the attempts are recorded.
    """
    from tqdm import tqdm

    plan = [(part, r, v) for part in args.parts for r in range(args.reps)
            for v in part_config(args, part)["variants"]]
    unavailable: dict[str, str] = {}
    records = []
    outer = tqdm(total=len(plan), desc="runs", position=0, dynamic_ncols=True)
    for part, rep, variant in plan:
        if variant in unavailable:  # no need to launch it again to be told so
            records.append({"part": part, "variant": variant, "layers": part_config(args, part)["layers"],
                            "rep": rep, "status": "unavailable", "reason": unavailable[variant]})
            outer.update()
            continue
        best = C.run_until_quiet(lambda attempt: run_one(args, part, variant, rep, env, attempt), args, outer.write)
        if best["status"] == "unavailable":
            unavailable[variant] = best.get("reason", "")
        records.append(best)
        outer.update()
    outer.close()
    C.make_up_contended(records, args, lambda rec, attempt: run_one(
        args, rec["part"], rec["variant"], rec["rep"], env, attempt))
    return records




# --------------------------------------------------------------------------- summaries


def _ok(records, part: str, variant: str) -> list[dict]:
    return [r for r in records if r.get("part") == part and r["variant"] == variant and r.get("status") == "ok"]


def per_rep(records, part: str, variant: str, key: str, reps: int) -> list[float | None]:
    """``key`` of each repetition of ``variant``, None where the run did not succeed."""
    out: list[float | None] = [None] * reps
    for r in _ok(records, part, variant):
        out[r["rep"]] = r.get(key)
    return out


def status_of(records, part: str, variant: str) -> str:
    mine = [r for r in records if r.get("part") == part and r["variant"] == variant]
    sts = [r.get("status") for r in mine]
    if sts and all(s == "ok" for s in sts):
        return "ok"
    bad = next((r for r in mine if r.get("status") != "ok"), None)
    return f"{bad['status']} ({sum(s == 'ok' for s in sts)}/{len(sts)} ok)" if bad else "-"


def _cell(x: float | None, key: str) -> str:
    if key == "comm_calls":
        return C.fmt(None if x is None else int(x))
    return C.fmt(x, 3 if key.endswith("_s") else 1)


def _mib(b: float) -> str:
    return f"{b / 2**20:.2f}"


def variant_table(records, part: str, variants, reps: int) -> str:
    headers = ["variant", "world", "status", *(h for _, h in METRICS), "step s range", "graph breaks", "last loss"]
    rows = []
    for v in variants:
        vals = {k: _cell(C.median(per_rep(records, part, v, k, reps)), k) for k, _ in METRICS}
        steps = [s for s in per_rep(records, part, v, "step_s", reps) if s is not None]
        ok = _ok(records, part, v)
        rows.append([
            v, ok[0]["world"] if ok else "-", status_of(records, part, v), *(vals[k] for k, _ in METRICS),
            f"{min(steps):.3f}-{max(steps):.3f}" if steps else "-",
            ok[0].get("graph_breaks") if ok else "-",
            f"{ok[0]['losses'][-1]:.5f}" if ok else "-",
        ])
    return C.markdown_table(headers, rows)


def comm_table(records, part: str, variants) -> str:
    """Collectives of one step by kind (first successful run of each variant; they are deterministic)."""
    kinds = sorted({k for v in variants for r in _ok(records, part, v)[:1] for k in r["comm_by_kind"]})
    rows = []
    for v in variants:
        ok = _ok(records, part, v)
        if not ok:
            rows.append([v, *(["-"] * len(kinds)), "-", "-"])
            continue
        r = ok[0]
        cells = []
        for k in kinds:
            c = r["comm_by_kind"].get(k)
            cells.append(f"{_mib(c['in_bytes'])} MiB / {c['calls']}" if c else "-")
        rows.append([v, *cells, f"{_mib(r['comm_bytes'])} MiB / {r['comm_calls']}",
                     f"{r['comm_check']} ({sum(r['comm_backend_calls'].values())} backend calls on "
                     f"{len(r['comm_backend_calls'])} ranks)"])
    return C.markdown_table(["variant", *(f"{k} (in MiB / calls)" for k in kinds), "total", "mode vs backend"],
                            rows)


def ratio_cell(records, part: str, subject: str, peer: str, key: str, reps: int, kind: str) -> tuple[str, float | None]:
    ratio = C.paired_ratio(per_rep(records, part, subject, key, reps), per_rep(records, part, peer, key, reps))
    target = TARGETS.get((key, kind))
    if ratio is None:
        return "n/a" + (f" (target <= {target:.2f})" if target else ""), None
    if target is None:
        return f"{ratio:.2f}", ratio
    return f"{ratio:.3f} (target <= {target:.2f}: {'met' if ratio <= target else 'MISSED'})", ratio


def ratio_table(records, part: str, subject: str, variants, reps: int) -> tuple[str, dict]:
    rows, out = [], {}
    for peer, kind in PARTS[part]["peers"].items():
        if peer == subject or peer not in variants:
            continue
        cells = [ratio_cell(records, part, subject, peer, k, reps, kind) for k, _ in RATIO_KEYS]
        rows.append([peer, *(c[0] for c in cells)])
        out[peer] = {k: {"ratio": c[1], "cell": c[0], "target": TARGETS.get((k, kind))}
                     for (k, _), c in zip(RATIO_KEYS, cells)}
    return C.markdown_table([f"{subject} / peer", *(h for _, h in RATIO_KEYS)], rows), out


def loss_check(records, part: str, variants) -> tuple[str, dict]:
    """Every variant trains the same model on the same data: their per-step losses should agree."""
    traj = {v: ok[0]["losses"] for v in variants if (ok := _ok(records, part, v))}
    if len(traj) < 2:
        return "loss check: fewer than two variants ran", {"max_abs_diff": None}
    ref = next(iter(traj))
    diffs = {v: max(abs(a - b) for a, b in zip(traj[ref], t)) for v, t in traj.items() if v != ref}
    worst = max(diffs.values())
    lines = ["last-step loss: " + ", ".join(f"{v} {t[-1]:.6f}" for v, t in traj.items()),
             f"max |loss - {ref} loss| over all steps: "
             + ", ".join(f"{v} {d:.2e}" for v, d in diffs.items())
             + f" -> {'agree' if worst <= LOSS_TOL else 'DISAGREE'} (tolerance {LOSS_TOL:g})"]
    return "\n".join(lines), {"reference": ref, "max_abs_diff": diffs, "agree": worst <= LOSS_TOL,
                              "last": {v: t[-1] for v, t in traj.items()}}


def part_report(args, records, part: str) -> tuple[str, dict]:
    cfg = part_config(args, part)
    variants, subject = cfg["variants"], PARTS[part]["subject"]
    mesh = "tp" if part == "tp" else f"dp {cfg['nproc'] // args.fsdp_tp_tp} x tp {args.fsdp_tp_tp}"
    data = (f"every rank on the same {cfg['batch']} sequences" if part == "tp"
            else f"{cfg['batch']} sequences per dp rank")
    head = (f"## {PARTS[part]['title']}: {cfg['layers']} layers, {cfg['nproc']} ranks ({mesh}), {data} x seq 128; "
            f"warmup {cfg['warmup']}, {cfg['steps']} timed steps, {args.reps} rep(s)"
            + ("; loss_parallel" if args.loss_parallel else ""))
    body = [head, variant_table(records, part, variants, args.reps),
            "### Collectives per step (one rank: the one that moved the most bytes)",
            comm_table(records, part, variants)]
    summary: dict = {}
    if subject in variants:
        table, summary["ratios"] = ratio_table(records, part, subject, variants, args.reps)
        body += ["### Ratios (median over repetitions of paired runs)", table]
    text, summary["loss"] = loss_check(records, part, variants)
    body.append(text)
    return "\n\n".join(body), summary


def report(args, records: list[dict], hw: str) -> tuple[str, dict]:
    header = (f"# TP benchmark: {hw}; AdamW; {'warm' if args.warm_cache else 'cold'} compile cache")
    sections, summary = [header], {}
    for part in args.parts:
        text, summary[part] = part_report(args, records, part)
        sections.append(text)
    unavail = {r["variant"]: r.get("reason", "") for r in records if r.get("status") in ("unavailable", "error",
                                                                                          "failed")}
    if unavail:
        sections.append("Not run / failed:\n\n" + "\n".join(f"* `{v}`: {why}" for v, why in unavail.items()))
    return "\n\n".join(sections) + "\n", summary




def out_name(args) -> str:
    return "tp" + ("_lp" if args.loss_parallel else "") + ("_fsdp" if args.fsdp_tp_only else "")


def _exit_on_sigterm(signum, frame) -> None:
    # SystemExit in the main thread: `_launch.launch` then kills the running torchrun's process group
    # (it runs in its own session and would otherwise outlive a driver stopped by `timeout` or `kill`).
    raise SystemExit(128 + signum)


def main(argv=None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    t0 = time.perf_counter()
    from_json = args.from_json
    if from_json:  # re-report saved runs (e.g. after changing the tables)
        with open(from_json) as f:
            saved = json.load(f)
        out_dir = args.out_dir
        args = argparse.Namespace(**saved["args"])
        args.out_dir = out_dir
        records, hw = saved["runs"], saved["hardware"]
    else:
        env, hw = launch_env(args)
        hw += f"; graphshard @ {C.git_revision()}"
        print(f"# TP benchmark: {hw}")
        records = run_all(args, env)
    text, summary = report(args, records, hw)
    print("\n" + text)
    name = out_name(args)
    os.makedirs(args.out_dir, exist_ok=True)
    with open(os.path.join(args.out_dir, name + ".md"), "w") as f:
        f.write(text)
    if not from_json:
        C.write_json(os.path.join(args.out_dir, name + ".json"),
                     {"args": vars(args), "hardware": hw, "wall_s": time.perf_counter() - t0,
                      "summary": summary, "runs": records})
    print(f"wrote {os.path.join(args.out_dir, name + '.md')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
