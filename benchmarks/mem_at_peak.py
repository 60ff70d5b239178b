"""What is live at a step's memory peak on the GPU, and where it was allocated.

    GS_BENCH_MEMORY_SNAPSHOT=/tmp/snap/graphshard torchrun ... benchmarks/_fsdp_worker.py ...
    python benchmarks/mem_at_peak.py /tmp/snap/graphshard.rank0.pickle [--top 30]

The worker's measured step (``_common.step_memory``) records the CUDA caching allocator's
allocation history when ``GS_BENCH_MEMORY_SNAPSHOT`` is set. This replays it: ``memory_allocated``
rises at each ``alloc`` and falls at each ``free_requested`` (a free the allocator defers for
another stream's use still counts as freed there), so the replay's maximum is the step's
``max_memory_allocated`` above what was live before the step. It prints the blocks live at that
moment, largest first, each with the innermost frames outside torch: the line of Inductor's
generated code (read from its file while it still exists), graphshard's or the model's source.
"""

from __future__ import annotations

import argparse
import linecache
import os
import pickle
from collections import defaultdict

TORCH_DIRS = (f"{os.sep}torch{os.sep}", f"{os.sep}site-packages{os.sep}", f"{os.sep}dist-packages{os.sep}")
GENERATED = "torchinductor"


def _own(frame: dict) -> bool:
    name = frame.get("filename", "")
    return GENERATED in name or not any(d in name for d in TORCH_DIRS)


def where(frames: list[dict], depth: int) -> str:
    """The innermost ``depth`` frames outside torch (Inductor's generated code counts as ours)."""
    out = []
    for fr in frames:
        if not _own(fr):
            continue
        name, line = fr.get("filename", "?"), fr.get("line", 0)
        text = linecache.getline(name, line).strip() if os.path.exists(name) else ""
        short = ("inductor:" + os.path.basename(name)) if GENERATED in name else os.path.relpath(name)
        out.append(f"{short}:{line} {fr.get('name', '')}" + (f"  `{text[:110]}`" if text else ""))
        if len(out) == depth:
            break
    return " <- ".join(out) or (frames[0].get("filename", "?") + f":{frames[0].get('line')}" if frames else "?")


def replay(trace: list[dict]) -> tuple[int, int, dict[int, dict]]:
    """(peak bytes above the start, index of the peak event, blocks live at the peak by address)."""
    live: dict[int, dict] = {}
    cur = peak = 0
    at_peak: dict[int, dict] = {}
    peak_i = -1
    for i, ev in enumerate(trace):
        act = ev.get("action")
        if act == "alloc":
            live[ev["addr"]] = ev
            cur += ev["size"]
            if cur > peak:
                peak, peak_i, at_peak = cur, i, dict(live)
        elif act == "free_requested" and ev["addr"] in live:
            cur -= live.pop(ev["addr"])["size"]
    return peak, peak_i, at_peak


def report(path: str, top: int, depth: int) -> str:
    with open(path, "rb") as f:
        snap = pickle.load(f)
    bench = snap.get("graphshard_bench", {})
    traces = [t for t in snap.get("device_traces", []) if t]
    if not traces:
        return f"{path}: no allocation history (was GS_BENCH_MEMORY_SNAPSHOT set on a GPU run?)"
    trace = traces[0]
    peak, peak_i, live = replay(trace)
    mib = 1 / 2**20
    lines = [f"# {os.path.basename(path)}",
             f"max_memory_allocated - resident: {(bench.get('peak', 0) - bench.get('resident', 0)) * mib:.2f} MiB "
             f"(the worker's figure); replayed peak above the step's start: {peak * mib:.2f} MiB, at event "
             f"{peak_i} of {len(trace)}; {len(live)} blocks live there",
             "", "## Live at the peak, largest first", "", "| MiB | where allocated |", "|---|---|"]
    for ev in sorted(live.values(), key=lambda e: -e["size"])[:top]:
        lines.append(f"| {ev['size'] * mib:.2f} | {where(ev.get('frames', []), depth)} |")
    grouped: dict[str, int] = defaultdict(int)
    for ev in live.values():
        grouped[where(ev.get("frames", []), 1).split("  `")[0]] += ev["size"]
    lines += ["", "## Live at the peak by allocating frame", "", "| MiB | frame |", "|---|---|"]
    for key, size in sorted(grouped.items(), key=lambda kv: -kv[1])[:top]:
        lines.append(f"| {size * mib:.2f} | {key} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("snapshots", nargs="+")
    p.add_argument("--top", type=int, default=30)
    p.add_argument("--depth", type=int, default=3, help="frames outside torch shown per block")
    a = p.parse_args(argv)
    print("\n\n".join(report(s, a.top, a.depth) for s in a.snapshots))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
