"""graphshard's programs in torch's AOTAutogradCache (`graphshard.compiler.program_cache`).

Two jobs of 2 gloo ranks on one Inductor cache directory (tests/workers/program_cache.py): the
first compiles and stores each program (regional FSDP with ``no_sync``, FSDP lowered whole, tensor
parallelism, FSDP with torch's activation checkpointing), the second loads them. Both must match
the single process, and the second must train exactly as the first. Two more jobs
(tests/workers/cache_variants.py) store one setting and then compile a changed one: each change
(a reduction dtype, a parameter dtype, the collective forms, an output size, another model
compiled first) must miss and train exactly as a fresh compile. The key itself is checked on the
fake process group: it is taken of the record the compile reads, and one change to any field of
the config, the unit specs, the plan, the model or the process changes it.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import os
import random

import pytest
import torch
import torch.fx as fx
from torch.distributed.device_mesh import init_device_mesh

import graphshard
from _golden import capture_dynamo
from _launch import torchrun
from graphshard import _compat, storage
from graphshard.compiler.prepare import prepare, trace
from graphshard.passes.pipeline import pre_autograd_passes, run_passes
from graphshard.compiler import program_cache
from graphshard.report import GraphReport
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


# --- a stored program is never served to another setting (tests/workers/cache_variants.py) ---

VARIANTS = ["reduce_fp32_to_bf16", "reduce_bf16_to_fp32", "param_dtype_added", "collectives_nccl", "output_width",
            "a_then_b"]


@pytest.fixture(scope="module")
def variants(tmp_path_factory):
    env = {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path_factory.mktemp("inductor-cache"))}
    store = {r["case"]: r for r in torchrun("cache_variants.py", VARIANTS, env={**env, "GS_CACHE_PHASE": "store"})}
    change = {r["case"]: r for r in torchrun("cache_variants.py", VARIANTS, env={**env, "GS_CACHE_PHASE": "change"})}
    return store, change


@needs_cache
@pytest.mark.parametrize("case", VARIANTS)
def test_a_changed_setting_misses_and_trains_as_a_fresh_compile(variants, case):
    store, change = variants
    for stored in store[case]["stored"]:  # the first job stored every setting it compiled
        assert stored["cache"]["saved"] == 1 and "error" not in stored, stored
    loaded, fresh = change[case]["changed"], change[case]["fresh"]
    assert loaded["cache"]["hit"] == 0 and loaded["cache"]["miss"] == 1, loaded["cache"]
    # the fresh program's numbers, or its error (param_dtype=bf16 over fp32 inputs), exactly
    assert loaded.get("error") == fresh.get("error")
    assert loaded.get("losses") == fresh.get("losses") and loaded.get("params") == fresh.get("params")
    assert loaded.get("collectives") == fresh.get("collectives")  # gloo's forms or NCCL's, as compiled
    if "error" not in fresh:  # and the single process: bf16 reductions round, fp32 ones do not
        tol = 5e-3 if "torch.bfloat16" in loaded["setting"].values() else 1e-5
        assert loaded["loss_err"] <= tol and loaded["param_err"] <= tol, loaded


# --- the key, taken of the record the compile reads (fake process group, world 4) ---


def _key(model_fn=None, plan_fn=None, config=CompileConfig(), inputs=None, rank=(0, 4)):
    """The program cache's key tag of ``model_fn()`` sharded by ``plan_fn()``, through the backend's own
    steps (dynamo's graph, the trace to ATen, the pre-autograd passes). Every model gets the id 1000, as
    the model at one position of a training script gets the same id in every process: two keys then
    differ only by what the setting changed."""
    ids, storage._model_ids = storage._model_ids, itertools.count(1000)
    try:
        torch._dynamo.reset()
        model = (model_fn or _Blocks)()
        graphshard.shard(model, (plan_fn or _plan)())
        gm, example_inputs = capture_dynamo(model, *(inputs or (torch.randn(4, 16),)))
        prepared = trace(prepare(gm, example_inputs), config, (model._graphshard,))
        traced = run_passes(prepared.graph, prepared.ctx, pre_autograd_passes())
        return program_cache.key_tag(traced, prepared.ctx, rank)
    finally:
        storage._model_ids = ids


class _Blocks(torch.nn.Module):
    """The issue's model: two blocks and an output layer (``out`` wide), every block a unit."""

    def __init__(self, out: int = 8, dtype=torch.float32):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = torch.nn.ModuleList([torch.nn.Linear(16, 32), torch.nn.Linear(32, 32)])
        self.head = torch.nn.Linear(32, out)
        self.to(dtype)

    def forward(self, x):
        for block in self.blocks:
            x = torch.relu(block(x))
        return self.head(x)


@functools.cache
def _mesh(shape, names):
    # one mesh per layout, as a training script builds it once: a new 2-D mesh makes new process groups,
    # whose names (part of the key) follow the order the script creates them in
    return init_device_mesh("cpu", shape, mesh_dim_names=names)


def _plan(spec=None, root=None, mesh_shape=(4,), names=("dp",), **plan):
    mesh = _mesh(mesh_shape, names)
    spec = spec or graphshard.FullyShard()
    return graphshard.Plan(mesh, {"blocks.*": spec, "": root or spec}, **plan)


_HSDP = dict(mesh_shape=(2, 2), names=("rep", "dp"))

# one change per field of the compile config, the unit specs (the mixed-precision policy among them)
# and the plan, and of the model and process the program is compiled for: each must change the key
_CONFIG_CHANGES = {
    "lower": "eager", "forward_prefetch": False, "backward_prefetch": "post", "limit_all_gathers": 3,
    "regional": False, "strict": True, "share_compile": False, "batch_cpp_kernels": True, "fast_isa_check": True,
    "check_collectives": False, "trace_once": False, "program_cache": False, "dump_graphs": "/tmp/graphshard-dumps",
}
_SPEC_CHANGES = {
    "FullyShard.reshard_after_forward": dict(plan_fn=lambda: _plan(graphshard.FullyShard(reshard_after_forward=False))),
    "FullyShard.param_dtype": dict(plan_fn=lambda: _plan(graphshard.FullyShard(param_dtype=torch.bfloat16))),
    "FullyShard.reduce_dtype": dict(plan_fn=lambda: _plan(graphshard.FullyShard(reduce_dtype=torch.bfloat16))),
    "FullyShard.flat_params": dict(plan_fn=lambda: _plan(graphshard.FullyShard(flat_params=True))),
    "FullyShard.shard_axis": dict(base=lambda: _plan(**_HSDP),
                                  plan_fn=lambda: _plan(graphshard.FullyShard(shard_axis="rep"), **_HSDP)),
    "Replicate.param_dtype": dict(base=lambda: _plan(graphshard.Replicate()),
                                  plan_fn=lambda: _plan(graphshard.Replicate(param_dtype=torch.bfloat16))),
    "Replicate.reduce_dtype": dict(base=lambda: _plan(graphshard.Replicate()),
                                   plan_fn=lambda: _plan(graphshard.Replicate(reduce_dtype=torch.bfloat16))),
    "Replicate.flat_params": dict(base=lambda: _plan(graphshard.Replicate()),
                                  plan_fn=lambda: _plan(graphshard.Replicate(flat_params=True))),
    "a unit's spec alone (the root's reduce dtype)": dict(
        plan_fn=lambda: _plan(root=graphshard.FullyShard(reduce_dtype=torch.bfloat16))),
    "Plan.rules (the units)": dict(plan_fn=lambda: graphshard.Plan(_mesh((4,), ("dp",)),
                                                                    {"": graphshard.FullyShard()})),
    "Plan.mesh (its shape)": dict(plan_fn=lambda: _plan(**_HSDP)),
    "Plan.mesh (an axis name)": dict(plan_fn=lambda: _plan(names=("fsdp",))),
    "Plan.collectives": dict(plan_fn=lambda: _plan(collectives="nccl")),
    "Plan.ignored_params": dict(plan_fn=lambda: _plan(ignored_params=("head.bias",))),
    "Plan.checkpoint": dict(plan_fn=lambda: _plan(checkpoint={"blocks.*": graphshard.Checkpoint()})),
    "the output width (rank 0's shard as before)": dict(model_fn=lambda: _Blocks(out=7)),
    "the parameters' dtype": dict(model_fn=lambda: _Blocks(dtype=torch.float64),
                                  inputs=(torch.randn(4, 16, dtype=torch.float64),)),
    "the rank": dict(rank=(1, 4)),
}


def test_the_same_setting_gives_the_same_key():
    assert _key() == _key()  # fresh models, fresh graphs: what the misses below are measured against
    assert _key(plan_fn=lambda: _plan(**_HSDP)) == _key(plan_fn=lambda: _plan(**_HSDP))


def test_every_config_field_has_a_change_here():
    assert set(_CONFIG_CHANGES) == {f.name for f in dataclasses.fields(CompileConfig)}, "a new CompileConfig field: add it"
    for spec in (graphshard.FullyShard, graphshard.Replicate):
        named = {k.split(".", 1)[1] for k in _SPEC_CHANGES if k.startswith(spec.__name__ + ".")}
        assert named == {f.name for f in dataclasses.fields(spec)}, f"a new {spec.__name__} field: add it"


@pytest.mark.parametrize("field", sorted(_CONFIG_CHANGES))
def test_each_config_field_changes_the_key(field):
    changed = dataclasses.replace(CompileConfig(), **{field: _CONFIG_CHANGES[field]})
    assert _key(config=changed) != _key()


@pytest.mark.parametrize("change", list(_SPEC_CHANGES))
def test_each_field_of_the_plan_specs_model_and_process_changes_the_key(change):
    kwargs = dict(_SPEC_CHANGES[change])
    base = kwargs.pop("base", None)
    assert _key(**kwargs) != _key(plan_fn=base)


def test_random_single_field_changes_each_miss():
    # one field at a time, drawn at random over the config, the specs and the model
    seed = int(os.environ.get("GS_KEY_SEED", "0"))
    rng = random.Random(seed)
    dtypes = [torch.bfloat16, torch.float16, torch.float64]
    draws = [
        lambda: dict(config=CompileConfig(limit_all_gathers=rng.choice([None, 1, 3, 4, 8]))),
        lambda: dict(config=CompileConfig(backward_prefetch=rng.choice(["post", None]))),
        lambda: dict(plan_fn=(lambda d=rng.choice(dtypes): _plan(graphshard.FullyShard(reduce_dtype=d)))),
        lambda: dict(plan_fn=(lambda d=rng.choice(dtypes): _plan(graphshard.FullyShard(param_dtype=d)))),
        lambda: dict(plan_fn=(lambda d=rng.choice(dtypes): _plan(root=graphshard.FullyShard(param_dtype=d)))),
        lambda: dict(model_fn=(lambda w=rng.choice([5, 6, 7, 9, 12]): _Blocks(out=w))),
        lambda: dict(rank=(rng.choice([1, 2, 3]), 4)),
    ]
    base = _key()
    for i in range(12):
        kwargs = rng.choice(draws)()
        assert _key(**kwargs) != base, f"seed {seed}, draw {i}: {kwargs}"


def test_the_record_is_walked_field_by_field_and_unknown_values_are_refused():
    from graphshard import fingerprint

    # a module in a record is storage: keyed by what the compile reads of it, never by the object
    with pytest.raises(fingerprint.Unkeyable, match=r"record\['m'\] is a module"):
        fingerprint.canonical({"m": torch.nn.Linear(2, 2)}, "record")

    class Opaque:  # not graphshard's: its repr would be an address
        __slots__ = ()

    with pytest.raises(fingerprint.Unkeyable, match="record.x is a .*Opaque"):
        fingerprint.canonical(_Holder(x=Opaque()), "record")
    # a dataclass field is keyed unless it says why not
    assert fingerprint.canonical(_Holder(x=1)) != fingerprint.canonical(_Holder(x=2))
    assert fingerprint.canonical(_Holder(x=1, note="a")) == fingerprint.canonical(_Holder(x=1, note="b"))


@dataclasses.dataclass
class _Holder:
    x: object
    note: str = dataclasses.field(default="", metadata={"graphshard_unkeyed": "a test's comment"})


def test_a_loaded_program_refuses_inputs_it_was_not_compiled_for():
    calls = []
    stored = program_cache.signature([torch.empty(4, 32), torch.empty(3, dtype=torch.bfloat16), 2])
    run = program_cache.verified(lambda inputs: calls.append(len(inputs)), stored, "forward", 0)
    with pytest.raises(program_cache.StaleProgram, match=r"input 0 as \(\(3, 32\), 'torch.float32'\) where it was "
                                                         r"compiled for \(\(4, 32\), 'torch.float32'\)"):
        run([torch.empty(3, 32), torch.empty(3, dtype=torch.bfloat16), 2])
    with pytest.raises(program_cache.StaleProgram, match="input 1"):
        run([torch.empty(4, 32), torch.empty(3), 2])
    assert calls == []  # refused, not run
    run([torch.empty(4, 32), torch.empty(3, dtype=torch.bfloat16), 2])
    assert calls == [3]


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
