"""TorchRec's own test models and harness pieces, graphshard's DMP in place of TorchRec's (tests/workers/dmp_peer.py).

TorchRec's sharding harness, ``torchrec.distributed.test_utils.test_sharding``, cannot be imported from
the torchrec 1.9.2 wheel (it imports ``torchrec.distributed.tests``, which the wheel does not ship), so
the worker builds the same comparison from the pieces that ship, wired as the harness wires them:
``test_model.TestSparseNN`` with TorchRec's test tables (two of which look up a feature again),
``ModelInput.generate`` / ``generate_variable_batch_input``, the ``TestEBCSharder`` of
``test_utils.emb_sharder``, TorchRec's planner with ``ParameterConstraints(min_partition=4)``, the model
built with its tables on the meta device, ``KeyedOptimizerWrapper`` over
``in_backward_optimizer_filter(named_parameters())`` beside ``fused_optimizer``, the global model's
weights copied in, training steps and a prediction. Each case runs on graphshard's DMP, on TorchRec's DMP
under the same plan and unsharded; graphshard must match the unsharded model (losses, prediction, every
state-dict entry) within 1e-5 (NaN fails) and TorchRec's DMP likewise, with TorchRec's state-dict keys and
shapes and TorchRec's ``named_parameters`` names. A case TorchRec cannot run on the CPU is checked
against the unsharded model only, and TorchRec's error is asserted (``PEER_FAILS``: if TorchRec starts
passing one, the test says so); a case graphshard refuses asserts the refusal (``REFUSED``). Nothing
is skipped.

CI runs ``CI`` in one launch as FX (the subject is the frontend's semantics and the sparse exchange, not
the lowering: `_coverage_share.launch_groups`); ``--coverage full`` runs every case with Inductor.
"""

from __future__ import annotations

import json
import os

import pytest

pytest.importorskip("torchrec")  # an optional dependency (scripts/setup.sh says when it is skipped)

from _coverage_share import ci_share, launch_groups  # noqa: E402
from _launch import run_cases  # noqa: E402

pytestmark = pytest.mark.multirank

TOL = 1e-5
CI = ["twcw", "cw:uneven:vbe", "tw:vb"]
"""``twcw``: table-column-wise from TorchRec's planner (several column blocks a rank), shared features,
two collections (one weighted), ``named_parameters``; ``cw:uneven:vbe``: column blocks of unequal width
(TorchRec's ``column_wise(size_per_rank=...)``) with a variable batch per feature; ``tw:vb``: ranks with
different batch sizes (refused, ``REFUSED``)."""
CASES = CI + ["tw", "rw", "cw", "cw:uneven", "cw:vbe", "twrw", "dp", "tw:mean", "cw:mean", "twcw:mean", "rw:mean", "tw:inbackward",
              "cw:inbackward", "tw:vbe", "rw:vbe", "dp:vbe", "twrw:vbe", "rw:vb", "tw:ec"]
"""Every sharding type TorchRec's ``test_model_parallel`` runs on a CPU (tw, rw, cw, twcw, twrw, dp), SUM and
MEAN pooling (``mean``), TorchRec's ``apply_optimizer_in_backward`` on the tables (``inbackward``), a
variable batch per feature (``vbe``) and per rank (``vb``), and ``EmbeddingConfig`` tables (``ec``)."""
FULL_ONLY = set(CASES) - set(CI)

REFUSED = {"tw:vb": "different batch sizes", "rw:vb": "different batch sizes"}
"""graphshard refuses ranks with different batch sizes (TorchRec's ``variable_batch_size``), naming it:
each rank's program is compiled from its own shapes (docs/frontends/model_parallel.md)."""
PEER_FAILS = {
    "rw:vbe": "ProcessGroupGloo::allgather: invalid tensor size",
    "twrw:vbe": "ProcessGroupGloo::allgather: invalid tensor size",
    "rw:vb": "ProcessGroupGloo::allgather: invalid tensor size",
    "dp:vbe": "Index 29 is out of bounds: 30, range 0 to 10",
}
"""TorchRec's DMP (1.9.2) on 2 gloo CPU ranks: row-wise and table-row-wise with a variable batch per feature,
and row-wise with a variable batch per rank, fail in its output distribution (an all-gather of unequal
pieces, which gloo refuses); data-parallel with a variable batch per feature fails in its lookup (an index
out of bounds). graphshard's DMP matches the unsharded model on each."""
REFERENCE_FAILS = {"tw:ec": "'dict_keys' object is not subscriptable"}
"""TorchRec's own ``TestSparseNN`` over ``EmbeddingConfig`` tables (its ``TestECSparseArch``) fails unsharded:
``_post_sparsenn_forward`` slices ``dict.keys()`` (TorchRec's own TODO says the EC arch "won't work" with it).
graphshard's ``EmbeddingCollection`` runs in tests/test_model_parallel.py (``seq``, ``seqtwo``)."""


def selected(config) -> list[str]:
    return ci_share(config, CASES, FULL_ONLY)


def pytest_generate_tests(metafunc):
    if "peer_case" in metafunc.fixturenames:
        metafunc.parametrize("peer_case", selected(metafunc.config))


LAUNCH = 6
"""Cases per torchrun launch: each case compiles new models from TorchRec's same code objects, and dynamo's
recompile limit per code object (8) must not be reached within one process, where dynamo would run the
rest eagerly (``explain`` lists that as a fallback)."""


@pytest.fixture(scope="module")
def results(request):
    out = {}
    for cases, env in launch_groups(request.config, selected(request.config), set()):
        for i in range(0, len(cases), LAUNCH):
            out.update(run_cases("dmp_peer.py", cases[i:i + LAUNCH], nproc=2, env=env))
    _write_table(out, request.config.getoption("coverage"))
    return out


def _write_table(results: dict, selection: str) -> None:
    """case -> graphshard's and TorchRec's largest differences from the unsharded model and from each other
    (``coverage_out/peer_torchrec.md``), or the error that stopped a side."""
    def fmt(r, key):
        g = r.get(key)
        return "-" if g is None else f"{g['loss']:.1e} / {g['pred']:.1e} / {g['worst_param']:.1e}"

    lines = [f"TorchRec harness parity ({selection}): loss / prediction / worst parameter, max |difference|", "",
             "| case | lowering | gs vs unsharded | TorchRec vs unsharded | gs vs TorchRec | errors |",
             "|---|---|---|---|---|---|"]
    for case, r in results.items():
        errors = "; ".join(f"{k}: {v[:80]}" for k, v in r.get("errors", {}).items()) or r.get("message", "")[:80]
        lines.append(f"| {case} | {r.get('lowering', '')} | {fmt(r, 'gs_ref')} | {fmt(r, 'tr_ref')} | "
                     f"{fmt(r, 'gs_tr')} | {errors} |")
    out = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "coverage_out")
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "peer_torchrec.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    with open(os.path.join(out, "peer_torchrec.json"), "w") as f:
        json.dump({c: {k: v for k, v in r.items() if k != "explain"} for c, r in results.items()}, f, indent=1)


def test_graphshard_matches_single_process(results, peer_case):
    r = results[peer_case]
    if peer_case in REFERENCE_FAILS:  # TorchRec's model itself cannot run it: its error, nothing to compare
        assert REFERENCE_FAILS[peer_case] in r["errors"].get("reference", ""), r["errors"]
        return
    if peer_case in REFUSED:
        assert REFUSED[peer_case] in r["errors"].get("graphshard", ""), r["errors"]
        assert "NotImplementedError" in r["errors"]["graphshard"] and "variable_batch_size" in r["errors"]["graphshard"]
        return
    assert "graphshard" not in r["errors"], r["errors"]
    g = r["gs_ref"]
    assert not g["keys_missing"] and not g["keys_extra"], g
    assert g["loss"] <= TOL and g["pred"] <= TOL, g
    bad = {k: v for k, v in g["params"].items() if not v <= TOL}  # NaN and inf fail too
    assert not bad, bad
    # every table trained, by more than the tolerance and by ten times its difference from the single process:
    # a table left as it was (or updated partly) would be off by about as much as it moved
    moved = {t: (r["moved"][t], g["params"][t]) for t in r["tables"]}
    assert all(m > TOL and 10 * e < m for m, e in moved.values()), moved


def test_torchrec_same_program(results, peer_case):
    r = results[peer_case]
    if peer_case in REFERENCE_FAILS:
        return  # asserted above
    if peer_case in PEER_FAILS:
        assert PEER_FAILS[peer_case] in r["errors"].get("torchrec", ""), ("TorchRec now runs it?", r["errors"])
        return
    assert "torchrec" not in r["errors"], r["errors"]
    t = r["tr_ref"]
    assert t["loss"] <= TOL and t["pred"] <= TOL and t["worst_param"] <= TOL, t
    if peer_case in REFUSED:
        return
    both = r["gs_tr"]
    assert both["loss"] <= TOL and both["pred"] <= TOL and both["worst_param"] <= TOL, both
    assert not both["keys_missing"] and not both["keys_extra"], both
    assert r["gs_shapes"] == r["tr_shapes"]
    # named_parameters as TorchRec lists them: every table, under its FQN, with prefix= and recurse=False
    assert r["gs_names"] == r["tr_names"]
    assert r["gs_names_prefixed"] == r["tr_names_prefixed"]
    assert r["gs_names_shallow"] == r["tr_names_shallow"]


def test_layouts_are_the_ones_named(results):
    # the cases exercise what their names say: blocks of unequal width, several blocks on a rank
    # (TorchRec's planner with min_partition=4), table-column-wise
    r = results["cw:uneven:vbe"]
    widths = {t: {w for _, _, w in shards} for t, (kind, shards) in r["plan"].items()}
    assert sum(len(w) > 1 for w in widths.values()) >= 6, widths  # every table wider than 8 columns
    r = results["twcw"]
    assert {kind for kind, _ in r["plan"].values()} == {"table_column_wise"}, r["plan"]
    ranks = [[rank for rank, _, _ in shards] for _, shards in r["plan"].values()]
    assert any(len(rs) > len(set(rs)) for rs in ranks), r["plan"]


def test_variable_batch_per_feature_is_expanded_and_explained(results):
    report = results["cw:uneven:vbe"]["explain"]
    assert "fallbacks (DistributedModelParallel input): a KeyedJaggedTensor with a variable batch per feature" \
        in report, report[:3000]
