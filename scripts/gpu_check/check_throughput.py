"""Section 6: training throughput on one GPU (world 1, NCCL): the benchmark ``Transformer``
(``graphshard.testing.models``; 8 layers, dim 1024) with bf16 parameters and fp32 reduction,
graphshard (``FullyShard`` per block and the root) against FSDP2 (``fully_shard`` per block and the
root, ``MixedPrecisionPolicy(bf16, fp32)``) + ``torch.compile``; AdamW. Tokens per second from
the steady steps (the first two, compile and warm-up, excluded) and peak memory
(``torch.cuda.max_memory_allocated`` over the run, parameters and optimizer state included).
Targets: graphshard >= 1.0x FSDP2's tokens/s and <= 1.0x its peak memory.

Where the time goes: two more steps of each variant under ``torch.profiler``
(``check_training.kernel_profile``: GPU busy fraction, kernel time by kind, top kernels, host
synchronizations), and ``graphshard_whole`` (``regional=False``: one Inductor compile per graph, so
Inductor fuses across the communication steps) when time is left, to tell regional lowering's
share of a gap from the rest.
"""

from __future__ import annotations

GPU = dict(dim=1024, layers=8, heads=16, vocab=32000, seq=2048, batch=4, steps=20)
DRY = dict(dim=64, layers=2, heads=4, vocab=256, seq=32, batch=2, steps=5)
VARIANTS = ["graphshard", "fsdp2_compile", "graphshard_whole"]
MIN_LEFT_S = {"graphshard": 30, "fsdp2_compile": 30, "fsdp2_compile_blocks": 30, "graphshard_whole": 35}
PROFILE_STEPS = 2
TARGETS = {"tokens_per_s": 1.0, "peak_mib": 1.0}  # graphshard / FSDP2: at least, at most


def run(res, dry: bool) -> None:
    import torch
    from torch.distributed.device_mesh import init_device_mesh

    from check_common import device, init_world1
    from check_training import run_variants
    from graphshard.testing.models import Transformer, TransformerConfig, lm_loss, token_batch

    cfg = DRY if dry else GPU
    dev = device(dry)
    init_world1(dry)
    mesh = init_device_mesh(dev.type, (1,), mesh_dim_names=("dp",))
    tcfg = TransformerConfig(vocab_size=cfg["vocab"], dim=cfg["dim"], n_layers=cfg["layers"], n_heads=cfg["heads"],
                             max_seq_len=cfg["seq"])
    torch.manual_seed(0)
    base = Transformer(tcfg)
    n_params = sum(p.numel() for p in base.parameters())
    tokens = cfg["batch"] * cfg["seq"]
    res.fig(config=cfg, params=n_params, tokens_per_step=tokens)
    res.line(f"Transformer: {cfg['layers']} layers, dim {cfg['dim']}, {cfg['heads']} heads, vocab {cfg['vocab']} "
             f"(tied embeddings; {n_params / 1e6:.1f} M parameters); batch {cfg['batch']} x seq {cfg['seq']} = "
             f"{tokens} tokens/step; {cfg['steps']} steps, the first 2 excluded; bf16 parameters, fp32 reduction; "
             f"world 1 ({'gloo' if dry else 'NCCL'}).")
    batches = [tuple(t.to(dev) for t in token_batch(i, cfg["batch"], cfg["seq"], cfg["vocab"]))
               for i in range(cfg["steps"])]

    autocast = _bf16_forward_fails(Transformer, TransformerConfig, dev)
    res.fig(autocast=bool(autocast))
    if autocast:
        res.line(f"- NOTE: the Transformer's forward fails with bf16 parameters ({autocast}): its attention adds an "
                 "fp32 mask to bf16 scores (promoted to fp32) and multiplies the result by bf16 values. Both variants "
                 "therefore run their forward under torch.autocast(bf16), which casts the matmul's inputs.")

    def loss_of(module, i):
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=bool(autocast)):
            logits = module(batches[i][0])
        return lm_loss(logits.float(), batches[i][1])

    run_variants(res, VARIANTS, base, dev, mesh, "layers.*", lambda m: list(m.layers), loss_of, cfg["steps"], 1e-4,
                 {k: (v * 3 if dry else v) for k, v in MIN_LEFT_S.items()}, lambda recs: summarize(res, recs, tokens),
                 profile_steps=PROFILE_STEPS)


def summarize(res, recs: dict, tokens: int) -> None:
    """Tokens/s and peak memory of each variant, graphshard's ratios to FSDP2 (rewritten after each variant)."""
    from check_common import fmt, table_lines
    from check_training import compiled_fsdp2, loss_gap, profile_lines, ratio

    for r in recs.values():
        r["tokens_per_s"] = tokens / r["steady_step_s"] if r["steady_step_s"] else None
    lines = table_lines(["variant", "first step s", "steady s/step", "tokens/s", "peak MiB"],
                        [[k, fmt(r["first_step_s"], 2), fmt(r["steady_step_s"], 4), fmt(r["tokens_per_s"], 0),
                          fmt(r.get("peak_mib"), 0)] for k, r in recs.items()])
    peer = compiled_fsdp2(recs)
    if "graphshard" in recs and peer:
        g, f = recs["graphshard"], recs[peer]
        ratios = {"tokens_per_s": ratio(g["tokens_per_s"], f["tokens_per_s"]),
                  "peak_mib": ratio(g.get("peak_mib"), f.get("peak_mib"))}
        res.fig(ratios=ratios, loss_gap=loss_gap(g, f), peer=peer)
        lines += [f"- graphshard / {peer}: tokens/s {fmt(ratios['tokens_per_s'])} (target >= "
                  f"{TARGETS['tokens_per_s']}: {_met(ratios['tokens_per_s'], TARGETS['tokens_per_s'], True)}), "
                  f"peak memory {fmt(ratios['peak_mib'])} (target <= {TARGETS['peak_mib']}: "
                  f"{_met(ratios['peak_mib'], TARGETS['peak_mib'], False)})",
                  f"- max |loss diff| graphshard vs {peer} over the {len(g['losses'])} steps: {loss_gap(g, f):.3e} "
                  "(both bf16: a sanity check that they trained the same model)"]
        if "graphshard_whole" in recs:
            w = recs["graphshard_whole"]
            res.fig(whole_ratio=ratio(w["tokens_per_s"], f["tokens_per_s"]))
            lines.append(f"- graphshard_whole (regional=False) / {peer}: tokens/s "
                         f"{fmt(ratio(w['tokens_per_s'], f['tokens_per_s']))}; max |loss diff| vs graphshard "
                         f"{loss_gap(w, g):.3e}")
    lines += [""] + profile_lines(recs)
    res.fig(variants=recs)
    res.block("summary", lines)


def _met(value, target, at_least: bool) -> str:
    if value is None:
        return "n/a"
    return "met" if (value >= target if at_least else value <= target) else "NOT met"


def _bf16_forward_fails(Transformer, TransformerConfig, dev) -> str | None:
    """Why a tiny copy of the model fails in bf16 (what FullyShard(param_dtype=bf16) computes in), or None."""
    import torch

    tiny = Transformer(TransformerConfig(vocab_size=16, dim=8, n_layers=1, n_heads=2, max_seq_len=4))
    try:
        with torch.no_grad():
            tiny.to(dev, torch.bfloat16)(torch.zeros(1, 4, dtype=torch.long, device=dev))
    except RuntimeError as e:
        return f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
    return None
