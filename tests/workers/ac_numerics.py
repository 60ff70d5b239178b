"""Activation-checkpointing numerics worker: ``torchrun --nproc-per-node N tests/workers/ac_numerics.py CASE ...``.

Each CASE is ``form:layout:lower``:

- form, how activation checkpointing (AC) is turned on, user code unchanged:
  ``fn`` (``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)`` in the model's forward,
  around each block and, nested, around its feed-forward with a keyword argument), ``wrapper``
  (``apply_activation_checkpointing`` with ``checkpoint_wrapper`` on the blocks, before sharding),
  ``reentrant`` (``fn`` with ``use_reentrant=True``, the form HF's ``gradient_checkpointing_enable()``
  uses by default), ``sac`` (the blocks under ``create_selective_checkpoint_contexts`` with a policy that saves
  matmuls), ``plan`` / ``plan_sac`` (``Plan(checkpoint={"layers.*": Checkpoint(...)})``, full or
  selective), ``skipped`` (``fn``'s blocks in a loop that logs, as HF's T5 does under gradient
  checkpointing: dynamo skips that frame, so the blocks and their recomputation run eagerly inside
  the compiled model), ``offload`` (``fn``'s blocks each under
  ``torch.autograd.graph.save_on_cpu``, as HF's ``activation_checkpointing_enable(offload=True)``
  wraps them, without the pinned memory a CPU-only machine lacks: dynamo does not trace
  ``save_on_cpu``, so the blocks run eagerly as ``skipped``'s do), ``none`` (no AC);
- layout: ``full_shard``, ``shard_grad_op``, ``replicate`` (1-D "dp"), ``hybrid`` (HSDP: a 2x2
  "replicate" x "shard" mesh; 4 ranks), ``tp`` (tensor parallel, 1-D "tp"), ``fsdp_tp`` (2x2 mesh:
  FullyShard on "dp", tensor parallel on "tp"; 4 ranks);
- lower: ``inductor`` or ``eager``;
- an optional flag ``deep``: 4 blocks instead of 2, so that blocks repeat and their checkpointed
  bodies are traced and partitioned once (`graphshard.compiler.outline`).

Every case trains the tied-embedding transformer for 4 steps of SGD with momentum on each rank's
slice of the global batch and compares the loss and every gathered parameter with the single
process on the global batch, running the same AC eagerly (torch's own checkpoint). It also
reports, from ``explain``, what the compiled backward recomputes.

``dropout:<layout>:<lower>`` checks that recomputed random ops draw the forward's values: a
stack of checkpointed ``fc1 -> GELU -> dropout -> fc2`` layers returns each layer's dropped
activation, whose zeros are the forward's mask; plain torch, multiplying by those masks, is the
reference for the losses and parameters. A recomputation that drew another mask would give
other gradients.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import io
import logging
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl, apply_activation_checkpointing, checkpoint_wrapper)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

import graphshard
from _compare import seq_err, tensor_err, worst
from _runner import run_cases
from graphshard import tensor_parallel as gtp
from graphshard.testing.models import Block, FeedForward, Transformer, TransformerConfig, lm_loss, token_batch

log = logging.getLogger(__name__)
STEPS = 4
SMALL = TransformerConfig(vocab_size=96, dim=32, n_layers=2, n_heads=4, max_seq_len=16)
TP_STYLES = {
    "tok_embeddings": gtp.RowwiseParallel(input_layouts=torch.distributed.tensor.Replicate()),
    "layers.*.attn.wq": gtp.ColwiseParallel(), "layers.*.attn.wk": gtp.ColwiseParallel(),
    "layers.*.attn.wv": gtp.ColwiseParallel(), "layers.*.attn.wo": gtp.RowwiseParallel(),
    "layers.*.ffn.w1": gtp.ColwiseParallel(), "layers.*.ffn.w2": gtp.RowwiseParallel(),
    "output": gtp.ColwiseParallel(output_layouts=torch.distributed.tensor.Replicate()),
}


def save_matmuls(ctx, op, *args, **kwargs):
    """A selective policy as torchtitan's "op" mode writes them: keep matmul outputs, recompute the rest."""
    if op in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default):
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


class CheckpointedFeedForward(FeedForward):
    """A feed-forward whose forward checkpoints its inner part, with a keyword argument."""

    def _inner(self, x, *, scale):
        return self.w2(F.gelu(self.w1(x))) * scale

    def forward(self, x):
        return checkpoint(self._inner, x, scale=1.0, use_reentrant=False)


class CheckpointedTransformer(Transformer):
    """The transformer as users write AC by hand: each block under checkpoint(), nested ones inside."""

    def __init__(self, cfg, selective: bool = False, reentrant: bool = False):
        super().__init__(cfg)
        self.selective, self.reentrant = selective, reentrant
        if not selective:
            for layer in self.layers:
                ffn = CheckpointedFeedForward(cfg)
                ffn.load_state_dict(layer.ffn.state_dict())
                layer.ffn = ffn

    def forward(self, tokens):
        pos = torch.arange(tokens.shape[1], device=tokens.device)
        h = self.tok_embeddings(tokens) + self.pos_embeddings(pos)
        for layer in self.layers:
            if self.selective:
                h = checkpoint(layer, h, use_reentrant=False,
                               context_fn=functools.partial(create_selective_checkpoint_contexts, save_matmuls))
            else:
                h = checkpoint(layer, h, use_reentrant=self.reentrant)
        return self.output(self.norm(h))


class SkippedFrameTransformer(Transformer):
    """Checkpointed blocks in a loop that logs: a graph break in a loop makes dynamo skip the whole
    frame (HF's T5Stack under gradient checkpointing), so the blocks run eagerly."""

    def blocks(self, h):
        for i, layer in enumerate(self.layers):
            log.debug("block %d", i)
            h = checkpoint(layer, h, use_reentrant=False)
        return h

    def forward(self, tokens):
        pos = torch.arange(tokens.shape[1], device=tokens.device)
        h = self.blocks(self.tok_embeddings(tokens) + self.pos_embeddings(pos))
        return self.output(self.norm(h))


def offloaded_checkpoint(function, *args, **kwargs):
    """HF's checkpoint function under ``activation_checkpointing_enable(offload=True)``: the
    checkpoint's saved inputs held in host memory (here unpinned: pinning needs an accelerator)."""
    with torch.autograd.graph.save_on_cpu(pin_memory=False, device_type="cpu"):
        return checkpoint(function, *args, **kwargs)


class OffloadedBlock(Block):
    """A block that checkpoints its own forward through `offloaded_checkpoint`, where HF's decoder
    layers do it (``GradientCheckpointingLayer.__call__``)."""

    def forward(self, x):
        return offloaded_checkpoint(super().forward, x, use_reentrant=False)


def build(form: str, cfg: TransformerConfig) -> nn.Module:
    torch.manual_seed(0)
    if form == "skipped":
        return SkippedFrameTransformer(cfg)
    if form == "offload":
        model = Transformer(cfg)
        for layer in model.layers:
            layer.__class__ = OffloadedBlock  # the same weights as every other form's
        return model
    if form in ("fn", "sac", "reentrant"):
        return CheckpointedTransformer(cfg, selective=form == "sac", reentrant=form == "reentrant")
    model = Transformer(cfg)
    if form == "wrapper":
        apply_activation_checkpointing(
            model, checkpoint_wrapper_fn=functools.partial(checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT),
            check_fn=lambda m: isinstance(m, Block))
    return model


def reference(form: str, model: nn.Module) -> nn.Module:
    """The single-process model with the same AC, run eagerly by torch."""
    ref = copy.deepcopy(model)
    if form.startswith("plan"):
        policy = {} if form == "plan" else {"context_fn": functools.partial(
            create_selective_checkpoint_contexts, graphshard.Checkpoint(mode="selective").context_fn().args[0])}
        apply_activation_checkpointing(
            ref, checkpoint_wrapper_fn=functools.partial(checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT,
                                                         **policy),
            check_fn=lambda m: isinstance(m, Block))
    return ref


def plan_for(layout: str, form: str, world: int):
    ckpt = {"plan": {"layers.*": graphshard.Checkpoint()},
            "plan_sac": {"layers.*": graphshard.Checkpoint(mode="selective")}}.get(form)
    units = {"full_shard": graphshard.FullyShard(), "shard_grad_op": graphshard.FullyShard(reshard_after_forward=False),
             "replicate": graphshard.Replicate()}
    if layout == "hybrid":
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
        rules = {"layers.*": graphshard.FullyShard(), "": graphshard.FullyShard()}
        return graphshard.Plan(mesh, rules, checkpoint=ckpt), world, dist.get_rank()
    if layout in units:
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
        return graphshard.Plan(mesh, {"layers.*": units[layout], "": units[layout]}, checkpoint=ckpt), world, mesh.get_local_rank("dp")
    styles = {(f"layers.*._checkpoint_wrapped_module.{k[len('layers.*.'):]}" if form == "wrapper" and k.startswith("layers")
               else k): v for k, v in TP_STYLES.items()}
    if layout == "tp":
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
        return graphshard.Plan(mesh, styles, checkpoint=ckpt), 1, 0
    mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))
    rules = {**styles, "layers.*": graphshard.FullyShard(), "": graphshard.FullyShard()}
    return graphshard.Plan(mesh, rules, checkpoint=ckpt), world // 2, mesh.get_local_rank("dp")


def train(model, batches, loss_of):
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    losses = []
    for x, y in batches:
        loss = loss_of(model, x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def full_params(model) -> dict[str, torch.Tensor]:
    """Every parameter, gathered, by FQN without checkpoint_wrapper's prefix (as its state_dict names them)."""
    return {n.replace("._checkpoint_wrapped_module", ""): (p.full_tensor() if isinstance(p, DTensor) else p.detach())
            for n, p in model.named_parameters()}


def mean_over_ranks(losses: list[float]) -> list[float]:
    t = torch.tensor(losses, dtype=torch.float64)
    dist.all_reduce(t)
    return (t / dist.get_world_size()).tolist()


def recompute_report(model) -> dict:
    reports = model._graphshard.explain
    with contextlib.redirect_stdout(io.StringIO()):
        text = graphshard.explain(model)
    return {"recomputed_ops": sum(r.recompute.get("ops", 0) for r in reports),
            "saved_bytes": sum(r.recompute.get("saved_bytes", 0) for r in reports),
            "saved_bytes_without_ac": sum(r.recompute.get("saved_bytes_without_ac", 0) for r in reports),
            "regions": sum(r.recompute.get("regions", 0) for r in reports),
            "graphs": len(reports), "fallbacks": sorted({f for r in reports for f in r.fallbacks}),
            "eager_units": sorted({(lambda info: info.layout.unit or info.fqn)(model._graphshard.params[k])
                                   for k in model._graphshard.eager_reads}),
            "explain_lists_eager_regions": "eager regions (frames run without compiling" in text,
            "notes": sorted({n for r in reports for n in r.notes})}


def run_case(case: str) -> dict:
    form, layout, lower, *flags = case.split(":")
    layers = 4 if "deep" in flags else 2
    if form == "dropout":
        return {**dropout_case(layout, lower, layers), "case": case}
    torch._dynamo.reset()
    cfg = dataclasses.replace(SMALL, n_layers=layers)
    model = build(form, cfg)
    ref = reference(form, model)
    plan, dp_world, dp_rank = plan_for(layout, form, dist.get_world_size())
    graphshard.compile(model, plan, lower=lower)
    batches = [token_batch(step, 2 * dp_world, cfg.max_seq_len, cfg.vocab_size, seed=4) for step in range(STEPS)]
    mine = [(x[2 * dp_rank:2 * dp_rank + 2], y[2 * dp_rank:2 * dp_rank + 2]) for x, y in batches]
    loss_of = lambda m, x, y: lm_loss(m(x), y)
    losses = mean_over_ranks(train(model, mine, loss_of))
    ref_losses = train(ref, batches, loss_of)
    ours, theirs = full_params(model), full_params(ref)
    assert list(ours) == list(theirs), (list(ours), list(theirs))
    return {"case": case, "layers": layers, "loss_err": seq_err(losses, ref_losses),
            "param_err": worst(tensor_err(ours[k], theirs[k]) for k in ours), **recompute_report(model)}


class DropoutLayer(nn.Module):
    def __init__(self, dim: int = 16, hidden: int = 32, p: float = 0.3):
        super().__init__()
        self.fc1, self.fc2, self.p = nn.Linear(dim, hidden), nn.Linear(hidden, dim), p

    def forward(self, x, mask=None):
        h = F.gelu(self.fc1(x))
        h = F.dropout(h, self.p, self.training) if mask is None else h * mask / (1 - self.p)
        return x + self.fc2(h), h


class DropoutStack(nn.Module):
    """Checkpointed layers that return their dropped activations (whose zeros are the masks)."""

    def __init__(self, n: int = 2):
        super().__init__()
        self.layers = nn.ModuleList(DropoutLayer() for _ in range(n))

    def forward(self, x, masks=None):
        drops = []
        for i, layer in enumerate(self.layers):
            if masks is None:
                x, h = checkpoint(layer, x, use_reentrant=False)
            else:
                x, h = layer(x, masks[i])
            drops.append(h)
        return x, drops


def dropout_case(layout: str, lower: str, layers: int) -> dict:
    torch._dynamo.reset()
    world = dist.get_world_size()
    torch.manual_seed(0)
    model = DropoutStack(layers)
    ref = copy.deepcopy(model)
    if layout == "tp":
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
        plan, dp_world, dp_rank = graphshard.Plan(mesh, {"layers.*.fc1": gtp.ColwiseParallel(),
                                                         "layers.*.fc2": gtp.RowwiseParallel()}), 1, 0
    else:
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
        plan, dp_world, dp_rank = graphshard.Plan(mesh, {"layers.*": graphshard.FullyShard(),
                                                         "": graphshard.FullyShard()}), world, dist.get_rank()
    graphshard.compile(model, plan, lower=lower)
    torch.manual_seed(1 + dist.get_rank())  # data-parallel ranks draw their own masks
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    losses, ref_losses, kept = [], [], []
    for step in range(3):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(4 * dp_world, 16, generator=g), torch.randn(4 * dp_world, 16, generator=g)
        out, drops = model(x[4 * dp_rank:4 * dp_rank + 4])
        loss = F.mse_loss(out, y[4 * dp_rank:4 * dp_rank + 4])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        masks = []
        for h in drops:  # the forward's masks, every data-parallel rank's batch rows in order
            mask = (h.detach() != 0).float()
            if dp_world > 1:
                parts = [torch.empty_like(mask) for _ in range(dp_world)]
                dist.all_gather(parts, mask)
                mask = torch.cat(parts)
            masks.append(mask)
        kept.append(worst(float(m.mean()) for m in masks))
        ref_out, _ = ref(x, masks)
        ref_loss = F.mse_loss(ref_out, y)
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        ref_losses.append(ref_loss.item())
    ours, theirs = full_params(model), full_params(ref)
    return {"layers": layers, "loss_err": seq_err(mean_over_ranks(losses), ref_losses),
            "param_err": worst(tensor_err(ours[k], theirs[k]) for k in ours), "kept_fraction": max(kept),
            **recompute_report(model)}


if __name__ == "__main__":
    run_cases(sys.argv[1:], run_case)
