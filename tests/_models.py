"""Small models and plans for golden-graph tests (fake process group, world size 4)."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
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


class RotaryAttention(nn.Module):
    """Attention with rotary position embeddings and ``scaled_dot_product_attention``;
    head counts hard-coded in the views.

    ``complex_form=False``: the real form, ``x * cos + rotate_half(x) * sin`` on
    [b, h, s, head_dim] with ``rotate_half`` written with ``chunk`` / ``cat`` and the
    cos/sin tables indexed by position. ``complex_form=True``: llama's form on
    [b, s, h, head_dim], ``view_as_complex`` times a complex ``freqs_cis`` table
    broadcast over heads, then ``view_as_real(...).flatten(3)``.
    """

    def __init__(self, dim: int = 16, n_heads: int = 4, max_seq_len: int = 8, complex_form: bool = False):
        super().__init__()
        self.n_heads, self.head_dim, self.complex_form = n_heads, dim // n_heads, complex_form
        self.wq = nn.Linear(dim, dim, bias=False)
        self.wk = nn.Linear(dim, dim, bias=False)
        self.wv = nn.Linear(dim, dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)
        inv_freq = 1.0 / (10000 ** (torch.arange(0, self.head_dim, 2).float() / self.head_dim))
        angles = torch.outer(torch.arange(max_seq_len).float(), inv_freq)  # [max_seq_len, head_dim / 2]
        if complex_form:
            self.register_buffer("freqs_cis", torch.polar(torch.ones_like(angles), angles), persistent=False)
        else:
            emb = torch.cat((angles, angles), dim=-1)
            self.register_buffer("cos", emb.cos(), persistent=False)
            self.register_buffer("sin", emb.sin(), persistent=False)

    @staticmethod
    def rotate_half(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((-x2, x1), dim=-1)

    def complex_rotary(self, x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
        b, s = x.shape[:2]
        xc = torch.view_as_complex(x.float().reshape(b, s, self.n_heads, -1, 2))
        return torch.view_as_real(xc * freqs_cis).flatten(3).type_as(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, self.n_heads, self.head_dim)
        k = self.wk(x).view(b, s, self.n_heads, self.head_dim)
        v = self.wv(x).view(b, s, self.n_heads, self.head_dim).transpose(1, 2)
        pos = torch.arange(s, device=x.device)
        if self.complex_form:
            freqs_cis = self.freqs_cis[pos].view(1, s, 1, self.head_dim // 2)
            q = self.complex_rotary(q, freqs_cis).transpose(1, 2)
            k = self.complex_rotary(k, freqs_cis).transpose(1, 2)
        else:
            q, k = q.transpose(1, 2), k.transpose(1, 2)
            cos, sin = self.cos[pos], self.sin[pos]
            q = q * cos + self.rotate_half(q) * sin
            k = k * cos + self.rotate_half(k) * sin
        out = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, s, self.n_heads * self.head_dim))


def rotary_attention(complex_form: bool = False):
    return seeded(RotaryAttention, 16, 4, 8, complex_form)


class CachedGQAAttention(nn.Module):
    """Attention as HF transformers writes it: grouped-query heads (``enable_gqa``), keys and
    values appended to a cache that starts as the legacy empty ``torch.tensor([])``, and the
    output merged back with ``view`` after a transpose (valid only for the strides of the
    attention's output as first traced)."""

    def __init__(self, dim: int = 16, heads: int = 4, kv_heads: int = 2):
        super().__init__()
        self.heads, self.kv_heads, self.hd = heads, kv_heads, dim // heads
        self.q_proj = nn.Linear(dim, heads * self.hd, bias=False)
        self.k_proj = nn.Linear(dim, kv_heads * self.hd, bias=False)
        self.v_proj = nn.Linear(dim, kv_heads * self.hd, bias=False)
        self.o_proj = nn.Linear(heads * self.hd, dim, bias=False)

    def forward(self, x):
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, -1, self.hd).transpose(1, 2)
        k = self.k_proj(x).view(b, s, -1, self.hd).transpose(1, 2)
        v = self.v_proj(x).view(b, s, -1, self.hd).transpose(1, 2)
        k = torch.cat([torch.tensor([]), k], dim=-2)
        v = torch.cat([torch.tensor([]), v], dim=-2)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.o_proj(out.transpose(1, 2).view(b, s, -1))


def cached_gqa_attention(heads: int, kv_heads: int):
    return seeded(CachedGQAAttention, 16, heads, kv_heads)


def tp_qkvo_plan(shard_kv: bool = True):
    """Column-parallel q (and k, v), row-parallel o: heads over the 4 ranks of "tp"."""
    from graphshard.tensor_parallel import ColwiseParallel, RowwiseParallel

    kv = {"k_proj": ColwiseParallel(), "v_proj": ColwiseParallel()} if shard_kv else {}
    return graphshard.Plan(mesh1d("tp"), {"q_proj": ColwiseParallel(), **kv, "o_proj": RowwiseParallel()})


class QNormAttention(nn.Module):
    """Qwen3's query norm: an RMSNorm over each head's dims, its weight applied to every head."""

    def __init__(self, dim: int = 16, heads: int = 4):
        super().__init__()
        self.heads, self.hd = heads, dim // heads
        self.q_proj = nn.Linear(dim, dim, bias=False)
        self.q_norm = nn.RMSNorm(self.hd)
        self.o_proj = nn.Linear(dim, dim, bias=False)

    def forward(self, x):
        b, s, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(b, s, self.heads, self.hd))
        return self.o_proj(q.view(b, s, -1))


def fsdp_tp_qnorm():
    """QNormAttention with q/o tensor-parallel on "tp" and FullyShard on "dp" (2x2 mesh)."""
    from graphshard.tensor_parallel import ColwiseParallel, RowwiseParallel

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    plan = graphshard.Plan(mesh, {"q_proj": ColwiseParallel(), "o_proj": RowwiseParallel(), "": graphshard.FullyShard()})
    return seeded(QNormAttention), plan


class FusedQKVAttention(nn.Module):
    """GPT-2's attention shape: one projection computes q | k | v side by side, then splits."""

    def __init__(self, dim: int = 16, heads: int = 4):
        super().__init__()
        self.dim, self.heads, self.hd = dim, heads, dim // heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.o = nn.Linear(dim, dim, bias=False)

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = (t.view(b, s, self.heads, self.hd).transpose(1, 2) for t in self.qkv(x).split(self.dim, dim=2))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(out.transpose(1, 2).reshape(b, s, self.dim))


def fused_qkv_attention():
    """FusedQKVAttention with the fused projection column-parallel over its three blocks."""
    from graphshard.tensor_parallel import RowwiseParallel

    fused = graphshard.ShardParams("tp", weight=graphshard.StridedShard(0, 3), bias=graphshard.StridedShard(0, 3))
    return seeded(FusedQKVAttention), graphshard.Plan(mesh1d("tp"), {"qkv": fused, "o": RowwiseParallel()})
