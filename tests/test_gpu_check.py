"""scripts/gpu_check.sh, the project's prepared GPU check: on a machine without a GPU it says so and
exits 0 in seconds, writing that to its report; its first section runs in the CPU dry run (the
other sections' dry run takes minutes: ``bash scripts/gpu_check.sh --cpu-dry-run OUTDIR``)."""

from __future__ import annotations

import json
import os
import subprocess
import time

import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(*args, timeout=300):
    start = time.monotonic()
    out = subprocess.run(["bash", os.path.join(REPO, "scripts", "gpu_check.sh"), *args], capture_output=True,
                         text=True, timeout=timeout)
    return out, time.monotonic() - start


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU: the check would run")
def test_without_a_gpu_it_says_so_and_exits_0(tmp_path):
    out, seconds = _run(str(tmp_path))
    assert out.returncode == 0, out.stderr
    assert seconds < 30, seconds
    assert "no CUDA GPU on this machine" in out.stdout
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["device"] == "none" and report["sections"] == {}
    assert "nothing checked" in (tmp_path / "gpu_check.md").read_text()


def test_versions_section_in_the_cpu_dry_run(tmp_path):
    out, _ = _run("--cpu-dry-run", "--sections", "versions", str(tmp_path))
    assert out.returncode == 0, out.stderr
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    section = report["sections"]["versions"]
    assert section["status"] == "ok", section
    assert report["setup"]["rc"] == 0, report["setup"]
    assert "private-API probe" in (tmp_path / "gpu_check.md").read_text()
