"""Driver-side process handling for the distributed benchmarks.

`launch` runs one ``torchrun`` (one benchmark run) and collects its JSON
result; `CpuMonitor` and `wait_for_idle` deal with a shared machine, where
other jobs running at the same time are the main source of noise.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any, Callable, Sequence

from _common import PROGRESS_TAG


def launch(
    script: str,
    args: Sequence[str],
    *,
    nproc: int,
    log_path: str,
    env: dict[str, str] | None = None,
    fresh_compile_cache: bool = True,
    cache_dir: str | None = None,
    timeout: float = 3600.0,
    on_progress: Callable[[int, int, str], None] | None = None,
) -> dict[str, Any]:
    """Run ``torchrun --standalone --nproc-per-node nproc script args --out <tmp>``.

    Streams stdout+stderr into ``log_path``, calls ``on_progress`` for every
    ``@@progress`` line, and returns the JSON rank 0 wrote (or a
    ``{"status": "failed", ...}`` record). With ``fresh_compile_cache`` the
    Inductor/Triton caches point at a new empty directory, so every run pays
    a cold compile, as the first run in a fresh environment would. ``cache_dir`` instead
    points them at that directory, which outlives the run: launched twice with the same one,
    the second run is a warm start (a second process on the same model and plan).
    """
    tmp = tempfile.mkdtemp(prefix="gsbench_")
    out = os.path.join(tmp, "result.json")
    run_env = dict(os.environ if env is None else env)
    run_env["PYTHONUNBUFFERED"] = "1"
    if fresh_compile_cache or cache_dir:
        warm_machine_compile_state(run_env)
        caches = cache_dir or tmp
        run_env["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(caches, "inductor")
        run_env["TRITON_CACHE_DIR"] = os.path.join(caches, "triton")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           script, *args, "--out", out]
    os.makedirs(os.path.dirname(os.path.abspath(log_path)), exist_ok=True)
    t0 = time.perf_counter()
    try:
        with open(log_path, "w") as log:
            log.write("$ " + " ".join(cmd) + "\n")
            log.flush()
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=run_env,
                                    start_new_session=True)
            # A hung collective must not hang the driver: kill the run's own process group.
            watchdog = threading.Timer(timeout, lambda: _kill_group(proc))
            watchdog.start()
            assert proc.stdout is not None
            try:
                for line in proc.stdout:
                    log.write(line)
                    if line.startswith(PROGRESS_TAG) and on_progress is not None:
                        _, done, total, phase = line.split(maxsplit=3)
                        on_progress(int(done), int(total), phase.strip())
                rc = proc.wait()
            except BaseException:  # Ctrl-C in the driver: take the run down with it
                _kill_group(proc)
                raise
            finally:
                watchdog.cancel()
        wall = time.perf_counter() - t0
        if os.path.exists(out):
            with open(out) as f:
                res = json.load(f)
        else:
            res = {"status": "failed", "reason": f"exit code {rc}, no result; see {log_path}"}
        res["launch_wall_s"] = wall
        res["log"] = log_path
        return res
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


_machine_state_checked = False  # this driver has built (or found) the per-machine compile state


def warm_machine_compile_state(env: dict[str, str]) -> None:
    """Builds, once per driver, what Inductor keeps per machine instead of in
    ``TORCHINDUCTOR_CACHE_DIR``: its precompiled C++ header (``/tmp/torchinductor_<user>/
    precompiled_headers``, about 150 MB, 10 s on the 2-core AMD machine). A benchmark's cold runs share
    that header; without this, the first cold run on a fresh machine would build it alone, and the
    first variant of a sweep would pay for every other. One tiny CPU compile in a throwaway cache
    directory builds it (15 s more here); a failure only means the first run pays, as before. Not on a
    GPU machine, where the runs build no C++ kernels, nor where a header is built already."""
    global _machine_state_checked
    if _machine_state_checked:
        return
    _machine_state_checked = True
    import getpass

    import torch

    headers = os.path.join(tempfile.gettempdir(), f"torchinductor_{getpass.getuser()}", "precompiled_headers")
    if torch.cuda.is_available() or (os.path.isdir(headers) and any(f.endswith(".gch") for f in os.listdir(headers))):
        return
    code = "import torch\nf = torch.compile(lambda x: (x * 2).sin())\nf(torch.randn(64))\n"
    with tempfile.TemporaryDirectory(prefix="gsbench_warm_") as cache:
        try:
            subprocess.run([sys.executable, "-c", code], env={**env, "TORCHINDUCTOR_CACHE_DIR": cache},
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=600, check=False)
        except subprocess.TimeoutExpired:
            pass


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def cpu_times() -> list[int] | None:
    """The aggregate ``cpu`` line of /proc/stat in clock ticks (None where there is none)."""
    try:
        with open("/proc/stat") as f:
            return [int(x) for x in f.readline().split()[1:9]]  # user nice system idle iowait irq softirq steal
    except (OSError, ValueError):
        return None


class CpuMonitor:
    """How much of the machine something other than our runs used while a run was measured.

    ``other_pct``: CPU time spent by processes that are not this driver or its
    children (other users' jobs on a shared machine, read as the machine's busy
    time from /proc/stat minus our own ``getrusage`` time), plus hypervisor
    steal, as a share of the machine's capacity over the run. A run with a high
    value was measured on a contended machine.
    """

    def __enter__(self) -> "CpuMonitor":
        self.ticks0, self.own0 = cpu_times(), self._own()
        return self

    def __exit__(self, *exc) -> None:
        self.other_pct = self.steal_pct = None
        ticks1 = cpu_times()
        if not self.ticks0 or not ticks1:
            return
        d = [b - a for a, b in zip(self.ticks0, ticks1)]
        hz = os.sysconf("SC_CLK_TCK")
        total_s = sum(d) / hz
        if total_s <= 0:
            return
        busy_s = (d[0] + d[1] + d[2] + d[5] + d[6]) / hz
        foreign_s = max(0.0, busy_s - (self._own() - self.own0))
        self.steal_pct = 100.0 * d[7] / hz / total_s
        self.other_pct = 100.0 * foreign_s / total_s + self.steal_pct

    @staticmethod
    def _own() -> float:
        ch, me = resource.getrusage(resource.RUSAGE_CHILDREN), resource.getrusage(resource.RUSAGE_SELF)
        return ch.ru_utime + ch.ru_stime + me.ru_utime + me.ru_stime


def wait_for_idle(max_wait_s: float, busy_below: float = 0.25, sample_s: float = 1.0) -> float:
    """Wait (up to ``max_wait_s``) until the machine's busy share over ``sample_s`` is below
    ``busy_below``; returns the seconds waited. Keeps runs from starting on top of other jobs."""
    t0 = time.perf_counter()
    while True:
        a = cpu_times()
        time.sleep(sample_s)
        b = cpu_times()
        if not a or not b:
            return 0.0
        d = [y - x for x, y in zip(a, b)]
        busy = (sum(d) - d[3] - d[4]) / max(1, sum(d))
        waited = time.perf_counter() - t0
        if busy < busy_below or waited >= max_wait_s:
            return waited
