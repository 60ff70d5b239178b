"""Section 4: HF ``LlamaForCausalLM`` (built from a ``LlamaConfig`` in code, no download) under
graphshard's ``FullyShard`` against torch's ``fully_shard``, both with bf16 parameters and fp32
gradient reduction, world 1 NCCL (gloo in the dry run), AdamW, the same initial weights and batches:

* ``graphshard``    ``Plan(mesh, {"model.layers.*": FullyShard(bf16, fp32), "": FullyShard(bf16, fp32)})``
                    + ``graphshard.compile`` (the plan tests/workers/coverage.py writes for HF models:
                    one unit per decoder layer, the root owns the rest);
* ``fsdp2_eager``   ``fully_shard`` on each decoder layer and the root, ``MixedPrecisionPolicy(bf16, fp32)``;
* ``fsdp2_compile`` the same, then ``torch.compile`` of the root (where that fails: each layer compiled
                    before ``fully_shard``, ``fsdp2_compile_blocks``), if time allows;
* ``fp32``          the unsharded model in fp32, eager: the single-process reference.

Reported: per-step losses, the largest |loss difference| between the two bf16 programs and of each
against the fp32 reference (the bf16 effect, measured), steady step times and their ratio. The KV
cache is off (``use_cache=False``) for every variant: training, and nothing for the compilers to trace.
"""

from __future__ import annotations

GPU = dict(hidden_size=1024, num_hidden_layers=4, num_attention_heads=16, num_key_value_heads=16,
           intermediate_size=2816, vocab_size=32000, seq=1024, batch=4, steps=6)
DRY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
           intermediate_size=128, vocab_size=256, seq=32, batch=2, steps=6)
LR = 1e-4
VARIANTS = ["fp32", "graphshard", "fsdp2_eager", "fsdp2_compile"]  # cheap first: a kill loses the least
MIN_LEFT_S = {"graphshard": 30, "fsdp2_eager": 10, "fsdp2_compile": 30, "fsdp2_compile_blocks": 30}  # x3 dry


def build_llama(cfg: dict):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**{k: v for k, v in cfg.items() if k not in ("seq", "batch", "steps")},
                         max_position_embeddings=max(cfg["seq"], 128), use_cache=False, attention_dropout=0.0,
                         pad_token_id=0, bos_token_id=1, eos_token_id=2)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    model.train()
    return model


def run(res, dry: bool) -> None:
    import torch
    from torch.distributed.device_mesh import init_device_mesh

    from check_common import device, init_world1
    from check_training import compiled_fsdp2, loss_gap, run_variants

    cfg = DRY if dry else GPU
    dev = device(dry)
    init_world1(dry)
    mesh = init_device_mesh(dev.type, (1,), mesh_dim_names=("dp",))
    base = build_llama(cfg)
    n_params = sum(p.numel() for p in base.parameters())
    res.fig(config=cfg, params=n_params)
    res.line(f"LlamaForCausalLM: {cfg['num_hidden_layers']} layers, hidden {cfg['hidden_size']}, "
             f"{cfg['num_attention_heads']} heads, intermediate {cfg['intermediate_size']}, vocab {cfg['vocab_size']} "
             f"({n_params / 1e6:.1f} M parameters); batch {cfg['batch']} x seq {cfg['seq']}; AdamW lr {LR}; "
             f"{cfg['steps']} steps; world 1 ({'gloo' if dry else 'NCCL'}); bf16 parameters, fp32 reduction.")
    gen = torch.Generator().manual_seed(1)
    batches = [torch.randint(3, cfg["vocab_size"], (cfg["batch"], cfg["seq"]), generator=gen).to(dev)
               for _ in range(cfg["steps"])]

    def loss_of(module, i):
        return module(input_ids=batches[i], labels=batches[i], use_cache=False).loss

    recs = run_variants(res, VARIANTS, base, dev, mesh, "model.layers.*", lambda m: list(m.model.layers), loss_of,
                        cfg["steps"], LR, {k: (v * 3 if dry else v) for k, v in MIN_LEFT_S.items()},
                        lambda recs: summarize(res, recs))
    peer = compiled_fsdp2(recs) or ("fsdp2_eager" if "fsdp2_eager" in recs else None)
    if peer and "graphshard" in recs and "fp32" in recs:
        gap, own = loss_gap(recs["graphshard"], recs[peer]), loss_gap(recs[peer], recs["fp32"])
        bound = 2 * max(own, 1e-3)
        res.check(f"graphshard's losses are as close to {peer}'s as twice {peer}'s own distance from fp32 "
                  "(at least 2e-3)", gap <= bound, f"{gap:.2e} vs bound {bound:.2e}")


def summarize(res, recs: dict) -> None:
    """Losses side by side, their largest differences, step times and ratios (rewritten after each variant)."""
    from check_common import fmt, table_lines
    from check_training import loss_gap, loss_table, ratio

    names = list(recs)
    gaps = {f"{a} vs {b}": loss_gap(recs[a], recs[b]) for i, a in enumerate(names) for b in names[i + 1:]
            if "fp32" not in a}
    gaps.update({f"{a} vs fp32": loss_gap(recs[a], recs["fp32"]) for a in names if a != "fp32" and "fp32" in recs})
    lines = ["Per-step loss:"] + loss_table(recs) + [f"- max |loss diff| {k}: {v:.3e}" for k, v in gaps.items()]
    lines += table_lines(["variant", "first step s", "steady s/step", "peak MiB"],
                         [[k, fmt(r["first_step_s"], 2), fmt(r["steady_step_s"], 4), fmt(r.get("peak_mib"), 0)]
                          for k, r in recs.items()])
    ratios = {peer: ratio(recs["graphshard"]["steady_step_s"], recs[peer]["steady_step_s"])
              for peer in names if peer.startswith("fsdp2") and "graphshard" in recs}
    lines += [f"- steady step time graphshard / {peer}: {fmt(r)}" for peer, r in ratios.items()]
    res.fig(loss_gaps=gaps, step_ratios=ratios)
    res.block("summary", lines)
