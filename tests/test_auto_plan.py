"""graphshard.auto_plan: dense and sparse placements from one cost model.

On the fake process group (world size 4, rank 0): the plans it picks for the benchmark
transformer (tensor-parallel pairs found from one forward, units by memory) and for a model
with ``nn.EmbeddingBag`` tables, and its errors. Training under an auto plan on 2 gloo ranks
against the single process is in tests/test_embedding_plan.py (case ``auto``).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

import graphshard
from graphshard import FullyShard, Replicate, ShardEmbedding
from graphshard.tensor_parallel import ColwiseParallel, RowwiseParallel
import graphshard.model_parallel  # noqa: F401  (FullyShardDense)
from graphshard.testing.models import Transformer, TransformerConfig

MiB = 2**20
CFG = TransformerConfig(vocab_size=256, dim=64, n_layers=3, n_heads=4, max_seq_len=16)


def _tokens(batch=2, seq=16):
    return torch.randint(0, CFG.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(0))


def _kinds(plan) -> dict:
    return {k: type(v).__name__ for k, v in plan.rules.items()}


def test_transformer_tensor_parallel_pairs_found_from_the_forward():
    # the hand TP plan of benchmarks/_tp_worker.py (tp_plan), found without names
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    plan = graphshard.auto_plan(Transformer(CFG), mesh, memory_budget=1024 * MiB, batch=_tokens())
    kinds = _kinds(plan)
    for name in ("wq", "wk", "wv"):
        assert kinds[f"layers.*.attn.{name}"] == "ColwiseParallel"
    assert kinds["layers.*.attn.wo"] == "RowwiseParallel"
    assert kinds["layers.*.ffn.w1"] == "ColwiseParallel" and kinds["layers.*.ffn.w2"] == "RowwiseParallel"
    assert "output" not in kinds  # the head has no row-wise partner: replicated on the tp axis
    # a big budget: every unit replicated (DDP moves fewer bytes than FSDP)
    assert kinds["layers.*"] == "Replicate" and kinds[""] == "Replicate"
    assert any("tensor parallel over tp=2: 6 column-wise -> row-wise" in n for n in plan.notes), plan.notes


def test_memory_budget_shards_the_largest_units_first():
    mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("dp",))
    model = Transformer(CFG)
    layer = sum(p.numel() * 4 for p in model.layers[0].parameters())
    root = sum(p.numel() * 4 for n, p in model.named_parameters() if not n.startswith("layers."))
    replicated = (3 * layer + root) * 4  # parameter, gradient, two Adam states
    plan = graphshard.auto_plan(model, mesh, memory_budget=replicated + MiB, batch=_tokens())
    assert set(_kinds(plan).values()) == {"Replicate"}
    # a little less: the largest unit (a layer; the root holds the embeddings and the tied head)
    # is sharded, the rest stays replicated
    plan = graphshard.auto_plan(model, mesh, memory_budget=replicated - 1, batch=_tokens())
    assert layer > root
    assert _kinds(plan) == {"layers.0": "FullyShard", "layers.1": "Replicate", "layers.2": "Replicate", "": "Replicate"}
    assert any("unit layers.0: FullyShard over dp=4 (to fit the budget)" in n for n in plan.notes), plan.notes
    # every unit sharded: a quarter of everything, and two gathered layers (computing, prefetched)
    all_sharded = replicated // 4 + 2 * layer
    plan = graphshard.auto_plan(model, mesh, memory_budget=all_sharded + 1024, batch=_tokens())
    assert _kinds(plan) == {"layers.*": "FullyShard", "": "FullyShard"}
    with pytest.raises(ValueError, match=r"does not fit in memory_budget=.* raise memory_budget, add ranks"):
        graphshard.auto_plan(model, mesh, memory_budget=all_sharded - 1024, batch=_tokens())


class Tables(nn.Module):
    """An MLP on pooled bags of three tables of different sizes."""

    def __init__(self):
        super().__init__()
        self.big = nn.EmbeddingBag(4000, 16, mode="sum")
        self.small = nn.EmbeddingBag(50, 16, mode="sum")
        self.mid = nn.EmbeddingBag(800, 16, mode="mean")
        self.mlp = nn.Sequential(nn.Linear(48, 32), nn.ReLU(), nn.Linear(32, 1))

    def forward(self, ids, offsets):
        return self.mlp(torch.cat([self.big(ids, offsets), self.small(ids % 50, offsets), self.mid(ids % 800, offsets)], 1))


def _bags(batch=8, per_bag=5):
    ids = torch.randint(0, 4000, (batch * per_bag,), generator=torch.Generator().manual_seed(0))
    return ids, torch.arange(0, batch * per_bag, per_bag)


def test_tables_placed_in_the_memory_the_dense_part_leaves():
    mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("dp",))
    plan = graphshard.auto_plan(Tables(), mesh, memory_budget=64 * MiB, batch=_bags())
    specs = {k: v for k, v in plan.rules.items() if isinstance(v, ShardEmbedding)}
    assert set(specs) == {"big", "small", "mid"}
    assert all(s.mesh_axis == "dp" and s.optimizer == "rowwise_adagrad" for s in specs.values())
    assert any("table big:" in n and "5.0 ids a bag" in n for n in plan.notes), plan.notes
    # the big table (250 KiB with its state) does not fit whole on a rank of 200 KiB: split
    plan = graphshard.auto_plan(Tables(), mesh, memory_budget=200 * 1024, batch=_bags(), optimizer_states=0)
    assert plan.rules["big"].sharding_type in ("row_wise", "column_wise"), plan.notes


def test_refuses_unnamed_meshes():
    with pytest.raises(ValueError, match="named axes"):
        graphshard.auto_plan(Tables(), init_device_mesh("cpu", (4,)), memory_budget=MiB, batch=_bags())


def test_specs_are_graphshard_types():
    plan = graphshard.auto_plan(Transformer(CFG), init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp")),
                                memory_budget=1024 * MiB, batch=_tokens())
    assert all(isinstance(v, (FullyShard, Replicate, ColwiseParallel, RowwiseParallel)) for v in plan.rules.values())


def _dlrm_and_batch(rows=2000):
    pytest.importorskip("torchrec")
    from torchrec.models.dlrm import DLRM
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    tables = [EmbeddingBagConfig(name=f"t{i}", embedding_dim=16, num_embeddings=rows * (i + 1), feature_names=[f"f{i}"])
              for i in range(3)]
    model = DLRM(embedding_bag_collection=EmbeddingBagCollection(tables=tables), dense_in_features=4,
                 dense_arch_layer_sizes=[8, 16], over_arch_layer_sizes=[8, 1])
    g = torch.Generator().manual_seed(0)
    lengths = torch.tensor([4] * 8 + [1] * 8 + [2] * 8)  # 4, 1 and 2 ids a bag, batch 8
    kjt = KeyedJaggedTensor(keys=["f0", "f1", "f2"], values=torch.randint(0, rows, (int(lengths.sum()),), generator=g),
                            lengths=lengths)
    return model, (torch.randn(8, 4, generator=g), kjt)


def test_torchrec_model_tables_from_the_example_kjt():
    model, batch = _dlrm_and_batch()
    mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("dp",))
    plan = graphshard.auto_plan(model, mesh, memory_budget=64 * MiB, batch=batch)
    (fqn, module_plan), = plan.torchrec_plan.plan.items()
    assert fqn == "sparse_arch.embedding_bag_collection" and set(module_plan) == {"t0", "t1", "t2"}
    assert all(ps.compute_kernel == ("dense" if ps.sharding_type == "data_parallel" else "fused")
               for ps in module_plan.values())
    assert not any(k.startswith("sparse_arch") for k in plan.rules)  # the tables are not dense units
    for name, per_bag in (("t0", "4.0"), ("t1", "1.0"), ("t2", "2.0")):  # each table's own line
        line = next(l for l in plan.notes if f"table sparse_arch.embedding_bag_collection.{name}:" in l)
        assert f"({per_bag} ids a bag" in line, line
    with pytest.raises(NotImplementedError, match=r"plan it on a 1-D \('dp',\) mesh"):
        graphshard.auto_plan(model, init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp")),
                             memory_budget=64 * MiB, batch=batch)


def test_dmp_takes_the_auto_plan():
    pytest.importorskip("torchrec")
    import torch.distributed as dist
    from torchrec.distributed.types import ShardingEnv

    from graphshard.model_parallel import DistributedModelParallel

    model, batch = _dlrm_and_batch()
    plan = graphshard.auto_plan(model, init_device_mesh("cpu", (4,), mesh_dim_names=("dp",)), memory_budget=64 * MiB,
                                batch=batch)
    dmp = DistributedModelParallel(model, env=ShardingEnv.from_process_group(dist.group.WORLD), plan=plan,
                                   init_data_parallel=False)
    assert dmp.plan is plan.torchrec_plan
    assert dmp._dense_rules() == {**plan.rules}  # the dense part as the auto plan lays it out
    with pytest.raises(ValueError, match="data_parallel_wrapper=None"):
        DistributedModelParallel(model, env=ShardingEnv.from_process_group(dist.group.WORLD), plan=plan,
                                 data_parallel_wrapper=graphshard.model_parallel.FullyShardDense(),
                                 init_data_parallel=False)


class TablesAndMLP(nn.Module):
    """Bags into a tensor-parallel-able MLP (48 -> 64 -> 48), then a head."""

    def __init__(self):
        super().__init__()
        self.big = nn.EmbeddingBag(4000, 48, mode="sum")
        self.up, self.down, self.head = nn.Linear(48, 64), nn.Linear(64, 48), nn.Linear(48, 1)

    def forward(self, ids, offsets):
        x = self.big(ids, offsets)
        return self.head(x + self.down(torch.relu(self.up(x))))


def test_tables_and_tensor_parallel_on_a_2d_mesh():
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    plan = graphshard.auto_plan(TablesAndMLP(), mesh, memory_budget=64 * MiB, batch=_bags())
    kinds = _kinds(plan)
    assert kinds["up"] == "ColwiseParallel" and kinds["down"] == "RowwiseParallel" and "head" not in kinds
    assert kinds["big"] == "ShardEmbedding" and plan.rules["big"].mesh_axis == "dp"  # tables over the dp axis
    assert kinds[""] == "Replicate"
