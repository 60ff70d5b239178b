"""graphshard.model_parallel.EmbeddingShardingPlanner: its plans, constraints, errors and cost model.

On the fake process group (world size 4, rank 0) where a collective is needed; the training
parity of a planned plan on 2 gloo ranks, and the collective plan's equality across ranks, are
in tests/test_model_parallel.py (case ``dlrm:rowwise_adagrad:planned``).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

pytest.importorskip("torchrec")

from fbgemm_gpu.split_embedding_configs import EmbOptimType  # noqa: E402
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder  # noqa: E402
from torchrec.distributed.planner.types import ParameterConstraints, Topology  # noqa: E402
from torchrec.models.dlrm import DLRM  # noqa: E402
from torchrec.modules.embedding_configs import EmbeddingBagConfig  # noqa: E402
from torchrec.modules.embedding_modules import EmbeddingBagCollection  # noqa: E402

from graphshard.model_parallel import EmbeddingShardingPlanner  # noqa: E402
from graphshard.planning import cost as _cost  # noqa: E402

META = torch.device("meta")
GiB = 2**30


def _sharders(optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD):
    return [EmbeddingBagCollectionSharder(fused_params={"optimizer": optimizer, "learning_rate": 0.01})]


def _topology(world=2, local=None, ddr_cap=None):
    return Topology(world_size=world, local_world_size=local or world, compute_device="cpu", ddr_cap=ddr_cap)


def _dlrm(tables=8, rows=100_000, dim=64):
    """The DMP benchmark's DLRM (benchmarks/_dmp_worker.py), on the meta device."""
    configs = [EmbeddingBagConfig(name=f"t{i}", embedding_dim=dim, num_embeddings=rows, feature_names=[f"f{i}"])
               for i in range(tables)]
    ebc = EmbeddingBagCollection(tables=configs, device=META)
    return DLRM(embedding_bag_collection=ebc, dense_in_features=13, dense_arch_layer_sizes=[128, dim],
                over_arch_layer_sizes=[128, 1])


def _placements(plan) -> dict:
    return {t: (ps.sharding_type, tuple(ps.ranks), ps.compute_kernel) for mp in plan.plan.values() for t, ps in mp.items()}


def _bytes_by_rank(plan, world: int) -> list[int]:
    """Each rank's bytes, by hand from the plan's shard sizes: fp32 weights and row-wise Adagrad's
    one fp32 value per row of every shard (the planner's own estimate is not consulted)."""
    out = [0] * world
    for mp in plan.plan.values():
        for ps in mp.values():
            for shard in ps.sharding_spec.shards:
                rows, cols = shard.shard_sizes
                out[shard.placement.rank()] += rows * cols * 4 + rows * 4
    return out


def _check_estimate(planner, plan):
    est = planner.estimate
    assert {t.table for t in est.tables} == set(_placements(plan))          # every table placed, once
    assert all(m <= c for m, c in zip(est.memory, est.capacity))          # within every rank's memory
    for r in range(len(est.load)):                                         # the totals are the tables' sums
        assert est.load[r] == pytest.approx(sum(t.cost.time(r) for t in est.tables))
        assert est.memory[r] == sum(t.cost.memory.get(r, 0) for t in est.tables)


def test_dlrm_benchmark_tables_balanced_table_wise():
    # equal tables: the cheapest plan is each table whole on one rank, half the tables on each
    # (row-wise would move twice the pooled rows for the same lookups)
    planner = EmbeddingShardingPlanner(topology=_topology(2), constraints={
        f"t{i}": ParameterConstraints(pooling_factors=[10.0]) for i in range(8)})
    plan = planner.plan(_dlrm(), _sharders())
    placed = _placements(plan)
    assert {kind for kind, _, _ in placed.values()} == {"table_wise"}
    assert sorted(ranks[0] for _, ranks, _ in placed.values()) == [0] * 4 + [1] * 4
    assert all(kernel == "fused" for _, _, kernel in placed.values())
    _check_estimate(planner, plan)
    assert planner.estimate.load[0] == pytest.approx(planner.estimate.load[1])
    # the memory counted is the weights and row-wise Adagrad's one value per row
    assert planner.estimate.memory[0] == 4 * (100_000 * 64 * 4 + 100_000 * 4)


def test_torchrec_test_tables():
    """TorchRec's own test model and tables (``torchrec.distributed.test_utils``): a weighted and
    an unweighted collection, tables of different sizes, on 4 ranks as 2 hosts x 2."""
    from torchrec.distributed.test_utils.test_model import TestSparseNN

    tables = [EmbeddingBagConfig(num_embeddings=(i + 1) * 10, embedding_dim=(i + 2) * 8, name=f"table_{i}",
                                 feature_names=[f"feature_{i}"]) for i in range(4)]
    weighted = [EmbeddingBagConfig(num_embeddings=(i + 1) * 10, embedding_dim=(i + 2) * 4, name=f"weighted_table_{i}",
                                   feature_names=[f"weighted_feature_{i}"]) for i in range(2)]
    model = TestSparseNN(tables=tables, weighted_tables=weighted, sparse_device=META, dense_device=META)
    planner = EmbeddingShardingPlanner(topology=_topology(4, local=2), batch_size=64)
    plan = planner.plan(model, _sharders())
    _check_estimate(planner, plan)
    assert set(plan.plan) == {"sparse.ebc", "sparse.weighted_ebc"}
    assert set(_placements(plan)) == {t.name for t in tables + weighted}
    weighted_costs = [t for t in planner.estimate.tables if t.table.startswith("weighted")]
    assert all(t.fqn == "sparse.weighted_ebc" for t in weighted_costs)


def test_constraints_are_honoured():
    constraints = {
        "t0": ParameterConstraints(sharding_types=["row_wise"]),
        "t1": ParameterConstraints(sharding_types=["column_wise"], min_partition=32),
        "t2": ParameterConstraints(sharding_types=["data_parallel", "table_wise"], compute_kernels=["dense"]),
        "t3": ParameterConstraints(sharding_types=["table_row_wise"]),
    }
    planner = EmbeddingShardingPlanner(topology=_topology(4, local=2), constraints=constraints)
    placed = _placements(planner.plan(_dlrm(tables=4), _sharders()))
    assert placed["t0"] == ("row_wise", (0, 1, 2, 3), "fused")
    kind, ranks, kernel = placed["t1"]
    assert kind == "column_wise" and kernel == "fused" and len(ranks) == 2  # 64 columns, shards of >= 32
    assert placed["t2"][0] == "data_parallel"  # only the dense kernel allowed: data-parallel
    kind, ranks, kernel = placed["t3"]
    assert kind == "table_row_wise" and kernel == "fused" and ranks in ((0, 1), (2, 3))


def test_memory_decides():
    # 3 tables of ~25 MiB on 2 ranks with 40 MiB each: a rank holds one whole table, so the third
    # is split (row- or column-wise) or the plan is refused
    cap = 40 * 2**20
    planner = EmbeddingShardingPlanner(topology=_topology(2, ddr_cap=cap))
    plan = planner.plan(_dlrm(tables=3), _sharders())
    _check_estimate(planner, plan)
    assert max(_bytes_by_rank(plan, 2)) <= cap
    assert any(kind != "table_wise" for kind, _, _ in _placements(plan).values())
    with pytest.raises(ValueError, match=r"the tables do not fit: table 't\d' .*needs at least .* raise the Topology's ddr_cap"):
        EmbeddingShardingPlanner(topology=_topology(2, ddr_cap=20 * 2**20)).plan(_dlrm(tables=3), _sharders())


class TwoTower(nn.Module):
    def __init__(self):
        super().__init__()
        ebc = EmbeddingBagCollection(tables=[
            EmbeddingBagConfig(name="a", embedding_dim=64, num_embeddings=50_000, feature_names=["f0"]),
            EmbeddingBagConfig(name="b", embedding_dim=64, num_embeddings=50_000, feature_names=["f1"])], device=META)
        self.query, self.item = nn.Module(), nn.Module()
        self.query.ebc = self.item.ebc = ebc


def test_shared_module_planned_and_counted_once():
    planner = EmbeddingShardingPlanner(topology=_topology(2))
    plan = planner.plan(TwoTower(), _sharders())
    assert list(plan.plan) == ["query.ebc"]  # one module, one entry (its first FQN)
    _check_estimate(planner, plan)
    one_copy = 2 * (50_000 * 64 * 4 + 50_000 * 4)
    assert sum(planner.estimate.memory) == one_copy


def test_errors_name_what_to_change():
    with pytest.raises(ValueError, match=r"ParameterConstraints name table\(s\) \['nope'\].*its tables are \['t0', 't1'\]"):
        EmbeddingShardingPlanner(topology=_topology(2), constraints={"nope": ParameterConstraints()}).plan(
            _dlrm(tables=2), _sharders())
    with pytest.raises(ValueError, match=r"table 't0' .*no sharding graphshard can run is allowed"):
        EmbeddingShardingPlanner(topology=_topology(2), constraints={
            "t0": ParameterConstraints(sharding_types=["table_wise"], compute_kernels=["dense"])}).plan(
            _dlrm(tables=2), _sharders())
    with pytest.raises(ValueError, match=r"2 pooling_factors for its 1 features"):
        EmbeddingShardingPlanner(topology=_topology(2), constraints={
            "t0": ParameterConstraints(pooling_factors=[1.0, 2.0])}).plan(_dlrm(tables=2), _sharders())
    with pytest.raises(NotImplementedError, match=r"EmbeddingShardingPlanner\(proposer=...\)"):
        EmbeddingShardingPlanner(proposer=object())
    # the fake process group has 4 ranks
    with pytest.raises(ValueError, match=r"Topology has world_size=2 but the process group has 4 ranks"):
        EmbeddingShardingPlanner(topology=_topology(2)).collective_plan(_dlrm(tables=2), _sharders())


def test_collective_plan_returns_the_plan_on_the_fake_group():
    # A smoke test: rank 0 plans and broadcasts, and on the fake group the broadcast delivers rank 0's
    # own object, so this cannot show that ranks agree. That every rank gets rank 0's plan is checked
    # on 2 gloo ranks: test_model_parallel.test_planned_plan_is_the_same_on_every_rank.
    planner = EmbeddingShardingPlanner(topology=_topology(dist.get_world_size()))
    collective = planner.collective_plan(_dlrm(tables=6), _sharders())
    local = EmbeddingShardingPlanner(topology=_topology(dist.get_world_size())).plan(_dlrm(tables=6), _sharders())
    assert _placements(collective) == _placements(local)
    assert planner.estimate is not None and "embedding plan" in planner.estimate.format()


def test_cost_model_terms():
    """The cost model's terms for one table (docs/cost-model.md): the lookup scales with the ids
    and the columns a rank holds, the distributions with the bytes through the rank."""
    hw = _cost.Hardware(world=2, local=2, mem_bw=1e9, intra_bw=1e8, inter_bw=1e7, bwd_multiplier=2.0,
                        capacity=(GiB, GiB))
    t = _cost.TableStats(name="t", rows=1000, dim=64, features=1, ids_per_sample=10.0, batch=100, weighted=False,
                         elem_bytes=4, state_per_row=1, sequence=False)
    tw = _cost.estimate(t, _cost.Option("table_wise", (0,)), hw)
    ids_all = 2 * 100 * 10
    assert tw.lookup == {0: pytest.approx(ids_all * 64 * 4 * 3 / 1e9)}
    sent = 100 * 10 * 8 + 100 * 8  # one rank's ids and lengths
    assert tw.input_dist[0] == pytest.approx(sent / 1e8) and tw.input_dist[1] == pytest.approx(sent / 1e8)
    assert tw.output_dist[0] == pytest.approx(2 * 100 * 64 * 4 / 1e8)
    assert tw.memory == {0: 1000 * 64 * 4 + 1000 * 4}
    rw = _cost.estimate(t, _cost.Option("row_wise", (0, 1)), hw)
    assert rw.lookup[0] == pytest.approx(tw.lookup[0] / 2) and rw.memory[1] == tw.memory[0] // 2
    assert rw.output_dist[0] == pytest.approx(2 * tw.output_dist[0])  # reduce-scatter + all-gather
    cw = _cost.estimate(t, _cost.Option("column_wise", (0, 1)), hw)
    assert cw.lookup[1] == pytest.approx(tw.lookup[0] / 2)  # all the ids, half the columns
    dp = _cost.estimate(t, _cost.Option("data_parallel", (0, 1)), hw)
    assert dp.memory == {0: 2 * 1000 * 64 * 4, 1: 2 * 1000 * 64 * 4}  # whole, with its gradient


def test_estimate_plan_of_any_plan():
    # the planner's own plan estimates as it did when planned; TorchRec's planner's plan (and a
    # hand plan) are estimated by the same cost model, so the planners compare on one scale
    from torchrec.distributed.planner import EmbeddingShardingPlanner as TorchRecPlanner
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan, row_wise
    from torchrec.distributed.types import ShardingPlan

    constraints = {f"t{i}": ParameterConstraints(pooling_factors=[10.0]) for i in range(8)}
    ours = EmbeddingShardingPlanner(topology=_topology(2), constraints=constraints)
    plan = ours.plan(_dlrm(), _sharders())
    again = ours.estimate_plan(_dlrm(), plan, _sharders())
    assert again.load == pytest.approx(ours.estimate.load) and again.memory == ours.estimate.memory
    theirs = TorchRecPlanner(topology=_topology(2), constraints=constraints).plan(_dlrm(), _sharders())
    assert max(ours.estimate_plan(_dlrm(), theirs, _sharders()).load) >= max(ours.estimate.load) - 1e-12
    model = _dlrm()
    ebc = model.sparse_arch.embedding_bag_collection
    rw = ShardingPlan({"sparse_arch.embedding_bag_collection": construct_module_sharding_plan(
        ebc, per_param_sharding={f"t{i}": row_wise(compute_kernel="fused") for i in range(8)}, world_size=2,
        device_type="cpu")})
    hand = ours.estimate_plan(model, rw, _sharders())
    assert {t.option.sharding_type for t in hand.tables} == {"row_wise"}
    assert max(hand.load) > max(ours.estimate.load)  # row-wise moves twice the pooled rows: worse here


def test_estimate_plan_reads_table_column_wise_as_column_wise():
    # TorchRec's planner picks table-column-wise (its default plan for a Criteo-shaped DLRM);
    # graphshard runs it as column-wise on one host, and its cost model estimates it so
    import dataclasses

    from torchrec.distributed.sharding_plan import column_wise, construct_module_sharding_plan
    from torchrec.distributed.types import ShardingPlan

    fqn = "sparse_arch.embedding_bag_collection"
    cw = construct_module_sharding_plan(
        _dlrm().sparse_arch.embedding_bag_collection, world_size=2, device_type="cpu",
        per_param_sharding={f"t{i}": column_wise(ranks=[0, 1], compute_kernel="fused") for i in range(8)})
    twcw = {name: dataclasses.replace(ps, sharding_type="table_column_wise") for name, ps in cw.items()}
    planner = EmbeddingShardingPlanner(topology=_topology(2))
    as_cw = planner.estimate_plan(_dlrm(), ShardingPlan({fqn: cw}), _sharders())
    as_twcw = planner.estimate_plan(_dlrm(), ShardingPlan({fqn: twcw}), _sharders())
    assert {t.option.sharding_type for t in as_twcw.tables} == {"column_wise"}
    assert as_twcw.load == pytest.approx(as_cw.load) and as_twcw.memory == as_cw.memory
