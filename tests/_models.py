"""Small models and plans for golden-graph tests (fake process group, world size 4)."""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard

import graphshard
from graphshard.testing.models import MLP, Attention, Transformer, TransformerConfig

TINY = TransformerConfig(vocab_size=32, dim=16, n_layers=1, n_heads=4, max_seq_len=8)


def mesh1d(name: str):
    return init_device_mesh("cpu", (4,), mesh_dim_names=(name,))


def tp_mlp_plan():
    return graphshard.Plan(mesh1d("tp"), {
        "fc1": graphshard.ShardParams("tp", weight=Shard(0), bias=Shard(0)),
        "fc2": graphshard.ShardParams("tp", weight=Shard(1)),
    })


def tp_attention_plan():
    return graphshard.Plan(mesh1d("tp"), {
        "wq": graphshard.ShardParams("tp", weight=Shard(0)),
        "wk": graphshard.ShardParams("tp", weight=Shard(0)),
        "wv": graphshard.ShardParams("tp", weight=Shard(0)),
        "wo": graphshard.ShardParams("tp", weight=Shard(1)),
    })


def fsdp_plan(**spec):
    return graphshard.Plan(mesh1d("dp"), {"layers.*": graphshard.FullyShard(**spec), "": graphshard.FullyShard(**spec)})


def seeded(cls, *args):
    torch.manual_seed(0)
    return cls(*args)


def mlp():
    return seeded(MLP, 16, 32, 8)


def attention():
    return seeded(Attention, TINY)


def tiny_transformer():
    return seeded(Transformer, TINY)


class Stack(nn.Module):
    """Three linears, each its own unit: the smallest model that shows prefetching."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8, bias=False) for _ in range(3))

    def forward(self, x):
        for layer in self.layers:
            x = torch.relu(layer(x))
        return x


def stack():
    return seeded(Stack)
