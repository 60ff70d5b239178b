"""graphshard's programs in torch's AOTAutogradCache (`graphshard.compiler.program_cache`).

Two jobs of 2 gloo ranks on one Inductor cache directory (tests/workers/program_cache.py): the
first compiles and stores each program (regional FSDP with ``no_sync``, FSDP lowered whole, tensor
parallelism, FSDP with torch's activation checkpointing), the second loads them. Both must match the single process, and the second must train
exactly as the first. The key's own terms are checked without a process group.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.fx as fx

from _launch import torchrun
from graphshard import _compat
from graphshard.compiler import program_cache
from graphshard.compiler.explain import GraphReport
from graphshard.config import CompileConfig

STORED = ["fsdp", "whole", "tp", "ac"]
CASES = [*STORED, "off"]  # off: fsdp with program_cache=False, after fsdp stored the same program
TOL = 1e-5

needs_cache = pytest.mark.skipif(not _compat.HAS_PROGRAM_CACHE, reason="torch < 2.13 cannot bundle graphshard's programs")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    env = {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path_factory.mktemp("inductor-cache"))}
    first = {r["case"]: r for r in torchrun("program_cache.py", CASES, env=env, timeout=900)}
    second = {r["case"]: r for r in torchrun("program_cache.py", CASES, env=env, timeout=900)}
    return first, second


@needs_cache
@pytest.mark.parametrize("case", STORED)
def test_the_first_process_stores_the_program(runs, case):
    first = runs[0][case]
    assert first["cache"] == {"hit": 0, "miss": 1, "bypass": 0, "saved": 1}, first["cache"]
    assert first["notes"][-1] == "program cache: compiled and stored in torch's AOTAutogradCache"


@needs_cache
@pytest.mark.parametrize("case", STORED)
def test_a_second_process_loads_it_and_compiles_nothing_after_the_pre_autograd_passes(runs, case):
    second = runs[1][case]
    assert second["cache"] == {"hit": 1, "miss": 0, "bypass": 0, "saved": 0}, second["cache"]
    assert second["notes"][-1].startswith("program cache: loaded from torch's AOTAutogradCache")
    assert "program_load" in second["phases"]
    assert not {"aot_autograd", "forward_lowering", "backward_lowering"} & set(second["phases"]), second["phases"]


@needs_cache
@pytest.mark.parametrize("case", CASES)
def test_both_processes_match_the_single_process(runs, case):
    for run in runs:  # NaN or inf in a loss or parameter makes the error inf
        assert run[case]["loss_err"] <= TOL and run[case]["param_err"] <= TOL, run[case]


def test_the_cache_is_on_by_default_and_off_compiles_afresh(runs):
    # the default stores and loads (the tests above); program_cache=False, on a key the fsdp
    # case has stored, neither loads nor stores: both processes run aot_autograd and lower
    assert CompileConfig().program_cache is True
    for run in runs:
        off = run["off"]
        assert off["cache"]["hit"] == 0 and off["cache"]["saved"] == 0, off["cache"]
        assert not any(n.startswith("program cache") for n in off["notes"]), off["notes"]
        assert {"aot_autograd", "forward_lowering", "backward_lowering"} <= set(off["phases"]), off["phases"]
    assert runs[1]["off"]["losses"] == runs[1]["fsdp"]["losses"]  # the same program, compiled or loaded


@needs_cache
@pytest.mark.parametrize("case", STORED)
def test_the_loaded_program_trains_exactly_as_the_stored_one(runs, case):
    first, second = runs[0][case], runs[1][case]
    assert second["losses"] == first["losses"]
    assert second["params"] == first["params"]  # a digest of every gathered parameter's bytes


@needs_cache
def test_no_sync_programs_are_built_from_the_stored_backward(runs):
    # the FSDP cases train their second step under no_sync: the loaded program built
    # its accumulate and flush programs from the backward graph stored with it, and matched
    for case in ("fsdp", "whole", "ac"):
        assert any(n.startswith("no_sync:") for n in runs[1][case]["notes"])


@needs_cache
def test_explain_reports_the_loaded_program_as_the_compile_did(runs):
    first, second = runs[0]["fsdp"]["explain"], runs[1]["fsdp"]["explain"]

    def lines(text, *prefixes):
        return [line for line in text.splitlines() if line.strip().startswith(prefixes)]

    kept = ("order after scheduling", "order in lowered code", "regions", "collectives (", "all_gather", "all_to_all")
    assert lines(second, *kept) == lines(first, *kept) != []
    assert "loaded with the program" in second


# --- the key's own terms (no process group) ---


def _graph() -> fx.GraphModule:
    gm = fx.symbolic_trace(lambda x: torch.relu(x) + 1)
    for n in gm.graph.nodes:
        n.meta["val"] = object()  # aot_autograd's key has the values: never part of graphshard's
    return gm


def _tag(gm, config=CompileConfig(), units=(None,), groups=None, rank=(0, 2)):
    return program_cache.key_tag(gm, config, list(units), groups or {"dp": "0"}, {}, rank)


def test_the_key_is_stable_and_leaves_out_what_aot_autograd_keys():
    a, b = _graph(), _graph()
    assert _tag(a) == _tag(b)  # fresh objects in "val", each with its own address


@pytest.mark.parametrize("change", ["recompute tag", "trace-once mark", "config", "unit", "process group", "rank"])
def test_the_key_covers_what_graphshard_reads_and_aot_autograd_does_not(change):
    gm = _graph()
    base = _tag(gm)
    relu = next(n for n in gm.graph.nodes if n.op == "call_function")
    if change == "recompute tag":
        relu.meta["recompute"] = torch.utils.checkpoint.CheckpointPolicy.MUST_SAVE
        assert _tag(gm) != base
    elif change == "trace-once mark":
        relu.meta["graphshard_body"] = "_graphshard_unit_body_0"
        assert _tag(gm) != base
    elif change == "config":
        assert _tag(gm, dataclasses.replace(CompileConfig(), limit_all_gathers=3)) != base
    elif change == "unit":
        assert _tag(gm, units=("layers.0",)) != base
    elif change == "process group":
        assert _tag(gm, groups={"dp": "1"}) != base
    else:  # ranks with equal forward graphs may differentiate them into different backwards (gloo's all-to-all)
        assert _tag(gm, rank=(1, 2)) != base


def test_a_report_delta_carries_what_a_stage_added():
    report = GraphReport(index=0, notes=["before"], order={"pre": ["x"]})
    delta = program_cache.ReportDelta(report)
    report.notes.append("added")
    report.order["forward"] = ["all_gather(a)"]
    report.regions["forward"] = {"regions": 3}
    added = delta.take()
    fresh = GraphReport(index=0, notes=["before"], order={"pre": ["x"]})
    program_cache.apply_delta(fresh, added)
    assert (fresh.notes, fresh.order, fresh.regions) == (report.notes, report.order, report.regions)
    assert delta.take() == {**{k: [] for k in delta.LISTS}, **{k: {} for k in delta.DICTS}}


def test_a_report_delta_leaves_out_what_only_this_process_did():
    # the ISA check split is this process's own work: a process that loads the program checks nothing
    from graphshard.compiler.inductor_cpu import ISA_SPLIT_NOTE

    report = GraphReport(index=0)
    delta = program_cache.ReportDelta(report)
    report.notes += [ISA_SPLIT_NOTE + "avx512 1.20s", "random ops: 2"]
    assert delta.take()["notes"] == ["random ops: 2"]


def test_unsupported_settings_are_named():
    assert "compiles nothing" in program_cache.supported(CompileConfig(lower="eager"))
    if _compat.HAS_PROGRAM_CACHE:
        assert program_cache.supported(CompileConfig()) is None
    else:
        assert "2.13" in program_cache.supported(CompileConfig())


def test_storing_and_loading_a_graph_leaves_compiled_frames_alone():
    # the stored backward's pickling once registered `slice` with torch's pytree and removed it
    # (GraphPickler's dumps and loads), which changed the registry that dynamo guards on: an HF
    # checkpointed model's frame compiled again on the next step (the model-coverage suite's AC cases)
    import torch.utils._pytree as pytree
    from torch.fx.experimental.proxy_tensor import make_fx

    from graphshard._compat import dynamo_counters

    @torch.compile(backend="eager")
    def flattens(x):
        leaves, _ = pytree.tree_flatten({"a": x, "b": (x * 2,)})
        return leaves[0] + leaves[1]

    flattens(torch.randn(3))
    dynamo_counters().clear()
    gm = make_fx(lambda x: torch.relu(x).sum(0), tracing_mode="fake")(torch.randn(4, 3))
    loaded = _compat.graph_from_bytes(_compat.graph_to_bytes(gm, program_cache.BACKWARD_META))
    assert [n.target for n in loaded.graph.nodes] == [n.target for n in gm.graph.nodes]
    flattens(torch.randn(3))
    assert dynamo_counters()["stats"]["unique_graphs"] == 0, dict(dynamo_counters()["stats"])
