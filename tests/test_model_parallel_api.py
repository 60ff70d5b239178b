"""graphshard.model_parallel's API and its errors, on the fake process group (world size 4, rank 0).

Training numerics are in tests/test_model_parallel.py (2 gloo ranks); here: what needs no
collective: the constructor's plan handling, the module's FQNs and state, and each bad input's
error naming the table, feature or module and the fix.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

pytest.importorskip("torchrec")

from torch.distributed._shard.sharding_spec import EnumerableShardingSpec, ShardMetadata  # noqa: E402
from torchrec.distributed.embedding import EmbeddingCollectionSharder  # noqa: E402
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder  # noqa: E402
from torchrec.distributed.sharding_plan import construct_module_sharding_plan, row_wise, table_wise  # noqa: E402
from torchrec.distributed.types import ParameterSharding, ShardingEnv, ShardingPlan  # noqa: E402
from torchrec.modules.embedding_configs import EmbeddingBagConfig, EmbeddingConfig  # noqa: E402
from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection  # noqa: E402
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor  # noqa: E402

from graphshard.model_parallel import DistributedModelParallel  # noqa: E402
from graphshard.ops.sparse import ops as sparse_ops  # noqa: E402

FUSED = "fused"


def _tables():
    return [EmbeddingBagConfig(name="a", embedding_dim=8, num_embeddings=10, feature_names=["f0", "f1"]),
            EmbeddingBagConfig(name="b", embedding_dim=8, num_embeddings=12, feature_names=["f2"])]


class Tower(nn.Module):
    def __init__(self, ebc):
        super().__init__()
        self.ebc = ebc

    def forward(self, kjt):
        return self.ebc(kjt).values()


class TwoTower(nn.Module):
    def __init__(self):
        super().__init__()
        ebc = EmbeddingBagCollection(tables=_tables(), device=torch.device("cpu"))
        self.query, self.item = Tower(ebc), Tower(ebc)

    def forward(self, q, i):
        return self.query(q) + self.item(i)


def _module_plan(ebc, sharding=None):
    sharding = sharding or {"a": table_wise(rank=1, compute_kernel=FUSED), "b": row_wise(compute_kernel=FUSED)}
    return construct_module_sharding_plan(ebc, per_param_sharding=sharding, world_size=dist.get_world_size(),
                                          device_type="cpu")


def _dmp(model, plan, **kw):
    return DistributedModelParallel(model, env=ShardingEnv.from_process_group(dist.group.WORLD), plan=plan,
                                    sharders=[EmbeddingBagCollectionSharder(fused_params={})],
                                    init_data_parallel=False, **kw)


def test_shared_module_sharded_once_under_either_fqn():
    torch.manual_seed(0)
    model = TwoTower()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    plan = ShardingPlan({"item.ebc": _module_plan(model.item.ebc)})  # the plan may name either FQN
    dmp = _dmp(model, plan)
    assert len(dmp._collections) == 1 and dmp._collections[0].layout.fqns == ("query.ebc", "item.ebc")
    state = dmp.state_dict()
    assert sorted(state) == sorted(before)  # every FQN, the user's names
    # the module's weights are kept (this rank's pieces): table a lives on rank 1, b's row block 0 here
    coll = dmp._collections[0]
    (shard, piece), = coll.local_pieces("b")
    assert (shard.row_offset, shard.rows) == (0, 3)  # 12 rows over 4 ranks, rank 0's block, by hand
    torch.testing.assert_close(piece, before["query.ebc.embedding_bags.b.weight"][0:3])
    assert coll.local_pieces("a") == []
    assert not any("_graphshard" in n for n, _ in dmp.named_buffers())
    # the fused tables are listed as TorchRec lists them (each once, under the first FQN), marked as updated in the
    # backward, so in_backward_optimizer_filter keeps them from a dense optimizer
    tables = {n: p for n, p in dmp.named_parameters() if ".embedding_bags." in n}
    assert sorted(tables) == ["query.ebc.embedding_bags.a.weight", "query.ebc.embedding_bags.b.weight"], sorted(tables)
    assert all(hasattr(p, "_in_backward_optimizers") and not p.requires_grad for p in tables.values())


def test_same_plan_under_both_fqns_is_one_plan():
    model = TwoTower()
    plan = ShardingPlan({"query.ebc": _module_plan(model.query.ebc), "item.ebc": _module_plan(model.item.ebc)})
    assert len(_dmp(model, plan)._collections) == 1


def test_two_plans_for_one_shared_module():
    model = TwoTower()
    other = _module_plan(model.item.ebc, {"a": table_wise(rank=0, compute_kernel=FUSED), "b": row_wise(compute_kernel=FUSED)})
    plan = ShardingPlan({"query.ebc": _module_plan(model.query.ebc), "item.ebc": other})
    with pytest.raises(ValueError, match=r"reachable as 'query.ebc' and 'item.ebc'.*two different shardings"):
        _dmp(model, plan)


def test_plan_names_missing_module():
    model = TwoTower()
    plan = ShardingPlan({"tower.ebc": _module_plan(model.query.ebc)})
    with pytest.raises(ValueError, match=r"names module 'tower.ebc'.*embedding modules are \['item.ebc', 'query.ebc'\]"):
        _dmp(model, plan)


def test_plan_names_missing_table():
    model = TwoTower()
    mp = _module_plan(model.query.ebc)
    mp["zz"] = mp["a"]
    with pytest.raises(ValueError, match=r"names table\(s\) \['zz'\].*its tables are \['a', 'b'\]"):
        _dmp(model, ShardingPlan({"query.ebc": mp}))


def test_column_split_must_tile_the_dim():
    model = TwoTower()
    mp = _module_plan(model.query.ebc)
    spec = EnumerableShardingSpec([ShardMetadata([0, 0], [10, 3], "rank:0/cpu"), ShardMetadata([0, 3], [10, 3], "rank:1/cpu")])
    mp["a"] = ParameterSharding(sharding_type="column_wise", compute_kernel=FUSED, ranks=[0, 1], sharding_spec=spec)
    with pytest.raises(ValueError, match=r"table 'a': column-wise shards \[\(0, 3\), \(3, 3\)\] do not tile the embedding dim 8"):
        _dmp(model, ShardingPlan({"query.ebc": mp}))


def test_dense_kernel_refused_with_the_fix():
    model = TwoTower()
    mp = _module_plan(model.query.ebc, {"a": table_wise(rank=0), "b": row_wise(compute_kernel=FUSED)})
    with pytest.raises(NotImplementedError, match=r"table 'a' is table_wise with compute kernel 'dense'.*compute_kernel='fused'"):
        _dmp(model, ShardingPlan({"query.ebc": mp}))


def test_default_plan_is_the_planners():
    # plan=None: graphshard's planner (its collective plan), kept with its estimates for explain
    from graphshard.model_parallel import EmbeddingShardingPlanner

    model = TwoTower()
    dmp = _dmp(model, None)
    (fqn, mp), = dmp.plan.plan.items()
    expected = EmbeddingShardingPlanner().plan(TwoTower(), [EmbeddingBagCollectionSharder(fused_params={})])
    assert fqn == "query.ebc" and set(mp) == {"a", "b"}
    assert {t: (ps.sharding_type, ps.ranks, ps.compute_kernel) for t, ps in mp.items()} == {
        t: (ps.sharding_type, ps.ranks, ps.compute_kernel) for t, ps in expected.plan["query.ebc"].items()}
    assert {t.table for t in dmp._plan_estimate.tables} == {"a", "b"}


def test_kjt_lengths_and_values_disagree():
    model = TwoTower()
    dmp = _dmp(model, None)
    good = KeyedJaggedTensor(keys=["f0", "f1", "f2"], values=torch.arange(3), lengths=torch.tensor([1, 0, 1, 0, 1, 0]))
    bad = KeyedJaggedTensor(keys=["f0", "f1", "f2"], values=torch.arange(5), lengths=torch.tensor([1, 0, 1, 0, 1, 0]))
    with pytest.raises(ValueError, match=r"argument 1: the KeyedJaggedTensor's lengths sum to 3 but it has 5 values"):
        dmp(good, bad)


def test_kjt_missing_feature():
    model = TwoTower()
    dmp = _dmp(model, None)
    kjt = KeyedJaggedTensor(keys=["f0", "f2"], values=torch.arange(2), lengths=torch.tensor([1, 0, 1, 0]))
    with pytest.raises(ValueError, match=r"query.ebc: the KeyedJaggedTensor has no feature\(s\) \['f1'\]"):
        dmp.module.query(kjt)


def test_out_of_range_id_names_feature_and_table():
    lengths = torch.tensor([1, 1, 2, 0])  # features f0 (rows 10), f2 (rows 12); batch 2
    with pytest.raises(ValueError, match=r"id 12 of feature 'f2' \(table 'b'\) is outside the table's 12 rows"):
        sparse_ops.check_ids(torch.tensor([3, 9, 12, 0]), lengths, [10, 12],
                             "feature 'f0' (table 'a')\nfeature 'f2' (table 'b')")
    ok = torch.tensor([3, 9, 11, 0])
    assert torch.equal(sparse_ops.check_ids(ok, lengths, [10, 12], "a\nb"), ok)


def test_other_wrappers_refused():
    with pytest.raises(NotImplementedError, match=r"data_parallel_wrapper=object.*FullyShardDense\(\)"):
        _dmp(TwoTower(), None, data_parallel_wrapper=object())


class Sequence(nn.Module):
    def __init__(self, need_indices=False):
        super().__init__()
        tables = [EmbeddingConfig(name="a", embedding_dim=8, num_embeddings=10, feature_names=["f0", "f1"]),
                  EmbeddingConfig(name="b", embedding_dim=8, num_embeddings=12, feature_names=["f2"])]
        self.ec = EmbeddingCollection(tables=tables, device=torch.device("cpu"), need_indices=need_indices)

    def forward(self, kjt):
        return self.ec(kjt)


def _seq_dmp(model, plan):
    return DistributedModelParallel(model, env=ShardingEnv.from_process_group(dist.group.WORLD), plan=plan,
                                    sharders=[EmbeddingCollectionSharder(fused_params={})], init_data_parallel=False)


def test_embedding_collection_state_and_default_plan():
    torch.manual_seed(0)
    model = Sequence()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    assert set(next(iter(_seq_dmp(Sequence(), None).plan.plan.values()))) == {"a", "b"}  # the planner plans ECs
    tw = {"a": table_wise(rank=0, compute_kernel=FUSED), "b": table_wise(rank=1, compute_kernel=FUSED)}
    dmp = _seq_dmp(model, ShardingPlan({"ec": _module_plan(model.ec, tw)}))
    coll = dmp._collections[0]
    assert coll.layout.sequence and coll.layout.attr == "embeddings"
    assert sorted(dmp.state_dict()) == sorted(before) == ["ec.embeddings.a.weight", "ec.embeddings.b.weight"]
    (shard, piece), = coll.local_pieces("a")  # this rank (0) holds table a: the module's weights, kept
    torch.testing.assert_close(piece, before["ec.embeddings.a.weight"])


def test_embedding_collection_row_wise_pieces_are_views_of_the_stacked_table():
    torch.manual_seed(0)
    model = Sequence()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    plan = ShardingPlan({"ec": construct_module_sharding_plan(
        model.ec, per_param_sharding={"a": row_wise(compute_kernel=FUSED), "b": row_wise(compute_kernel=FUSED)},
        world_size=dist.get_world_size(), device_type="cpu")})
    coll = _seq_dmp(model, plan)._collections[0]
    (tbe,) = coll.fused()
    assert tbe.shapes == [(3 + 3, 8)]  # rank 0's row blocks of a (10 rows / 4) and b (12 / 4), stacked
    for name in ("a", "b"):
        (shard, piece), = coll.local_pieces(name)
        torch.testing.assert_close(piece, before[f"ec.embeddings.{name}.weight"][:3])  # rank 0: rows 0..2 of each
        assert piece.untyped_storage().data_ptr() == tbe.weights.untyped_storage().data_ptr()


def test_embedding_collection_table_row_wise_refused():
    model = Sequence()
    spec = EnumerableShardingSpec([ShardMetadata([0, 0], [5, 8], "rank:0/cpu"), ShardMetadata([5, 0], [5, 8], "rank:1/cpu")])
    mp = _module_plan_seq(model.ec)
    mp["a"] = ParameterSharding(sharding_type="table_row_wise", compute_kernel=FUSED, ranks=[0, 1], sharding_spec=spec)
    with pytest.raises(NotImplementedError, match=r"ec: table 'a' is table_row_wise; sequence embeddings"):
        _seq_dmp(model, ShardingPlan({"ec": mp}))


def _module_plan_seq(ec):
    return construct_module_sharding_plan(ec, per_param_sharding={"a": table_wise(rank=0, compute_kernel=FUSED),
                                                                  "b": table_wise(rank=1, compute_kernel=FUSED)},
                                          world_size=dist.get_world_size(), device_type="cpu")


@pytest.mark.parametrize("cls,kwargs,match", [
    (torch.optim.Adam, {"lr": 0.1},
     r"query\.ebc: apply_optimizer_in_backward\(torch\.optim\.adam\.Adam\).*torch\.optim\.SGD, torch\.optim\.Adagrad, "
     r"torchrec\.optim\.RowWiseAdagrad"),
    (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}, r"query\.ebc: in-backward optimizer SGD\(momentum=0\.9\).*drop momentum"),
])
def test_in_backward_optimizer_without_a_fused_kernel_is_refused(cls, kwargs, match):
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

    model = TwoTower()
    apply_optimizer_in_backward(cls, model.query.ebc.parameters(), kwargs)
    with pytest.raises(NotImplementedError, match=match):
        _dmp(model, ShardingPlan({"query.ebc": _module_plan(model.query.ebc)}))


def test_in_backward_optimizer_arguments_at_their_defaults_are_accepted():
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

    model = TwoTower()
    apply_optimizer_in_backward(torch.optim.SGD, model.query.ebc.parameters(), {"lr": 0.1, "momentum": 0.0})
    dmp = _dmp(model, ShardingPlan({"query.ebc": _module_plan(model.query.ebc)}))
    assert [g["lr"] for g in dmp.fused_optimizer.param_groups] == [pytest.approx(0.1)]


def test_variable_batch_per_feature_is_expanded_as_its_inverse_indices_say():
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    from graphshard.frontends.model_parallel._batches import expand_vbe

    # f0 has 2 bags, f1 one, f2 three; the batch has 3 samples: sample i of f reads bag inverse[f][i]
    kjt = KeyedJaggedTensor(
        keys=["f0", "f1", "f2"], values=torch.tensor([1, 2, 3, 4, 5, 6]), weights=torch.arange(6.0),
        lengths=torch.tensor([1, 1, 2, 1, 0, 1]), stride_per_key_per_rank=[[2], [1], [3]],
        inverse_indices=(["f2", "f0", "f1"], torch.tensor([[0, 1, 2], [0, 1, 1], [0, 0, 0]])))
    out = expand_vbe(kjt)
    assert not out.variable_stride_per_key() and out.stride() == 3 and out.keys() == ["f0", "f1", "f2"]
    assert out.lengths().tolist() == [1, 1, 1, 2, 2, 2, 1, 0, 1]
    assert out.values().tolist() == [1, 2, 2, 3, 4, 3, 4, 3, 4, 5, 6]
    assert out.weights().tolist() == [0, 1, 1, 2, 3, 2, 3, 2, 3, 4, 5]
