"""FSDP1 parity worker: ``torchrun --nproc-per-node N tests/workers/fsdp1.py CASE [CASE ...]``.

Each CASE is ``model:strategy:prefetch:params[:flag ...]``: ``model`` transformer | bn (a BatchNorm and a buffer) | llama (HF
transformers, tiny config); ``strategy`` a ShardingStrategy name in lower case (full_shard,
shard_grad_op, no_shard, hybrid_shard); ``prefetch`` pre | post | none (``backward_prefetch``);
``params`` flat | orig (``use_orig_params``). Flags: ``clip`` (``clip_grad_norm_`` at 0.05 each
step; ``clipinf`` with ``norm_type=inf``), ``tied`` (output and input embeddings one parameter),
``tiedunits`` (tied, and every Linear a unit: the tied weight is
held by the root's embedding and by the output unit), ``frozen`` (one frozen weight in a unit), ``fwd`` (``forward_prefetch=True``), ``nolimit`` (``limit_all_gathers=False``), ``accum``
(each step accumulates two micro-batches, the first inside ``no_sync()``), ``ignore``
(``ignored_modules=[layers[0].ffn]``), ``ignorestates`` (``ignored_states=[norm.weight,
output.weight]``), ``summon`` (``summon_full_params`` with writeback after training): ignored parameters are not reduced, so the wrappers are compared with each
other, not with the single process; ``cpuonly`` (``CPUOffload(offload_params=True)``,
``sync_module_states=True``, no ``device_id``: torch's FSDP1 refuses each on a CPU-only build)
(and ignored parameters not with ``clip``: the total norm then differs per
rank, and which elements each rank's coefficient scales depends on the shard layout, torch's
flat chunks or graphshard's rows). ``acbefore`` / ``acafter``: torch's
``apply_activation_checkpointing`` with a non-reentrant ``checkpoint_wrapper`` on the blocks,
before or after wrapping (the single process checkpoints the same blocks); graphshard's run
then reports how many forward ops its compiled backward recomputes.

The same user program (`train`) runs three times on one batch stream: with torch's
``FullyShardedDataParallel``, with ``graphshard.fsdp.FullyShardedDataParallel`` (only the class
differs), and unwrapped in one process on the global batch. Rank 0 reports the largest loss and
parameter differences of each wrapper against the single process, and of the two against each
other, plus the names each wrapper's ``named_parameters()`` gives. graphshard's programs lower with
Inductor, or as FX where the launch sets ``GS_TEST_LOWER=eager``.
"""

from __future__ import annotations

import copy
import glob
import os
import re
import shutil
import sys
import tempfile

import torch
import torch.distributed as dist

from _compare import seq_err, tensor_err, worst
from _runner import lowering, run_cases
from graphshard.testing.models import Block, Transformer, TransformerConfig, lm_loss, token_batch

STEPS = 4
_REDUCTION_EVENTS = ("gloo:reduce_scatter", "gloo:all_to_all", "gloo:all_reduce")
"""Profiler events of gloo's gradient reductions (what went over the wire; c10d ops also
appear while graphshard traces, without communicating)."""


_REDUCTION = re.compile(r': "(\w+)\[[^"]*\]" = torch\.ops\._c10d_functional\.'
                        r'(?:all_to_all_single|reduce_scatter_tensor|all_reduce)\.default\(')


def reduction_dtypes(dump_dir: str) -> list[str]:
    """The dtypes of the gradient reductions in graphshard's backward graphs, read from its
    ``dump_graphs`` output (on gloo a reduce-scatter is an all-to-all)."""
    found = set()
    for path in glob.glob(os.path.join(dump_dir, "g*_backward_*.txt")):
        with open(path) as f:
            found.update(_REDUCTION.findall(f.read()))
    return sorted(found)


def _reductions(prof) -> int:
    return sum(e.name.startswith(_REDUCTION_EVENTS) for e in prof.events())
SMALL = TransformerConfig(vocab_size=96, dim=32, n_layers=2, n_heads=4, max_seq_len=16)


class MLPBlock(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(SMALL.dim, 2 * SMALL.dim)
        self.fc2 = torch.nn.Linear(2 * SMALL.dim, SMALL.dim)

    def forward(self, h):
        return h + self.fc2(torch.nn.functional.gelu(self.fc1(h)))


class BNNet(torch.nn.Module):
    """Token embeddings, MLP blocks, a BatchNorm (a ``_module_classes_to_ignore`` class) and a
    registered buffer: the mixed-precision case."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(SMALL.vocab_size, SMALL.dim)
        self.layers = torch.nn.ModuleList(MLPBlock() for _ in range(2))
        self.bn = torch.nn.BatchNorm1d(SMALL.dim)
        self.register_buffer("scale", torch.full((SMALL.dim,), 0.5))
        self.out = torch.nn.Linear(SMALL.dim, SMALL.vocab_size)

    def forward(self, tokens):
        h = self.emb(tokens)
        for layer in self.layers:
            h = layer(h)
        h = self.bn(h.transpose(1, 2)).transpose(1, 2) * self.scale
        return self.out(h)


def build(model_name: str, flags: list[str] = ()):
    torch.manual_seed(0)
    if model_name == "transformer" and ({"tied", "tiedunits", "frozen"} & set(flags)):
        model = Transformer(SMALL)
        if {"tied", "tiedunits"} & set(flags):  # one parameter under two FQNs, in the root unit and used by two modules
            model.output.weight = model.tok_embeddings.weight
        if "frozen" in flags:  # frozen and trainable parameters in one unit
            model.layers[0].attn.wq.weight.requires_grad_(False)
        return model, Block, lambda out: out
    if model_name == "bn":
        return BNNet(), MLPBlock, lambda out: out
    if model_name == "llama":
        import transformers

        cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, vocab_size=96,
                                       max_position_embeddings=64, attn_implementation="eager")
        model = transformers.LlamaForCausalLM(cfg)
        block = transformers.models.llama.modeling_llama.LlamaDecoderLayer
        return model, block, lambda out: out.logits
    return Transformer(SMALL), Block, lambda out: out


def train(FSDP, model, block, logits, args: dict, sl: slice):
    """The user's program: wrap, train with SGD + momentum, read a full state dict."""
    from torch.distributed.fsdp import CPUOffload, FullStateDictConfig, MixedPrecision, StateDictType
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    kwargs = dict(args["fsdp"])
    if FSDP.__module__.startswith("graphshard"):  # graphshard's compile options
        kwargs["lower"] = lowering()
        if args.get("dump_graphs"):
            kwargs["dump_graphs"] = args["dump_graphs"]
    if args["bf16"]:
        kwargs["mixed_precision"] = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                                   buffer_dtype=torch.bfloat16, keep_low_precision_grads=args["klp"])
    if args["ignore"] == "ignore":
        kwargs["ignored_modules"] = [model.layers[0].ffn]
    elif args["ignore"] == "ignorestates":
        kwargs["ignored_states"] = [model.norm.weight, model.output.weight]
    if args["cpuonly"]:  # what torch's FSDP1 cannot run without an accelerator
        kwargs.update(cpu_offload=CPUOffload(offload_params=True), sync_module_states=True)
        if dist.get_rank() != 0:  # sync_module_states must bring rank 0's values here
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(torch.randn_like(p))
    else:
        kwargs["device_id"] = torch.device("cpu")
    classes = {block, torch.nn.Linear} if args["tiedunits"] else {block}  # tiedunits: output its own unit
    if args["ac"] == "acbefore":
        checkpoint_blocks(model, block)
    fsdp = FSDP(model, auto_wrap_policy=ModuleWrapPolicy(classes), **kwargs)
    if args["ac"] == "acafter":
        checkpoint_blocks(fsdp, block)
    opt = torch.optim.SGD(fsdp.parameters(), lr=0.05, momentum=0.9)
    losses, norms, reductions, synced, dtypes = [], [], [], [], set()
    for step in range(STEPS):
        if args["accum"]:  # gradient accumulation: a micro-batch without communication first
            x, y = token_batch(100 + step, args["batch"], SMALL.max_seq_len, SMALL.vocab_size, seed=1)
            with fsdp.no_sync(), torch.profiler.profile() as prof:
                lm_loss(logits(fsdp(x[sl])), y[sl]).backward()
            reductions.append(_reductions(prof))
        x, y = token_batch(step, args["batch"], SMALL.max_seq_len, SMALL.vocab_size, seed=1)
        loss = lm_loss(logits(fsdp(x[sl])), y[sl])
        with torch.profiler.profile() as prof:
            loss.backward()
        synced.append(_reductions(prof))
        dtypes.update(str(p.dtype) for p in fsdp.parameters())
        dtypes.update(str(p.grad.dtype) for p in fsdp.parameters() if p.grad is not None)
        grad_dtypes = {n: str(p.grad.dtype) for n, p in fsdp.named_parameters() if p.grad is not None}
        if args["clip"]:
            norms.append(float(fsdp.clip_grad_norm_(0.05, args["norm_type"])))
        opt.step()
        opt.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / dist.get_world_size())
    if args["ac"] and FSDP.__module__.startswith("graphshard"):
        from graphshard.storage import state_of

        reports = next(state_of(m) for m in fsdp.modules() if state_of(m) is not None).explain
        args["recomputed"].append(sum(r.recompute.get("ops", 0) for r in reports))
    buffers = {n: str(b.dtype) for n, b in fsdp.named_buffers()}  # torch casts them at the first forward
    with FSDP.state_dict_type(fsdp, StateDictType.FULL_STATE_DICT, FullStateDictConfig(rank0_only=False)):
        sd = fsdp.state_dict()
    summoned = summon_and_write_back(FSDP, fsdp, sd) if args["summon"] else None
    return losses, norms, sd, [n for n, _ in fsdp.named_parameters()], (reductions, synced, sorted(dtypes), buffers, summoned, grad_dtypes)


def summon_and_write_back(FSDP, fsdp, sd: dict) -> dict:
    """``summon_full_params``: the names, shapes and values it exposes (against the full state
    dict), then +1 written into every full parameter and read back through a new state dict."""
    from torch.distributed.fsdp import FullStateDictConfig, StateDictType

    with FSDP.summon_full_params(fsdp, writeback=True):
        named = list(fsdp.named_parameters())
        shapes = {n: list(p.shape) for n, p in named}
        value_err = worst(tensor_err(p, sd[n.replace("_fsdp_wrapped_module.", "")]) for n, p in named)
        with torch.no_grad():
            for _, p in named:
                p.add_(1.0)
    with FSDP.state_dict_type(fsdp, StateDictType.FULL_STATE_DICT, FullStateDictConfig(rank0_only=False)):
        after = fsdp.state_dict()
    user_names = {n.replace("_fsdp_wrapped_module.", "") for n in shapes}
    written = worst(tensor_err(after[k] - 1.0, sd[k]) for k in after if after[k].is_floating_point()
                    and k in user_names)
    # writeback=False: torch discards the changes, unless it does not shard (NO_SHARD, world size 1)
    with FSDP.summon_full_params(fsdp, writeback=False):
        with torch.no_grad():
            for _, p in fsdp.named_parameters():
                p.add_(1.0)
    with FSDP.state_dict_type(fsdp, StateDictType.FULL_STATE_DICT, FullStateDictConfig(rank0_only=False)):
        again = fsdp.state_dict()
    persisted = worst(tensor_err(again[k], after[k]) for k in user_names) > 0.5
    return {"shapes": shapes, "value_err": value_err, "writeback_err": written, "no_writeback_persisted": persisted}


def checkpoint_blocks(model, block) -> None:
    """FSDP1's activation-checkpointing idiom: torch's helper, a non-reentrant wrapper per block."""
    import functools

    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl, apply_activation_checkpointing, checkpoint_wrapper)

    apply_activation_checkpointing(
        model, checkpoint_wrapper_fn=functools.partial(checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT),
        check_fn=lambda m: isinstance(m, block))


def reference(model, logits, args: dict):
    if args["ac"]:
        checkpoint_blocks(model, args["block"])
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    losses, norms = [], []
    for step in range(STEPS):
        if args["accum"]:
            x, y = token_batch(100 + step, args["batch"], SMALL.max_seq_len, SMALL.vocab_size, seed=1)
            lm_loss(logits(model(x)), y).backward()
        x, y = token_batch(step, args["batch"], SMALL.max_seq_len, SMALL.vocab_size, seed=1)
        loss = lm_loss(logits(model(x)), y)
        loss.backward()
        if args["clip"]:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05, args["norm_type"])))
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, norms, model.state_dict()


def fsdp_args(strategy: str, prefetch: str, params: str, flags: list[str]) -> dict:
    from torch.distributed.fsdp import BackwardPrefetch, ShardingStrategy

    kwargs = dict(sharding_strategy=ShardingStrategy[strategy.upper()], use_orig_params=params == "orig",
                  backward_prefetch={"pre": BackwardPrefetch.BACKWARD_PRE, "post": BackwardPrefetch.BACKWARD_POST,
                                     "none": None}[prefetch],
                  forward_prefetch="fwd" in flags, limit_all_gathers="nolimit" not in flags)
    if "hybrid" in strategy:  # HYBRID_SHARD and _HYBRID_SHARD_ZERO2: replicated over 2 groups of 2
        from torch.distributed.device_mesh import init_device_mesh

        kwargs["device_mesh"] = init_device_mesh("cpu", (2, dist.get_world_size() // 2),
                                                 mesh_dim_names=("replicate", "shard"))
    return kwargs


def _diff(a: dict, b: dict) -> float:
    missing = [k for k in b if k not in a]
    assert not missing, (missing[:3], list(a))
    return worst(tensor_err(a[k], b[k]) for k in b)


def run_case(case: str) -> dict:
    import graphshard.fsdp
    from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP

    model_name, strategy, prefetch, params, *flags = case.split(":")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch._dynamo.reset()
    per_rank = 2
    args = {"fsdp": fsdp_args(strategy, prefetch, params, flags), "batch": per_rank * world, "clip": "clip" in flags or "clipinf" in flags,
            "norm_type": float("inf") if "clipinf" in flags else 2.0,
            "accum": "accum" in flags, "ignore": next((f for f in flags if f.startswith("ignore")), None),
            "bf16": "bf16" in flags, "klp": "klp" in flags, "cpuonly": "cpuonly" in flags, "summon": "summon" in flags,
            "tiedunits": "tiedunits" in flags, "ac": next((f for f in flags if f in ("acbefore", "acafter")), None),
            "recomputed": []}
    sl = slice(rank * per_rank, (rank + 1) * per_rank)
    base, block, logits = build(model_name, flags)
    args["block"] = block
    if args["ac"] and model_name == "llama":
        # HF's KV cache grows in the forward and again in the recomputation, so torch's own eager
        # checkpoint_wrapper fails on it (a 32-long key against a 16-long mask); HF's own switch
        # turns the cache off (gradient_checkpointing_enable), as AC users must
        base.config.use_cache = False
    ref_losses, ref_norms, ref_sd = reference(copy.deepcopy(base), logits, args)
    out = {"case": case, "lowering": lowering()}
    results = {}
    dump = tempfile.mkdtemp(prefix="fsdp1_graphs_") if args["bf16"] else None
    for name, cls in (("torch", TorchFSDP), ("graphshard", graphshard.fsdp.FullyShardedDataParallel)):
        try:
            losses, norms, sd, names, reductions = train(cls, copy.deepcopy(base), block, logits,
                                                         {**args, "dump_graphs": dump}, sl)
        except Exception as e:  # torch's FSDP1 cannot run every program; say which
            if name == "graphshard":
                raise
            out[f"{name}_error"] = f"{type(e).__name__}: {e}"[:500]
            continue
        results[name] = sd
        out[f"{name}_losses"], out[f"{name}_norms"] = losses, norms
        out[f"{name}_loss_err"] = seq_err(losses, ref_losses)
        out[f"{name}_norm_err"] = seq_err(norms, ref_norms)
        out[f"{name}_param_err"] = _diff(sd, ref_sd)
        out[f"{name}_keys_match"] = list(sd) == list(ref_sd)
        out[f"{name}_names"] = names
        (out[f"{name}_no_sync_reductions"], out[f"{name}_sync_reductions"], out[f"{name}_dtypes"],
         out[f"{name}_buffer_dtypes"], out[f"{name}_summon"], out[f"{name}_grad_dtypes"]) = reductions
        out[f"{name}_sd_dtypes"] = sorted({str(v.dtype) for v in sd.values()})
    if args["ac"]:
        out["graphshard_recomputed_ops"] = args["recomputed"][-1]
    if dump is not None:
        out["graphshard_reduction_dtypes"] = reduction_dtypes(dump)  # MixedPrecision(reduce_dtype=float32)
        shutil.rmtree(dump, ignore_errors=True)
    if args["bf16"] and "torch" in results:
        # the whole effect of bf16 on this program: torch's FSDP1 with and without MixedPrecision.
        # A wrapper that ignored param_dtype would sit that far from torch's bf16 run.
        *_, fp32_sd, _, _ = train(TorchFSDP, copy.deepcopy(base), block, logits, {**args, "bf16": False}, sl)
        out["bf16_effect"] = _diff(results["torch"], fp32_sd)
    if len(results) == 2:
        out["between_param_err"] = _diff(results["graphshard"], results["torch"])
        out["between_loss_err"] = seq_err(out["graphshard_losses"], out["torch_losses"])
        out["between_norm_err"] = seq_err(out["graphshard_norms"], out["torch_norms"])
    return out


if __name__ == "__main__":
    run_cases(sys.argv[1:], run_case)
