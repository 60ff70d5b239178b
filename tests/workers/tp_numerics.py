"""Tensor-parallel numerics worker: ``torchrun --nproc-per-node N tests/workers/tp_numerics.py CASE ...``.

Each CASE is ``plan:frontend:lower``:

- plan: ``tp`` (column/row-parallel attention and MLP, vocabulary-parallel
  embedding, output gathered), ``sp`` (tp plus sequence parallelism: norms and
  the residual stream sharded on the sequence dim), ``loss_parallel`` (logits
  returned as a DTensor sharded on the vocabulary, loss under ``loss_parallel()``),
  ``loss_inside`` (the loss computed inside the compiled model on class-sharded
  logits), ``fsdp_tp`` (tp on the "tp" axis plus FullyShard on "dp", 2x2 mesh);
- frontend: ``parallelize`` (``graphshard.tensor_parallel.parallelize_module``)
  or ``plan`` (the same styles in a ``graphshard.Plan`` with ``graphshard.compile``);
- lower: ``inductor`` or ``eager``;
- an optional fourth field ``dynamic``: the batch size changes from step to step (2, 1, 3, ...),
  so dynamo recompiles with a symbolic batch and the hard-coded head counts' merged
  ``batch * heads`` dims are localized symbolically.

Every case trains the tied-embedding transformer with hard-coded head counts
for 5 steps of SGD with momentum and compares the loss and every gathered
parameter with a single-process run on the global batch. ``torch_tp`` runs
torch's own ``parallelize_module`` with the same plan on the variant torch can
run (``-1`` head reshapes, untied embeddings) next to graphshard on that
variant, and reports how far each is from the single process and from each
other; it also records that torch's tensor parallelism fails on the hard-coded
heads. Rank 0 prints one JSON line per case.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

import graphshard
from _compare import seq_err, tensor_err, worst
from _runner import run_cases
from graphshard import tensor_parallel as gtp
from graphshard.testing.models import Transformer, TransformerConfig, lm_loss, token_batch

STEPS = 5
SMALL = TransformerConfig(vocab_size=96, dim=32, n_layers=2, n_heads=4, max_seq_len=16)
DEEP = dataclasses.replace(SMALL, n_layers=4)
"""The ``deep`` flag's model: 4 blocks, so that blocks repeat and share one traced and
differentiated body (2 blocks do not: the last block runs on into the tail, and shares the body
only with a group of two or more)."""
TORCH_RUNNABLE = TransformerConfig(vocab_size=96, dim=32, n_layers=2, n_heads=4, max_seq_len=16,
                                   tie_embeddings=False, infer_heads=True)


def tp_plan(styles, plan: str) -> dict:
    """The tensor-parallel plan in the style classes of ``styles`` (graphshard's or torch's)."""
    Col, Row = styles.ColwiseParallel, styles.RowwiseParallel
    if plan == "sp":
        seq_in = styles.PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
        return {
            "tok_embeddings": Row(input_layouts=Replicate(), output_layouts=Shard(1)),
            "layers.*.attn_norm": styles.SequenceParallel(), "layers.*.ffn_norm": styles.SequenceParallel(),
            "layers.*.attn": seq_in, "layers.*.ffn": seq_in,
            "layers.*.attn.wq": Col(), "layers.*.attn.wk": Col(), "layers.*.attn.wv": Col(),
            "layers.*.attn.wo": Row(output_layouts=Shard(1)),
            "layers.*.ffn.w1": Col(), "layers.*.ffn.w2": Row(output_layouts=Shard(1)),
            "norm": styles.SequenceParallel(),
            "output": Col(input_layouts=Shard(1), output_layouts=Replicate()),
        }
    output = {
        "loss_parallel": Col(use_local_output=False),
        "loss_inside": Col(),
    }.get(plan, Col(output_layouts=Replicate()))
    return {
        "tok_embeddings": Row(input_layouts=Replicate()),
        "layers.*.attn.wq": Col(), "layers.*.attn.wk": Col(), "layers.*.attn.wv": Col(),
        "layers.*.attn.wo": Row(), "layers.*.ffn.w1": Col(), "layers.*.ffn.w2": Row(),
        "output": output,
    }


class WithLoss(nn.Module):
    """The model and its loss in one forward, so the loss is compiled with the model."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, tokens, targets):
        return lm_loss(self.model(tokens), targets)


def train(model, batches, loss_ctx=contextlib.nullcontext, inside=False):
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    losses = []
    for x, y in batches:
        with loss_ctx():
            loss = model(x, y) if inside else lm_loss(model(x), y)
            loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.full_tensor().item() if isinstance(loss, DTensor) else loss.item())
    return losses


def full_params(model) -> dict[str, torch.Tensor]:
    return {n: (p.full_tensor() if isinstance(p, DTensor) else p.detach()) for n, p in model.named_parameters()}


def max_diff(a: dict, b: dict) -> float:
    assert list(a) == list(b), (list(a), list(b))
    return worst(tensor_err(a[k], b[k]) for k in a)


def run_case(case: str) -> dict:
    plan_name, frontend, lower, *flags = case.split(":")
    torch._dynamo.reset()
    world = dist.get_world_size()
    torch.manual_seed(0)
    ref = Transformer(DEEP if "deep" in flags else SMALL)
    model = copy.deepcopy(ref)
    if plan_name == "fsdp_tp":
        mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))
        dp_world, dp_rank = world // 2, mesh.get_local_rank("dp")
    else:
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
        dp_world, dp_rank = 1, 0
    styles = tp_plan(gtp, "tp" if plan_name == "fsdp_tp" else plan_name)
    inside = plan_name == "loss_inside"
    if inside:
        model, ref = WithLoss(model), WithLoss(ref)
        styles = {f"model.{k}": v for k, v in styles.items()}
    if plan_name == "fsdp_tp":
        rules = {**styles, "layers.*": graphshard.FullyShard(), "": graphshard.FullyShard()}
        graphshard.compile(model, graphshard.Plan(mesh, rules), lower=lower)
    elif frontend == "parallelize":
        assert lower == "inductor", "parallelize_module compiles with Inductor"
        assert gtp.parallelize_module(model, mesh, styles) is model
    else:
        graphshard.compile(model, graphshard.Plan(mesh, styles), lower=lower)
    per_rank = [(2, 1, 3)[step % 3] if "dynamic" in flags else 2 for step in range(STEPS)]
    batches = [token_batch(step, per_rank[step] * dp_world, SMALL.max_seq_len, SMALL.vocab_size, seed=2)
               for step in range(STEPS)]
    mine = [(x[dp_rank * n:(dp_rank + 1) * n], y[dp_rank * n:(dp_rank + 1) * n]) for (x, y), n in zip(batches, per_rank)]
    loss_ctx = gtp.loss_parallel if plan_name == "loss_parallel" else contextlib.nullcontext
    losses = train(model, mine, loss_ctx, inside)
    ref_losses = train(ref, batches, inside=inside)
    if dp_world > 1:
        t = torch.tensor(losses)
        dist.all_reduce(t)
        losses = (t / world).tolist()  # every tp rank of a dp group has the same loss
    out = {
        "case": case,
        "loss_err": seq_err(losses, ref_losses),
        "param_err": max_diff(full_params(model), full_params(ref)),
        "dtensor_params": sorted(n for n, p in model.named_parameters() if isinstance(p, DTensor)),
        "names": [n for n, _ in model.named_parameters()] == [n for n, _ in ref.named_parameters()],
        "graphs": len(model._graphshard.explain) if hasattr(model, "_graphshard") else 0,
        "fallbacks": sorted({f for r in model._graphshard.explain for f in r.fallbacks})
        if hasattr(model, "_graphshard") else [],
        "trace_once": [n for r in model._graphshard.explain for n in r.notes if n.startswith("trace once")]
        if hasattr(model, "_graphshard") else [],
    }
    return out


def torch_comparison(plan_name: str) -> dict:
    """graphshard and torch's parallelize_module, same plan, same model (the variant torch runs)."""
    from torch.distributed.tensor import parallel as ttp

    torch._dynamo.reset()
    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    torch.manual_seed(0)
    ref = Transformer(TORCH_RUNNABLE)
    ours, theirs = copy.deepcopy(ref), copy.deepcopy(ref)
    gtp.parallelize_module(ours, mesh, tp_plan(gtp, plan_name))
    ttp.parallelize_module(theirs, mesh, tp_plan(ttp, plan_name))
    batches = [token_batch(step, 2, SMALL.max_seq_len, SMALL.vocab_size, seed=3) for step in range(STEPS)]
    our_losses, their_losses, ref_losses = train(ours, batches), train(theirs, batches), train(ref, batches)
    torch_fails_on_fixed_heads = None
    fixed = Transformer(SMALL)
    ttp.parallelize_module(fixed, mesh, tp_plan(ttp, plan_name))
    try:
        fixed(batches[0][0])
        torch_fails_on_fixed_heads = False
    except RuntimeError as e:  # view(b, s, n_heads, head_dim) on a local tensor of n_heads / world heads
        torch_fails_on_fixed_heads = str(e).splitlines()[0][:200]
    return {
        "case": f"torch_tp:{plan_name}",
        "ours_vs_ref_loss": seq_err(our_losses, ref_losses),
        "torch_vs_ref_loss": seq_err(their_losses, ref_losses),
        "ours_vs_torch_loss": seq_err(our_losses, their_losses),
        "ours_vs_torch_params": max_diff(full_params(ours), full_params(theirs)),
        "ours_vs_ref_params": max_diff(full_params(ours), full_params(ref)),
        "torch_fails_on_fixed_heads": torch_fails_on_fixed_heads,
    }




def run(case: str) -> dict:
    return torch_comparison(case.split(":", 1)[1]) if case.startswith("torch_tp:") else run_case(case)


if __name__ == "__main__":
    run_cases(sys.argv[1:], run)
