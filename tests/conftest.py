"""Test set-up: one fake process group (world size 4) for golden-graph tests in this process.

Multi-rank numerics run in torchrun subprocesses with gloo (see tests/_launch.py).
"""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.distributed as dist

import _coverage_share
from graphshard import _compat

WORLD = 4


@pytest.fixture(scope="session", autouse=True)
def fake_process_group():
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
    if not dist.is_initialized():
        dist.init_process_group("fake", store=_compat.fake_process_group_store(), rank=0, world_size=WORLD)
    yield


@pytest.fixture
def fake_collective_outputs():
    """For a test whose values cross the fake process group (a parameter scattered from rank 0, a
    gradient reduce-scattered): skipped where torch's fake backend leaves a collective's output as
    allocated (torch 2.11; 2.13 copies the rank's own input), since the values would be uninitialized
    memory. The same programs' numerics run on gloo ranks in the launch tests."""
    out = torch.full((WORLD,), -1.0)
    dist.all_to_all_single(out, torch.arange(float(WORLD)))
    if bool((out < 0).any()):
        pytest.skip(f"torch {torch.__version__}'s fake process group leaves collective outputs unwritten")


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


# ---- the model-coverage table (tests/test_model_coverage.py) ----
COVERAGE_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "coverage_out")
_coverage: dict = {}


def pytest_addoption(parser):
    parser.addoption("--coverage", choices=("quick", "full"), default="quick",
                     help="the multi-rank suites: the CI share (quick) or every case (every architecture x "
                          "strategy x lowering of the model-coverage suite, every module's FULL_ONLY cases)")


# ---- the CI share of the multi-rank suites (tests/_coverage_share.py) ----


def pytest_collection_modifyitems(config, items):
    if _coverage_share.full_coverage(config):
        return
    keep, drop = [], []
    for item in items:
        full_only = getattr(getattr(item, "module", None), "FULL_ONLY", ())
        params = getattr(getattr(item, "callspec", None), "params", {})
        (drop if params.get("case") in full_only else keep).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


def record_coverage(results: dict) -> None:
    _coverage.update(results)
    os.makedirs(COVERAGE_DIR, exist_ok=True)
    with open(os.path.join(COVERAGE_DIR, "model_coverage.json"), "w") as f:
        json.dump(_coverage, f, indent=1)
    with open(os.path.join(COVERAGE_DIR, "model_coverage.md"), "w") as f:
        f.write(coverage_table(_coverage) + "\n")


def coverage_table(results: dict) -> str:
    """architecture x (strategy, lowering) -> ok / FAIL with the diff / the error class."""
    archs = list(dict.fromkeys(c.split(":")[0] for c in results))
    columns = list(dict.fromkeys(":".join(c.split(":")[1:]) for c in results))
    lines = ["| arch | " + " | ".join(columns) + " |", "|---" * (len(columns) + 1) + "|"]
    for arch in archs:
        cells = []
        for col in columns:
            r = results.get(f"{arch}:{col}")
            if r is None:
                cells.append("")
            elif r.get("skipped"):
                cells.append("n/a")
            elif r["ok"]:
                cells.append("ok")
            elif "error" in r:
                cells.append(f"FAIL {r['error']}")
            else:
                why = f"loss {r['loss_err']:.1e} param {r['param_err']:.1e}"
                cells.append(f"FAIL {why}" + (f", {r['new_graphs']} new graphs" if r["new_graphs"] else "")
                             + (", nothing recomputed" if r.get("recomputed_ops") == 0 else ""))
        lines.append(f"| {arch} | " + " | ".join(cells) + " |")
    ok = sum(r["ok"] for r in results.values())
    skipped = sum(bool(r.get("skipped")) for r in results.values())
    lines.append(f"\n{ok}/{len(results) - skipped} ok" + (f" ({skipped} n/a: no gradient checkpointing)" if skipped else ""))
    return "\n".join(lines)


def pytest_terminal_summary(terminalreporter):
    if _coverage:
        terminalreporter.write_sep("=", "model coverage (coverage_out/model_coverage.md)")
        terminalreporter.write_line(coverage_table(_coverage))
