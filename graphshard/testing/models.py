"""Reference models: written as for one device, with nothing graphshard-specific.

`Transformer` is a small decoder with tied input/output embeddings and an
attention that reshapes with hard-coded head counts (``view(b, s, n_heads,
head_dim)`` with Python constants), the shape of code that torch's eager tensor
parallelism cannot run unchanged.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True, kw_only=True)
class TransformerConfig:
    vocab_size: int = 1024
    dim: int = 256
    n_layers: int = 4
    n_heads: int = 4
    max_seq_len: int = 128
    ffn_mult: int = 4
    tie_embeddings: bool = True
    """``output.weight`` is ``tok_embeddings.weight``."""
    infer_heads: bool = False
    """Reshape heads with ``-1`` (``view(b, s, -1, head_dim)``), as torch's eager tensor
    parallelism requires, instead of the hard-coded ``n_heads``."""


class Attention(nn.Module):
    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        self.n_heads = -1 if cfg.infer_heads else cfg.n_heads
        self.head_dim = cfg.dim // cfg.n_heads
        self.wq = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wo = nn.Linear(cfg.dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bsz, seqlen, _ = x.shape
        # Hard-coded head counts, as most model code is written.
        q = self.wq(x).view(bsz, seqlen, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(bsz, seqlen, self.n_heads, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(bsz, seqlen, self.n_heads, self.head_dim).transpose(1, 2)
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(self.head_dim)
        mask = torch.full((seqlen, seqlen), float("-inf"), device=x.device).triu(1).to(scores.dtype)  # bf16 scores: a bf16 mask
        attn = F.softmax(scores + mask, dim=-1)
        out = (attn @ v).transpose(1, 2).reshape(bsz, seqlen, -1 if self.n_heads == -1 else self.n_heads * self.head_dim)
        return self.wo(out)


class FeedForward(nn.Module):
    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        hidden = cfg.ffn_mult * cfg.dim
        self.w1 = nn.Linear(cfg.dim, hidden)
        self.w2 = nn.Linear(hidden, cfg.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.gelu(self.w1(x)))


class Block(nn.Module):
    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        self.attn_norm = nn.LayerNorm(cfg.dim)
        self.attn = Attention(cfg)
        self.ffn_norm = nn.LayerNorm(cfg.dim)
        self.ffn = FeedForward(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.ffn(self.ffn_norm(x))


class Transformer(nn.Module):
    """Decoder-only transformer; by default ``output.weight`` is tied to ``tok_embeddings.weight``."""

    def __init__(self, cfg: TransformerConfig = TransformerConfig()):
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.pos_embeddings = nn.Embedding(cfg.max_seq_len, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = nn.LayerNorm(cfg.dim)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        nn.init.normal_(self.tok_embeddings.weight, std=0.02)
        nn.init.normal_(self.pos_embeddings.weight, std=0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(tokens.shape[1], device=tokens.device)
        h = self.tok_embeddings(tokens) + self.pos_embeddings(pos)
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))


class MLP(nn.Module):
    """Two linears with a GELU between them; dimensions deliberately uneven for sharding."""

    def __init__(self, dim_in: int = 10, hidden: int = 30, dim_out: int = 7):
        super().__init__()
        self.fc1 = nn.Linear(dim_in, hidden)
        self.fc2 = nn.Linear(hidden, dim_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(0, 1))


def token_batch(
    step: int, batch: int, seq_len: int, vocab: int, *, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of ``step``: inputs and next-token targets, deterministic in (seed, step)."""
    g = torch.Generator().manual_seed(seed * 100_003 + step)
    data = torch.randint(0, vocab, (batch, seq_len + 1), generator=g)
    return data[:, :-1].contiguous(), data[:, 1:].contiguous()


class SharedBlockMLP(nn.Module):
    """One ``nn.Linear`` object reachable as ``first`` and ``second`` (applied twice)."""

    def __init__(self, dim_in: int = 10, hidden: int = 16, dim_out: int = 7):
        super().__init__()
        self.inp = nn.Linear(dim_in, hidden)
        block = nn.Linear(hidden, hidden)
        self.first = block
        self.second = block
        self.out = nn.Linear(hidden, dim_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.gelu(self.first(self.inp(x)))
        return self.out(F.gelu(self.second(h)))


class DropoutMLP(nn.Module):
    """``fc1 -> GELU -> dropout -> fc2 -> dropout``. Under tensor parallelism (``fc1``
    column-parallel, ``fc2`` row-parallel) the first dropout draws its mask on a sharded
    value (the hidden units) and the second on a replicated one (the output)."""

    def __init__(self, dim: int = 16, hidden: int = 32, p: float = 0.25):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)
        self.p = p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.dropout(F.gelu(self.fc1(x)), self.p, self.training)
        return F.dropout(self.fc2(h), self.p, self.training)
