"""Common misuses of a compiled model stop with an error naming the FQN and the fix, instead of
training wrongly in silence (issue 74): an optimizer built before the compile, a submodule replaced
after it, a meta-device model, an integer parameter, an unsharded state dict loaded into it.

Fake process group, world size 4 (tests/conftest.py); the multi-rank halves (full state dicts,
mixed-precision inputs against FSDP2) are in tests/test_misuse_multirank.py.
"""

from __future__ import annotations

import re

import pytest
import torch

import graphshard
from _models import mesh1d, mlp, tiny_transformer
from graphshard.fsdp import FullyShardedDataParallel as FSDP


def _plan():
    return graphshard.Plan(mesh1d("dp"), {"layers.*": graphshard.FullyShard(), "": graphshard.FullyShard()})


def _tokens():
    return torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(1))


# ---- a. an optimizer created before graphshard.compile ----

def test_optimizer_created_before_compile_stops_at_its_step():
    model = tiny_transformer()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    graphshard.compile(model, _plan(), lower="eager")
    owned = {id(p) for p in model.parameters()}
    assert not any(id(p) in owned for g in opt.param_groups for p in g["params"])  # holds none of them
    model(_tokens()).sum().backward()
    with pytest.raises(ValueError, match=r"AdamW steps over 16 parameter\(s\) that graphshard replaced .* sharded "
                                         r"Transformer \('tok_embeddings.weight', .*Create the optimizer after "
                                         r"graphshard.compile"):
        opt.step()


def test_optimizer_created_before_the_fsdp_wrapper_stops_too():
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    wrapped = FSDP(model, lower="eager")
    wrapped(torch.randn(4, 16)).sum().backward()
    with pytest.raises(ValueError, match=r"SGD steps over 4 parameter\(s\) .*'fc1.weight', 'fc1.bias', 'fc2.weight', "
                                         r"'fc2.bias'\)"):
        opt.step()


def test_optimizer_created_after_compile_trains_and_others_are_untouched():
    model = tiny_transformer()
    graphshard.compile(model, _plan(), lower="eager")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = {n: p.to_local().clone() for n, p in model.named_parameters()}
    model(_tokens()).sum().backward()
    opt.step()
    opt.step()  # the second step reuses the first one's check
    assert any(not torch.equal(before[n], p.to_local()) for n, p in model.named_parameters())
    plain = torch.nn.Linear(2, 2)  # an optimizer of a model graphshard never saw
    other = torch.optim.SGD(plain.parameters(), lr=0.1)
    plain(torch.ones(1, 2)).sum().backward()
    other.step()


# ---- b. a submodule replaced after the compile ----

def test_submodule_replaced_after_compile_is_an_error_naming_it():
    from _models import TINY
    from graphshard.testing.models import Block

    model = tiny_transformer()
    graphshard.compile(model, _plan(), lower="eager")
    model(_tokens()).sum().backward()
    model.layers[0] = Block(TINY)  # plain parameters: without the check they train unsynchronized
    with pytest.raises(ValueError, match=r"parameter 'layers.0.attn_norm.weight' \(and 11 more: .*\) of the compiled "
                                         r"Transformer is a plain nn.Parameter graphshard never sharded: .*Replace "
                                         r"submodules before graphshard.compile"):
        model(_tokens())


def test_submodule_replaced_inside_an_fsdp_unit_is_named_by_the_users_fqn():
    from graphshard.fsdp.wrap import ModuleWrapPolicy
    from graphshard.testing.models import Block

    model = FSDP(tiny_transformer(), auto_wrap_policy=ModuleWrapPolicy({Block}), lower="eager")
    model(_tokens()).sum().backward()
    model.module.layers[0].module.ffn = torch.nn.Sequential(torch.nn.Linear(16, 16))
    with pytest.raises(ValueError, match=r"parameter 'layers.0.ffn.0.weight' \(and 1 more: layers.0.ffn.0.bias\)"):
        model(_tokens())


def test_ignored_parameters_stay_plain_and_a_replaced_ignored_module_is_allowed():
    model = mlp()
    plan = graphshard.Plan(mesh1d("dp"), {"": graphshard.FullyShard()}, ignored_params=("fc2.*",))
    graphshard.compile(model, plan, lower="eager")
    x = torch.randn(4, 16)
    model(x).sum().backward()  # fc2's plain parameters were there at the compile: fine
    model.fc2 = torch.nn.Linear(32, 8)  # under the ignored glob: plain on purpose
    model(x).sum().backward()
    assert model.fc2.weight.grad is not None


def test_a_parameter_set_on_a_sharded_module_after_compile_is_an_error():
    model = mlp()
    graphshard.compile(model, graphshard.Plan(mesh1d("dp"), {"": graphshard.FullyShard()}), lower="eager")
    x = torch.randn(4, 16)
    model(x).sum().backward()
    model.fc1.weight = torch.nn.Parameter(torch.randn(32, 16))
    with pytest.raises(ValueError, match=r"parameter 'fc1.weight' of the compiled MLP is a plain nn.Parameter"):
        model(x)


# ---- d. an integer nn.Parameter ----

class _Permuted(torch.nn.Module):
    """A model reading an integer parameter as indices (the failing case: packed with the unit's float
    weights it became float)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc = torch.nn.Linear(16, 16)
        self.order = torch.nn.Parameter(torch.arange(16).flip(0), requires_grad=False)

    def forward(self, x):
        return self.fc(x)[..., self.order]


def test_integer_parameter_is_an_error_naming_it_and_the_fix():
    with pytest.raises(ValueError, match=re.escape(
            "parameter 'order' is an nn.Parameter of dtype torch.int64") + ".*" + re.escape(
            "model.register_buffer('order', tensor)") + ".*" + re.escape("Plan(ignored_params=['order'])")):
        graphshard.compile(_Permuted(), graphshard.Plan(mesh1d("dp"), {"": graphshard.FullyShard()}), lower="eager")
    with pytest.raises(ValueError, match=r"parameter 'fc1.order' .*model.get_submodule\('fc1'\).register_buffer"):
        model = mlp()
        model.fc1.register_parameter("order", torch.nn.Parameter(torch.arange(3), requires_grad=False))
        graphshard.compile(model, graphshard.Plan(mesh1d("dp"), {"": graphshard.FullyShard()}), lower="eager")


def test_integer_parameter_named_in_ignored_params_trains_as_the_single_process():
    ref, model = _Permuted(), _Permuted()
    # Replicate: the fake process group's gathers do not give the whole weight; numerics against FSDP's
    # gathers run on gloo ranks elsewhere, this checks the indices
    graphshard.compile(model, graphshard.Plan(mesh1d("dp"), {"": graphshard.Replicate()}, ignored_params=("order",)),
                       lower="eager")
    x = torch.randn(4, 16)
    torch.testing.assert_close(model(x), ref(x))
    assert model.order.dtype == torch.int64 and not isinstance(model.order, torch.distributed.tensor.DTensor)


# ---- c. a model built on the meta device ----

def _meta_transformer():
    from _models import TINY
    from graphshard.testing.models import Transformer

    with torch.device("meta"):
        return Transformer(TINY)


def test_meta_model_called_before_to_empty_names_the_parameter_and_the_fix():
    model = graphshard.compile(_meta_transformer(), _plan(), lower="eager")  # shards on meta, as fully_shard does
    assert model.layers[0].ffn.w1.weight.to_local().is_meta and model.layers[0].ffn.w1.weight.shape == (64, 16)
    with pytest.raises(ValueError, match=r"parameter 'tok_embeddings.weight' \(and 15 more\) is on the meta device: "
                                         r".*model.to_empty\(device=...\).*then initialize it"):
        model(_tokens())


def test_meta_model_materialized_with_to_empty_loads_and_runs():
    ref = tiny_transformer()
    model = graphshard.compile(_meta_transformer(), _plan(), lower="eager")
    params = {n: id(p) for n, p in model.named_parameters()}
    model.to_empty(device="cpu")
    assert {n: id(p) for n, p in model.named_parameters()} == params  # the same parameter objects, now on the CPU
    model.load_state_dict(ref.state_dict())  # a full state dict, sharded on load (case e)
    for n, p in model.named_parameters():
        assert p.placements == (torch.distributed.tensor.Shard(0),) and not p.to_local().is_meta, n
        torch.testing.assert_close(p.to_local(), ref.state_dict()[n].chunk(4)[0], rtol=0, atol=0)
    model(_tokens()).sum().backward()
    assert all(p.grad is not None for p in model.parameters())


# ---- e. an unsharded state dict loaded into the compiled model ----

def test_full_state_dict_loads_into_the_sharded_parameters():
    ref, model = tiny_transformer(), tiny_transformer()
    graphshard.compile(model, _plan(), lower="eager")
    full = {k: v + 1 for k, v in ref.state_dict().items()}
    assert not model.load_state_dict(full).missing_keys
    for n, p in model.named_parameters():  # this rank's (rank 0's) rows of each full tensor
        torch.testing.assert_close(p.to_local(), full[n].chunk(4)[0], rtol=0, atol=0)
    assert isinstance(model.layers[0].ffn.w1.weight, torch.distributed.tensor.DTensor)


def test_state_dict_of_local_shapes_is_torchs_size_mismatch_naming_the_key():
    model = tiny_transformer()
    graphshard.compile(model, _plan(), lower="eager")
    local = {k: (v.to_local() if isinstance(v, torch.distributed.tensor.DTensor) else v)
             for k, v in model.state_dict().items()}
    with pytest.raises(RuntimeError, match=r"size mismatch for tok_embeddings.weight: copying a param with shape "
                                           r"torch.Size\(\[8, 16\]\) from checkpoint, the shape in current model is "
                                           r"torch.Size\(\[32, 16\]\)"):
        model.load_state_dict(local)


# ---- g. param_dtype units fed fp32 inputs ----

def test_bf16_units_cast_their_floating_inputs_and_leave_integers():
    from graphshard.testing.models import MLP

    torch.manual_seed(0)
    model = MLP(16, 32, 8)
    graphshard.compile(model, graphshard.Plan(mesh1d("dp"), {"": graphshard.FullyShard(param_dtype=torch.bfloat16)}),
                       lower="eager")
    out = model(torch.randn(4, 16))  # fp32 in: failed inside the compiled code ("mat1 and mat2 ... same dtype")
    assert out.dtype == torch.bfloat16
    out.float().sum().backward()
    assert model.fc1.weight.grad.dtype == torch.float32  # fp32 parameters and gradients, as FSDP2
    from graphshard.storage import _cast_floating

    ints, floats = torch.arange(3), torch.ones(2, dtype=torch.float64)
    cast = _cast_floating(((ints, [floats]), {"k": floats}), torch.bfloat16)
    assert cast[0][0] is ints and cast[0][1][0].dtype == torch.bfloat16 and cast[1]["k"].dtype == torch.bfloat16
