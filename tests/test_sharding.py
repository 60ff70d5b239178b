"""One explicit compile input: a sharded model's `ShardedModel`, bound into the backend.

A compile reads its parameters from the model it is bound to (never from a process-wide
table), every frontend compiles through one function, and FSDP1's and TorchRec's frontends
take graphshard.compile's options."""

import ast
import os
import pathlib
import tempfile

import pytest
import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

import graphshard
from _models import mesh1d, mlp
from graphshard import params, sharding

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture
def no_key_tables(monkeypatch):
    """Empties the two key tables (parameters by key, models by id) for the test: what only the eager
    marker implementations and the by-name entry may read."""
    monkeypatch.setattr(params, "_KEYS", type(params._KEYS)())
    monkeypatch.setattr(sharding, "_MODELS", type(sharding._MODELS)())


def test_a_compile_reads_only_the_model_it_is_bound_to(no_key_tables):
    model = mlp()
    graphshard.compile(model, graphshard.Plan(mesh1d("dp"), {"": graphshard.FullyShard()}), lower="eager")
    params._KEYS.clear(), sharding._MODELS.clear()  # what shard() registered: gone before the compile
    model(torch.randn(4, 16)).sum().backward()
    report = model._graphshard.explain[0]
    assert [c.kind for c in report.collectives][:2] == ["all_gather", "reduce_scatter"]
    for name, p in model.named_parameters():
        assert isinstance(p.grad, DTensor) and p.grad.placements == p.placements, name


def test_by_name_without_a_live_model_names_the_key(no_key_tables):
    model = graphshard.shard(mlp(), graphshard.Plan(mesh1d("dp"), {"": graphshard.FullyShard()}))
    sharding._MODELS.clear()  # nothing bound and nothing to find: the entry refuses, naming the key
    compiled = torch.compile(model, backend="graphshard", options={"lower": "eager"})
    # the traced marker carries the model's key; the input it reads names the parameter
    with pytest.raises(Exception, match=r"the graph reads 'm\d+/\?' \(input 'L_self_modules_fc1_parameters_weight_'\), "
                                        r"a parameter or layout of no live sharded model"):
        compiled(torch.randn(4, 16))


def test_unshard_outside_a_compile_is_refused():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(), pytest.raises(RuntimeError, match=r"graphshard::unshard of \['m0/w'\] outside a "
                                                              r"graphshard compile"):
        torch.ops.graphshard.unshard([torch.empty(2)], ["m0/w"])


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(8, 4)
        self.head = nn.Linear(4, 8, bias=False)
        self.head.weight = self.emb.weight


def test_one_record_per_parameter_with_its_views():
    model = graphshard.shard(Tied(), graphshard.Plan(mesh1d("dp"), {"": graphshard.FullyShard()}))
    state = model._graphshard
    record = state.param_for_fqn("head.weight")
    assert record is state.param_for_fqn("emb.weight") and len(state.params) == 1
    assert record.layout.fqns == ("emb.weight", "head.weight") and record.owner == (model.emb, "weight")
    p = model.emb.weight
    assert record.local().data_ptr() == p.to_local().data_ptr()  # the stored shard itself
    assert record.dtensor().placements == p.placements and record.dtensor().shape == p.shape
    # rank 0 of 4 holds torch.chunk's first two of eight rows
    assert record.local().shape == (2, 4) and tuple(record.placements) == tuple(p.placements)


def test_flat_unit_records_are_views_of_the_flat_parameter():
    plan = graphshard.Plan(mesh1d("dp"), {"": graphshard.FullyShard(flat_params=True)})
    model = graphshard.shard(mlp(), plan)
    unit = model._graphshard.units[""].flat
    for record in model._graphshard.params.values():
        assert record.flat is unit and record.slot.key == record.key
        assert record.local().untyped_storage().data_ptr() == unit.param.untyped_storage().data_ptr()
        module, name = record.owner
        assert name not in module._parameters  # read through the flat parameter
        view = getattr(module, name)  # outside forward: the shard as a DTensor, a view of the flat parameter
        assert isinstance(view, DTensor) and view.to_local().data_ptr() == record.local().data_ptr()


def test_a_sharded_module_prints():
    # nn.EmbeddingBag's extra_repr takes the repr of its whole __dict__, where the getters' records
    # live: a record that printed its module would print every module again (a DMP worker's repr
    # of a model with several bags never returned)
    plan = graphshard.Plan(mesh1d("dp"), {"": graphshard.FullyShard(flat_params=True)})
    model = graphshard.shard(nn.Sequential(*[nn.EmbeddingBag(8, 4) for _ in range(3)]), plan)
    records = list(model._graphshard.params.values())
    assert all("EmbeddingBag" not in repr(r) and "EmbeddingBag" not in repr(r.flat) for r in records)
    assert repr(model).count("EmbeddingBag(") == 3


def test_graphshard_compiles_in_one_place():
    # every frontend builds a Plan and a CompileConfig and calls api.compile_sharded
    calls = []
    for path in sorted((ROOT / "graphshard").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):  # m.compile(...), torch.compile(...)
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "compile"
                    and (any(k.arg == "backend" for k in node.keywords) or ast.unparse(node.func) == "torch.compile")):
                calls.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert len(calls) == 1 and calls[0].startswith("graphshard/api.py:"), calls


def test_fsdp_takes_compile_options():
    from graphshard.fsdp import FullyShardedDataParallel as FSDP

    with tempfile.TemporaryDirectory() as d:
        model = FSDP(mlp(), lower="eager", dump_graphs=d)
        model(torch.randn(4, 16)).sum().backward()
        dumps = os.listdir(d)
        assert any(f.startswith("g0_pre_autograd_") for f in dumps) and any("_backward_" in f for f in dumps), dumps
    with pytest.raises(TypeError, match=r"FullyShardedDataParallel got unexpected keyword argument\(s\) "
                                        r"\['lowr'\]; the compile options it takes are graphshard.compile's"):
        FSDP(mlp(), lowr="eager")


def test_dmp_takes_compile_options():
    pytest.importorskip("torchrec")
    from graphshard.model_parallel import DistributedModelParallel

    with pytest.raises(TypeError, match=r"DistributedModelParallel got unexpected keyword argument\(s\) "
                                        r"\['dump_graph'\]"):
        DistributedModelParallel(nn.Linear(2, 2), dump_graph="/tmp")
