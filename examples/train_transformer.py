"""graphshard demo: FULL_SHARD training of a small decoder transformer.

Launched by ``scripts/demo.sh`` (``torchrun --nproc-per-node N``). Every rank
trains on its slice of each global batch; the script also trains the same model
in one process on the whole global batch and reports how closely the sharded run
matches it, then prints graphshard's explain summary.
"""

from __future__ import annotations

import argparse
import copy
import os
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import graphshard
from graphshard.testing.models import Transformer, TransformerConfig, lm_loss, token_batch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--batch-per-rank", type=int, default=4)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--lower", choices=["inductor", "eager"], default="inductor")
    ap.add_argument("--fast-compile", action="store_true",
                    help="batch_cpp_kernels and fast_isa_check (the opt-ins that shorten a cold CPU compile)")
    args = ap.parse_args()

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("dp",))

    cfg = TransformerConfig(vocab_size=1024, dim=args.dim, n_layers=args.layers, n_heads=4, max_seq_len=args.seq)
    torch.manual_seed(0)
    reference = Transformer(cfg).to(device)
    model = copy.deepcopy(reference)
    plan = graphshard.Plan(mesh, {"layers.*": graphshard.FullyShard(), "": graphshard.FullyShard()})
    model = graphshard.compile(model, plan, lower=args.lower, batch_cpp_kernels=args.fast_compile,
                               fast_isa_check=args.fast_compile)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    if rank == 0:
        print(f"graphshard demo: {world} ranks ({'nccl' if cuda else 'gloo'}), {cfg.n_layers} layers, dim {cfg.dim}, "
              f"{sum(p.numel() for p in reference.parameters()):,} parameters, FULL_SHARD, lower={args.lower}"
              + (", fast compile" if args.fast_compile else ""))

    b = args.batch_per_rank
    worst = 0.0
    for step in range(args.steps):
        x, y = token_batch(step, b * world, args.seq, cfg.vocab_size)
        x, y = x.to(device), y.to(device)
        t0 = time.perf_counter()
        loss = lm_loss(model(x[rank * b:(rank + 1) * b]), y[rank * b:(rank + 1) * b])
        loss.backward()
        opt.step()
        opt.zero_grad()
        dt = time.perf_counter() - t0
        ref_loss = lm_loss(reference(x), y)
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        mean = mean.item() / world
        worst = max(worst, abs(mean - ref_loss.item()))
        if rank == 0:
            note = " (includes compile)" if step == 0 else ""
            print(f"step {step}: loss {mean:.6f}  single-process {ref_loss.item():.6f}  "
                  f"|diff| {abs(mean - ref_loss.item()):.2e}  {dt:.3f} s{note}", flush=True)

    ref_params = dict(reference.named_parameters())
    param_err = max((p.full_tensor() - ref_params[n]).abs().max().item() for n, p in model.named_parameters())
    if rank == 0:
        ok = worst < 1e-4 and param_err < 1e-4
        print(f"match against the single-process run: max |loss diff| {worst:.2e}, "
              f"max |param diff| {param_err:.2e} -> {'OK' if ok else 'MISMATCH'}")
        print("\nexplain:")
        graphshard.explain(model)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
