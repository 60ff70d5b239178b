"""Third-party architectures for the model-coverage suite: HF transformers models built
from tiny configs (no weights, no downloads), with HF's defaults left as users leave
them (the KV cache on), and the plans a user would write for each.

Every architecture is a name -> `Arch`: how to build it, what a batch looks like, and
which tensor-parallel plan applies (the Llama-style names, a written plan, or none).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

VOCAB, SEQ = 128, 8
# Small enough to compile fast, large enough that every dim a plan shards divides by 2.
TINY = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
            pad_token_id=0, bos_token_id=1, eos_token_id=2)  # special ids inside the tiny vocabulary
# Dropout off: a multi-rank run is compared with one process; the RNG rule has its own test.
NO_DROPOUT = ("attention_dropout", "hidden_dropout", "embd_pdrop", "resid_pdrop", "attn_pdrop",
              "hidden_dropout_prob", "attention_probs_dropout_prob", "dropout_rate", "dropout",
              "classifier_dropout", "activation_dropout", "summary_first_dropout", "ffn_dropout")

# The Llama-style tensor-parallel plan: column-parallel q/k/v and gate/up, row-parallel o/down.
ATTN_TP = {"**.self_attn.q_proj": "col", "**.self_attn.k_proj": "col", "**.self_attn.v_proj": "col",
           "**.self_attn.o_proj": "row"}
MLP_TP = {"**.mlp.gate_proj": "col", "**.mlp.up_proj": "col", "**.mlp.down_proj": "row"}
LLAMA_TP = {**ATTN_TP, **MLP_TP}
# A mixture of experts' experts (3-D weights, gate | up fused): the intermediate dim over the ranks.
EXPERTS_TP = {"**.mlp.experts": "experts"}


@dataclass(frozen=True)
class Arch:
    model_type: str
    task: str = "causal_lm"                 # causal_lm | masked_lm | seq2seq | image
    overrides: dict = field(default_factory=dict)
    tp: dict | None = None                  # FQN glob -> "col" | "row" (None: no TP plan for it)
    fsdp_tp: bool = False                   # also run FSDP + TP on a 2x2 mesh
    attn: str = "sdpa"                      # HF's attention implementation ("eager" where HF has no SDPA)


ARCHS: dict[str, Arch] = {
    "llama": Arch("llama", tp=LLAMA_TP, fsdp_tp=True),
    "mistral": Arch("mistral", tp=LLAMA_TP, fsdp_tp=True),
    "qwen2": Arch("qwen2", tp=LLAMA_TP, fsdp_tp=True),
    "qwen3": Arch("qwen3", tp=LLAMA_TP, fsdp_tp=True),
    "gemma": Arch("gemma", tp=LLAMA_TP, fsdp_tp=True),
    "gemma2": Arch("gemma2", tp=LLAMA_TP, fsdp_tp=True, attn="eager"),  # HF's default for Gemma2 (softcapping)
    "gemma3": Arch("gemma3_text", overrides=dict(sliding_window=4), tp=LLAMA_TP, fsdp_tp=True),
    "olmo2": Arch("olmo2", tp=LLAMA_TP, fsdp_tp=True),
    "granite": Arch("granite", tp=LLAMA_TP, fsdp_tp=True),
    "stablelm": Arch("stablelm", overrides=dict(num_key_value_heads=4), tp=LLAMA_TP, fsdp_tp=True),
    "smollm3": Arch("smollm3", tp=LLAMA_TP, fsdp_tp=True),
    # phi3's q/k/v and gate/up projections are fused and left whole: the row-parallel layers get the whole
    # activation on every rank (input_layouts=Replicate(); torch's default Shard(-1) would read it as a piece)
    "phi3": Arch("phi3", tp={"**.self_attn.o_proj": "row_rep", "**.mlp.down_proj": "row_rep"}),
    "mixtral": Arch("mixtral", overrides=dict(num_local_experts=4, num_experts_per_tok=2),
                    tp={**ATTN_TP, **EXPERTS_TP}, fsdp_tp=True),
    "qwen2_moe": Arch("qwen2_moe", overrides=dict(num_experts=4, num_experts_per_tok=2,
                                                  moe_intermediate_size=32, shared_expert_intermediate_size=32),
                      tp={**ATTN_TP, **EXPERTS_TP, **{k.replace("mlp.", "mlp.shared_expert."): v
                                                      for k, v in MLP_TP.items()}}),
    "gpt2": Arch("gpt2", overrides=dict(n_embd=32, n_layer=2, n_head=4, n_positions=64, n_inner=64),
                 tp={"transformer.h.*.attn.c_attn": "conv1d_qkv", "transformer.h.*.attn.c_proj": "conv1d_row",
                     "transformer.h.*.mlp.c_fc": "conv1d_col", "transformer.h.*.mlp.c_proj": "conv1d_row"}),
    "gpt_neox": Arch("gpt_neox", overrides=dict(rotary_pct=0.5)),
    "phi": Arch("phi"),
    "opt": Arch("opt", overrides=dict(ffn_dim=64, word_embed_proj_dim=32)),
    "bloom": Arch("bloom", overrides=dict(n_layer=2, n_head=4), attn="eager"),  # HF has no SDPA for Bloom
    "falcon": Arch("falcon", overrides=dict(new_decoder_architecture=True, num_kv_heads=2)),
    "starcoder2": Arch("starcoder2"),
    "bert": Arch("bert", task="masked_lm"),
    "roberta": Arch("roberta", task="masked_lm", overrides=dict(max_position_embeddings=66)),
    "t5": Arch("t5", task="seq2seq", overrides=dict(d_model=32, d_kv=8, d_ff=64, num_layers=2,
                                                    num_decoder_layers=2, num_heads=4,
                                                    decoder_start_token_id=0)),  # T5's own value; no default in transformers 5
    # problem_type: HF's classification loss sets it on its first call, a config change that makes
    # any torch.compile recompile once; set as it would be, so the first step's graph is the last.
    "vit": Arch("vit", task="image", overrides=dict(image_size=16, patch_size=4, num_channels=3,
                                                    num_labels=5, problem_type="single_label_classification")),
}


def config_for(name: str, layers: int | None = None):
    """The architecture's tiny config; ``layers``: that many blocks instead of TINY's 2."""
    from transformers import AutoConfig

    arch = ARCHS[name]
    kwargs = {**TINY, **arch.overrides, **({"num_hidden_layers": layers} if layers else {})}
    cls = type(AutoConfig.for_model(arch.model_type))
    # Sizes a config derives (Falcon's head_dim is a read-only property) are left to it.
    kwargs = {k: v for k, v in kwargs.items()
              if not (isinstance(getattr(cls, k, None), property) and getattr(cls, k).fset is None)}
    cfg = AutoConfig.for_model(arch.model_type, **kwargs)
    for attr in NO_DROPOUT:
        if isinstance(getattr(cfg, attr, None), float):
            setattr(cfg, attr, 0.0)
    if hasattr(cfg, "layer_types") and cfg.layer_types is not None and len(cfg.layer_types) != cfg.num_hidden_layers:
        cfg.layer_types = cfg.layer_types[: cfg.num_hidden_layers]
    cfg._attn_implementation = arch.attn
    return cfg


def build(name: str, seed: int = 0, layers: int | None = None) -> torch.nn.Module:
    import transformers as tf

    arch = ARCHS[name]
    cfg = config_for(name, layers)
    auto = {"causal_lm": tf.AutoModelForCausalLM, "masked_lm": tf.AutoModelForMaskedLM,
            "seq2seq": tf.AutoModelForSeq2SeqLM, "image": tf.AutoModelForImageClassification}[arch.task]
    torch.manual_seed(seed)
    model = auto.from_config(cfg)
    model.train()
    return model


def batch(name: str, step: int, n: int) -> dict:
    """Inputs for ``n`` samples of step ``step``: the same on every rank, each takes its slice."""
    arch = ARCHS[name]
    g = torch.Generator().manual_seed(1000 + step)
    if arch.task == "image":
        cfg = config_for(name)
        return {"pixel_values": torch.randn(n, cfg.num_channels, cfg.image_size, cfg.image_size, generator=g),
                "labels": torch.randint(0, cfg.num_labels, (n,), generator=g)}
    ids = torch.randint(3, VOCAB, (n, SEQ), generator=g)
    if arch.task == "seq2seq":
        return {"input_ids": ids, "labels": torch.randint(3, VOCAB, (n, SEQ), generator=g)}
    if arch.task == "masked_lm":
        labels = torch.full_like(ids, -100)
        labels[:, ::2] = ids[:, ::2]  # the same count of labelled tokens in every sample
        return {"input_ids": ids, "labels": labels}
    return {"input_ids": ids, "labels": ids}


def unit_fqns(model: torch.nn.Module) -> list[str]:
    """FSDP units as users write them: each module whose class is in ``_no_split_modules``."""
    classes = set(getattr(model, "_no_split_modules", None) or [])
    return [fqn for fqn, m in model.named_modules() if fqn and type(m).__name__ in classes]


def tp_styles(name: str, styles) -> dict:
    """The architecture's tensor-parallel plan in ``styles``' classes (graphshard's or torch's)."""
    out = {}
    for glob, kind in (ARCHS[name].tp or {}).items():
        if kind == "col":
            out[glob] = styles.ColwiseParallel()
        elif kind == "row":
            out[glob] = styles.RowwiseParallel()
        elif kind == "row_rep":  # the input is whole on every rank: each rank takes its piece of it
            from torch.distributed.tensor import Replicate

            out[glob] = styles.RowwiseParallel(input_layouts=Replicate())
        elif kind == "experts":
            out[glob] = experts_style()
        else:  # GPT-2's Conv1D keeps its weight as (in, out): column-parallel shards dim 1
            out[glob] = conv1d_style(kind)
    return out


def conv1d_style(kind: str):
    """GPT-2's ``Conv1D`` (``x @ weight + bias``, weight stored (in, out)) as ``ShardParams``:
    column-parallel shards the weight's dim 1 and the bias, row-parallel the weight's dim 0.
    The fused ``c_attn`` (q | k | v side by side) is column-parallel over its three blocks."""
    from torch.distributed.tensor import Shard

    import graphshard

    if kind == "conv1d_qkv":
        return graphshard.ShardParams("tp", weight=graphshard.StridedShard(1, 3), bias=graphshard.StridedShard(0, 3))
    if kind == "conv1d_col":
        return graphshard.ShardParams("tp", weight=Shard(1), bias=Shard(0))
    return graphshard.ShardParams("tp", weight=Shard(0))


def experts_style():
    """HF's fused experts (``gate_up_proj`` (E, 2 * I, D) = gate | up, ``down_proj`` (E, D, I)):
    column-parallel over the two blocks of ``gate_up_proj``, row-parallel ``down_proj``."""
    from torch.distributed.tensor import Shard

    import graphshard

    return graphshard.ShardParams("tp", gate_up_proj=graphshard.StridedShard(1, 2), down_proj=Shard(2))


def loss_of(out) -> torch.Tensor:
    return out.loss if hasattr(out, "loss") else out[0]


Strategy = Callable
