"""graphshard.fsdp.wrap.decide_units against the units torch's FSDP1 creates (fake process group).

For each policy torch's ``FullyShardedDataParallel`` wraps a copy of the model; the units
(the modules its ``fsdp_modules`` hold, named by their FQN in the unwrapped model) and their
overrides must be the ones ``decide_units`` computes without changing the model.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch
import torch.nn as nn
from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP, MixedPrecision, ShardingStrategy
from torch.distributed.fsdp.wrap import (
    CustomPolicy,
    ModuleWrapPolicy,
    always_wrap_policy,
    lambda_auto_wrap_policy,
    size_based_auto_wrap_policy,
    transformer_auto_wrap_policy,
)

from graphshard.fsdp.wrap import decide_units
from graphshard.testing.models import Attention, Block, FeedForward, Transformer, TransformerConfig


def _transformer():
    torch.manual_seed(0)
    return Transformer(TransformerConfig(vocab_size=32, dim=16, n_layers=2, n_heads=4, max_seq_len=8))


def _bn_net():
    return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Sequential(nn.Linear(16, 16), nn.ReLU()),
                         nn.Linear(16, 4))


def _llama():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=96, max_position_embeddings=64)
    return transformers.LlamaForCausalLM(cfg)


def _torch_units(model: nn.Module, **kwargs) -> dict[str, dict]:
    names = {id(m): n for n, m in model.named_modules()}
    wrapped = TorchFSDP(model, device_id=torch.device("cpu"), **kwargs)
    return {names[id(u.module)]: {"sharding_strategy": u.sharding_strategy,
                                  "mixed_precision": u.mixed_precision.param_dtype}
            for u in TorchFSDP.fsdp_modules(wrapped)}


def _our_units(model: nn.Module, policy, *, root_mp=None, **kwargs) -> dict[str, dict]:
    out = {}
    for fqn, _, overrides in decide_units(model, policy, **kwargs):
        mp = overrides.get("mixed_precision", root_mp)
        out[fqn] = {"sharding_strategy": overrides.get("sharding_strategy", ShardingStrategy.FULL_SHARD),
                    "mixed_precision": None if mp is None else mp.param_dtype}
    return out


def _llama_layer():
    transformers = pytest.importorskip("transformers")
    return transformers.models.llama.modeling_llama.LlamaDecoderLayer


POLICIES = {
    "module_wrap_blocks": lambda: ModuleWrapPolicy({Block}),
    "module_wrap_nested": lambda: ModuleWrapPolicy({Block, Attention, nn.Embedding}),
    "size_based_100": lambda: functools.partial(size_based_auto_wrap_policy, min_num_params=100),
    "size_based_300": lambda: functools.partial(size_based_auto_wrap_policy, min_num_params=300),
    "size_based_2000": lambda: functools.partial(size_based_auto_wrap_policy, min_num_params=2000),
    "transformer": lambda: functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block}),
    "lambda": lambda: functools.partial(lambda_auto_wrap_policy, lambda_fn=lambda m: isinstance(m, FeedForward)),
    "always": lambda: always_wrap_policy,
    "custom_callable": lambda: (lambda module, recurse, nonwrapped_numel: recurse or nonwrapped_numel > 500),
    "custom_policy": lambda: CustomPolicy(
        lambda m: {"sharding_strategy": ShardingStrategy.SHARD_GRAD_OP} if isinstance(m, Attention)
        else isinstance(m, FeedForward)),
}


@pytest.mark.parametrize("name", list(POLICIES))
def test_units_are_torchs(name):
    model = _transformer()
    assert _our_units(model, POLICIES[name]()) == _torch_units(copy.deepcopy(model), auto_wrap_policy=POLICIES[name]())


@pytest.mark.parametrize("name", ["module_wrap_blocks", "size_based_300"])
def test_units_leave_ignored_modules_out_as_torch(name):
    model = _transformer()
    ours = _our_units(model, POLICIES[name](), ignored_modules={model.layers[0].ffn})
    twin = copy.deepcopy(model)
    assert ours == _torch_units(twin, auto_wrap_policy=POLICIES[name](), ignored_modules=[twin.layers[0].ffn])


@pytest.mark.parametrize("policy", [lambda: ModuleWrapPolicy({nn.Sequential}),
                                    lambda: functools.partial(size_based_auto_wrap_policy, min_num_params=200)])
def test_mixed_precision_classes_to_ignore_are_units_without_mixed_precision(policy):
    mp = MixedPrecision(param_dtype=torch.bfloat16)
    model = _bn_net()
    ours = _our_units(model, policy(), root_mp=mp, full_precision_classes=tuple(mp._module_classes_to_ignore))
    theirs = _torch_units(copy.deepcopy(model), auto_wrap_policy=policy(), mixed_precision=mp)
    assert ours == theirs and ours["1"]["mixed_precision"] is None


def test_units_of_an_hf_model_are_torchs():
    model = _llama()
    policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={_llama_layer()})
    assert _our_units(model, policy) == _torch_units(copy.deepcopy(model), auto_wrap_policy=policy)


def test_decide_units_leaves_the_model_unchanged():
    model = _transformer()
    before = [(n, type(m)) for n, m in model.named_modules()]
    decide_units(model, ModuleWrapPolicy({Block}))
    assert [(n, type(m)) for n, m in model.named_modules()] == before
