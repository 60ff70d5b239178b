"""One FSDP benchmark run: launched by ``bench_fsdp.py`` as
``torchrun --standalone --nproc-per-node N benchmarks/_fsdp_worker.py --variant X --layers L --out F``.

Builds the reference `Transformer` with the same seed on every rank, shards it
the way the variant says, trains ``1 + warmup + steps`` AdamW steps on the
rank's slice of the deterministic global batch, measures one more step for
memory, gathers per-rank figures to rank 0 and writes them to ``--out`` as JSON.

Variants (see `VARIANTS`):

* ``fsdp2``                 ``fully_shard`` on every block, then the root; eager.
* ``fsdp2_compile_root``    as ``fsdp2``, then ``torch.compile`` of the sharded root.
* ``fsdp2_compile_blocks``  ``block.compile()`` on every block, then ``fully_shard`` (torchtitan's recipe; torch's
                            "regional compilation" recipe: identical blocks share one compiled artifact).
* ``fsdp2_nested``          ``fully_shard`` on every block and the root, each block's forward marked
                            ``torch.compiler.nested_compile_region``, then ``torch.compile`` of the root (torch's
                            hierarchical compilation: one region compiled, stamped out for every block).
* ``fsdp1``                 ``FullyShardedDataParallel``, one unit per block, ``use_orig_params=True``.
* ``fsdp1_flat``            the same with ``use_orig_params=False`` (flat parameters).
* ``gs_fsdp1`` / ``gs_fsdp1_flat``  the same two programs with ``graphshard.fsdp.FullyShardedDataParallel``.
* ``fsdp1_flat_fwd`` / ``gs_fsdp1_flat_fwd``  the flat programs with ``forward_prefetch=True``.
* ``graphshard_flat``       ``graphshard.compile`` with ``FullyShard(flat_params=True)``: the Plan ``gs_fsdp1_flat`` builds.
* ``graphshard_eq`` / ``graphshard_eq_flat``  ``graphshard`` / ``graphshard_flat`` with the scheduling FSDP1's defaults
                            map to (``forward_prefetch=False``): the exact program ``gs_fsdp1`` / ``gs_fsdp1_flat`` compile.
* ``graphshard``            ``graphshard.compile(model, Plan(mesh, {"layers.*": FullyShard(), "": FullyShard()}))``.
* ``graphshard_flat_trace`` ``graphshard`` with ``trace_once=False``: every block traced, differentiated and
                            partitioned in line (the default traces each distinct repeated block once,
                            ``graphshard.compiler.outline``).
* ``graphshard_uncached``   ``graphshard`` with ``program_cache=False``: a second process (``--warm-start``)
                            differentiates, partitions and lowers again (Inductor's kernels still
                            come from its cache); by default it loads the lowered programs from
                            torch's AOTAutogradCache.
* ``graphshard_post``       the same with ``backward_prefetch="post"``: a unit's backward all-gather issued after
                            the next unit's gradient computation, so under AC after its recomputation too.
* ``graphshard_nccl``       the same with ``Plan(collectives="nccl")``: on gloo, the collectives a GPU run issues
                            (the unit's gather packed into its own slot and gathered in place).
* ``graphshard_comm``       graphshard's collectives of one step alone, no compute (`build_graphshard_comm`).
* ``graphshard_auto``       ``graphshard.compile`` with ``graphshard.auto_plan``'s plan (``--auto-budget-mib``).
* ``local_compile``         no sharding and no communication: an unsharded ``torch.compile``'d copy per rank.

Activation checkpointing (``--ac full|selective``) is applied to the model's blocks before any
variant shards or compiles it, the same way for every variant (`apply_ac`): torch's
``apply_activation_checkpointing`` with a non-reentrant ``checkpoint_wrapper`` on every `Block`
(``selective``: a policy that saves the outputs of the matmuls and recomputes the rest). Each
``layers[i]`` is then the ``CheckpointWrapper``, which is what ``fully_shard``, ``block.compile()``
and graphshard's ``"layers.*"`` rule get (torchtitan's order: AC, compile, fully_shard).

``--model llama`` runs the same variants on an HF ``LlamaForCausalLM`` built from a config (no
weights), its ``model.layers[i]`` (``LlamaDecoderLayer``) in the role of the blocks.

A variant that cannot be built here (graphshard without ``compile``) raises
`Unavailable`; the run then reports ``status: unavailable`` and exits cleanly.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import time
from typing import Callable

import torch
from torch.distributed.device_mesh import init_device_mesh

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402

from graphshard.testing.models import Transformer, TransformerConfig, lm_loss, token_batch  # noqa: E402

StepFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]



AC_MODES = ("none", "full", "selective")

SELECTIVE_SAVE = ("mm", "addmm", "bmm")
"""``--ac selective`` saves the outputs of these ATen ops and recomputes every other op
(torchtitan's "op" mode; on this model the same ops as ``graphshard.checkpointing.MATMULS_AND_ATTENTION``
finds: it has no attention kernel or ``baddbmm``)."""


def _save_matmuls(ctx, op, *args, **kwargs):
    from torch.utils.checkpoint import CheckpointPolicy

    aten = torch.ops.aten
    save = {getattr(aten, n) for n in SELECTIVE_SAVE}
    packet = getattr(op, "overloadpacket", op)
    return CheckpointPolicy.MUST_SAVE if packet in save else CheckpointPolicy.PREFER_RECOMPUTE


def apply_ac(model: torch.nn.Module, mode: str) -> None:
    """Activation checkpointing of every `Block` with torch's own wrapper (non-reentrant),
    before any variant shards or compiles the model: ``full`` recomputes the whole block in the
    backward, ``selective`` saves what `SELECTIVE_SAVE` names and recomputes the rest."""
    if mode == "none":
        return
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl, apply_activation_checkpointing, checkpoint_wrapper)
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    blocks = blocks_of(model)[1]
    block_type = type(blocks[0])
    kw = {}
    if mode == "selective":
        kw["context_fn"] = functools.partial(create_selective_checkpoint_contexts, _save_matmuls)
    apply_activation_checkpointing(
        model, checkpoint_wrapper_fn=functools.partial(checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT,
                                                       **kw),
        check_fn=lambda m: isinstance(m, block_type))
    wrapped = sum(type(m).__name__ == "CheckpointWrapper" for m in model.modules())
    if wrapped != len(blocks):
        raise RuntimeError(f"--ac {mode}: {wrapped} CheckpointWrappers for {len(blocks)} blocks")


FORWARD_MARK = "forward"
"""`_common.mark_region` name of a step's forward + loss: the live bytes at its end are what the
forward leaves for the backward."""

DEVICE = [None]
"""The run's device (for `_common.mark_region` on GPU)."""

OPT_TIMES: list[float] = []
"""Seconds of each ``opt.step()`` + ``zero_grad`` (the optimizer's share of a step)."""


def _make_step(module: Callable, params, lr: float) -> StepFn:
    """One training step: forward, loss, backward, AdamW step, zero_grad(set_to_none)."""
    opt = torch.optim.AdamW(params, lr=lr)

    def step(tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        with C.mark_region(FORWARD_MARK, DEVICE[0]):
            out = module(tokens)
            loss = lm_loss(getattr(out, "logits", out), targets)
        loss.backward()
        t0 = time.perf_counter()
        opt.step()
        opt.zero_grad(set_to_none=True)
        OPT_TIMES.append(time.perf_counter() - t0)
        return loss.detach()

    return step


def blocks_of(model: torch.nn.Module) -> tuple[str, torch.nn.ModuleList]:
    """The model's repeated blocks and their container's FQN: ``layers`` of the benchmark
    `Transformer`, ``model.layers`` of an HF causal LM."""
    inner = getattr(model, "model", None)
    if isinstance(getattr(inner, "layers", None), torch.nn.ModuleList):
        return "model.layers", inner.layers
    return "layers", model.layers


def build_fsdp2(model, mesh, lr, *, compile_root=False, compile_blocks=False, nested=False) -> StepFn:
    from torch.distributed.fsdp import fully_shard

    blocks = blocks_of(model)[1]
    if nested:  # on the block's class (the mark takes a function, not a bound method); this process only
        cls = type(blocks[0])
        cls.forward = torch.compiler.nested_compile_region(cls.forward)
    for block in blocks:
        if compile_blocks:
            block.compile()
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    module = torch.compile(model) if compile_root or nested else model
    return _make_step(module, model.parameters(), lr)


def build_fsdp1(model, mesh, lr, *, use_orig_params=True, graphshard_fsdp=False, forward_prefetch=False) -> StepFn:
    """FSDP1's program, one unit per block; with ``graphshard_fsdp`` the same lines with
    ``graphshard.fsdp.FullyShardedDataParallel`` (the only difference)."""
    if graphshard_fsdp:
        from graphshard.fsdp import FullyShardedDataParallel as FSDP
    else:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    dev = mesh.device_type
    fsdp = FSDP(
        model,
        auto_wrap_policy=ModuleWrapPolicy({type(blocks_of(model)[1][0])}),
        use_orig_params=use_orig_params,
        forward_prefetch=forward_prefetch,
        # An explicit CPU device_id is FSDP1's (only) way to run without an accelerator.
        device_id=torch.device(dev, torch.cuda.current_device()) if dev == "cuda" else torch.device("cpu"),
    )
    return _make_step(fsdp, fsdp.parameters(), lr)


def _graphshard_plan(mesh, blocks: str = "layers", plan_kwargs=None, **spec):
    """FullyShard on every block (``<blocks>.*``, see `blocks_of`) and the root."""
    try:
        import graphshard
    except Exception as e:  # noqa: BLE001
        raise C.Unavailable(f"import graphshard failed: {e!r}") from e
    return graphshard, graphshard.Plan(mesh, {f"{blocks}.*": graphshard.FullyShard(**spec),
                                              "": graphshard.FullyShard(**spec)}, **(plan_kwargs or {}))


FSDP1_DEFAULTS = dict(forward_prefetch=False, backward_prefetch="pre", limit_all_gathers=2)
"""The compile settings FSDP1's defaults map to (what graphshard.fsdp compiles with)."""


def build_graphshard(model, mesh, lr, compile_kwargs=None, plan_kwargs=None, **spec) -> StepFn:
    graphshard, plan = _graphshard_plan(mesh, blocks_of(model)[0], plan_kwargs, **spec)
    graphshard.compile(model, plan, **(compile_kwargs or {}))
    return _make_step(model, model.parameters(), lr)


def build_graphshard_comm(model, mesh, lr) -> StepFn:
    """graphshard's collectives of one training step and nothing else, one after another,
    through the ops its compiled step runs: every unit's all-gather (forward), the re-gather
    of the units it reshards (backward; not the root) and every unit's gradient reduction.
    On a CPU machine the ranks' transfers run on the cores that compute, so this run's CPU
    seconds per step are what communication takes from any sharded step."""
    graphshard, plan = _graphshard_plan(mesh, blocks_of(model)[0])
    from graphshard.ops.dense import gather_params, reduce_grads

    graphshard.shard(model, plan)
    state = model._graphshard
    units = []
    for unit, keys in state.units.items():
        infos = [state.params[k] for k in keys]
        if infos and infos[0].shard is not None:
            shards = [model.get_parameter(info.fqn).to_local() for info in infos]
            grads = [torch.zeros(info.dp_full_shape, dtype=info.reduce_dtype, device=shards[0].device)
                     for info in infos]
            units.append((unit, infos, shards, grads))

    def step(tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            for _, infos, shards, _ in units:
                gather_params(shards, infos)
            for unit, infos, shards, grads in reversed(units):
                if infos[0].reshard_after_forward:
                    gather_params(shards, infos)
                reduce_grads(grads, infos)
        return torch.zeros(())

    return step


AUTO: dict = {}
"""``graphshard_auto``: the example batch and the memory budget ``run`` gives ``auto_plan``."""


def build_graphshard_auto(model, mesh, lr) -> StepFn:
    """``graphshard.compile`` with the plan ``graphshard.auto_plan`` picks in ``--auto-budget-mib``
    (default: no limit; AdamW's two states counted)."""
    import graphshard

    plan = graphshard.auto_plan(model, mesh, memory_budget=AUTO["budget"], batch=AUTO["batch"], optimizer_states=2)
    AUTO["plan"] = {k: type(v).__name__ for k, v in plan.rules.items()}
    graphshard.compile(model, plan)
    return _make_step(model, model.parameters(), lr)


def build_local_compile(model, mesh, lr) -> StepFn:
    """No sharding and no communication: each rank trains its own copy, torch.compile'd, on its
    own rows. Run with N ranks, it is the compute floor of a machine shared by N ranks."""
    return _make_step(torch.compile(model), model.parameters(), lr)


VARIANTS: dict[str, Callable[..., StepFn]] = {
    "fsdp2": build_fsdp2,
    "fsdp2_compile_root": lambda m, mesh, lr: build_fsdp2(m, mesh, lr, compile_root=True),
    "fsdp2_compile_blocks": lambda m, mesh, lr: build_fsdp2(m, mesh, lr, compile_blocks=True),
    "fsdp2_nested": lambda m, mesh, lr: build_fsdp2(m, mesh, lr, nested=True),
    "fsdp1": build_fsdp1,
    "fsdp1_flat": lambda m, mesh, lr: build_fsdp1(m, mesh, lr, use_orig_params=False),
    "gs_fsdp1": lambda m, mesh, lr: build_fsdp1(m, mesh, lr, graphshard_fsdp=True),
    "gs_fsdp1_flat": lambda m, mesh, lr: build_fsdp1(m, mesh, lr, use_orig_params=False, graphshard_fsdp=True),
    "fsdp1_flat_fwd": lambda m, mesh, lr: build_fsdp1(m, mesh, lr, use_orig_params=False, forward_prefetch=True),
    "gs_fsdp1_flat_fwd": lambda m, mesh, lr: build_fsdp1(m, mesh, lr, use_orig_params=False, graphshard_fsdp=True,
                                                         forward_prefetch=True),
    "graphshard": build_graphshard,
    "graphshard_flat": lambda m, mesh, lr: build_graphshard(m, mesh, lr, flat_params=True),
    "graphshard_eq": lambda m, mesh, lr: build_graphshard(m, mesh, lr, FSDP1_DEFAULTS),
    "graphshard_eq_flat": lambda m, mesh, lr: build_graphshard(m, mesh, lr, FSDP1_DEFAULTS, flat_params=True),
    "graphshard_post": lambda m, mesh, lr: build_graphshard(m, mesh, lr, dict(backward_prefetch="post")),
    "graphshard_nccl": lambda m, mesh, lr: build_graphshard(m, mesh, lr, plan_kwargs=dict(collectives="nccl")),
    "graphshard_flat_trace": lambda m, mesh, lr: build_graphshard(m, mesh, lr, dict(trace_once=False)),
    "graphshard_uncached": lambda m, mesh, lr: build_graphshard(m, mesh, lr, dict(program_cache=False)),
    "graphshard_fast": lambda m, mesh, lr: build_graphshard(m, mesh, lr, dict(batch_cpp_kernels=True, fast_isa_check=True)),
    "graphshard_comm": build_graphshard_comm,
    "graphshard_auto": build_graphshard_auto,
    "local_compile": build_local_compile,
}


MODELS = ("transformer", "llama")


def build_model(args) -> torch.nn.Module:
    """``--model``: the benchmark `Transformer`, or an HF Llama of the same sizes (4 heads, an MLP
    of 4 x dim, RoPE, RMSNorm), built from a config with random weights."""
    if args.model == "transformer":
        cfg = TransformerConfig(vocab_size=args.vocab, dim=args.dim, n_layers=args.layers, n_heads=4,
                                max_seq_len=args.seq)
        return Transformer(cfg)
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=args.vocab, hidden_size=args.dim, intermediate_size=4 * args.dim,
                      num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=4,
                      max_position_embeddings=args.seq, tie_word_embeddings=False, use_cache=False)
    cfg._attn_implementation = "sdpa"
    return LlamaForCausalLM(cfg)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--variant", required=True, choices=sorted(VARIANTS))
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--model", choices=MODELS, default="transformer",
                   help="the benchmark Transformer, or an HF LlamaForCausalLM from a config of the same sizes")
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--batch", type=int, default=8, help="sequences per rank")
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--data-world", type=int, default=None,
                   help="world size the global batch is cut for (default: this run's); a world-1 floor "
                        "run passes the nominal world so rank 0 sees the same sequences")
    p.add_argument("--ac", choices=AC_MODES, default="none",
                   help="activation checkpointing of every block (torch's checkpoint_wrapper, non-reentrant), "
                        "applied before the variant shards/compiles the model; selective saves matmul outputs")
    p.add_argument("--auto-budget-mib", type=float, default=None,
                   help="graphshard_auto: memory budget per rank for auto_plan (default: no limit)")
    p.add_argument("--out", required=True, help="JSON result path (written by rank 0)")
    return p.parse_args(argv)


def run(args: argparse.Namespace, ctx: C.DistCtx) -> dict | None:
    data_world = args.data_world or ctx.world
    lo, hi = ctx.rank * args.batch, (ctx.rank + 1) * args.batch

    def batch(i: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = token_batch(i, args.batch * data_world, args.seq, args.vocab, seed=args.seed)
        return x[lo:hi].to(ctx.device), y[lo:hi].to(ctx.device)

    t0 = time.perf_counter()
    mesh = init_device_mesh(ctx.device_type, (ctx.world,), mesh_dim_names=("dp",))
    torch.manual_seed(args.seed)
    model = build_model(args).to(ctx.device)
    DEVICE[0] = ctx.device
    apply_ac(model, args.ac)
    AUTO.update(batch=batch(0)[0], budget=int(args.auto_budget_mib * 2**20) if args.auto_budget_mib else 2**62)
    step_fn = VARIANTS[args.variant](model, mesh, args.lr)
    C.barrier(ctx)
    setup_s = time.perf_counter() - t0

    first_s, times, losses, cpu_s = C.time_steps(ctx, lambda i: step_fn(*batch(i)), args.warmup, args.steps)
    mem_step = 1 + args.warmup + args.steps
    mem = C.step_memory(ctx, lambda: step_fn(*batch(mem_step)), marks=(FORWARD_MARK,))
    peak, resident, unseen_free, mem_method = mem["peak"], mem["resident"], mem["unseen_free"], mem["method"]

    mine = {
        "rank": ctx.rank, "setup_s": setup_s, "first_step_s": first_s, "step_times_s": times, "cpu_s": cpu_s,
        "opt_s": statistics.median(OPT_TIMES[-args.steps - 1:]) if OPT_TIMES else None,
        "losses": losses, "peak_live_bytes": peak, "resident_bytes": resident,
        "unseen_free_bytes": unseen_free, "activation_bytes": mem["above_resident"],
        "fwd_saved_bytes": mem["at_marks"].get(FORWARD_MARK),
        "rss_mib": C.peak_rss_mib(), **C.dynamo_counts(),
    }
    ranks = C.gather_to_rank0(mine)
    if ranks is None:
        return None
    mib = 1 / 2**20
    return {
        "status": "ok",
        "world": ctx.world,
        "data_world": data_world,
        **C.rank_timings(ranks),
        "peak_live_mib": max(r["peak_live_bytes"] for r in ranks) * mib,
        "resident_mib": max(r["resident_bytes"] for r in ranks) * mib,
        "activation_mib": max(r["activation_bytes"] for r in ranks) * mib,
        "fwd_saved_mib": (max(r["fwd_saved_bytes"] for r in ranks) * mib
                          if all(r["fwd_saved_bytes"] is not None for r in ranks) else None),
        "unseen_free_mib": max(r["unseen_free_bytes"] for r in ranks) * mib,
        "rss_mib": max(r["rss_mib"] for r in ranks),
        "opt_s": max((r["opt_s"] for r in ranks if r["opt_s"] is not None), default=None),
        "graph_breaks": ranks[0].get("graph_breaks"),
        "unique_graphs": ranks[0].get("unique_graphs"),
        "graph_break_reasons": C.graph_break_reasons(),
        "mem_method": mem_method,
        "per_rank": ranks,
    }


def main(argv=None) -> int:
    args = parse_args(argv)
    ctx = C.init_dist()
    base = {
        "variant": args.variant, "model": args.model, "ac": args.ac, "auto_plan": AUTO.get("plan"), "layers": args.layers,
        "batch_per_rank": args.batch, "seq": args.seq,
        "warmup": args.warmup, "steps": args.steps, "device": str(ctx.device), "backend": ctx.backend,
        "torch": torch.__version__, "threads": torch.get_num_threads(),
    }
    return C.run_worker(run, args, ctx, base)


if __name__ == "__main__":
    sys.exit(main())
