"""graphshard.fsdp against torch's FSDP1 and against graphshard.compile with the equivalent Plan.

```
python benchmarks/bench_fsdp1.py --reps 3          # table + ratios, alternated runs
python benchmarks/bench_fsdp1.py --quick           # smoke run
```

The program is the FSDP1 one of ``bench_fsdp.py``'s ``fsdp1`` variant (``ModuleWrapPolicy``
on the blocks) with ``use_orig_params`` both ways, run with torch's class (``fsdp1``,
``fsdp1_flat``) and with graphshard's (``gs_fsdp1``, ``gs_fsdp1_flat``); ``graphshard_eq`` and
``graphshard_eq_flat`` are ``graphshard.compile`` with the Plan and the scheduling settings the
frontend builds from FSDP1's defaults (``forward_prefetch=False``). ``local_compile`` (an
unsharded compiled copy per rank, no communication) and ``graphshard_comm`` (the step's
collectives alone) give the sharded floor on a CPU machine: what the 0.9x target is held
against. Every
(repetition, variant) is its own ``torchrun``, variants alternated within a repetition;
ratios are medians over repetitions of same-repetition pairs.
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402
import bench_fsdp as B  # noqa: E402

VARIANTS = ("fsdp1", "gs_fsdp1", "graphshard_eq", "fsdp1_flat", "gs_fsdp1_flat", "graphshard_eq_flat",
            B.LOCAL_FLOOR, B.COMM_ONLY)
# (subject, peer, metric, target): printed beside the ratio, never asserted.
RATIOS = [
    ("gs_fsdp1_flat", "fsdp1_flat", "step_s", 0.90),
    ("gs_fsdp1", "fsdp1", "step_s", 0.90),
    ("gs_fsdp1_flat", "fsdp1", "step_s", 0.90),
    ("gs_fsdp1_flat", "graphshard_eq_flat", "step_s", 1.03),
    ("gs_fsdp1", "graphshard_eq", "step_s", 1.03),
    ("gs_fsdp1_flat", "fsdp1_flat", "peak_live_mib", 1.00),
    ("gs_fsdp1", "fsdp1", "peak_live_mib", 1.00),
    ("gs_fsdp1_flat", "fsdp1_flat", "opt_s", None),
    ("gs_fsdp1_flat_fwd", "fsdp1_flat_fwd", "step_s", None),  # only with --variants naming them (forward_prefetch=True)
]


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not any(a.startswith("--variants") for a in argv):
        argv += ["--variants", ",".join(VARIANTS)]
    args = B.parse_args(argv)
    nproc, env, hw = B.device_setup(args)
    hw += f"; graphshard @ {C.git_revision()}"
    print(f"# FSDP1 benchmark: {hw}")
    t0 = time.perf_counter()
    records = B.run_all(args, nproc, env)
    layers = args.layers
    text = [f"# graphshard.fsdp vs torch FSDP1: {hw}", "",
            B.variant_table(records, args.variants, layers, args.reps), "", "## Ratios", ""]
    rows = []
    for subject, peer, key, target in RATIOS:
        if subject not in args.variants or peer not in args.variants:
            continue
        ratio = C.paired_ratio(B.per_rep(records, subject, layers, key, args.reps),
                               B.per_rep(records, peer, layers, key, args.reps))
        cell = C.fmt(ratio, 2)
        if ratio is not None and target is not None:
            cell += f" (target <= {target:.2f}: {'met' if ratio <= target else 'MISSED'})"
        rows.append([f"{subject} / {peer}", key, cell])
    text.append(C.markdown_table(["ratio", "metric", "value"], rows))
    for subject, peer in (("gs_fsdp1_flat", "fsdp1_flat"), ("gs_fsdp1", "fsdp1")):
        if {subject, peer} <= set(args.variants):
            floor_text, _ = B.sharded_floor(records, subject, layers, args.reps, peer=peer)
            if floor_text:
                text += ["", floor_text]
    out = "\n".join(text)
    print("\n" + out)
    os.makedirs(args.out_dir, exist_ok=True)
    with open(os.path.join(args.out_dir, "fsdp1.md"), "w") as f:
        f.write(out)
    C.write_json(os.path.join(args.out_dir, "fsdp1.json"), {"args": vars(args), "hardware": hw,
                                                             "wall_s": time.perf_counter() - t0, "runs": records})
    return 0


if __name__ == "__main__":
    sys.exit(main())
