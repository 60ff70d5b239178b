"""The refusals the README and docs/frontends promise, each reached through the public API as a user would reach it.

Each test asserts the error's type and that its message names the offending thing (FQN, argument
or value) and, where the library gives one, the fix. Everything runs in this process on the fake
process group of tests/conftest.py (world size 4, rank 0): no refusal here needs a collective, and
nothing is lowered with Inductor. The TorchRec cases skip without TorchRec; the others do not.
"""

from __future__ import annotations

import re

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate, Shard

import graphshard
from _models import mesh1d, mlp, tiny_transformer
from graphshard.storage import state_of
from graphshard.tensor_parallel import ColwiseParallel, RowwiseParallel


# ---- ShardEmbedding on a module it cannot shard (docs/frontends: "padding_idx and max_norm are refused") ----
class Bags(nn.Module):
    def __init__(self, bag: nn.Module):
        super().__init__()
        self.bag = bag
        self.head = nn.Linear(bag.embedding_dim, 1)


def _embedding_plan(**spec_kwargs):
    return graphshard.Plan(mesh1d("dp"), {"": graphshard.FullyShard(),
                                          "bag": graphshard.ShardEmbedding("row_wise", **spec_kwargs)})


@pytest.mark.parametrize("bag, match", [
    (nn.EmbeddingBag(10, 8, mode="sum", padding_idx=0),
     r"^bag: nn\.EmbeddingBag\(padding_idx=0\) is not supported sharded: drop the padding id from the bags"),
    (nn.EmbeddingBag(10, 8, mode="sum", max_norm=1.0),
     r"^bag: nn\.EmbeddingBag\(max_norm=1\.0\) is not supported sharded: renormalize the rows outside"),
    # nn.Embedding is refused before its padding_idx / max_norm are looked at, with the fix
    (nn.Embedding(10, 8, padding_idx=0),
     r"^bag is a Embedding; ShardEmbedding shards nn\.EmbeddingBag "
     r"\(for a vocabulary-parallel nn\.Embedding use RowwiseParallel\)$"),
    (nn.Embedding(10, 8, max_norm=1.0),
     r"^bag is a Embedding; ShardEmbedding shards nn\.EmbeddingBag "
     r"\(for a vocabulary-parallel nn\.Embedding use RowwiseParallel\)$"),
], ids=["bag-padding_idx", "bag-max_norm", "embedding-padding_idx", "embedding-max_norm"])
def test_shard_embedding_refuses_padding_idx_and_max_norm(bag, match):
    model = Bags(bag)
    with pytest.raises(NotImplementedError, match=match):
        graphshard.shard(model, _embedding_plan())
    assert state_of(model) is None  # left as it was: nothing sharded
    assert not any(isinstance(p, torch.distributed.tensor.DTensor) for p in model.parameters())


# ---- a mesh axis the mesh does not have ----
def test_shard_params_unknown_mesh_axis():
    with pytest.raises(ValueError, match=r"^plan key 'fc1': ShardParams axis 'mp' is not a mesh axis \('tp',\)$"):
        graphshard.Plan(mesh1d("tp"), {"fc1": graphshard.ShardParams("mp", weight=Shard(0))})


def test_shard_embedding_unknown_mesh_axis():
    with pytest.raises(ValueError, match=r"^bag: ShardEmbedding mesh_axis 'ep' is not an axis of the mesh \('dp',\)$"):
        graphshard.shard(Bags(nn.EmbeddingBag(10, 8)), _embedding_plan(mesh_axis="ep"))


# ---- Shard(dim) beyond the parameter's rank ----
@pytest.mark.parametrize("placement, shown", [(Shard(2), r"Shard\(dim=2\)"), (Shard(-3), r"Shard\(dim=-3\)")],
                         ids=["dim2", "dim-3"])
def test_shard_dim_beyond_rank(placement, shown):
    model = mlp()  # fc1.weight is (32, 16)
    plan = graphshard.Plan(mesh1d("tp"), {"fc1": graphshard.ShardParams("tp", weight=placement)})
    with pytest.raises(ValueError, match=rf"^fc1\.weight: {shown} is out of range for shape \(32, 16\)$"):
        graphshard.shard(model, plan)
    assert state_of(model) is None
    assert not any(isinstance(p, torch.distributed.tensor.DTensor) for p in model.parameters())


# ---- two globs giving one module conflicting specs ----
def test_two_globs_conflicting_unit_specs():
    plan = graphshard.Plan(mesh1d("dp"), {"layers.*": graphshard.FullyShard(), "layers.0": graphshard.Replicate(),
                                          "": graphshard.FullyShard()})
    with pytest.raises(ValueError, match=r"^module 'layers\.0' is matched by two unit specs "
                                         r"\(FullyShard\(.*\) by plan key 'layers\.\*' and Replicate\(.*\) by plan "
                                         r"key 'layers\.0'\); keep one key$"):
        graphshard.shard(tiny_transformer(), plan)


def test_two_globs_conflicting_tensor_parallel_styles():
    plan = graphshard.Plan(mesh1d("tp"), {"fc*": ColwiseParallel(), "fc1": RowwiseParallel()})
    with pytest.raises(ValueError, match=r"^module 'fc1' is given two tensor-parallel styles "
                                         r"\(ColwiseParallel\(.*\) under 'fc1' by plan key 'fc\*' and "
                                         r"RowwiseParallel\(.*\) by plan key 'fc1'\); a module object gets one style: "
                                         r"fix the plan keys$"):
        graphshard.shard(mlp(), plan)


@pytest.mark.parametrize("first", [graphshard.ShardParams("tp", weight=Shard(0)),
                                   graphshard.ShardParams("tp", weight=Replicate()), ColwiseParallel()],
                         ids=["ShardParams-Shard0", "ShardParams-Replicate", "ColwiseParallel"])
def test_two_globs_conflicting_shard_params(first):
    plan = graphshard.Plan(mesh1d("tp"), {"fc1": first, "fc*": graphshard.ShardParams("tp", weight=Shard(1))})
    with pytest.raises(ValueError, match=r"^fc1\.weight: plan key 'fc\*' \(.* on 'fc1'\) places it .* on mesh axis "
                                         r"'tp', but plan key 'fc1' \(.* on 'fc1'\) places it .*; a parameter gets one "
                                         r"placement per axis: fix the plan keys so they agree$"):
        graphshard.shard(mlp(), plan)


def test_two_globs_agreeing_on_a_placement_are_accepted():
    # the same placement from two keys (Shard(-1) is Shard(1) of a matrix) is no conflict
    plan = graphshard.Plan(mesh1d("tp"), {"fc1": graphshard.ShardParams("tp", weight=Shard(1)),
                                          "fc*": graphshard.ShardParams("tp", weight=Shard(-1))})
    model = mlp()
    graphshard.shard(model, plan)
    assert model.fc1.weight.placements == (Shard(1),)


# ---- an invalid lower= ----
def test_compile_invalid_lower():
    model = mlp()
    with pytest.raises(ValueError, match=r"^lower='tvm': expected 'inductor' or 'eager'$"):
        graphshard.compile(model, graphshard.Plan(mesh1d("dp"), {"": graphshard.FullyShard()}), lower="tvm")
    assert state_of(model) is None  # refused before anything was sharded
    assert not any(isinstance(p, torch.distributed.tensor.DTensor) for p in model.parameters())


def test_torch_compile_backend_invalid_lower():
    # the backend's options are checked when dynamo first calls it: torch wraps the ValueError
    model = mlp()
    graphshard.shard(model, graphshard.Plan(mesh1d("dp"), {"": graphshard.FullyShard()}))
    compiled = torch.compile(model, backend="graphshard", options={"lower": "tvm"})
    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed,
                       match=r"backend='graphshard' raised:\nValueError: lower='tvm': expected 'inductor' or 'eager'"):
        compiled(torch.randn(2, 16))


# ---- a wrong-shaped state dict loaded into a sharded model ----
@pytest.mark.parametrize("case", ["fully_shard", "shard_params", "flat_params"])
def test_load_wrong_shaped_state_dict(case):
    model = mlp()
    if case == "shard_params":
        plan = graphshard.Plan(mesh1d("tp"), {"fc1": graphshard.ShardParams("tp", weight=Shard(0), bias=Shard(0))})
    else:
        plan = graphshard.Plan(mesh1d("dp"), {"": graphshard.FullyShard(flat_params=case == "flat_params")})
    graphshard.compile(model, plan, lower="eager")
    state = model.state_dict()
    if case == "flat_params":  # one flat parameter per unit, torch's name (FSDP1's use_orig_params=False)
        key, bad, shape = "_flat_param", torch.zeros(100), r"\[202\]"
    else:  # the local shard where the whole (logical) tensor belongs: the usual mistake
        key, bad, shape = "fc1.weight", state["fc1.weight"].to_local(), r"\[32, 16\]"
        assert tuple(bad.shape) == (8, 16)
    before = state[key].detach().clone()
    state[key] = bad
    given = re.escape(str(list(bad.shape)))
    with pytest.raises(RuntimeError, match=rf"Error\(s\) in loading state_dict for MLP:\n\tsize mismatch for "
                                           rf"{re.escape(key)}: copying a param with shape torch\.Size\({given}\) "
                                           rf"from checkpoint, the shape in current model is torch\.Size\({shape}\)"):
        model.load_state_dict(state)
    after = model.state_dict()[key]
    local = (lambda t: t.to_local() if isinstance(t, DTensor) else t)  # torch 2.11's DTensor has no assert_close
    torch.testing.assert_close(local(after), local(before), rtol=0, atol=0, equal_nan=True)  # left as it was


# ---- graphshard.model_parallel.DistributedModelParallel (TorchRec) ----
class TestDistributedModelParallel:
    """TorchRec is optional: these skip without it, the tests above do not."""

    @pytest.fixture(autouse=True)
    def _torchrec(self):
        pytest.importorskip("torchrec")

    @staticmethod
    def _model_and_plan(kernel_a: str = "fused", kernel_b: str = "fused"):
        from torchrec.distributed.sharding_plan import construct_module_sharding_plan, row_wise, table_wise
        from torchrec.distributed.types import ShardingPlan
        from torchrec.modules.embedding_configs import EmbeddingBagConfig
        from torchrec.modules.embedding_modules import EmbeddingBagCollection

        class Tower(nn.Module):
            def __init__(self):
                super().__init__()
                self.ebc = EmbeddingBagCollection(tables=[
                    EmbeddingBagConfig(name="a", embedding_dim=8, num_embeddings=10, feature_names=["f0", "f1"]),
                    EmbeddingBagConfig(name="b", embedding_dim=8, num_embeddings=12, feature_names=["f2"]),
                ], device=torch.device("cpu"))

            def forward(self, kjt):
                return self.ebc(kjt).values()

        model = Tower()
        module_plan = construct_module_sharding_plan(
            model.ebc, per_param_sharding={"a": table_wise(rank=1, compute_kernel=kernel_a),
                                           "b": row_wise(compute_kernel=kernel_b)},
            world_size=dist.get_world_size(), device_type="cpu")
        return model, ShardingPlan({"ebc": module_plan})

    @staticmethod
    def _dmp(model, plan, **kwargs):
        from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
        from torchrec.distributed.types import ShardingEnv

        from graphshard.model_parallel import DistributedModelParallel

        return DistributedModelParallel(model, env=ShardingEnv.from_process_group(dist.group.WORLD), plan=plan,
                                        sharders=[EmbeddingBagCollectionSharder(fused_params={})], **kwargs)

    @pytest.mark.parametrize("device", ["meta", torch.device("meta"), "mps"], ids=["meta-str", "meta", "mps"])
    def test_unsupported_device(self, device):
        model, plan = self._model_and_plan()
        name = torch.device(device).type
        with pytest.raises(NotImplementedError, match=rf"^device={name}: graphshard's DistributedModelParallel runs "
                                                      r"on 'cpu' \(gloo\) or 'cuda' \(NCCL\)$"):
            self._dmp(model, plan, device=device)

    @pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for a machine without a CUDA device")
    def test_cuda_without_a_gpu(self):
        model, plan = self._model_and_plan()
        with pytest.raises(ValueError, match=r"^device=cuda: this torch sees no CUDA device .*; use device='cpu'"):
            self._dmp(model, plan, device="cuda")

    def test_mixed_fused_and_fused_triton_kernels(self):
        model, plan = self._model_and_plan(kernel_a="fused", kernel_b="fused_triton")
        with pytest.raises(NotImplementedError, match=r"^ebc: tables \['a'\] use compute kernel 'fused' and \['b'\] "
                                                      r"'fused_triton'; a module's sharded tables share one kernel: "
                                                      r"give them the same compute_kernel$"):
            self._dmp(model, plan, init_data_parallel=False)

    def test_variable_batch_per_feature(self):
        from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

        model, plan = self._model_and_plan()
        dmp = self._dmp(model, plan)  # compiled, as a user gets it (init_data_parallel=True)
        # f0 has 2 samples, f1 one, f2 three: TorchRec's variable batch per feature
        kjt = KeyedJaggedTensor(
            keys=["f0", "f1", "f2"], values=torch.tensor([1, 2, 3, 4, 5, 6]),
            lengths=torch.tensor([1, 1, 2, 1, 0, 1]), stride_per_key_per_rank=[[2], [1], [3]],
            inverse_indices=(["f0", "f1", "f2"], torch.tensor([[0, 1, 1], [0, 0, 0], [0, 1, 2]])))
        assert kjt.variable_stride_per_key()
        # DistributedModelParallel expands one it is given (tests/test_peer_torchrec.py); one that reaches the
        # lookup without passing through it (the module called directly, or a KJT built inside the model) is refused
        with pytest.raises(NotImplementedError, match=r"^ebc: a KeyedJaggedTensor with a variable batch per feature "
                                                        r"\(stride_per_key_per_rank\) reached the sharded lookup inside "
                                                        r"the model; DistributedModelParallel expands one it is given"):
            dmp.module(kjt)
