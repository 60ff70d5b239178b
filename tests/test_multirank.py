"""Multi-rank numerics with gloo: sharded training matches a single process on the global batch.

Each launch runs several cases in one torchrun job (start-up and imports dominate
on the CPU). A case trains 5 steps of SGD with momentum; the loss (averaged over
ranks) and every gathered parameter must match the single-process run within
1e-5 absolute (fp32).
"""

from __future__ import annotations

import pytest

from _launch import torchrun

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
]
FOUR_RANK = ["transformer:hybrid:inductor", "mlp:hybrid:eager"]

pytestmark = pytest.mark.multirank


@pytest.fixture(scope="module")
def two_rank_results():
    return {r["case"]: r for r in torchrun("numerics.py", TWO_RANK, nproc=2)}


@pytest.fixture(scope="module")
def four_rank_results():
    return {r["case"]: r for r in torchrun("numerics.py", FOUR_RANK, nproc=4)}


def _check(result):
    assert result["loss_err"] < TOL, result
    assert result["param_err"] < TOL, result


@pytest.mark.parametrize("case", TWO_RANK)
def test_two_rank_matches_single_process(two_rank_results, case):
    _check(two_rank_results[case])


@pytest.mark.parametrize("case", FOUR_RANK)
def test_hybrid_four_rank_matches_single_process(four_rank_results, case):
    _check(four_rank_results[case])


@pytest.mark.parametrize("case", [c for c in TWO_RANK if c.split(":")[2] in ("inductor", "eager", "backend")
                                  and not c.endswith(":dynamic")])
def test_no_graph_breaks_and_no_recompiles(two_rank_results, case):
    r = two_rank_results[case]
    assert r["graph_breaks"] == 0, r
    assert r["frames"] == 1, f"{case} compiled {r['frames']} graphs over 5 steps"


def test_fqns_are_the_users(two_rank_results):
    r = two_rank_results["transformer:full_shard:inductor"]
    assert r["params"] == r["ref_names"]
    assert r["state_dict"] == r["ref_state_dict"]
    assert "output.weight" in r["state_dict"]  # the tied weight keeps both names


def test_shared_module_keeps_both_fqns(two_rank_results):
    r = two_rank_results["shared:full_shard:eager"]
    assert "first.weight" in r["state_dict"] and "second.weight" in r["state_dict"]
    assert r["params"] == r["ref_names"]
