"""One tensor-parallel benchmark run: launched by ``bench_tp.py`` as
``torchrun --standalone --nproc-per-node N benchmarks/_tp_worker.py --variant X --layers L --out F``.

Builds the reference `Transformer` (untied embeddings, ``-1`` head reshapes:
what torch's eager tensor parallelism needs; every variant runs this same
model) with the same seed on every rank, parallelizes it the way the variant
says, trains ``1 + warmup + steps`` AdamW steps, counts the collectives of one
more step, gathers per-rank figures to rank 0 and writes them to ``--out``.

Tensor parallelism (``tp_*`` variants, mesh ``("tp",) = (N,)``): every rank
feeds the same ``--batch`` sequences. FSDP + TP (``*fsdp_tp*`` variants, mesh
``("dp", "tp") = (N / tp, tp)``): each dp rank feeds its own ``--batch`` rows of
the global batch of ``batch * dp`` sequences.

Variants (see `VARIANTS`):

* ``torch_tp_eager``            torch ``parallelize_module(model, mesh, plan)``; eager.
* ``torch_tp_compile``          as ``torch_tp_eager``, then ``torch.compile(model)`` (Inductor).
* ``graphshard_tp``             ``graphshard.tensor_parallel.parallelize_module(model, mesh, plan)``.
* ``torch_fsdp_tp``             torch ``parallelize_module`` on ``mesh["tp"]``, then ``fully_shard``
                                on every block and the root on ``mesh["dp"]``; eager.
* ``torch_fsdp_tp_compile``     as ``torch_fsdp_tp`` with ``block.compile()`` on every block before
                                ``fully_shard`` (torchtitan's recipe; not in the defaults).
* ``graphshard_fsdp_tp``        ``graphshard.compile(model, Plan(mesh, {**tp_plan, "layers.*": FullyShard(),
                                "": FullyShard()}))`` with graphshard's styles.

The TP plan is the same for every variant (torch's styles for torch,
graphshard's for graphshard), see `tp_plan`. With ``--loss-parallel`` the
output projection keeps its logits sharded on the vocabulary
(``ColwiseParallel(use_local_output=False)``) and loss and backward run under
``loss_parallel()`` (torch's or graphshard's).

A variant that cannot be built here (``graphshard.tensor_parallel`` not
importable) raises `Unavailable`; the run then reports ``status: unavailable``
and exits cleanly.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from typing import Any, Callable

import torch
from torch.distributed.device_mesh import init_device_mesh

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402

from graphshard.testing.models import Transformer, TransformerConfig, lm_loss, token_batch  # noqa: E402

StepFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]



def tp_plan(styles: Any, loss_parallel: bool) -> dict[str, Any]:
    """The TP plan, built from ``styles`` (a module with ``ColwiseParallel``/``RowwiseParallel``:
    ``torch.distributed.tensor.parallel`` or ``graphshard.tensor_parallel``)."""
    from torch.distributed.tensor import Replicate

    col, row = styles.ColwiseParallel, styles.RowwiseParallel
    return {
        "tok_embeddings": row(input_layouts=Replicate()),
        "layers.*.attn.wq": col(),
        "layers.*.attn.wk": col(),
        "layers.*.attn.wv": col(),
        "layers.*.attn.wo": row(),
        "layers.*.ffn.w1": col(),
        "layers.*.ffn.w2": row(),
        "output": col(use_local_output=False) if loss_parallel else col(output_layouts=Replicate()),
    }


def _make_step(module: Callable, params, lr: float, loss_ctx: Callable[[], Any]) -> StepFn:
    """One training step: forward, loss, backward, AdamW step, zero_grad(set_to_none).

    ``loss_ctx`` wraps loss and backward (``loss_parallel()`` or a null context)."""
    opt = torch.optim.AdamW(params, lr=lr)

    def step(tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = module(tokens)
        with loss_ctx():
            loss = lm_loss(logits, targets)
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss = loss.detach()
        # A DTensor loss (loss_parallel) is replicated: its local value is the loss.
        return loss.full_tensor() if hasattr(loss, "full_tensor") else loss

    return step


def _torch_loss_ctx(args) -> Callable[[], Any]:
    if not args.loss_parallel:
        return contextlib.nullcontext
    from torch.distributed.tensor.parallel import loss_parallel

    return loss_parallel


def build_torch_tp(model, mesh, args, *, compile=False) -> StepFn:
    import torch.distributed.tensor.parallel as tp

    tp.parallelize_module(model, mesh["tp"], tp_plan(tp, args.loss_parallel))
    module = torch.compile(model) if compile else model
    return _make_step(module, model.parameters(), args.lr, _torch_loss_ctx(args))


def build_torch_fsdp_tp(model, mesh, args, *, compile=False) -> StepFn:
    """TP on ``mesh["tp"]``, then FSDP2 on ``mesh["dp"]`` per block and root. ``compile``: each block is
    compiled between the two (torchtitan's recipe); ``torch.compile`` of the whole FSDP2 + TP root fails in
    torch 2.13 on CPU ("Mixing fake modes NYI" in the embedding)."""
    import torch.distributed.tensor.parallel as tp
    from torch.distributed.fsdp import fully_shard

    tp.parallelize_module(model, mesh["tp"], tp_plan(tp, args.loss_parallel))
    for block in model.layers:
        if compile:
            block.compile()
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    return _make_step(model, model.parameters(), args.lr, _torch_loss_ctx(args))


def _import_graphshard():
    try:
        import graphshard
        import graphshard.tensor_parallel as gtp
    except Exception as e:  # noqa: BLE001
        raise C.Unavailable(f"import graphshard failed: {type(e).__name__}: {e}") from e
    return graphshard, gtp


def build_graphshard_tp(model, mesh, args) -> StepFn:
    _, gtp = _import_graphshard()
    loss_ctx = gtp.loss_parallel if args.loss_parallel else contextlib.nullcontext
    gtp.parallelize_module(model, mesh, tp_plan(gtp, args.loss_parallel))
    return _make_step(model, model.parameters(), args.lr, loss_ctx)


def build_graphshard_fsdp_tp(model, mesh, args) -> StepFn:
    graphshard, gtp = _import_graphshard()
    loss_ctx = gtp.loss_parallel if args.loss_parallel else contextlib.nullcontext
    rules = {**tp_plan(gtp, args.loss_parallel), "layers.*": graphshard.FullyShard(), "": graphshard.FullyShard()}
    graphshard.compile(model, graphshard.Plan(mesh, rules))
    return _make_step(model, model.parameters(), args.lr, loss_ctx)


VARIANTS: dict[str, Callable[..., StepFn]] = {
    "torch_tp_eager": build_torch_tp,
    "torch_tp_compile": lambda m, mesh, a: build_torch_tp(m, mesh, a, compile=True),
    "graphshard_tp": build_graphshard_tp,
    "torch_fsdp_tp": build_torch_fsdp_tp,
    "torch_fsdp_tp_compile": lambda m, mesh, a: build_torch_fsdp_tp(m, mesh, a, compile=True),
    "graphshard_fsdp_tp": build_graphshard_fsdp_tp,
}


def is_fsdp_tp(variant: str) -> bool:
    return "fsdp_tp" in variant


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--variant", required=True, choices=sorted(VARIANTS))
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--batch", type=int, default=16,
                   help="sequences per step: every rank's under TP; per dp rank under FSDP + TP")
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tp", type=int, default=2, help="FSDP + TP: size of the tp mesh axis (dp = world / tp)")
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads per rank (CPU)")
    p.add_argument("--loss-parallel", action="store_true",
                   help="output stays sharded on the vocabulary; loss and backward under loss_parallel()")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--out", required=True, help="JSON result path (written by rank 0)")
    return p.parse_args(argv)


def run(args: argparse.Namespace, ctx: C.DistCtx) -> dict | None:
    t0 = time.perf_counter()
    if is_fsdp_tp(args.variant):
        if ctx.world % args.tp:
            raise ValueError(f"world {ctx.world} is not a multiple of --tp {args.tp}")
        mesh = init_device_mesh(ctx.device_type, (ctx.world // args.tp, args.tp), mesh_dim_names=("dp", "tp"))
        dp, dp_rank = mesh["dp"].size(), mesh["dp"].get_local_rank()
    else:
        mesh = init_device_mesh(ctx.device_type, (ctx.world,), mesh_dim_names=("tp",))
        dp, dp_rank = 1, 0
    lo, hi = dp_rank * args.batch, (dp_rank + 1) * args.batch

    def batch(i: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = token_batch(i, args.batch * dp, args.seq, args.vocab, seed=args.seed)
        return x[lo:hi].to(ctx.device), y[lo:hi].to(ctx.device)

    cfg = TransformerConfig(vocab_size=args.vocab, dim=args.dim, n_layers=args.layers, n_heads=args.heads,
                            max_seq_len=args.seq, tie_embeddings=False, infer_heads=True)
    torch.manual_seed(args.seed)
    model = Transformer(cfg).to(ctx.device)
    step_fn = VARIANTS[args.variant](model, mesh, args)
    C.barrier(ctx)
    setup_s = time.perf_counter() - t0

    first_s, times, losses, cpu_s = C.time_steps(ctx, lambda i: step_fn(*batch(i)), args.warmup, args.steps)
    # One more step, not timed, with every collective counted.
    C.progress(ctx, 1 + args.warmup + args.steps, 1 + args.warmup + args.steps, "counting collectives")
    C.barrier(ctx)
    comm = C.count_collectives(lambda: step_fn(*batch(1 + args.warmup + args.steps)))

    mine = {
        "rank": ctx.rank, "dp_rank": dp_rank, "setup_s": setup_s, "first_step_s": first_s, "step_times_s": times, "cpu_s": cpu_s,
        "losses": losses, "comm": comm, "rss_mib": C.peak_rss_mib(), **C.dynamo_counts(),
    }
    ranks = C.gather_to_rank0(mine)
    if ranks is None:
        return None
    # The rank that moved the most bytes (TP ranks are symmetric; under FSDP + TP they can differ).
    heaviest = max(ranks, key=lambda r: r["comm"]["in_bytes"])
    backend_calls = {r["rank"]: sum(r["comm"]["backend_calls"].values()) for r in ranks}
    mode_calls = {r["rank"]: r["comm"]["calls"] for r in ranks}
    return {
        "status": "ok",
        "world": ctx.world,
        "mesh": {n: mesh[n].size() for n in mesh.mesh_dim_names},
        "dp": dp,
        **C.rank_timings(ranks),
        "comm_bytes": heaviest["comm"]["in_bytes"],
        "comm_mib": heaviest["comm"]["in_bytes"] / 2**20,
        "comm_calls": heaviest["comm"]["calls"],
        "comm_by_kind": heaviest["comm"]["by_kind"],
        "comm_ops": heaviest["comm"]["ops"],
        "comm_rank": heaviest["rank"],
        # cross-check: the dispatch mode saw as many collectives as the backend ran (per rank)
        "comm_mode_calls": mode_calls,
        "comm_backend_calls": backend_calls,
        "comm_check": "ok" if all(backend_calls[k] == mode_calls[k] for k in mode_calls) else "mismatch",
        "rss_mib": max(r["rss_mib"] for r in ranks),
        "graph_breaks": ranks[0].get("graph_breaks"),
        "unique_graphs": ranks[0].get("unique_graphs"),
        "graph_break_reasons": C.graph_break_reasons(),
        "per_rank": ranks,
    }


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    ctx = C.init_dist()
    base = {
        "variant": args.variant, "layers": args.layers, "batch": args.batch, "seq": args.seq,
        "loss_parallel": args.loss_parallel, "warmup": args.warmup, "steps": args.steps,
        "device": str(ctx.device), "backend": ctx.backend, "torch": torch.__version__,
        "threads": torch.get_num_threads(),
    }
    return C.run_worker(run, args, ctx, base)


if __name__ == "__main__":
    sys.exit(main())
