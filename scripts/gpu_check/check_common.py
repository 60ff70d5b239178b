"""What every section of ``scripts/gpu_check.py`` shares: the repository on the import path
(no install), the section's result (flushed to its JSON file on every change, so a section
killed at its time limit still reports what it had), parts that fail on their own, the
device, a one-rank process group, timing and comparison helpers.

A section module (``check_*.py`` beside this file) defines ``run(res, dry)``: it fills ``res``
(a ``Result``) and raises only for what stops the whole section. ``scripts/gpu_check.py`` holds the
list of sections with their titles and time budgets, and runs each in a process of its own
(``main`` below).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
import time
import traceback
from importlib.abc import MetaPathFinder
from importlib.util import spec_from_file_location
from typing import Any, Iterator

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
BENCHMARKS = os.path.join(REPO, "benchmarks")

# ----------------------------------------------------------------------------- import path


class _RepoPackages(MetaPathFinder):
    """``graphshard.passes`` and ``graphshard.kernels`` from the repository's ``passes/`` and
    ``kernels/`` (pyproject's package-dir mapping, which only an install provides): the check
    runs from a bare checkout on the GPU machine, where nothing can be installed from a registry."""

    MAP = {"graphshard.passes": os.path.join(REPO, "passes"), "graphshard.kernels": os.path.join(REPO, "kernels")}

    def find_spec(self, fullname, path, target=None):
        where = self.MAP.get(fullname)
        if where is None:
            return None
        return spec_from_file_location(fullname, os.path.join(where, "__init__.py"), submodule_search_locations=[where])


def bootstrap() -> None:
    """This checkout's graphshard first on the import path (before any installed copy)."""
    for p in (BENCHMARKS, REPO):
        if p not in sys.path:
            sys.path.insert(0, p)
    if not any(isinstance(f, _RepoPackages) for f in sys.meta_path):
        sys.meta_path.insert(0, _RepoPackages())


def child_env(dry: bool, **extra: str) -> dict[str, str]:
    """The environment of a process a section launches (torchrun): the repository on PYTHONPATH."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([REPO, *filter(None, [env.get("PYTHONPATH")])])
    env.setdefault("PYTHONUNBUFFERED", "1")
    if dry:
        env.setdefault("OMP_NUM_THREADS", "1")
    env.update(extra)
    return env


def torchrun_cmd(nproc: int, script: str, *args: str) -> list[str]:
    """``torchrun --standalone --nproc-per-node N run_script.py SCRIPT ARGS``: the repository's
    script run with this checkout's graphshard."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
            os.path.join(HERE, "run_script.py"), os.path.join(REPO, script), *args]


def run_launcher(cmd: list[str], env: dict, timeout: float) -> tuple[int | None, str]:
    """Runs ``cmd`` (a torchrun), its output echoed to this section's log and returned. On
    ``timeout``: SIGTERM (torchrun then stops its workers, which run in sessions of their own),
    SIGKILL 10 s later; the return code is then None."""
    import signal
    import subprocess
    import threading

    lines: list[str] = []
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    def pump():
        for line in proc.stdout:
            lines.append(line)
            print(line, end="", flush=True)

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    try:
        rc = proc.wait(timeout=max(1.0, timeout))
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        rc = None
    reader.join(timeout=5)
    return rc, "".join(lines)


# ----------------------------------------------------------------------------- results


class Result:
    """A section's report: ``status`` (ok / fail / error), ``figures`` (JSON), ``md`` (markdown
    lines), ``parts`` (name -> status and error). Written to ``path`` on every change."""

    def __init__(self, path: str, deadline: float):
        self.path, self.deadline = path, deadline
        self.data: dict[str, Any] = {"status": "running", "figures": {}, "md": [], "parts": {}}
        self._md: list = []  # markdown lines, and names of blocks (`block`) where they stand
        self._blocks: dict[str, list[str]] = {}
        self.flush()

    def flush(self) -> None:
        self.data["md"] = [l for e in self._md for l in (self._blocks[e[1]] if isinstance(e, tuple) else [e])]
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(self.data, f, indent=1, default=str)
        os.replace(tmp, self.path)

    def fig(self, **kv) -> None:
        self.data["figures"].update(kv)
        self.flush()

    def line(self, text: str) -> None:
        last = self._md[-1] if self._md else ""
        if isinstance(last, str) and last.lstrip().startswith("- ") and not text.lstrip().startswith("- "):
            self._md.append("")  # a paragraph after a list: not a continuation of its last item
        self._md.append(text)
        print(text, flush=True)
        self.flush()

    def table(self, headers: list[str], rows: list[list[Any]]) -> None:
        for line in table_lines(headers, rows):
            self._md.append(line)
        print("\n".join(table_lines(headers, rows)), flush=True)
        self.flush()

    def block(self, name: str, lines: list[str]) -> None:
        """Markdown lines that a later call with the same ``name`` replaces where they stand (a
        summary rewritten as results come in, so a section killed midway still shows one)."""
        if name not in self._blocks:
            self._md.append(("block", name))
        self._blocks[name] = list(lines)
        print("\n".join(lines), flush=True)
        self.flush()

    def check(self, name: str, ok: bool, detail: str = "") -> bool:
        """A pass/fail fact: a failed one makes the section ``fail``."""
        self.data.setdefault("checks", []).append({"name": name, "ok": bool(ok), "detail": detail})
        self.line(f"- {'PASS' if ok else 'FAIL'}: {name}" + (f" ({detail})" if detail else ""))
        return ok

    def left_s(self) -> float:
        return self.deadline - time.time()

    def need(self, seconds: float) -> None:
        """Raises ``NoTime`` (inside a ``part``: that part is left out) unless ``seconds`` are left."""
        if self.left_s() < seconds:
            raise NoTime(f"{self.left_s():.0f} s left, {seconds:.0f} s wanted")

    @contextlib.contextmanager
    def part(self, name: str) -> Iterator[None]:
        """A part of the section that may fail without stopping the rest: its exception is
        recorded (class, message, traceback tail) and the section goes on."""
        t0 = time.perf_counter()
        self.data["parts"][name] = {"status": "running"}
        self.flush()
        try:
            yield
        except Skip as e:
            status = "no time" if isinstance(e, NoTime) else "skipped"
            self.data["parts"][name] = {"status": status, "reason": str(e)}
            self.line(f"- {name}: {status} ({e})")
        except Exception as e:  # noqa: BLE001 - reported, the section goes on
            root = root_cause(e)
            self.data["parts"][name] = {
                "status": "error", "seconds": round(time.perf_counter() - t0, 1),
                "error": f"{type(root).__name__}: {str(root).strip()[:600]}",
                "traceback": traceback.format_exc()[-3000:]}
            self.line(f"- {name}: ERROR {type(root).__name__}: {one_line((str(root).strip().splitlines() or [''])[0])}")
            traceback.print_exc()
        else:
            self.data["parts"][name] = {"status": "ok", "seconds": round(time.perf_counter() - t0, 1)}
        self.flush()

    def finish(self) -> None:
        failed = any(not c["ok"] for c in self.data.get("checks", []))
        errored = any(p["status"] == "error" for p in self.data["parts"].values())
        short = any(p["status"] == "no time" for p in self.data["parts"].values())
        self.data["status"] = "error" if errored else "fail" if failed else "incomplete" if short else "ok"
        self.flush()


def table_lines(headers: list[str], rows: list[list[Any]]) -> list[str]:
    from _common import markdown_table

    return ["", markdown_table(headers, rows), ""]


def one_line(text: str, n: int = 300) -> str:
    """``text`` on one line (markdown list items and table cells), at most ``n`` characters."""
    return " ".join(str(text).split())[:n].replace("|", "/")


class Skip(Exception):
    """A part that does not apply here (a missing optional package): reported as skipped."""


class NoTime(Skip):
    """A part left out for lack of time: the section is then ``incomplete``."""


def root_cause(e: BaseException) -> BaseException:
    """The error a compile failure wraps (dynamo's BackendCompilerFailed names only the backend)."""
    seen = set()
    while id(e) not in seen:
        seen.add(id(e))
        inner = getattr(e, "inner_exception", None) or e.__cause__
        if inner is None:
            break
        e = inner
    return e


# ----------------------------------------------------------------------------- device, process group


def device(dry: bool):
    import torch

    return torch.device("cpu") if dry else torch.device("cuda", 0)


def init_world1(dry: bool) -> None:
    """A one-rank default process group (NCCL on the GPU, gloo in the dry run), no launcher."""
    import torch
    import torch.distributed as dist

    if dist.is_initialized():
        return
    if dry:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    else:
        torch.cuda.set_device(0)
        dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1,
                                device_id=torch.device("cuda", 0))


def sync(dev) -> None:
    import torch

    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def reset_compile_state() -> None:
    """Between variants of one process: dynamo's caches and counters, and free device memory."""
    import gc

    import torch

    torch._dynamo.reset()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def max_abs_diff(a, b) -> float:
    """Largest |a - b| that fails on NaN/inf (a ``max()`` over NaN would drop it): inf then."""
    import torch

    a, b = torch.as_tensor(a).double(), torch.as_tensor(b).double()
    if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
        return math.inf
    return float((a - b).abs().max()) if a.numel() else 0.0


def worst(values) -> float:
    """The largest of ``values``, inf if any is NaN."""
    out = 0.0
    for v in values:
        if not v <= out:  # NaN compares false: it wins
            out = math.inf if math.isnan(v) else v
    return out


def fmt(x: Any, nd: int = 3) -> str:
    from _common import fmt as _fmt

    return _fmt(x, nd)


def median(xs) -> float | None:
    import statistics

    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def main(module_name: str, result_path: str, dry: bool, deadline: float) -> int:
    """Runs one section in this process (``gpu_check.py --section``); exit 0 unless it raised."""
    bootstrap()
    import importlib

    mod = importlib.import_module(module_name)
    res = Result(result_path, deadline)
    try:
        mod.run(res, dry)
    except Exception as e:  # noqa: BLE001 - the driver shows the tail of stderr
        root = root_cause(e)
        res.data["error"] = f"{type(root).__name__}: {str(root).strip()[:1000]}"
        res.data["status"] = "error"
        res.flush()
        traceback.print_exc()
        return 1
    res.finish()
    return 0
