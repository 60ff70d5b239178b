"""The collective check: ranks compare a program's collectives through the store before the first one.

On 2 gloo ranks (tests/workers/divergence.py): a rank-dependent branch, a rank with another plan
and a rank with another input shape are each caught on every rank, with the first collective that
differs, each side's version and the FX node it came from; nothing hangs. Programs
that agree pass, and ``explain`` prints what was compared and its cost. The comparison itself
(sizes the data decides match anything) is checked on entries built by hand.
"""

from __future__ import annotations

import time

import pytest

from _launch import torchrun
from graphshard.compiler.collective_check import CollectiveMismatch, Entry, _compare


def _entry(op, args, node="n", source="model.py:1 forward: x"):
    return Entry(op, args, node, source)


def test_sizes_the_data_decides_match_any_size():
    mine = [_entry("all_gather", ["int64[?,4]", 2])]
    _compare("g", "forward", (0, 0), mine, (1, 1), [_entry("all_gather", ["int64[12,4]", 2])])
    with pytest.raises(CollectiveMismatch, match="collective #0 differs"):  # a static size still counts
        _compare("g", "forward", (0, 0), mine, (1, 1), [_entry("all_gather", ["int64[12,5]", 2])])


def test_an_all_to_all_is_checked_pairwise():
    # an all-to-all's splits differ by rank: what rank 0 sends rank 1 (its input split 1) must be
    # what rank 1 expects from rank 0 (its output split 0), and the other way round
    rank0 = [_entry("all_to_all", ["float32[8]", [3, 7], [3, 5]])]
    rank1 = [_entry("all_to_all", ["float32[9]", [5, 2], [7, 2]])]
    _compare("g", "forward", (0, 0), rank0, (1, 1), rank1)
    _compare("g", "forward", (1, 1), rank1, (0, 0), rank0)
    _compare("g", "forward", (0, 0), [_entry("all_to_all", ["float32[?]", ["?", "?"], [3, "?"]])], (1, 1), rank1)
    with pytest.raises(CollectiveMismatch, match="collective #0 differs"):
        _compare("g", "forward", (0, 0), rank0, (1, 1), [_entry("all_to_all", ["float32[10]", [6, 2], [7, 3]])])


def test_a_missing_collective_is_named_with_each_side():
    mine = [_entry("all_gather", ["float32[16]", 2], "ag0"),
            _entry("all_gather", ["float32[8]", 2], "ag1", "net.py:9 forward: y = self.b(x)")]
    with pytest.raises(CollectiveMismatch) as e:
        _compare("dp", "forward", (1, 1), mine, (0, 0), mine[:1])
    text = str(e.value)
    assert "ranks 0 and 1" in text and "collective #1 differs" in text, text
    assert "rank 0: nothing (its program ends here)" in text, text
    assert "rank 1: all_gather(float32[8], 2) from node 'ag1', net.py:9 forward: y = self.b(x)" in text, text


CASES = ("branch", "plan", "shape", "same", "break", "break_branch", "late", "shape_later", "shape_dynamic")


@pytest.fixture(scope="module")
def results():
    t0 = time.perf_counter()
    out = {r["case"]: r for r in torchrun("divergence.py", list(CASES), timeout=600)}
    out["_seconds"] = time.perf_counter() - t0
    return out


@pytest.mark.multirank
def test_nothing_hangs(results):
    assert set(results) == {*CASES, "_seconds"}, sorted(results)
    assert results["_seconds"] < 300, results["_seconds"]  # seven cases, compiles included; a hang is 60 s each
    for case in ("branch", "plan", "shape", "break_branch", "shape_later", "shape_dynamic"):
        assert results[case]["seconds"] < 30, (case, results[case]["seconds"])


@pytest.mark.multirank
def test_a_rank_dependent_branch_is_caught_on_every_rank(results):
    errors = results["branch"]["errors"]
    assert all(errors) and len(set(errors)) == 1, errors  # every rank raised the same message
    text = errors[0]
    assert "would issue different collectives on process group" in text and "forward program" in text, text
    assert "rank 1: all_gather(" in text, text  # rank 1's extra unit b is gathered


@pytest.mark.multirank
def test_a_rank_with_another_plan_is_caught(results):
    errors = results["plan"]["errors"]
    assert all(errors) and len(set(errors)) == 1, errors
    assert "collective #0 differs" in errors[0] and "all_gather([float32[" in errors[0], errors[0]


@pytest.mark.multirank
@pytest.mark.parametrize("case", ["shape", "shape_later", "shape_dynamic"])
def test_a_rank_fed_another_shape_under_tp_is_caught_on_every_rank_at_any_step(results, case):
    # the first step, a later step whose new size only one rank recompiles for, and a program whose batch
    # size is symbolic (one program, sizes that differ by rank: gloo aborted the job before): every rank
    # raises the same CollectiveMismatch before the call's first collective, naming both ranks' inputs
    errors = results[case]["errors"]
    assert all(errors) and len(set(errors)) == 1, errors
    text = errors[0]
    rows = {"shape": (4, 6), "shape_later": (4, 6), "shape_dynamic": (5, 7)}[case]
    assert "ranks 0 and 1 of the model-parallel axis 'tp'" in text and "inputs of other shapes" in text, text
    assert f"rank 0: ((float32[{rows[0]},8]),{{}})" in text and f"rank 1: ((float32[{rows[1]},8]),{{}})" in text, text


@pytest.mark.multirank
def test_agreeing_ranks_pass_and_explain_prints_the_cost(results):
    r = results["same"]
    assert not any(r["errors"]), r["errors"]
    lines = [line for line in r["explain"].splitlines() if "collectives compared across ranks" in line]
    assert {line.split("(")[1].split(")")[0] for line in lines} == {"forward", "backward"}, r["explain"]
    assert all("with 1 peer(s)" in line and "ms on the first call, besides" in line and "waiting for peers" in line
               for line in lines), lines


@pytest.mark.multirank
def test_each_frame_of_a_graph_break_is_compared_with_the_same_frame(results):
    # two frames (forward and dynamo's resume function), each compiled twice (a second batch size):
    # each of the four graphs is paired with the peer's graph of the same frame and compile
    r = results["break"]
    assert not any(r["errors"]), r["errors"]
    headers = [line for line in r["explain"].splitlines() if line.startswith("graph ")]
    frames = [h.split("(", 1)[1].rsplit(", compile", 1)[0] for h in headers]
    assert len(headers) == 4 and len(set(frames)) == 2, headers
    assert any(f.startswith("Net.forward (divergence.py:") for f in frames), headers
    assert any(f.startswith("Net.torch_dynamo_resume_in_forward_at_") for f in frames), headers
    assert sorted(h.rsplit(", compile ", 1)[1] for h in headers) == ["0):", "0):", "1):", "1):"], headers
    compared = [line for line in r["explain"].splitlines() if "collectives compared across ranks" in line]
    assert len(compared) == 8, r["explain"]  # forward and backward of each graph


@pytest.mark.multirank
def test_a_branch_after_a_graph_break_names_the_resume_function(results):
    errors = results["break_branch"]["errors"]
    assert all(errors) and len(set(errors)) == 1, errors
    text = errors[0]
    assert "torch_dynamo_resume_in_forward_at_" in text and "compile 0" in text, text
    assert "rank 1: all_gather(" in text, text


@pytest.mark.multirank
def test_a_recompile_a_peer_makes_later_is_waited_for(results):
    # rank 1 recompiles for a new batch size 3 s before rank 0 does: its new all-reduce size differs
    # from rank 0's first compile, which is all rank 0 has posted; it waits for rank 0's recompile
    r = results["late"]
    assert not any(r["errors"]), r["errors"]
    headers = [line for line in r["explain"].splitlines() if line.startswith("graph ")]
    assert [h.rsplit(", compile ", 1)[1] for h in headers] == ["0):", "1):"], headers


@pytest.mark.multirank
def test_model_parallel_ranks_compare_every_calls_inputs_and_explain_prints_the_cost(results):
    # the TP model of the late case: two calls, each compared over the tp group
    text = results["late"]["explain"]
    line = next((l for l in text.splitlines() if "every call's input shapes compared" in l), None)
    assert line is not None, text
    assert "over the model-parallel group(s) 'tp': 2 calls" in line and "ms a call" in line, line
    # data-parallel ranks each feed their own batch: nothing is compared per call there
    assert "every call's input shapes" not in results["same"]["explain"], results["same"]["explain"]
