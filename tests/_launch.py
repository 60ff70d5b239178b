"""Runs a worker under torchrun (gloo on the CPU) and returns the JSON results rank 0 printed."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys

HERE = os.path.dirname(__file__)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(worker: str, args: list[str], nproc: int = 2, timeout: int = 900,
           env: dict | None = None) -> tuple[list[dict], subprocess.CompletedProcess]:
    """Runs the worker (``env``: variables added to the environment); returns the results rank 0
    printed (however the job ended) and the process."""
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
           f"--master-port={_free_port()}", os.path.join(HERE, "workers", worker), *args]
    # faulthandler: a rank that dies of a signal (an abort at exit, a segfault) prints every thread's
    # Python stack into the output the failing test shows
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCHINDUCTOR_COMPILE_THREADS": "1", "PYTHONFAULTHANDLER": "1",
           **(env or {})}
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) as job:
        try:
            out, err = job.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:  # what the job printed before it is stopped still counts
            job.terminate()  # torchrun stops its ranks (each in a session of its own) on SIGTERM
            try:
                out, err = job.communicate(timeout=60)
            except subprocess.TimeoutExpired:
                job.kill()
                out, err = job.communicate()
            err += f"\nTimeoutError: the job ran past its {timeout} s limit and was stopped\n"
    proc = subprocess.CompletedProcess(cmd, job.returncode, out, err)
    results = [json.loads(l[len("RESULT "):]) for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
    return results, proc


def torchrun(worker: str, args: list[str], nproc: int = 2, timeout: int = 900, env: dict | None = None) -> list[dict]:
    results, proc = launch(worker, args, nproc, timeout, env)
    if proc.returncode != 0:
        raise AssertionError(f"{' '.join(proc.args)} failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}")
    return results


JOB_FAILED = "JobFailed"
"""The ``error`` of a case that took its job down (`run_cases`)."""


class CaseResults(dict):
    """Results by case (`run_cases`). Reading a case that took its job down fails the reading test
    with that job's error; the cases after it ran in a job of their own."""

    def __getitem__(self, case: str) -> dict:
        result = super().__getitem__(case)
        if result.get("error") == JOB_FAILED:
            raise AssertionError(f"{case} took its job down: {result['message']}\n{result['traceback']}")
        return result


def run_cases(worker: str, cases: list[str], nproc: int = 2, timeout: int = 900,
              env: dict | None = None) -> CaseResults:
    """Every case's result from ``worker``, which prints one ``RESULT`` with its ``case`` per case,
    in order. A case that takes its job down (an exception, a crash, a collective another rank
    never joined) is recorded as such, and the job is launched again for the cases after it: one
    failure fails one case, and the others still say whether they pass. A job that fails after
    its last case's result fails the run."""
    results = CaseResults()
    cases = list(cases)
    while cases:
        done, proc = launch(worker, cases, nproc, timeout, env)
        if proc.returncode != 0:
            done = _before_peer_died(done)
        results.update((r["case"], r) for r in done)
        cases = [c for c in cases if c not in results]
        if not cases:
            if proc.returncode != 0:
                raise AssertionError(f"{' '.join(proc.args)} failed ({proc.returncode}) after its last case:\n"
                                     f"{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}")
            break
        if proc.returncode == 0:
            raise AssertionError(f"{worker} ended without results for {cases}")
        results[cases[0]] = {"case": cases[0], "ok": False, "error": JOB_FAILED, "message": _cause(proc.stderr),
                             "traceback": _first_death(proc.stderr)}
        cases = cases[1:]
    return results


_PEER_GONE = re.compile(r"Connection (reset|closed) by peer|Broken pipe|Connection refused")
"""gloo's words, on a rank still running, for a collective whose peer process has died."""


def _before_peer_died(done: list[dict]) -> list[dict]:
    """The results of a failed job up to the first case whose error is a dead peer: rank 0 goes on
    through the cases after a peer died, failing each on the lost connection. That case is the one
    the death interrupted, and is reported with the job's error (`_first_death`); the cases after it
    run again in a job of their own."""
    for i, r in enumerate(done):
        if any(_PEER_GONE.search(str(r.get(k, ""))) for k in ("refused", "error", "message", "traceback")):
            return done[:i]
    return done


_DEATH = re.compile(r"^(Fatal Python error|terminate called|Current thread|Thread 0x|.*Signal \d+ \(SIG)", re.M)


def _first_death(stderr: str, limit: int = 8000) -> str:
    """What the job printed from the first sign of a rank's death on (faulthandler's stacks, the
    C++ ``terminate`` line): the dying rank's own account, which the launcher's summary at the end
    of a long output would push out of a tail; the tail when there is no such sign."""
    m = _DEATH.search(stderr)
    if m is None:
        return stderr[-limit:]
    start = max(0, stderr.rfind("\n", 0, max(0, m.start() - 1500)))  # the lines just before it too
    text = stderr[start:start + limit]
    return text if len(stderr) - start <= limit else text + f"\n[... {len(stderr) - start - limit} more characters]\n" + stderr[-1500:]


def _cause(stderr: str) -> str:
    """The line of a failed job's output that says what a rank raised (not the launcher's own
    ``ChildFailedError``), else the last line that mentions an error."""
    lines = stderr.splitlines()
    raised = [l for l in lines if re.search(r"\w*(Error|Exception): ", l) and "ChildFailedError" not in l]
    return ((raised or [l for l in lines if "rror" in l] or [stderr[-300:]])[-1]).strip()[:300]
