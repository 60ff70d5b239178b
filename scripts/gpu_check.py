"""The project's one prepared GPU check (one H100/H200, about 8 minutes, no package registry).

```
bash scripts/gpu_check.sh OUTDIR                    # on the GPU machine: OUTDIR/gpu_check.md, .json, .log
bash scripts/gpu_check.sh --cpu-dry-run OUTDIR      # every section on the CPU, tiny sizes (figures meaningless)
bash scripts/gpu_check.sh --budget 600 --sections tbe,llama OUTDIR
```

Sections, in this order, each in its own process with its own time limit (one that fails or
runs out of time does not stop the others; its partial figures are kept):

1. ``versions``   python, torch, triton, transformers, CUDA, GPU; torchrec / fbgemm_gpu;
                  ``graphshard._api_probe.probe_private_apis()``
2. ``tbe``        graphshard's Triton TBE against the torch reference (forward; weights and state
                  after one fused step), then its bandwidth as a fraction of a device copy's
3. ``demo``       ``torchrun --nproc-per-node 1 examples/train_transformer.py --steps 5``
4. ``frontends``  graphshard.fsdp (device_id, sync_module_states, built on the CPU / on meta, buffers,
                  a "cpu:gloo,cuda:nccl" group) and graphshard.tensor_parallel vs the single process
5. ``llama``      HF Llama: graphshard FullyShard (bf16 params, fp32 reduce) vs torch's fully_shard
                  (+ torch.compile; eager if time allows) vs an fp32 single-process reference
6. ``world4``     world 4 on the fake process group on CUDA: FSDP + TP, compiled, collectives counted;
                  ShardEmbedding tables (kernel="triton") beside a FullyShard part; TorchRec DMP if present;
                  the sparse plan and TorchRec's DLRM under DMP at world 1 (NCCL) against plain torch
7. ``throughput`` 8 layers, dim 1024: graphshard vs FSDP2 + torch.compile, tokens/s and peak memory;
                  a kernel profile of each (where a gap goes) and graphshard with ``regional=False``
8. ``ac``         8 layers, full AC and none: graphshard vs FSDP2 + torch.compile per block, activation
                  memory and the AC step overhead (issue 29; outside the default budget:
                  ``--budget 200 --sections ac``)
9. ``coldstart``  setup + first step at 4 and 32 layers, cold and warm caches: graphshard vs FSDP2 +
                  torch.compile per block (issue 31's targets; outside the default budget:
                  ``--budget 300 --sections coldstart``)

The overall limit (``--budget``, default 480 s; the dry run's is larger) is shared: a section may
use what earlier ones left, but never the time the later sections' own budgets need; a section
with too little time left is skipped. The report is rewritten after every section, so a kill
still leaves one. Section code lives in ``scripts/gpu_check/check_*.py``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
SECTION_DIR = os.path.join(HERE, "gpu_check")

# name, module, title, seconds on an H100 (compile included), seconds in the CPU dry run, dry-run env
SECTIONS = [
    ("versions", "check_versions", "versions and API probe", 25, 60, {}),
    ("tbe", "check_tbe", "Triton TBE vs the torch reference", 60, 400, {"TRITON_INTERPRET": "1"}),
    ("demo", "check_demo", "the demo on one GPU", 60, 300, {}),
    ("frontends", "check_frontends", "graphshard.fsdp and graphshard.tensor_parallel vs the single process", 40, 300,
     {}),
    ("llama", "check_llama", "HF Llama: FullyShard vs torch's fully_shard", 100, 600, {}),
    ("world4", "check_world4", "FSDP + TP and sharded embeddings at world 4 (fake process group)", 120, 600,
     {"TRITON_INTERPRET": "1"}),
    ("throughput", "check_throughput", "throughput: graphshard vs FSDP2 + torch.compile", 140, 500, {}),
    ("ac", "check_ac", "activation checkpointing: activation memory vs FSDP2 + torch.compile per block", 150, 600, {}),
    ("coldstart", "check_coldstart", "first step against depth, cold and warm: graphshard vs FSDP2 + torch.compile "
     "per block", 240, 600, {}),
]
GRACE_S = 5.0  # a section's own deadline is this much before it is killed: time to write what it has


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("outdir")
    p.add_argument("--cpu-dry-run", action="store_true",
                   help="every section on the CPU with tiny sizes (gloo, Triton interpreter); figures meaningless")
    p.add_argument("--budget", type=float, default=None,
                   help="overall seconds (default 480; dry run: the sum of the dry-run budgets)")
    p.add_argument("--sections", default=None, help="comma list of section names or numbers (default all)")
    return p.parse_args(argv)


def _selected(spec: str | None):
    if not spec:
        return list(SECTIONS)
    want = {s.strip() for s in spec.split(",") if s.strip()}
    picked = [s for i, s in enumerate(SECTIONS, 1) if s[0] in want or str(i) in want]
    unknown = want - {s[0] for s in picked} - {str(i) for i, s in enumerate(SECTIONS, 1) if s in picked}
    if unknown:
        raise SystemExit(f"unknown sections {sorted(unknown)}; choose from {[s[0] for s in SECTIONS]}")
    return picked


def _cuda_probe(timeout: float = 90.0) -> tuple[bool, str]:
    """Whether torch sees a CUDA GPU, asked in a child process (the driver holds no CUDA context)."""
    code = ("import torch; ok = torch.cuda.is_available(); "
            "print(ok, torch.cuda.get_device_name(0) if ok else '', torch.__version__, sep='|')")
    try:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return False, "torch did not answer within 90 s"
    if out.returncode != 0:
        return False, f"import torch failed: {out.stderr.strip().splitlines()[-1:]}"
    ok, name, version = out.stdout.strip().splitlines()[-1].split("|")
    return ok == "True", (name if ok == "True" else f"torch {version} sees no CUDA GPU")


def _setup(timeout: float = 60.0) -> dict:
    """``bash scripts/setup.sh`` (the README's set-up; on the GPU machine it installs graphshard
    without a package index and skips, one line each, what it cannot get): its exit code, time
    and lines. The sections import this checkout's graphshard either way (check_common.bootstrap)."""
    t0 = time.perf_counter()
    try:
        out = subprocess.run(["bash", os.path.join(REPO, "scripts", "setup.sh")], cwd=REPO, capture_output=True,
                             text=True, timeout=timeout)
        rc, lines = out.returncode, (out.stderr + out.stdout).strip().splitlines()
    except subprocess.TimeoutExpired as e:
        rc, lines = None, [f"killed after {timeout:.0f} s", *((e.stderr or b"").decode(errors="replace").splitlines())]
    return {"rc": rc, "seconds": round(time.perf_counter() - t0, 1), "lines": lines[-12:]}


def _git() -> str:
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True,
                             timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return (rev or "?") + (" (uncommitted changes)" if dirty else "")
    except Exception:  # noqa: BLE001 - a copy without git
        return "unknown"


def _tail(path: str, n: int = 2500) -> str:
    try:
        with open(path, errors="replace") as f:
            text = f.read()
    except OSError:
        return ""
    lines = [l for l in text.splitlines() if not l.startswith("@@")]
    return "\n".join(lines)[-n:]


def run_section(sec, dry: bool, timeout: float, workdir: str) -> dict:
    name, module = sec[0], sec[1]
    result_path = os.path.join(workdir, f"{name}.json")
    log_path = os.path.join(workdir, f"{name}.log")
    env = dict(os.environ, PYTHONUNBUFFERED="1", **(sec[5] if dry else {}))
    cmd = [sys.executable, os.path.abspath(__file__), "--section", module, "--result", result_path,
           "--deadline", str(time.time() + timeout - GRACE_S)] + (["--cpu-dry-run"] if dry else [])
    t0 = time.perf_counter()
    status = None
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            # The section's own process group: SIGTERM first, so a torchrun in it stops its workers
            # (they run in sessions of their own and would hold the GPU), then SIGKILL what is left.
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
            rc, status = None, "timeout"
        else:
            try:  # what the section left running (compile workers) goes with it
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    seconds = time.perf_counter() - t0
    try:
        with open(result_path) as f:
            res = json.load(f)
    except (OSError, ValueError):
        res = {"figures": {}, "md": [], "parts": {}}
    if status == "timeout":
        res["status"] = "timeout"
        for part in res.get("parts", {}).values():
            if part.get("status") == "running":
                part["status"] = "killed"
        res["error"] = f"killed after {timeout:.0f} s (its time limit); figures above are what it had"
    elif rc != 0 and res.get("status") in (None, "running", "ok"):
        res["status"] = "error"
        res.setdefault("error", f"exit code {rc}")
    if res.get("status") != "ok":
        res["log_tail"] = _tail(log_path)
    res.update(seconds=round(seconds, 1), limit_s=round(timeout, 1))
    return res


def write_report(outdir: str, meta: dict, results: list) -> None:
    title = "graphshard GPU check" + (" (CPU dry run)" if meta["dry"] else "")
    md = [f"# {title}", ""]
    if meta["dry"]:
        md += ["**CPU dry run**: tiny sizes, gloo, Triton under its interpreter, \"cpu\" meshes. It proves the code "
               "paths only; every figure below is meaningless.", ""]
    md += [f"- device: {meta['device']}", f"- git: {meta['git']}; started {meta['started']}",
           f"- budget {meta['budget']:.0f} s, used {meta['elapsed']:.0f} s"]
    if "setup" in meta:
        st = meta["setup"]
        md.append(f"- `bash scripts/setup.sh`: exit {st['rc']} in {st['seconds']} s"
                  + (":" if st["lines"] else ", nothing to install"))
        md += [f"  - `{line}`" for line in st["lines"]]
    md.append("")
    md += ["| # | section | status | seconds | limit s |", "|---|---------|--------|---------|---------|"]
    for i, (sec, r) in enumerate(results, 1):
        md.append(f"| {i} | {sec[2]} | {r.get('status')} | {r.get('seconds', '')} | {r.get('limit_s', '')} |")
    for i, (sec, r) in enumerate(results, 1):
        md += ["", f"## {i}. {sec[2]}: {r.get('status')}" + (f" ({r['seconds']} s)" if "seconds" in r else ""), ""]
        if r.get("reason"):
            md.append(f"skipped: {r['reason']}")
        md += r.get("md", [])
        parts = r.get("parts", {})
        bad = {k: v for k, v in parts.items() if v.get("status") not in ("ok", "running")}
        if parts:
            md.append("")
            md.append("parts: " + ", ".join(f"{k} {v.get('status')}" for k, v in parts.items()))
        for k, v in bad.items():
            if v.get("error"):
                md += ["", f"{k}: `{v['error'][:400]}`"]
        if r.get("error"):
            md += ["", f"error: `{r['error'][:600]}`"]
        if r.get("log_tail"):
            md += ["", "tail of its output:", "", "```", r["log_tail"][-1500:], "```"]
    os.makedirs(outdir, exist_ok=True)
    with open(os.path.join(outdir, "gpu_check.md"), "w") as f:
        f.write("\n".join(md) + "\n")
    sections = {sec[0]: r for sec, r in results}
    with open(os.path.join(outdir, "gpu_check.json"), "w") as f:
        json.dump({**meta, "sections": sections}, f, indent=1, default=str)


def drive(args) -> int:
    start = time.time()
    dry = args.cpu_dry_run
    outdir = os.path.abspath(args.outdir)
    os.makedirs(outdir, exist_ok=True)
    picked = _selected(args.sections)
    budget = args.budget or (sum(s[4] for s in picked) + 60 if dry else 480.0)
    meta = {"dry": dry, "git": _git(), "started": datetime.datetime.now().isoformat(timespec="seconds"),
            "budget": budget, "elapsed": 0.0, "python": sys.version.split()[0]}
    if dry:
        meta["device"] = "CPU dry run (gloo, Triton interpreter)"
    else:
        ok, what = _cuda_probe()
        if not ok:
            line = f"gpu_check: no CUDA GPU on this machine ({what}); nothing checked. " \
                   f"Run it on the GPU machine, or use --cpu-dry-run."
            print(line)
            meta.update(device="none", elapsed=time.time() - start)
            with open(os.path.join(outdir, "gpu_check.md"), "w") as f:
                f.write(f"# graphshard GPU check\n\n{line}\n")
            with open(os.path.join(outdir, "gpu_check.json"), "w") as f:
                json.dump({**meta, "skipped": line, "sections": {}}, f, indent=1)
            return 0
        meta["device"] = what
    print(f"gpu_check: {meta['device']}; budget {budget:.0f} s; report in {outdir}/gpu_check.md", flush=True)
    meta["setup"] = _setup()
    print(f"gpu_check: scripts/setup.sh exit {meta['setup']['rc']} in {meta['setup']['seconds']} s", flush=True)
    workdir = tempfile.mkdtemp(prefix="gpu_check_")
    results: list = []
    log_all = open(os.path.join(outdir, "gpu_check.log"), "w")
    own = 4 if dry else 3  # index of the budget column
    for i, sec in enumerate(picked):
        left = budget - (time.time() - start)
        reserved = sum(s[own] for s in picked[i + 1:])
        limit = min(left, max(sec[own], left - reserved))
        if limit < max(10.0, sec[own] / 3):
            res = {"status": "skipped", "reason": f"{left:.0f} s of the budget left, {sec[own]} s wanted"}
        else:
            print(f"[{i + 1}/{len(picked)}] {sec[0]}: {sec[2]} (limit {limit:.0f} s)", flush=True)
            res = run_section(sec, dry, limit, workdir)
            print(f"    -> {res['status']} in {res['seconds']} s", flush=True)
            log_all.write(f"\n===== {sec[0]} ({res['status']}, {res['seconds']} s) =====\n")
            log_all.write(_tail(os.path.join(workdir, f"{sec[0]}.log"), 200_000) + "\n")
            log_all.flush()
        results.append((sec, res))
        meta["elapsed"] = time.time() - start
        write_report(outdir, meta, results)
    log_all.close()
    print(f"gpu_check: done in {meta['elapsed']:.0f} s: "
          + ", ".join(f"{s[0]} {r['status']}" for s, r in results), flush=True)
    return 0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--section" in argv:  # one section, in this process (launched by drive)
        p = argparse.ArgumentParser()
        p.add_argument("--section", required=True)
        p.add_argument("--result", required=True)
        p.add_argument("--deadline", type=float, required=True)
        p.add_argument("--cpu-dry-run", action="store_true")
        a = p.parse_args(argv)
        sys.path.insert(0, SECTION_DIR)
        from check_common import main as section_main

        return section_main(a.section, a.result, a.cpu_dry_run, a.deadline)
    return drive(parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
