"""Runs a worker under torchrun (gloo on the CPU) and returns the JSON results rank 0 printed."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

HERE = os.path.dirname(__file__)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(worker: str, args: list[str], nproc: int = 2, timeout: int = 900) -> tuple[list[dict], subprocess.CompletedProcess]:
    """Runs the worker; returns the results rank 0 printed (however the job ended) and the process."""
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
           f"--master-port={_free_port()}", os.path.join(HERE, "workers", worker), *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCHINDUCTOR_COMPILE_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    results = [json.loads(l[len("RESULT "):]) for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
    return results, proc


def torchrun(worker: str, args: list[str], nproc: int = 2, timeout: int = 900) -> list[dict]:
    results, proc = launch(worker, args, nproc, timeout)
    if proc.returncode != 0:
        raise AssertionError(f"{' '.join(proc.args)} failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}")
    return results
