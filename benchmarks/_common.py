"""Shared helpers for graphshard's distributed benchmarks.

Two halves, used by different processes:

* Worker side (inside a ``torchrun`` process): `init_dist`, `time_steps`,
  `peak_live_bytes`, `step_memory`, `mark_region`, `live_tensor_bytes`, `peak_rss_mib`, `dynamo_counts`,
  `count_collectives`, `gather_to_rank0`, `progress`.
* Driver side (the plain ``python`` process that launches one ``torchrun`` per
  run, see ``_launch.py``): `median`, `paired_ratio`, `markdown_table`, `fmt`,
  `plot_lines`.

Benchmarks may use private torch APIs (the profiler's kineto results, dynamo
counters); library code may not.

The worker/driver protocol is deliberately small: the worker prints
``@@progress <done> <total> <phase>`` lines on rank 0's stdout (the driver turns
them into a progress bar) and rank 0 writes one JSON object to ``--out``.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import resource
import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

PROGRESS_TAG = "@@progress"
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# --------------------------------------------------------------------------- worker side


class Unavailable(Exception):
    """The variant cannot run in this environment (reported, not an error)."""


def run_worker(run: Callable[[Any, "DistCtx"], dict | None], args, ctx: "DistCtx", base: dict) -> int:
    """Runs one variant and writes its JSON on rank 0 (``status`` unavailable / error on failure);
    returns the process exit code."""
    import traceback

    import torch.distributed as dist

    rc = 0
    try:
        res = run(args, ctx)
        if res is not None:
            write_json(args.out, {**base, **res})
    except Unavailable as e:  # raised identically on every rank, before any collective of the step
        if ctx.rank == 0:
            write_json(args.out, {**base, "status": "unavailable", "reason": str(e)})
    except Exception as e:  # noqa: BLE001
        traceback.print_exc()
        if ctx.rank == 0:
            write_json(args.out, {**base, "status": "error", "reason": f"{type(e).__name__}: {e}"[:2000]})
        rc = 1
    if rc == 0:
        dist.destroy_process_group()
    return rc


@dataclass
class DistCtx:
    rank: int
    world: int
    local_rank: int
    device: Any  # torch.device
    backend: str

    @property
    def device_type(self) -> str:
        return self.device.type


def init_dist() -> DistCtx:
    """Initialise the default process group: NCCL on GPUs, gloo on CPU."""
    import torch
    import torch.distributed as dist

    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        device, backend = torch.device("cuda", local_rank), "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    dist.init_process_group(backend, device_id=device if backend == "nccl" else None)
    return DistCtx(dist.get_rank(), dist.get_world_size(), local_rank, device, backend)


def sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def barrier(ctx: DistCtx) -> None:
    import torch.distributed as dist

    if ctx.backend == "nccl":
        dist.barrier(device_ids=[ctx.local_rank])
    else:
        dist.barrier()


def progress(ctx: DistCtx, done: int, total: int, phase: str) -> None:
    """Report progress to the driver (rank 0 only)."""
    if ctx.rank == 0:
        print(f"{PROGRESS_TAG} {done} {total} {phase}", flush=True)


def process_cpu_s() -> float:
    """CPU seconds this process has used so far, all its threads (gloo's included), user + system."""
    import resource

    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def time_steps(
    ctx: DistCtx,
    step: Callable[[int], float],
    warmup: int,
    steps: int,
) -> tuple[float, list[float], list[float], float]:
    """Run ``1 + warmup + steps`` steps; ``step(i)`` runs step ``i`` and returns its loss.

    Every step starts after a barrier (not timed) so ranks enter it together,
    and is timed with ``perf_counter`` (plus a device sync on GPU). Returns the
    first step's time (compile, lazy init), the times of the ``steps`` measured
    steps (warmup steps are dropped), the loss of every step, and the CPU seconds
    per measured step (`process_cpu_s`, barriers included).
    """
    total = 1 + warmup + steps
    times, losses = [], []
    cpu0 = 0.0
    for i in range(total):
        progress(ctx, i, total, "compile" if i == 0 else ("warmup" if i <= warmup else "steps"))
        if i == 1 + warmup:
            cpu0 = process_cpu_s()
        barrier(ctx)
        sync(ctx.device)
        t0 = time.perf_counter()
        loss = step(i)
        sync(ctx.device)
        times.append(time.perf_counter() - t0)
        losses.append(float(loss))
    cpu_s = (process_cpu_s() - cpu0) / max(steps, 1)
    progress(ctx, total, total, "memory")
    return times[0], times[1 + warmup :], losses, cpu_s


def live_tensor_bytes(device_type: str = "cpu") -> int:
    """Bytes of distinct tensor storages reachable from Python on ``device_type``.

    Walks the garbage collector's objects; storages are deduplicated by data
    pointer (views, tied weights, a DTensor's local shard and its Parameter
    wrapper count once). Wrapper subclasses (DTensor) and fake/meta tensors
    have no storage of their own and are skipped; their inner tensors are
    found as objects in their own right. Storages resized to 0 (freed
    FSDP-style) count 0.
    """
    import torch
    from torch._subclasses.fake_tensor import FakeTensor
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    gc.collect()
    seen: dict[int, int] = {}
    for obj in gc.get_objects():
        try:
            if not isinstance(obj, torch.Tensor) or isinstance(obj, FakeTensor):
                continue
            if is_traceable_wrapper_subclass(obj):
                continue
            st = obj.untyped_storage()
            if st.device.type != device_type:
                continue
            ptr = st.data_ptr()
            if ptr:
                seen[ptr] = max(seen.get(ptr, 0), st.nbytes())
        except Exception:  # exotic tensor types (functional, sparse): skip
            continue
    return sum(seen.values())


MARK_PREFIX = "gsbench:"
"""Name prefix of the profiler ranges `mark_region` opens."""

_CUDA_MARKS: dict[str, int] = {}
"""GPU: ``torch.cuda.memory_allocated`` at the end of each `mark_region`, the latest call of each name."""


@contextlib.contextmanager
def mark_region(name: str, device=None):
    """Names a region of a training step (the forward, say) so that `step_memory` can report
    the live bytes at its end. On the CPU it is a profiler range (``record_function``, a few
    microseconds when no profiler runs), whose end time places it among the allocation events;
    on a GPU the allocator's ``memory_allocated`` is read when it ends."""
    import torch

    with torch.profiler.record_function(MARK_PREFIX + name):
        yield
    if device is not None and getattr(device, "type", None) == "cuda":
        _CUDA_MARKS[name] = torch.cuda.memory_allocated(device)


def _cpu_profiled_peak_delta(fn: Callable[[], Any], marks: Sequence[str] = ()) -> tuple[int, int, dict[str, int]]:
    """Peak of net CPU allocations made while running ``fn`` (bytes above its start).

    Uses the profiler's memory events (``profile_memory=True``): every
    allocation and free through c10's CPU allocator on a thread the profiler
    sees, including those made by Inductor-generated code, which a
    TorchDispatchMode would not see. Returns ``(peak, unseen_free_bytes, at_marks)``:
    ``at_marks[name]`` is the net allocation (the same running sum) at the end of the
    last `mark_region` ``name`` that ``fn`` ran (absent if it ran none).

    Frees the profiler does not see: frees of blocks allocated before ``fn``
    started, and frees made on a thread outside the profiler's thread-local
    state. The second kind is common with gloo: a collective's work object
    holds its input and output tensors, and when gloo's worker thread drops the
    last reference (after the caller's ``wait`` has returned and the caller has
    let go of the tensors) the block is freed on that thread, unreported. A
    plain running sum would count such a block as live for the rest of the step,
    by an amount that depends on thread timing. So a block is taken as freed,
    at the latest, when the allocator hands its address out again (an address
    is never given to two live blocks); its bytes are reported as
    ``unseen_free_bytes``. A block whose free is unseen and whose address is
    not reused stays counted, so the result can still only over-estimate.
    """
    from torch._C._profiler import _EventType  # private: benchmark-only
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = []
    mark_end: dict[str, int] = {}
    wanted = {MARK_PREFIX + m: m for m in marks}
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        e = stack.pop()
        stack.extend(e.children)
        if e.typed[0] == _EventType.Allocation and e.typed[1].device.type == "cpu":
            events.append((e.start_time_ns, e.typed[1].ptr, e.typed[1].alloc_size))
        elif e.name in wanted:
            m = wanted[e.name]
            mark_end[m] = max(mark_end.get(m, 0), e.end_time_ns)
    # A mark's reading is taken after every allocation event up to its end time.
    events.extend((t, None, m) for m, t in mark_end.items())
    events.sort(key=lambda x: (x[0], x[1] is None))
    live: dict[int, int] = {}
    at_marks: dict[str, int] = {}
    cur = peak = unseen = 0
    for _, ptr, nbytes in events:
        if ptr is None:  # a mark's end
            at_marks[nbytes] = cur
            continue
        if nbytes > 0:
            if ptr in live:  # the block that had this address was freed where the profiler did not look
                freed = live.pop(ptr)
                cur -= freed
                unseen += freed
            live[ptr] = nbytes
        else:
            live.pop(ptr, None)
        cur += nbytes
        peak = max(peak, cur)
    return peak, unseen, at_marks


SNAPSHOT_ENV = "GS_BENCH_MEMORY_SNAPSHOT"
"""A path prefix: `step_memory` on a GPU records the measured step's allocations and writes
``<prefix>.rank<r>.pickle`` (open it with ``benchmarks/mem_at_peak.py`` or pytorch.org/memory_viz)."""


def _dump_snapshot(prefix: str, rank: int, resident: int, peak: int) -> None:
    import pickle

    from graphshard._compat import cuda_memory_history, cuda_memory_snapshot

    snap = cuda_memory_snapshot()
    cuda_memory_history(False)
    snap["graphshard_bench"] = {"resident": resident, "peak": peak}
    os.makedirs(os.path.dirname(os.path.abspath(prefix)), exist_ok=True)
    with open(f"{prefix}.rank{rank}.pickle", "wb") as f:
        pickle.dump(snap, f)


def step_memory(ctx: DistCtx, fn: Callable[[], Any], marks: Sequence[str] = ()) -> dict[str, Any]:
    """Live tensor memory of one call of ``fn`` (one training step), in bytes.

    ``resident``: live at the step boundary, right before ``fn`` (after the previous step's
    ``opt.step()`` and ``zero_grad``): parameters, optimizer state, persistent buffers.
    ``peak``: the most live at any point during the step. ``above_resident`` = ``peak -
    resident``: what the step itself holds at its peak (activations saved for the backward,
    gathered parameters, gradients, temporaries); the activation figure. ``at_marks[name]``:
    live bytes above ``resident`` at the end of each `mark_region` ``name`` the step ran (at the
    end of the forward: what the forward leaves for the backward). ``unseen_free``: the CPU
    measurement's correction for frees the profiler did not see (0 on GPU).

    * GPU: ``torch.cuda.max_memory_allocated`` after a peak reset (the caching
      allocator's live bytes, not its reserved pool); marks read ``memory_allocated``.
    * CPU: ``live_tensor_bytes`` at the step boundary plus the peak of the
      step's net allocations from the profiler (`_cpu_profiled_peak_delta`).
    """
    import torch

    if ctx.device_type == "cuda":
        sync(ctx.device)
        resident = torch.cuda.memory_allocated(ctx.device)
        snapshot = os.environ.get(SNAPSHOT_ENV)
        if snapshot:
            from graphshard._compat import cuda_memory_history

            cuda_memory_history(True)
        torch.cuda.reset_peak_memory_stats(ctx.device)
        _CUDA_MARKS.clear()
        fn()
        sync(ctx.device)
        peak = torch.cuda.max_memory_allocated(ctx.device)
        if snapshot:
            _dump_snapshot(snapshot, ctx.rank, resident, peak)
        at = {m: _CUDA_MARKS[m] - resident for m in marks if m in _CUDA_MARKS}
        return {"peak": peak, "resident": resident, "above_resident": peak - resident, "unseen_free": 0,
                "at_marks": at, "method": "cuda.max_memory_allocated"}
    resident = live_tensor_bytes("cpu")
    delta, unseen, at = _cpu_profiled_peak_delta(fn, marks)
    return {"peak": resident + delta, "resident": resident, "above_resident": delta, "unseen_free": unseen,
            "at_marks": at, "method": "gc-live-storages+profiler-cpu-alloc"}


def peak_live_bytes(ctx: DistCtx, fn: Callable[[], Any]) -> tuple[int, int, int, str]:
    """Peak live tensor bytes during one call of ``fn`` (one training step).

    Returns ``(peak, resident, unseen_free, method)``: ``resident`` is what is
    live at the step boundary (parameters, optimizer state, any persistent
    buffers); ``unseen_free`` is the CPU measurement's correction for frees the
    profiler did not see (0 on GPU). See `step_memory`, which also gives the
    live bytes at the end of marked regions.
    """
    m = step_memory(ctx, fn)
    return m["peak"], m["resident"], m["unseen_free"], m["method"]


def peak_rss_mib() -> float:
    """This process's peak resident set size (``ru_maxrss``, KiB on Linux) in MiB."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def dynamo_counts() -> dict[str, int]:
    """Graph breaks and graphs compiled by dynamo in this process (private counters)."""
    try:
        from torch._dynamo.utils import counters
    except Exception:
        return {}
    return {
        "graph_breaks": int(sum(counters["graph_break"].values())),
        "unique_graphs": int(counters["stats"].get("unique_graphs", 0)),
    }


def graph_break_reasons(limit: int = 5) -> list[str]:
    try:
        from torch._dynamo.utils import counters
    except Exception:
        return []
    return [f"{n}x {r[:200]}" for r, n in counters["graph_break"].most_common(limit)]


# Collective ops by kind. Namespaces: ``_c10d_functional`` (DTensor, funcol, Inductor-generated code),
# ``_c10d_functional_autograd`` (autograd-aware funcol) and ``c10d`` (ProcessGroup methods, which
# torch.distributed's Python API and FSDP2 call; ProcessGroup routes them through these dispatcher ops).
COLLECTIVE_KINDS = {
    "all_reduce": ("all_reduce", "all_reduce_", "all_reduce_coalesced", "all_reduce_coalesced_",
                   "allreduce_", "allreduce_coalesced_"),
    "all_gather": ("all_gather_into_tensor", "all_gather_into_tensor_out", "all_gather_into_tensor_coalesced",
                   "_allgather_base_", "allgather_", "allgather_coalesced_", "allgather_into_tensor_coalesced_"),
    "reduce_scatter": ("reduce_scatter_tensor", "reduce_scatter_tensor_out", "reduce_scatter_tensor_coalesced",
                       "_reduce_scatter_base_", "reduce_scatter_", "reduce_scatter_tensor_coalesced_"),
    "all_to_all": ("all_to_all_single", "alltoall_", "alltoall_base_"),
    "broadcast": ("broadcast", "broadcast_"),
    "reduce": ("reduce_",),
    "gather": ("gather_",),
    "scatter": ("scatter_",),
    "send": ("send", "isend", "batch_p2p_ops"),
}
_OP_KIND = {op: kind for kind, ops in COLLECTIVE_KINDS.items() for op in ops}
COLLECTIVE_NAMESPACES = ("_c10d_functional", "_c10d_functional_autograd", "c10d")


def _tensor_bytes(x: Any) -> int:
    import torch

    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(_tensor_bytes(y) for y in x)
    return 0


def _collective_counter_cls():
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    class CollectiveCounter(TorchDispatchMode):
        """Bytes and calls of every collective op dispatched while active, by kind.

        ``in_bytes`` are the bytes of the op's input tensors on this rank (the
        local shard for an all-gather, the full buffer for an all-reduce or a
        reduce-scatter), ``out_bytes`` those of its outputs. Ops that only wait
        or receive (``wait_tensor``, ``recv_``, barriers) are not counted.

        ``ignore_compile_internals`` is True so that code compiled by
        ``torch.compile`` still runs compiled under the mode (dynamo skips frames
        under other modes and the step would run eagerly); Inductor's generated
        wrapper calls ``torch.ops._c10d_functional.*``, which the mode sees.
        Ops on tensor subclasses (DTensor) are handed back to the subclass
        (``NotImplemented``), which then runs under the mode: the funcol ops it
        issues on its local tensors (redistributions, loss_parallel's
        all-reduces) are seen.
        """

        @classmethod
        def ignore_compile_internals(cls) -> bool:
            return True

        def __init__(self) -> None:
            super().__init__()
            self.by_kind: dict[str, dict[str, int]] = {}
            self.ops: dict[str, int] = {}

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if any(t is not torch.Tensor for t in types):
                # A tensor subclass (DTensor, funcol's AsyncCollectiveTensor): let it dispatch with this
                # mode still active, so the collectives it issues on its local tensors are seen. (Calling
                # ``func`` here would run the subclass with the mode popped: DTensor's in-op
                # redistributions and loss_parallel's all-reduces would be missed.)
                return NotImplemented
            out = func(*args, **kwargs)
            kind = _OP_KIND.get(func._schema.name.split("::")[-1]) if func.namespace in COLLECTIVE_NAMESPACES else None
            if kind is not None:
                in_b = out_b = 0
                named = list(zip((a.name for a in func._schema.arguments), args)) + list(kwargs.items())
                for name, val in named:
                    if name.startswith("output") or name in ("out", "outputs"):
                        out_b += _tensor_bytes(val)
                    else:
                        in_b += _tensor_bytes(val)
                if func.namespace != "c10d":  # funcol: the result is the output
                    out_b = out_b or _tensor_bytes(out)
                elif kind in ("all_reduce", "broadcast"):  # in-place: the buffer is the output
                    out_b = in_b
                rec = self.by_kind.setdefault(kind, {"calls": 0, "in_bytes": 0, "out_bytes": 0})
                rec["calls"] += 1
                rec["in_bytes"] += in_b
                rec["out_bytes"] += out_b
                self.ops[str(func)] = self.ops.get(str(func), 0) + 1
            return out

        @property
        def total_in_bytes(self) -> int:
            return sum(r["in_bytes"] for r in self.by_kind.values())

        @property
        def total_calls(self) -> int:
            return sum(r["calls"] for r in self.by_kind.values())

    return CollectiveCounter


def count_collectives(fn: Callable[[], Any]) -> dict[str, Any]:
    """Run ``fn`` (one training step) counting the collectives this rank issues.

    Returns ``{"by_kind": {kind: {calls, in_bytes, out_bytes}}, "in_bytes", "calls",
    "ops": {op: calls}, "backend_calls": {event: calls}}``. The step runs under a
    `TorchDispatchMode` (see ``CollectiveCounter``) and, as a cross-check, under the
    profiler: ``backend_calls`` counts the process-group backend's own events
    (``gloo:all_reduce``, ``nccl:...``), one per collective whichever layer issued
    it, so a collective the mode missed shows as a difference in call counts.
    """
    from torch.profiler import ProfilerActivity, profile

    counter = _collective_counter_cls()()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        with counter:
            fn()
    backend: dict[str, int] = {}
    for e in prof.events():
        if e.name.startswith(("gloo:", "nccl:")) and "barrier" not in e.name:
            backend[e.name] = backend.get(e.name, 0) + 1
    return {"by_kind": counter.by_kind, "in_bytes": counter.total_in_bytes, "calls": counter.total_calls,
            "ops": counter.ops, "backend_calls": backend}


def gather_to_rank0(obj: Any) -> list[Any] | None:
    """``all_gather_object`` of a small picklable object; the list on rank 0, None elsewhere."""
    import torch.distributed as dist

    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out if dist.get_rank() == 0 else None


def write_json(path: str, obj: Any) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(obj, f, indent=1)


# --------------------------------------------------------------------------- driver side


def median(xs: Iterable[float | None]) -> float | None:
    vals = [x for x in xs if x is not None]
    return statistics.median(vals) if vals else None


def rank_timings(ranks: list[dict]) -> dict:
    """The timing part of a run's result from every rank's figures: the slowest rank's
    set-up and first step, per step the slowest rank, the busiest rank's CPU seconds per
    step, and the loss averaged over ranks
    (under data parallelism the ranks see different rows; the mean is the global-batch loss)."""
    n_steps = len(ranks[0]["step_times_s"])
    step_times = [max(r["step_times_s"][i] for r in ranks) for i in range(n_steps)]
    return {
        "setup_s": max(r["setup_s"] for r in ranks),
        "first_step_s": max(r["first_step_s"] for r in ranks),
        "step_times_s": step_times,
        "step_s": median(step_times),
        "cpu_s": max(r["cpu_s"] for r in ranks),
        "losses": [sum(r["losses"][i] for r in ranks) / len(ranks) for i in range(len(ranks[0]["losses"]))],
    }


def paired_ratio(num: Sequence[float | None], den: Sequence[float | None]) -> float | None:
    """Median over repetitions of ``num[i] / den[i]``: runs adjacent in time are paired,
    which cancels most of the drift between launches."""
    return median(a / b for a, b in zip(num, den) if a is not None and b)


def fmt(x: Any, nd: int = 3) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:.{nd}f}"
    return str(x)


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    cells = [[str(h) for h in headers]] + [[fmt(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    line = lambda r: "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |"  # noqa: E731
    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(cells[0]), sep, *(line(r) for r in cells[1:])])


def plot_lines(
    x: Sequence[float],
    panels: dict[str, dict[str, Sequence[float | None]]],
    path: str,
    *,
    xlabel: str,
    title: str = "",
) -> str | None:
    """One subplot per ``panels`` entry (title -> {series label -> y values}); saves a PNG.

    Returns the path, or None when matplotlib is missing (``pip install .[bench]``).
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4), squeeze=False)
    for ax, (name, series) in zip(axes[0], panels.items()):
        for label, ys in series.items():
            pts = [(a, b) for a, b in zip(x, ys) if b is not None]
            if pts:
                ax.plot(*zip(*pts), marker="o", label=label)
        ax.set_title(name)
        ax.set_xlabel(xlabel)
        ax.set_xticks(list(x))
        ax.grid(alpha=0.3)
        ax.set_ylim(bottom=0)
    axes[0][0].legend(fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


# --------------------------------------------------------------------------- driver side


def add_runner_args(p, saved_json: str) -> None:
    """The driver options every benchmark shares: caching, contention handling, timeouts, output."""
    p.add_argument("--warm-cache", action="store_true",
                   help="share Inductor/Triton caches between runs (default: a cold cache per run)")
    p.add_argument("--idle-wait", type=float, default=60.0,
                   help="before each run, wait up to this many seconds for the machine to be idle (0: off)")
    p.add_argument("--max-other-cpu", type=float, default=15.0,
                   help="repeat a run during which other jobs used more than this %% of the machine")
    p.add_argument("--retries", type=int, default=2, help="at most this many repeats of a contended run")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per run before it is killed")
    p.add_argument("--out-dir", default=os.path.join(REPO, "bench_out"))
    p.add_argument("--from-json", default=None, metavar="PATH",
                   help=f"no runs: re-print the report of a saved {saved_json}")


def contended(rec: dict, args) -> bool:
    return rec.get("status") == "ok" and (rec.get("other_cpu_pct") or 0) > args.max_other_cpu


def least_contended(attempts: list[dict], earlier: list | None = None) -> dict:
    """The successful attempt with the least foreign CPU load; records every attempt's load."""
    best = min(attempts, key=lambda r: (r["status"] != "ok", r.get("other_cpu_pct") or 0))
    loads = (earlier or []) + [r.get("other_cpu_pct") for r in attempts[1 if earlier else 0:]]
    return {**best, "attempts_other_cpu_pct": loads}


def run_until_quiet(run: Callable[[int], dict], args, write: Callable[[str], Any]) -> dict:
    """Runs ``run(attempt)`` up to ``1 + args.retries`` times, stopping at the first run that
    failed or was measured on a quiet machine; returns the least contended attempt."""
    attempts = []
    for attempt in range(1 + args.retries):
        res = run(attempt)
        write(res.pop("_msg"))
        attempts.append(res)
        if not contended(res, args):
            break
    return least_contended(attempts)


def make_up_contended(records: list[dict], args, rerun: Callable[[dict, int], dict]) -> None:
    """Make-up pass: runs still contended after their retries get one more try at the end
    (``rerun(record, attempt)``); each record keeps the less contended of the two."""
    if not args.retries:
        return
    for i, rec in enumerate(records):
        if contended(rec, args):
            again = rerun(rec, len(rec["attempts_other_cpu_pct"]))
            print(again.pop("_msg"), flush=True)
            records[i] = least_contended([rec, again], rec["attempts_other_cpu_pct"])


def git_revision() -> str:
    """HEAD of the checkout being measured, '+dirty' when graphshard/ or passes/ have local changes."""
    import subprocess

    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                              text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "graphshard", "passes", "kernels"],
                               cwd=REPO, capture_output=True, text=True).stdout.strip()
        return head + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
