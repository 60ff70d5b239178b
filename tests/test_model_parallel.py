"""graphshard.model_parallel against TorchRec's DistributedModelParallel and the single process
(tests/workers/dmp.py).

TorchRec's DLRM (five tables: table-wise, table-wise with mean pooling, row-wise, column-wise,
data-parallel; on 4 ranks as 2 hosts x 2: table-row-wise on each host), a weighted collection,
a two-tower model holding one ``EmbeddingBagCollection`` under two FQNs and a sequence model
(an ``EmbeddingCollection``)
train on 2 gloo ranks with graphshard's DMP, with TorchRec's (same plan, same fused
optimizer, same initial weights) and unwrapped in one process on the global batch: losses and
every table and dense parameter (read back through ``state_dict()``) must match the single
process within 1e-5, and the state dicts must have the model's FQNs.

The grid (``GRID``): TorchRec's own models (``DLRM``, ``DLRM_DCN``, ``DLRM_Projection``,
``DLRMTrain``, ``SimpleDeepFMNN``, the test suite's ``TestSparseNN`` with an unweighted and a
weighted collection) and a two-tower retrieval model over one ``EmbeddingCollection``, each with
every table table-wise, row-wise, column-wise or data-parallel, and under graphshard's planner
(``plan=None``). CI runs ``GRID_CI``; ``--coverage full`` runs all of it and writes the table of
differences to ``coverage_out/dmp_parity.md``.
"""

from __future__ import annotations

import json
import os
import re

import pytest

pytest.importorskip("torchrec")  # an optional dependency (scripts/setup.sh says when it is skipped)

from _coverage_share import ci_share, full_coverage, launch_groups, lowering  # noqa: E402
from _launch import JOB_FAILED, CaseResults, run_cases  # noqa: E402

pytestmark = pytest.mark.multirank  # every test reads the torchrun jobs' results

TOL = 1e-5
CASES = ["dlrm:rowwise_adagrad", "dlrm:adagrad", "twotower:rowwise_adagrad", "weighted:rowwise_adagrad",
         "dlrm:inbackward_rowwise_adagrad", "dlrm:rowwise_adagrad:fsdp", "seq:rowwise_adagrad", "seq:sgd:dp",
         "seqtwo:rowwise_adagrad", "dlrm:rowwise_adagrad:planned", "dlrm:rowwise_adagrad:triton",
         "dlrm:rowwise_adagrad:auto", "dlrm:rowwise_adagrad:fsdp:ac"]
"""``weighted``: per-sample weights in the KJT; ``inbackward_``: the tables' optimizer from TorchRec's
``apply_optimizer_in_backward`` instead of the sharder's ``fused_params``; ``fsdp``: graphshard's
dense part sharded (``FullyShardDense``) in the same program as the sparse exchange; ``seq``: an
``EmbeddingCollection`` (one row per id; table-, row-, column-wise, and two shard widths on one
rank), ``dp``: with a data-parallel table; ``seqtwo``: two towers holding one ``EmbeddingCollection``;
``planned``: ``plan=None``, graphshard's planner chooses (its collective plan), and TorchRec's DMP
and the reference follow the plan it chose; ``triton``: graphshard's sharded tables with
``compute_kernel="fused_triton"`` (its Triton TBE, under Triton's interpreter on the CPU),
TorchRec's with ``fused`` (fbgemm's); ``auto``: the plan from ``graphshard.auto_plan`` (tables and
dense units in one 64 KiB budget), given to graphshard's DMP as a graphshard ``Plan`` and to
TorchRec's as its ``torchrec_plan``."""
GRID_MODELS = ["dlrm", "dcn", "projection", "dlrmtrain", "deepfm", "sparsenn", "seqtwo"]
"""``dcn``: ``DLRM_DCN`` (a low-rank cross net); ``projection``: ``DLRM_Projection`` (two interaction
branches and their product); ``dlrmtrain``: ``DLRMTrain`` around ``DLRM`` (a ``Batch`` in, its own loss
out); ``deepfm``: ``SimpleDeepFMNN`` (``DeepFM`` and ``FactorizationMachine``); ``sparsenn``: TorchRec's
``TestSparseNN`` (a ``ModelInput`` in, its own loss out; an unweighted and a weighted collection, the
over arch regroups their ``KeyedTensor`` s); ``seqtwo``: two towers holding one ``EmbeddingCollection``
(query and item, dot-product score). Dense layers of 7, 11 and 13 units."""
GRID_SHARDINGS = ["tw", "rw", "cw", "dp", "planned"]
"""Every table of the model table-wise (round-robin over the ranks), row-wise, column-wise (over
both ranks), data-parallel, or as graphshard's planner places it (``plan=None``; TorchRec's DMP
gets the plan it chose)."""
GRID = [f"{m}:rowwise_adagrad:{s}" for m in GRID_MODELS for s in GRID_SHARDINGS
        if f"{m}:rowwise_adagrad:{s}" not in CASES]
GRID_CI = ["sparsenn:rowwise_adagrad:cw", "projection:rowwise_adagrad:dp", "deepfm:rowwise_adagrad:tw"]
"""The grid's CI share: three models, three sharding types (``dlrm`` and the planner are in ``CASES``)."""
FOUR_RANK = ["dlrm4:rowwise_adagrad"]
"""4 ranks as 2 hosts x 2 (``LOCAL_WORLD_SIZE=2``): table-row-wise tables on each host."""
AC = [c for c in CASES if c.endswith(":ac")]
"""``ac``: the dense part (DLRM's dense and over arch) under torch's ``apply_activation_checkpointing``
in all three runs; graphshard compiles it as recomputation in the backward."""
TORCHREC_WRONG = {"twotower:rowwise_adagrad", "dlrm4:rowwise_adagrad", "seqtwo:rowwise_adagrad",
                  "seqtwo:rowwise_adagrad:tw", "seqtwo:rowwise_adagrad:rw", "seqtwo:rowwise_adagrad:cw"}
"""TorchRec (1.9.2) shards a module reachable under two FQNs per FQN and applies the fused
update once per use: row-wise Adagrad then accumulates its state twice a step, and the tables
train ~9e-2 away from the single process (it logs "Module item.ebc is already in cache"), under
any sharding type of fused tables. graphshard merges the two uses into one lookup and one update."""
TORCHREC_EC_DATA_PARALLEL = "split_with_sizes expects split_sizes to sum exactly to"
"""TorchRec (1.9.2) cannot run a data-parallel table of an ``EmbeddingCollection`` on the CPU:
its lookup, fbgemm's ``DenseTableBatchedEmbeddingBagsCodegen`` with ``PoolingMode.NONE``,
pools per bag there (one row per sample, not per id), and TorchRec's output split fails
(``seq:sgd:dp``, ``seqtwo:rowwise_adagrad:dp``, and ``seqtwo:rowwise_adagrad:planned``, whose
planner puts both small tables data-parallel). The worker catches only this error, only there."""
SEQUENCE_MODELS = {"seq", "seqtwo"}


def torchrec_fails(case: str, r: dict) -> str | None:
    """The error TorchRec's DMP is known to raise on this case (by the plan it ran), or None."""
    if case.split(":")[0] in SEQUENCE_MODELS and "data_parallel" in r["sharding"].values():
        return TORCHREC_EC_DATA_PARALLEL
    return None


FULL_ONLY = {"dlrm:adagrad", "weighted:rowwise_adagrad", "seqtwo:rowwise_adagrad", "projection:rowwise_adagrad:dp"}
"""Cases only ``--coverage full`` runs (`_coverage_share.ci_share`); in CI the same feature runs
elsewhere: plain Adagrad's fused update in tests/test_fbgemm_tbe.py and test_triton_tbe.py (here it
differs from the row-wise case only in its state's shape), weighted tables in ``sparsenn``
(TestSparseNN has both kinds), a module reached under two FQNs in ``twotower``, a data-parallel
table in ``seq:sgd:dp``."""


def selected(config) -> list[str]:
    """The 2-rank cases: CI's (``CASES`` and ``GRID_CI`` less ``FULL_ONLY``), and with
    ``--coverage full`` all of them and the whole grid."""
    rest = [c for c in GRID if c not in GRID_CI] if full_coverage(config) else []
    return ci_share(config, CASES + GRID_CI, FULL_ONLY) + rest


def pytest_generate_tests(metafunc):
    if "dmp_case" in metafunc.fixturenames:
        metafunc.parametrize("dmp_case", selected(metafunc.config) + FOUR_RANK)


INDUCTOR_IN_CI = {"dlrm:rowwise_adagrad", "dlrm:rowwise_adagrad:fsdp", "dlrm:rowwise_adagrad:triton"}
"""The cases CI lowers with Inductor (`_coverage_share.launch_groups`): the sparse exchange and
fbgemm's kernels in one compiled program with the replicated dense part, with the sharded one, and
with graphshard's Triton kernel. CI runs the others as FX (a checkpointed dense part under Inductor
is tests/test_activation_checkpointing.py's); ``--coverage full`` lowers every case with Inductor."""

LAUNCH = 7
"""Cases per torchrun launch (each launch's output comes back when it ends; every launch pays the
start-up and the imports once, ~12 s on the 2-core machine)."""


@pytest.fixture(scope="module")
def results(request):
    out = CaseResults()
    for cases, env in launch_groups(request.config, selected(request.config), INDUCTOR_IN_CI):
        for i in range(0, len(cases), LAUNCH):
            out.update(run_cases("dmp.py", cases[i:i + LAUNCH], nproc=2, env=env))
    for cases, env in launch_groups(request.config, FOUR_RANK, INDUCTOR_IN_CI):
        out.update(run_cases("dmp.py", cases, nproc=4, env=env))
    _write_table(out, request.config.getoption("coverage"))
    return out


def _write_table(results: dict, selection: str) -> None:
    """model x sharding -> the largest loss and parameter differences of graphshard's DMP against the
    single process and against TorchRec's DMP (``coverage_out/dmp_parity.md``)."""
    def worst(d):
        return max(d.values(), default=0.0) if d is not None else None

    def fmt(x):
        return "-" if x is None else f"{x:.1e}"

    lines = [f"DMP parity ({selection}): loss / param max |difference|", "",
             "| case | lowering | gs vs single | gs vs TorchRec | TorchRec vs single | TorchRec |",
             "|---|---|---|---|---|---|"]
    for case, r in results.items():
        if r.get("error") == JOB_FAILED:
            lines.append(f"| {case} | | took its job down | | | |")
            continue
        tr = ("fails: " + r["torchrec_error"][:60]) if r["torchrec_error"] else (
            "known wrong" if case in TORCHREC_WRONG else "ok")
        lines.append(f"| {case} | {r['lowering']} | {fmt(r['loss_gs_ref'])} / {fmt(worst(r['param_gs_ref']))} "
                     f"| {fmt(r['loss_gs_tr'])} / {fmt(worst(r['param_gs_tr']))} "
                     f"| {fmt(r['loss_tr_ref'])} / {fmt(worst(r['param_tr_ref']))} | {tr} |")
    out = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "coverage_out")
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "dmp_parity.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    with open(os.path.join(out, "dmp_parity.json"), "w") as f:
        # a case that took its job down has no figures: its own test reads it and fails with the job's error
        json.dump({c: {k: r[k] for k in ("loss_gs_ref", "param_gs_ref", "loss_gs_tr", "param_gs_tr", "loss_tr_ref",
                                         "param_tr_ref", "torchrec_error", "sharding")}
                   if r.get("error") != JOB_FAILED else {"error": r["message"]} for c, r in results.items()},
                  f, indent=1)


def test_graphshard_matches_single_process(results, dmp_case):
    r = results[dmp_case]
    assert r["keys_graphshard"] == r["keys_reference"]
    assert r["loss_gs_ref"] <= TOL, r
    assert set(r["param_gs_ref"]) == set(r["keys_reference"])
    bad = {k: v for k, v in r["param_gs_ref"].items() if not v <= TOL}  # NaN is bad too
    assert not bad, bad
    # every table trained, by enough that one left as it was would be off by more than TOL (data-parallel
    # tables take plain SGD on their dense gradient and move least: ~8e-5 in 4 steps of the auto plan;
    # a grid case with every table data-parallel trains at the worker's LR_DP for this reason)
    assert all(r["moved"][t] > 5 * TOL for t in r["tables"]), {t: r["moved"][t] for t in r["tables"]}


def test_torchrec_same_program(results, dmp_case):
    case, r = dmp_case, results[dmp_case]
    known = torchrec_fails(case, r)
    if known is not None:
        assert r["torchrec_error"] is not None and known in r["torchrec_error"], r["torchrec_error"]  # its known defect
        return
    assert r["torchrec_error"] is None, r["torchrec_error"]
    assert r["keys_torchrec"] == r["keys_reference"]
    if case in TORCHREC_WRONG:
        assert max(r["param_tr_ref"].values()) > 1e-2, r["param_tr_ref"]  # TorchRec's known defect, still there
        return
    assert r["loss_tr_ref"] <= TOL and max(r["param_tr_ref"].values()) <= TOL, r
    assert max(r["param_gs_tr"].values()) <= TOL and r["loss_gs_tr"] <= TOL, (r["param_gs_tr"], r["loss_gs_tr"])


ONE_TYPE = {"tw": "table_wise", "rw": "row_wise", "cw": "column_wise", "dp": "data_parallel"}


def test_grid_case_shards_every_table_as_asked(results):
    # the one-type flags put every table of the model (both collections of TestSparseNN) under that
    # type; the planned cases' plan is the same on every rank and places every table
    ran = [c for c in results if c in GRID]
    assert ran, sorted(results)
    for case in ran:
        r, flag = results[case], case.split(":")[2]
        assert len(r["sharding"]) == len(r["tables"]), (case, r["sharding"])
        if flag in ONE_TYPE:
            assert set(r["sharding"].values()) == {ONE_TYPE[flag]}, (case, r["sharding"])
        else:
            assert r["plans_equal"], (case, r["sharding"])


def test_compiled_once_for_dynamic_ids(results):
    # the first step compiles for its sizes, the second generalizes them (the ids per batch are
    # dynamic); no recompile after, no graph break. Every model in a process compiles the same
    # way (each model's forward is its own code object for dynamo)
    for case, r in results.items():
        assert r["graphs"] == 2, (case, r["explain"])


def test_each_case_ran_the_lowering_its_launch_asked_for(results, request):
    # Inductor's generated code has an order of its own in explain; an FX program has none
    for case, r in results.items():
        want = lowering(request.config, case, INDUCTOR_IN_CI)
        assert r["lowering"] == want, (case, r["lowering"])
        assert ("order in lowered code" in r["explain"]) == (want == "inductor"), (case, r["explain"])


def test_ids_exchange_overlaps_the_bottom_mlp(results):
    # forward: the input distribution (lengths, then ids, every group) is issued first, the dense
    # bottom MLP runs while the ids travel, their waits sit at the lookups
    report = results["dlrm:rowwise_adagrad"]["explain"]
    order = next(line for line in report.splitlines() if "order after scheduling (forward)" in line)
    events = order.split(": ", 1)[1].split(" -> ")
    first_compute = next(i for i, e in enumerate(events) if e.startswith("compute"))
    before = events[:first_compute]
    # lengths and ids of both groups, and the data-parallel table's lengths (all-gather) and ids
    assert sum(e.startswith("all_to_all") for e in before) == 5, order
    assert sum(e.startswith("all_gather") for e in before) == 1, order
    assert sum(e.startswith("wait") for e in before) == 3, order  # only the lengths' waits
    assert "sharded embeddings:" in report and "row_wise t_rw@0,1" in report


def test_planned_plan_is_the_same_on_every_rank(results):
    r = results["dlrm:rowwise_adagrad:planned"]
    assert r["plans_equal"], r["sharding"]
    assert set(r["sharding"]) == {"t_tw", "t_mean", "t_rw", "t_cw", "t_dp"}  # every table placed
    report = r["explain"]
    assert report.startswith("embedding plan (graphshard planner"), report[:2000]
    # the trained steps' time beside the estimate ("measured: no step yet" before any step)
    assert re.search(r"step: est [0-9.]+ ms \(embeddings only\), measured [0-9.]+ ms", report), report[:2000]


def test_auto_plan_is_the_same_on_every_rank_and_explained(results):
    r = results["dlrm:rowwise_adagrad:auto"]
    assert r["plans_equal"] and set(r["sharding"]) == {"t_tw", "t_mean", "t_rw", "t_cw", "t_dp"}, r["sharding"]
    assert r["explain"].startswith("plan notes:\n  auto_plan: memory_budget 64.0 KiB per rank"), r["explain"][:2000]


def test_fused_triton_runs_the_triton_kernel(results):
    # parity alone would not show which kernel ran: explain names it (fbgemm's is the unnamed default)
    assert "triton kernel" in results["dlrm:rowwise_adagrad:triton"]["explain"]
    assert "triton kernel" not in results["dlrm:rowwise_adagrad"]["explain"]


@pytest.mark.parametrize("case", AC)
def test_checkpointed_dense_part_is_recomputed(results, case):
    # parity is checked above; here, that the checkpointing was compiled as recomputation
    assert results[case]["recomputed_ops"] > 0, results[case]["explain"]
    assert "activation checkpointing:" in results[case]["explain"]
