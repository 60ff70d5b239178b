"""``ShardEmbedding`` plan specs: TorchRec's sharding types for plain ``nn.EmbeddingBag`` modules,
in one plan with FullyShard and the tensor-parallel styles (tests/workers/embedding_plan.py).

Training on 2 gloo ranks (a 1-D mesh) and on 4 (a 2 x 2 mesh, the MLP tensor-parallel) must
match the single process on the global batch within 1e-5; the errors need no collective and
run on the fake process group.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

pytest.importorskip("fbgemm_gpu")

import graphshard  # noqa: E402
from _coverage_share import launch_groups, lowering  # noqa: E402
from _launch import CaseResults, run_cases  # noqa: E402
from graphshard import FullyShard, Plan, ShardEmbedding  # noqa: E402

TOL = 1e-5
CASES = {2: ["dp:sgd", "dp:rowwise_adagrad", "auto:rowwise_adagrad"],
         4: ["dp_tp:rowwise_adagrad"]}
"""``auto``: the plan is ``graphshard.auto_plan``'s (dense units and tables in an 8 KiB budget).
graphshard's Triton TBE (``ShardEmbedding(kernel="triton")``) trains in tests/test_sparse_without_fbgemm.py."""


INDUCTOR_IN_CI = {"dp:sgd"}
"""The case CI lowers with Inductor (`_coverage_share.launch_groups`): the lookups' kernels and the
sharded dense units in one compiled program. CI runs the others (other optimizers, the auto plan,
the 2-D mesh: planning and exchange, not lowering) as FX; ``--coverage full`` lowers them all with
Inductor."""


@pytest.fixture(scope="module")
def results(request):
    out = CaseResults()
    for nproc, cases in CASES.items():
        for group, env in launch_groups(request.config, cases, INDUCTOR_IN_CI):
            out.update(run_cases("embedding_plan.py", group, nproc=nproc, env=env))
    return out


@pytest.mark.multirank
def test_each_case_ran_the_lowering_its_launch_asked_for(results, request):
    for case, r in results.items():
        want = lowering(request.config, case, INDUCTOR_IN_CI)
        assert r.get("lowering") == want, (case, r.get("lowering"), r.get("message"))


@pytest.mark.multirank
@pytest.mark.parametrize("case", [c for cs in CASES.values() for c in cs])
def test_matches_single_process(results, case):
    r = results[case]
    assert r["keys"] == r["ref_keys"]  # <module>.weight for every table, fused ones included
    assert r["loss"] <= TOL, r
    bad = {k: v for k, v in r["params"].items() if not v <= TOL}  # NaN is bad too
    assert not bad and set(r["params"]) == set(r["ref_keys"]), r["params"]
    assert r["copies_spread"] == 0.0, r["copies_spread"]  # a table held by several groups: the same copy
    rw = r["chosen"]["emb_rw"]  # the auto plan's choice, the hand plans' row-wise
    assert f"{rw} emb_rw@0,1" in r["explain"]
    fallbacks = {l.strip() for l in r["explain"].splitlines() if "fallbacks:" in l}
    assert fallbacks == {"fallbacks: none"}, fallbacks  # every graph's, not one of them


def _plan(**rules):
    mesh = DeviceMesh.from_group(dist.group.WORLD, "cpu", mesh_dim_names=("dp",))
    return Plan(mesh, {"": FullyShard(), **rules})


class Bags(nn.Module):
    def __init__(self, bag):
        super().__init__()
        self.bag = bag
        self.head = nn.Linear(bag.embedding_dim, 1)


@pytest.mark.parametrize("bag, spec, error, match", [
    (nn.EmbeddingBag(10, 6), ShardEmbedding("column_wise"), ValueError,
     r"bag: column-wise sharding over 4 ranks needs the embedding dim \(6\) to divide into 4 equal blocks"),
    (nn.EmbeddingBag(10, 8, mode="max"), ShardEmbedding("row_wise"), NotImplementedError,
     r"bag: nn.EmbeddingBag\(mode='max'\); sharded bags pool by 'sum' or 'mean'"),
    (nn.Embedding(10, 8), ShardEmbedding("row_wise"), NotImplementedError,
     r"bag is a Embedding; ShardEmbedding shards nn.EmbeddingBag \(for a vocabulary-parallel nn.Embedding use RowwiseParallel\)"),
    (nn.EmbeddingBag(10, 8), ShardEmbedding("table_row_wise"), NotImplementedError, r"table-row-wise needs hosts"),
    (nn.EmbeddingBag(10, 8), ShardEmbedding("row_wise", optimizer="adam"), ValueError, r"optimizer 'adam'"),
    (nn.EmbeddingBag(10, 8), ShardEmbedding("row_wise", kernel="cuda"), ValueError, r"kernel 'cuda'; expected"),
])
def test_bad_specs(bag, spec, error, match):
    model = Bags(bag)
    with pytest.raises(error, match=match):
        graphshard.shard(model, _plan(bag=spec))


def test_fused_table_leaves_the_dense_plan_and_keeps_its_name():
    torch.manual_seed(0)
    model = Bags(nn.EmbeddingBag(12, 8))
    weight = model.bag.weight.detach().clone()
    graphshard.shard(model, _plan(bag=ShardEmbedding("row_wise")))
    assert [n for n, _ in model.named_parameters()] == ["head.weight", "head.bias"]  # the table is fused
    state = model.state_dict()
    assert sorted(state) == ["bag.weight", "head.bias", "head.weight"]
    local = state["bag.weight"].to_local()  # this rank's row block (rank 0 of 4: rows 0..2), the module's values
    torch.testing.assert_close(local, weight[:3])


@pytest.mark.multirank
def test_auto_plan_explains_itself(results):
    r = results["auto:rowwise_adagrad"]
    assert set(r["chosen"]) == {"emb_rw", "emb_tw", "emb_cw", "emb_dp"}  # every table placed
    assert r["explain"].startswith("plan notes:\n  auto_plan: memory_budget 8.0 KiB per rank"), r["explain"][:500]
