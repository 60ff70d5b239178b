"""Sharded storage: DTensor parameters under the user's FQNs, shared objects sharded once."""

import math

import pytest
import torch
from torch.distributed.tensor import DTensor, Shard

import graphshard
from _models import fsdp_plan, mesh1d, mlp, tiny_transformer
from graphshard.testing.models import SharedBlockMLP


def test_parameters_become_sharded_dtensors_with_user_fqns():
    model = tiny_transformer()
    names = [n for n, _ in model.named_parameters()]
    sd_keys = list(model.state_dict())
    graphshard.shard(model, fsdp_plan())
    assert [n for n, _ in model.named_parameters()] == names
    assert list(model.state_dict()) == sd_keys
    for name, p in model.named_parameters():
        assert isinstance(p, DTensor) and p.placements == (Shard(0),), name
    assert type(model).__name__ == "Transformer" and isinstance(model, torch.nn.Module)


def test_tied_weight_is_one_object_under_both_fqns():
    model = tiny_transformer()
    graphshard.shard(model, fsdp_plan())
    assert model.output._parameters["weight"] is model.tok_embeddings._parameters["weight"]
    sd = model.state_dict()
    assert sd["output.weight"].to_local().data_ptr() == sd["tok_embeddings.weight"].to_local().data_ptr()
    assert len(model._graphshard.params) == len(list(model.parameters()))


def test_shared_module_is_sharded_once():
    model = SharedBlockMLP()
    plan = graphshard.Plan(mesh1d("dp"), {"first": graphshard.FullyShard(), "": graphshard.FullyShard()})
    graphshard.shard(model, plan)
    assert model.first is model.second
    assert set(model._graphshard.units) == {"first", ""}
    info = model._graphshard.param_for_fqn("second.weight")
    assert info.layout.fqns == ("first.weight", "second.weight") and info.layout.unit == "first"


def test_uneven_rows_follow_torch_chunk():
    plan = graphshard.Plan(mesh1d("dp"), {"": graphshard.FullyShard()})
    odd = torch.nn.Linear(16, 7)
    graphshard.shard(odd, plan)  # 7 rows over 4 ranks: 2, 2, 2, 1
    assert odd.weight.to_local().shape == (2, 16)
    info = odd._graphshard.param_for_fqn("weight")
    assert (info.chunk_rows, info.local_rows) == (2, 2)


@pytest.mark.usefixtures("fake_collective_outputs")
def test_model_parallel_params_are_sharded_over_their_axis():
    from _models import tp_mlp_plan

    model = mlp()
    full = {n: p.detach().clone() for n, p in model.named_parameters()}
    graphshard.shard(model, tp_mlp_plan())
    assert model.fc1.weight.placements == (Shard(0),) and model.fc1.weight.to_local().shape == (8, 16)
    assert model.fc2.weight.placements == (Shard(1),) and model.fc2.weight.to_local().shape == (8, 8)
    assert model.fc2.bias.placements[0].is_replicate()
    # rank 0 of 4 holds torch.chunk's first piece of each sharded parameter, the whole replicated one
    assert torch.equal(model.fc1.weight.to_local(), full["fc1.weight"].chunk(4, 0)[0])
    assert torch.equal(model.fc2.weight.to_local(), full["fc2.weight"].chunk(4, 1)[0])
    assert torch.equal(model.fc2.bias.to_local(), full["fc2.bias"])


@pytest.mark.usefixtures("fake_collective_outputs")
def test_optimizer_and_grad_clipping_work_on_the_sharded_parameters():
    model = mlp()
    graphshard.compile(model, graphshard.Plan(mesh1d("dp"), {"": graphshard.FullyShard()}), lower="eager")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(4, 16)).sum().backward()
    assert all(isinstance(p.grad, DTensor) and p.grad.placements == p.placements for p in model.parameters())
    before = {n: (p.placements, p.to_local().clone()) for n, p in model.named_parameters()}
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    norm = norm.full_tensor() if isinstance(norm, DTensor) else norm
    assert bool(torch.isfinite(norm)) and float(norm) > 0, norm
    opt.step()
    for n, p in model.named_parameters():  # still DTensors where they were; every shard stepped
        placements, local = before[n]
        assert isinstance(p, DTensor) and p.placements == placements, n
        assert bool(torch.isfinite(p.to_local()).all()) and not torch.equal(p.to_local(), local), n
        exp_avg = opt.state[p]["exp_avg"]
        assert isinstance(exp_avg, DTensor) and exp_avg.placements == placements, n


def test_axis_records_the_backend_that_runs_it():
    from graphshard.storage import backend_on

    model = tiny_transformer()
    graphshard.shard(model, fsdp_plan())
    info = next(iter(model._graphshard.params.values()))
    assert info.shard.backend == "fake"  # this process's test group
    assert not info.shard.scatter_by_all_to_all
    assert backend_on("gloo", "cpu") == "gloo"
    assert backend_on("cpu:gloo,cuda:nccl", "cuda") == "nccl"
    assert backend_on("cpu:gloo,cuda:nccl", "cpu") == "gloo"


def test_flat_params_replace_a_units_parameters_by_one_flat_shard():
    """FullyShard(flat_params=True) (FSDP1's use_orig_params=False): named_parameters() yields one
    1-D ``_flat_param`` per unit holding this rank's shards, each padded to its chunk; every
    original parameter is still an attribute: a DTensor viewing the flat parameter."""
    model = tiny_transformer()
    logical = [p.shape for p in model.layers[0].parameters()]
    graphshard.shard(model, fsdp_plan(flat_params=True))
    flat = dict(model.named_parameters())
    assert list(flat) == ["_flat_param", "layers.0._flat_param"]
    layer = model.layers[0]
    infos = [model._graphshard.param_for_fqn(f"layers.0.{n}") for n in ("attn_norm.weight", "attn.wq.weight", "ffn.w1.weight")]
    assert flat["layers.0._flat_param"].dim() == 1
    # each parameter's rows padded to 4 equal chunks, by hand from the unsharded shapes
    assert flat["layers.0._flat_param"].numel() == sum(-(-s[0] // 4) * math.prod(s[1:]) for s in logical)
    wq = layer.attn.wq.weight
    assert isinstance(wq, DTensor) and wq.placements == (Shard(0),) and wq.shape == infos[1].logical_shape
    assert wq.to_local().untyped_storage().data_ptr() == flat["layers.0._flat_param"].untyped_storage().data_ptr()
    with torch.no_grad():
        flat["layers.0._flat_param"].fill_(2.0)
    assert bool((layer.attn.wq.weight.to_local() == 2.0).all())
    assert "weight" not in layer.attn.wq._parameters


def test_flat_params_need_one_requires_grad_per_unit():
    model = mlp()
    model.fc1.bias.requires_grad_(False)
    plan = graphshard.Plan(mesh1d("dp"), {"": graphshard.FullyShard(flat_params=True)})
    with pytest.raises(ValueError, match=r"different requires_grad .*fc1.bias \(False\).*use_orig_params=True"):
        graphshard.shard(model, plan)


def test_every_model_in_a_process_compiles():
    # dynamo's recompile_limit (8) counts per code object; each model's root forward is its own
    # code object, so the sixth model here compiles like the first (two graphs each: static,
    # then dynamic sizes), none runs eagerly
    from graphshard._compat import dynamo_counters

    dynamo_counters().clear()
    for _ in range(6):
        model = mlp()
        graphshard.compile(model, graphshard.Plan(mesh1d("dp"), {"": graphshard.FullyShard()}), lower="eager")
        for batch in (4, 6, 8):
            model(torch.randn(batch, 16)).sum().backward()
        report = graphshard.explain(model)
        assert sum(line.startswith("graph ") for line in report.splitlines()) == 2, report
    assert dynamo_counters()["stats"]["unique_graphs"] == 12, dict(dynamo_counters()["stats"])
