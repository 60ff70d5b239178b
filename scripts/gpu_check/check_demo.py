"""Section 3: the demo on one GPU, ``torchrun --nproc-per-node 1 examples/train_transformer.py --steps 5``
(NCCL, world 1; gloo in the dry run). The demo compares its sharded run with the same model trained
in one process and prints a match line; this section records its figures and verdict."""

from __future__ import annotations

import re

STEP = re.compile(r"step (\d+): loss ([-\d.e+naif]+)\s+single-process ([-\d.e+naif]+)\s+\|diff\| ([-\d.e+naif]+)\s+"
                  r"([\d.]+) s")
MATCH = re.compile(r"max \|loss diff\| ([-\d.e+naif]+), max \|param diff\| ([-\d.e+naif]+) -> (\w+)")


def run(res, dry: bool) -> None:
    from check_common import child_env, median, run_launcher, torchrun_cmd

    cmd = torchrun_cmd(1, "examples/train_transformer.py", "--steps", "5")
    res.line("`torchrun --standalone --nproc-per-node 1 examples/train_transformer.py --steps 5`")
    rc, out = run_launcher(cmd, child_env(dry), res.left_s() - 2)
    steps = [dict(step=int(m[0]), loss=float(m[1]), single=float(m[2]), diff=float(m[3]), seconds=float(m[4]))
             for m in STEP.findall(out)]
    header = next((l for l in out.splitlines() if l.startswith("graphshard demo:")), "")
    match = MATCH.search(out)
    res.fig(rc=rc, steps=steps, header=header)
    if header:
        res.line(f"- {header}")
    if steps:
        res.table(["step", "loss", "single-process", "abs diff", "seconds"],
                  [[s["step"], f"{s['loss']:.6f}", f"{s['single']:.6f}", f"{s['diff']:.2e}", f"{s['seconds']:.3f}"]
                   for s in steps])
        later = [s["seconds"] for s in steps[1:]]
        res.fig(first_step_s=steps[0]["seconds"], steady_step_s=median(later))
        res.line(f"- first step (compile) {steps[0]['seconds']:.1f} s; later steps median "
                 f"{median(later) or float('nan'):.4f} s")
    if match:
        res.fig(max_loss_diff=float(match[1]), max_param_diff=float(match[2]), verdict=match[3])
        res.line(f"- match line: max |loss diff| {match[1]}, max |param diff| {match[2]} -> {match[3]}")
    if rc is None:
        raise TimeoutError("the demo did not finish in the section's time")
    res.check("the demo exits 0", rc == 0, f"exit code {rc}")
    res.check("the demo prints its match line and says OK", bool(match) and match[3] == "OK",
              match[0] if match else "no match line in its output")
