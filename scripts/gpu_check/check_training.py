"""What sections 4 (HF Llama) and 6 (throughput) share: the two FSDP programs with bf16 parameters
and fp32 gradient reduction, built the same way on any model, and a timed AdamW training loop.

* ``graphshard``: ``graphshard.compile(model, Plan(mesh, {unit_glob: FullyShard(bf16, fp32), "": ...}))``;
  ``graphshard_whole``: the same with ``regional=False`` (one Inductor compile per graph instead of
  one per distinct region between communication steps);
* ``fsdp2_compile`` / ``fsdp2_eager``: torch's ``fully_shard`` on each unit and the root with
  ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``, then ``torch.compile`` of the root, or
  eager; ``fsdp2_compile_blocks``: each unit compiled (``unit.compile()``) before ``fully_shard``
  (torchtitan's recipe), run only where ``fsdp2_compile`` failed;
* ``fp32``: the unsharded model, eager, fp32: the single-process reference.
"""

from __future__ import annotations

import copy
import time
from typing import Callable

from check_common import median, one_line, reset_compile_state, sync


def bf16_spec():
    import torch

    return dict(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def build(variant: str, base, dev, mesh, unit_glob: str, units: Callable):
    """A fresh copy of ``base`` on ``dev``, set up as ``variant``; returns (module to call, its model).
    ``units(model)``: the modules ``fully_shard`` wraps before the root (those ``unit_glob`` names)."""
    import torch

    model = copy.deepcopy(base).to(dev)
    if variant == "fp32":
        return model, model
    if variant in ("graphshard", "graphshard_whole"):
        import graphshard

        spec = graphshard.FullyShard(**bf16_spec())
        graphshard.compile(model, graphshard.Plan(mesh, {unit_glob: spec, "": spec}),
                           regional=variant == "graphshard")
        return model, model
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(**bf16_spec())
    for unit in units(model):
        if variant == "fsdp2_compile_blocks":
            unit.compile()
        fully_shard(unit, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    if variant == "fsdp2_compile":
        return torch.compile(model), model
    assert variant in ("fsdp2_eager", "fsdp2_compile_blocks"), variant
    return model, model


def train(module, model, loss_of: Callable, steps: int, dev, lr: float, warm: int = 2,
          profile_steps: int = 0) -> dict:
    """``steps`` AdamW steps of ``loss_of(module, i)``; per-step loss and seconds, the steady step
    time (median after the first ``warm`` steps: compile, first recompiles), and peak device memory.
    ``profile_steps``: that many more steps (on the last batches again) under ``torch.profiler``
    on CUDA, summarized by ``kernel_profile`` (kept out of the timed steps)."""
    import torch

    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    losses, times = [], []
    for i in range(steps):
        sync(dev)
        t0 = time.perf_counter()
        loss = loss_of(module, i)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync(dev)
        times.append(time.perf_counter() - t0)
        losses.append(float(loss.detach()))
    out = {"losses": losses, "step_s": times, "first_step_s": times[0], "steady_step_s": median(times[warm:])}
    if dev.type == "cuda":
        out["peak_mib"] = torch.cuda.max_memory_allocated(dev) / 2**20
    if profile_steps:
        def step(i):
            loss_of(module, i).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        out["profile"] = kernel_profile(step, [steps - 1 - i % steps for i in range(profile_steps)], dev)
    return out


KERNEL_KINDS = (  # (kind, substrings of the kernel name), first match wins
    ("nccl", ("nccl",)),
    ("gemm", ("gemm", "cutlass", "nvjet", "sm90_xmma", "cublas", "_mma", "wgmma")),
    ("attention", ("flash", "fmha", "attention")),
    ("triton (Inductor)", ("triton_",)),
    ("copy / memset", ("memcpy", "memset", "copy_kernel", "direct_copy", "CatArrayBatchedCopy")),
    ("optimizer (foreach)", ("multi_tensor_apply", "foreach")),
    ("reduction", ("reduce_kernel", "softmax", "norm")),
    ("elementwise (ATen)", ("elementwise", "vectorized", "unrolled")),
)
SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")


def kernel_profile(step: Callable[[int], None], batches: list[int], dev, top: int = 12) -> dict:
    """Where a step's time goes on the GPU: ``step(i)`` for each ``i`` in ``batches`` under
    ``torch.profiler``; per step: wall ms, GPU kernel ms (sum of kernel durations: busy time when
    kernels do not overlap), kernel launches, host-blocking synchronizations and device-to-host
    copies, kernel ms by kind (``KERNEL_KINDS``) and the ``top`` kernels by total time. On the CPU
    (the dry run) the top-level CPU ops stand in for kernels."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    device_type = torch.autograd.DeviceType.CUDA if dev.type == "cuda" else torch.autograd.DeviceType.CPU
    n = len(batches)
    sync(dev)
    t0 = time.perf_counter()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for i in batches:
            step(i)
        sync(dev)
    wall_ms = (time.perf_counter() - t0) * 1e3 / n
    kernels: dict[str, list[float]] = {}
    syncs = d2h = launches = 0
    events = prof.events()
    # the GPU timeline also holds the host's annotations (``Optimizer.step#...``, ``FSDP::...``) as
    # ranges: not kernels, and they overlap the kernels they enclose
    host_names = {e.name for e in events if e.device_type == torch.autograd.DeviceType.CPU}
    for e in events:
        name = e.name
        if dev.type == "cuda" and e.device_type == device_type and name not in host_names \
                or dev.type != "cuda" and e.cpu_parent is None:
            kernels.setdefault(name, []).append(e.time_range.elapsed_us() / 1e3)
        elif name in SYNC_CALLS:
            syncs += 1
        elif name in ("cudaMemcpyAsync", "cudaMemcpy"):
            d2h += 1  # host-side memcpy calls (a copy to the host blocks the host)
        elif name in ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx", "cudaLaunchKernelExC"):
            launches += 1
    total = {k: sum(v) for k, v in kernels.items()}
    by_kind: dict[str, float] = {}
    for name, ms in total.items():
        low = name.lower()
        kind = next((k for k, subs in KERNEL_KINDS if any(s.lower() in low for s in subs)), "other")
        by_kind[kind] = by_kind.get(kind, 0.0) + ms / n
    busy = sum(total.values()) / n
    ranked = sorted(total.items(), key=lambda kv: -kv[1])[:top]
    return {"steps": n, "wall_ms": wall_ms, "kernel_ms": busy, "busy_frac": busy / wall_ms if wall_ms else None,
            "kernels_per_step": sum(len(v) for v in kernels.values()) / n, "launches_per_step": launches / n,
            "syncs_per_step": syncs / n, "memcpy_calls_per_step": d2h / n,
            "by_kind_ms": dict(sorted(by_kind.items(), key=lambda kv: -kv[1])),
            "top": [{"name": k[:90], "ms_per_step": v / n, "calls_per_step": len(kernels[k]) / n} for k, v in ranked]}


def profile_lines(recs: dict) -> list[str]:
    """Markdown: the variants' kernel profiles side by side (kinds), then each variant's top kernels."""
    from check_common import fmt, table_lines

    profs = {k: r["profile"] for k, r in recs.items() if "kernel_ms" in r.get("profile", {})}
    if not profs:
        return []
    names = list(profs)
    rows = [["wall ms/step"] + [fmt(p["wall_ms"], 2) for p in profs.values()],
            ["GPU kernel ms/step"] + [fmt(p["kernel_ms"], 2) for p in profs.values()],
            ["GPU busy"] + [f"{p['busy_frac']:.0%}" for p in profs.values()],
            ["kernels / launches per step"] + [f"{p['kernels_per_step']:.0f} / {p['launches_per_step']:.0f}"
                                               for p in profs.values()],
            ["host syncs / memcpy calls per step"] + [f"{p['syncs_per_step']:.0f} / {p['memcpy_calls_per_step']:.0f}"
                                                     for p in profs.values()]]
    kinds = sorted({k for p in profs.values() for k in p["by_kind_ms"]},
                   key=lambda k: -max(p["by_kind_ms"].get(k, 0.0) for p in profs.values()))
    rows += [[f"{k} ms"] + [fmt(p["by_kind_ms"].get(k, 0.0), 2) for p in profs.values()] for k in kinds]
    lines = ["Kernel profile (torch.profiler, steps after the timed ones):", ""]
    lines += table_lines(["per step"] + names, rows)
    for name, p in profs.items():
        lines += ["", f"Top kernels, {name}:", ""]
        lines += table_lines(["kernel", "ms/step", "calls/step"],
                             [[f"`{t['name']}`", fmt(t["ms_per_step"], 3), fmt(t["calls_per_step"], 1)]
                              for t in p["top"]])
    return lines


FALLBACK = {"fsdp2_compile": "fsdp2_compile_blocks"}
"""A compiled FSDP2 variant that failed is retried with torchtitan's per-block compile (reported as its own part)."""


def run_variants(res, variants: list[str], base, dev, mesh, unit_glob: str, units: Callable, loss_of: Callable,
                 steps: int, lr: float, min_left_s: dict, summarize: Callable[[dict], None],
                 profile_steps: int = 0) -> dict:
    """Each variant as a part of ``res`` (one failing does not stop the others; a compiled FSDP2
    that fails is followed by its ``FALLBACK``); a variant with less than ``min_left_s[variant]``
    seconds left is skipped. ``summarize(records)`` runs after each variant. Returns variant ->
    ``train``'s record."""
    import _common

    from graphshard._compat import dynamo_counters

    out: dict = {}
    lines: list[str] = []  # one per variant that ran, kept above the summary
    queue = list(variants)
    while queue:
        variant = queue.pop(0)
        with res.part(variant):
            res.need(min_left_s.get(variant, 0))
            if variant in FALLBACK:
                queue.insert(0, FALLBACK[variant])  # removed again below once this variant has run
            dynamo_counters().clear()
            t0 = time.perf_counter()
            module, model = build(variant, base, dev, mesh, unit_glob, units)
            rec = train(module, model, loss_of, steps, dev, lr, profile_steps=profile_steps)
            if variant in FALLBACK:
                queue.remove(FALLBACK[variant])
            rec["setup_s"] = time.perf_counter() - t0 - sum(rec["step_s"])
            rec.update(_common.dynamo_counts(),
                       graph_break_reasons=[r.split("\n")[0] for r in _common.graph_break_reasons(3)])
            out[variant] = rec
            res.fig(variants=out)
            lines.append(f"- {variant}: first step {rec['first_step_s']:.1f} s, steady {rec['steady_step_s']:.4f} s/step"
                         + (f", peak {rec['peak_mib']:.0f} MiB" if "peak_mib" in rec else "")
                         + (f"; dynamo: {rec.get('unique_graphs')} graphs, {rec.get('graph_breaks')} graph breaks"
                            if variant != "fp32" else "")
                         + (f" ({one_line('; '.join(rec['graph_break_reasons']))})" if rec.get("graph_breaks") else ""))
            res.block("variants", lines)
        module = model = None  # a variant that failed midway must not hold its memory into the next
        reset_compile_state()
        if out:
            summarize(out)
    return out


def compiled_fsdp2(recs: dict) -> str | None:
    """The compiled FSDP2 variant that ran: ``fsdp2_compile``, else its fallback."""
    return next((v for v in ("fsdp2_compile", "fsdp2_compile_blocks") if v in recs), None)


def loss_table(recs: dict) -> list[str]:
    """Markdown lines: per-step losses of every variant side by side."""
    from check_common import table_lines

    names = list(recs)
    steps = max(len(r["losses"]) for r in recs.values())
    rows = [[i] + [f"{recs[n]['losses'][i]:.6f}" if i < len(recs[n]["losses"]) else "" for n in names]
            for i in range(steps)]
    return table_lines(["step"] + names, rows)


def loss_gap(a: dict, b: dict) -> float:
    """Largest per-step |loss difference| of two records (inf on NaN)."""
    from check_common import worst

    return worst([abs(x - y) for x, y in zip(a["losses"], b["losses"])])


def ratio(a, b) -> float | None:
    return a / b if a is not None and b else None
