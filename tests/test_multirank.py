"""Multi-rank numerics with gloo: sharded training matches a single process on the global batch.

Each launch runs several cases in one torchrun job (start-up and imports dominate
on the CPU). A case trains 5 steps of SGD with momentum; the loss (averaged over
ranks) and every gathered parameter must match the single-process run within
1e-5 absolute (fp32). Cases flagged ``nccl_forms`` build the plan with
``collectives="nccl"``: gloo then runs the collectives a NCCL (GPU) run issues.
"""

from __future__ import annotations

import re

import pytest

from _launch import run_cases, torchrun

TOL = 1e-5
TWO_RANK = [
    "transformer:full_shard:inductor",
    "transformer:full_shard:eager",
    "transformer:shard_grad_op:inductor",
    "mlp:shard_grad_op:eager",
    "transformer:replicate:eager",
    "mlp:replicate:inductor",
    "mlp:tp:eager",
    "mlp:tp:inductor",
    "shared:full_shard:eager",
    "mlp:full_shard:uncompiled",
    "mlp:full_shard:backend",
    "transformer:full_shard:eager:dynamic",
    "mlp:tp:eager:dynamic",
    "transformer:full_shard:inductor:nccl_forms",
    "transformer:shard_grad_op:eager:nccl_forms",
    "transformer:full_shard:inductor:flat",
    "shared:full_shard:eager:flat",
    # Odd shard sizes (49, 7, 39, 3 elements) lowered whole, NCCL's and gloo's forms (the "mlp"
    # cases above take sizes 150, 15, 105, 4 through the other lowerings): Inductor requires
    # the gradients cut from a unit's reduced bucket to start aligned (tests/test_bucket_ops.py).
    "odd:full_shard:whole:nccl_forms",
    "odd:replicate:whole",
    # Trace once (graphshard.compiler.outline): the 4 blocks share one outlined body (the last
    # block's segment runs on into the tail: its beginning is the body); the root's is in line.
    "transformer4:full_shard:eager",
    "transformer4:full_shard:inductor",
]
FOUR_RANK = ["transformer:hybrid:inductor", "mlp:hybrid:eager", "transformer:hybrid:eager:nccl_forms"]
# Ops a step runs (the worker's "ops"): NCCL's forms (Plan(collectives="nccl"), and on NCCL itself)
# and gloo's (the default on gloo). c10d implements each functional collective by a ProcessGroup op.
# The unit's gather: packed, then all-gathered; lowered by Inductor (by region or whole), the pair
# runs in place: the shards packed into this rank's slot of the gathered buffer, which is gathered
# into itself (`ops.dense.gather_in_place`).
NCCL_FORMS = {"graphshard::unpack", "graphshard::pack_grads", "_c10d_functional::reduce_scatter_tensor",
              "graphshard::unpack_reduced"}
PACKED_GATHER = {"graphshard::pack", "_c10d_functional::all_gather_into_tensor"}
IN_PLACE_GATHER = {"_c10d_functional::all_gather_into_tensor_out"}
GLOO_FORMS = {"_c10d_functional::all_gather_into_tensor_coalesced", "_c10d_functional::all_to_all_single"}
# Rank 1 alone sees a new input shape at step 2 and compiles a second graph, lowered by region
# or whole, with shared compiles on (both ranks share the first graph's compile).
ONE_RANK_COMPILES = ["mlp:full_shard:inductor:rank1_shape", "odd:full_shard:whole:rank1_shape"]
# Tensor parallelism (tests/workers/tp_numerics.py): plan:frontend:lower, and torch's own TP beside ours.
TP_TWO_RANK = ["tp:plan:eager", "tp:plan:eager:dynamic", "sp:plan:eager:deep", "loss_parallel:plan:eager",
               "loss_inside:plan:eager", "tp:parallelize:inductor:deep", "torch_tp:tp"]
# ``deep``: 4 blocks, which share one traced and differentiated body (outline cuts at the blocks)
TP_FOUR_RANK = ["fsdp_tp:plan:eager"]

pytestmark = pytest.mark.multirank


@pytest.fixture(scope="module")
def two_rank_results():
    return run_cases("numerics.py", [*TWO_RANK, *ONE_RANK_COMPILES], nproc=2)


@pytest.fixture(scope="module")
def four_rank_results():
    return run_cases("numerics.py", FOUR_RANK, nproc=4)


def _check(result):
    assert result["loss_err"] < TOL, result
    assert result["param_err"] < TOL, result


@pytest.mark.parametrize("case", TWO_RANK)
def test_two_rank_matches_single_process(two_rank_results, case):
    _check(two_rank_results[case])


@pytest.mark.parametrize("case", FOUR_RANK)
def test_hybrid_four_rank_matches_single_process(four_rank_results, case):
    _check(four_rank_results[case])


@pytest.mark.parametrize("case", [c for c in TWO_RANK if c.split(":")[2] in ("inductor", "eager", "backend", "whole")
                                  and not c.endswith(":dynamic")])
def test_no_graph_breaks_and_no_recompiles(two_rank_results, case):
    r = two_rank_results[case]
    assert r["graph_breaks"] == 0, r
    # on every rank: a rank-dependent guard would recompile on one rank only
    assert r["frames_per_rank"] == [1, 1], f"{case} compiled {r['frames_per_rank']} graphs per rank over 5 steps"


@pytest.mark.parametrize("case", [c for c in TWO_RANK if c.endswith(":nccl_forms")])
def test_nccl_forms_run_on_gloo(two_rank_results, case):
    # The numerics above passed through NCCL's collectives: the step ran those and no gloo form.
    ops = set(two_rank_results[case]["ops"])
    assert NCCL_FORMS <= ops and not GLOO_FORMS & ops, sorted(ops)
    # lowered by Inductor the gather runs in place; the eager lowering runs the graph's pair
    in_place = case.split(":")[2] in ("inductor", "whole")
    gather, other = (IN_PLACE_GATHER, PACKED_GATHER) if in_place else (PACKED_GATHER, IN_PLACE_GATHER)
    assert gather <= ops and not other & ops, sorted(ops)


@pytest.mark.parametrize("case", [c for c in TWO_RANK if c.split(":")[1] in ("full_shard", "shard_grad_op")
                                  and not c.endswith(":nccl_forms")])
def test_gloo_forms_by_default(two_rank_results, case):
    ops = set(two_rank_results[case]["ops"])
    assert GLOO_FORMS <= ops and not {"_c10d_functional::reduce_scatter_tensor", "graphshard::unpack"} & ops, sorted(ops)


def test_hybrid_nccl_forms_run_on_gloo(four_rank_results):
    ops = set(four_rank_results["transformer:hybrid:eager:nccl_forms"]["ops"])
    assert NCCL_FORMS | PACKED_GATHER | {"_c10d_functional::all_reduce"} <= ops and not GLOO_FORMS & ops, sorted(ops)


@pytest.mark.parametrize("case", ONE_RANK_COMPILES)
def test_a_graph_compiled_by_one_rank_only_completes(two_rank_results, case):
    # Shared compiles once passed a barrier on every local rank inside the compile: a graph
    # that only rank 1 compiled held it there while rank 0 went on to its next collective,
    # and the job hung. Now a rank waits only for work another rank has claimed.
    r = two_rank_results[case]
    _check(r)
    assert r["frames_per_rank"] == [1, 2], r


@pytest.mark.parametrize("case", [c for c in TWO_RANK if c.startswith("transformer4:")])
def test_trace_once_shared_the_repeated_blocks(two_rank_results, case):
    # the parity above holds with the blocks traced once; here, that they were
    notes = [n for n in two_rank_results[case]["notes"] if n.startswith("trace once")]
    assert notes == ["trace once: 4 units traced as 1 body (layers.0 x4), 1 on their own"], notes
    # explain's compile time per distinct unit: the body, the units that reused it, and (lowered
    # with Inductor) its regions: each compiled one stamped out once per block
    lines = two_rank_results[case]["distinct_units"]
    # dynamo traced one block and stamped its body out for the other three (compiler.regions)
    assert lines[1] == "dynamo: 4 blocks from 1 traced body, traced to ATen once", lines
    # (an earlier run on the same Inductor cache may have stored the program: then it was loaded)
    assert lines[2].startswith(tuple(f"layers.0, reused by 4 units (layers.0, layers.1, layers.2, layers.3): {done}"
                                     for done in ("traced once in ", "loaded with the program"))), lines
    assert lines[-1].startswith("in line (the units on their own"), lines
    if case.endswith(":inductor"):
        lowered = re.findall(r"(forward|backward) (\d+) regions from (\d+) compiled", lines[2])
        assert {stage for stage, _, _ in lowered} == {"forward", "backward"}, lines
        for stage, regions, compiled in lowered:
            assert int(compiled) >= 1 and int(regions) >= 4 * int(compiled), lines


def test_fqns_are_the_users(two_rank_results):
    r = two_rank_results["transformer:full_shard:inductor"]
    assert r["named_parameters"] == r["ref_names"]  # the compiled model's own names, not the reference's
    assert r["state_dict"] == r["ref_state_dict"]
    assert "output.weight" in r["state_dict"]  # the tied weight keeps both names


def test_flat_params_are_what_the_optimizer_steps(two_rank_results):
    """FullyShard(flat_params=True): one ``_flat_param`` per unit is every parameter the model
    registers (the optimizer steps those), and the numbers match the single process."""
    assert two_rank_results["transformer:full_shard:inductor:flat"]["named_parameters"] == [
        "_flat_param", "layers.0._flat_param", "layers.1._flat_param"]
    assert two_rank_results["shared:full_shard:eager:flat"]["named_parameters"] == ["_flat_param", "first._flat_param"]


def test_shared_module_keeps_both_fqns(two_rank_results):
    r = two_rank_results["shared:full_shard:eager"]
    assert "first.weight" in r["state_dict"] and "second.weight" in r["state_dict"]
    assert r["named_parameters"] == r["ref_names"]


@pytest.fixture(scope="module")
def tp_results():
    return run_cases("tp_numerics.py", TP_TWO_RANK, nproc=2)


@pytest.mark.parametrize("case", [c for c in TP_TWO_RANK if not c.startswith("torch_tp")])
def test_tensor_parallel_matches_single_process(tp_results, case):
    r = tp_results[case]
    _check(r)
    assert r["names"] and r["fallbacks"] == [], r
    assert "tok_embeddings.weight" in " ".join(r["dtensor_params"])
    if case.endswith(":dynamic"):  # the batch changed: a symbolic-batch program trained the later steps
        assert r["graphs"] >= 2, r


@pytest.mark.parametrize("case", [c for c in TP_TWO_RANK if c.endswith(":deep")])
def test_tensor_parallel_blocks_share_one_differentiated_body(tp_results, case):
    # the parity above holds with the blocks outlined for aot_autograd; here, that they were: with
    # tensor parallelism alone there are no units to cut at, so outline cuts at dynamo's blocks
    assert tp_results[case]["trace_once"] == ["trace once: 4 units traced as 1 body (layers.0 x4), 0 on their own"]


def test_tensor_parallel_matches_torchs_parallelize_module(tp_results):
    r = tp_results["torch_tp:tp"]
    assert r["torch_vs_ref_loss"] < TOL and r["ours_vs_ref_loss"] < TOL, r
    assert r["ours_vs_torch_loss"] < TOL and r["ours_vs_torch_params"] < TOL, r
    assert r["ours_vs_ref_params"] < TOL, r


def test_torch_tensor_parallel_cannot_run_hard_coded_heads(tp_results):
    # graphshard runs that model (every other TP case uses it); torch's eager TP needs view(b, s, -1, hd)
    assert "is invalid for input of size" in tp_results["torch_tp:tp"]["torch_fails_on_fixed_heads"]


def test_fsdp_and_tensor_parallel_on_a_2x2_mesh():
    (r,) = torchrun("tp_numerics.py", TP_FOUR_RANK, nproc=4)
    _check(r)


# Random ops under model parallelism (tests/workers/rng_numerics.py): one 4-rank launch, every rank seeded
# differently; two 2-rank TP jobs, then FSDP + TP on a 2x2 mesh, each lowered eagerly and by Inductor.
RNG_CASES = ["tp:eager", "tp:inductor", "fsdp_tp:eager", "fsdp_tp:inductor"]


@pytest.fixture(scope="module")
def rng_results():
    return run_cases("rng_numerics.py", RNG_CASES, nproc=4)


@pytest.mark.parametrize("case", RNG_CASES)
def test_random_ops_follow_placements(rng_results, case):
    r = rng_results[case]
    assert r["replicated_params"] == ["fc2.bias"], r
    # replicated over "tp": bitwise the same on every tp rank, though the ranks' generators differ
    assert r["replicated_diff"] == 0 and r["loss_diff_tp"] == 0, r
    # the draws are the logical program's: the run matches the model on one tp rank seeded like the group's first
    assert r["loss_err"] < TOL and r["param_err"] < TOL, r
    if case.startswith("tp:"):  # ranks 2 and 3: a second job, checked by its own first rank
        second = r["second_job"]
        assert second["replicated_diff"] == 0 and second["loss_diff_tp"] == 0, second
        assert second["loss_err"] < TOL and second["param_err"] < TOL, second
        if case.endswith(":eager"):
            assert second["probe_shape"] == [4, 6, 32] and not second["probe_halves_equal"], second
            assert second["probe_values"] == [0.0, round(1 / 0.75, 6)], second
    if case.endswith(":eager"):
        assert r["probe_shape"] == [4, 6, 32], r  # the gathered (BATCH, SEQ, HIDDEN) mask
        assert not r["probe_halves_equal"], r  # shards draw their own values (for "tp": the same seed on every rank)
        assert r["probe_sharded_diff"] == 0, r  # every tp rank holds the same logical mask
        # torch's dropout (p 0.25), independently of graphshard: the rate within 3 sigma of 768
        # draws, kept values scaled by 1 / (1 - p)
        assert r["probe_replicated_diff"] == 0 and abs(r["probe_drop_rate"] - 0.25) < 0.05, r
        assert r["probe_values"] == [0.0, round(1 / 0.75, 6)], r
        if case.startswith("fsdp_tp"):
            assert r["probe_dp_equal"] is False, r  # each data-parallel rank its own stream, both masks
