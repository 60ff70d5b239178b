"""A stored program is never served to another setting: ``torchrun --nproc-per-node 2 tests/workers/cache_variants.py CASE ...``.

Run twice on one Inductor cache directory. The first job (``GS_CACHE_PHASE=store``) compiles each
case's first setting with the program cache on (the default) and trains it; the second
(``GS_CACHE_PHASE=change``) compiles the case's changed setting, which must miss the cache, and
then the same changed setting with ``program_cache=False``: the two must train identically (the
fresh program's numbers). Each case's models get the same ids in both jobs (`_same_position`), as
the model at one place in a training script does in every process, so nothing but the change
tells the two programs apart. The model is the issue's: two blocks and an output layer, every
block and the root a FullyShard unit, 2 gloo ranks each feeding its own rows.

- ``reduce_fp32_to_bf16`` / ``reduce_bf16_to_fp32``: the units' ``reduce_dtype``;
- ``param_dtype_added``: ``param_dtype=bf16`` added (fp32 inputs);
- ``collectives_nccl``: ``Plan(collectives="nccl")`` added (gloo's forms stored);
- ``output_width``: the output layer 8 -> 7 wide (rank 0's shard keeps its (4, 32) shape);
- ``a_then_b``: the first job compiles the 8-wide model, then the 7-wide one; the second only the 7-wide.
"""

from __future__ import annotations

import itertools
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import graphshard
from _compare import seq_err, tensor_err, worst
from _runner import run_cases
from graphshard import storage
from graphshard._compat import autograd_cache_counts

STEPS = 3
BF16 = torch.bfloat16
CASES = {  # case -> (the stored settings, in order; the changed setting)
    "reduce_fp32_to_bf16": ([dict(reduce=torch.float32)], dict(reduce=BF16)),
    "reduce_bf16_to_fp32": ([dict(reduce=BF16)], dict(reduce=torch.float32)),
    "param_dtype_added": ([dict()], dict(param=BF16)),
    "collectives_nccl": ([dict()], dict(collectives="nccl")),
    "output_width": ([dict(out=8)], dict(out=7)),
    "a_then_b": ([dict(out=8), dict(out=7)], dict(out=7)),
}


class Blocks(torch.nn.Module):
    def __init__(self, out: int):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = torch.nn.ModuleList([torch.nn.Linear(16, 32), torch.nn.Linear(32, 32)])
        self.head = torch.nn.Linear(32, out)

    def forward(self, x):
        for block in self.blocks:
            x = torch.relu(block(x))
        return self.head(x)


def _same_position(case: str) -> None:
    """The case's first model gets the same id in both jobs, whatever the cases before it compiled."""
    storage._model_ids = itertools.count(100 * (list(CASES).index(case) + 1))


def train(setting: dict, **compile_options) -> dict:
    """Compiles the setting's model and trains it; its numbers against the single process on the whole batch."""
    torch._dynamo.reset()
    out = setting.get("out", 8)
    ref = Blocks(out)
    model = Blocks(out)
    spec = graphshard.FullyShard(param_dtype=setting.get("param"), reduce_dtype=setting.get("reduce"))
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp",))
    plan = graphshard.Plan(mesh, {"blocks.*": spec, "": spec}, collectives=setting.get("collectives", "auto"))
    before = autograd_cache_counts()
    result = {"setting": {k: str(v) for k, v in setting.items()}}
    try:
        graphshard.compile(model, plan, **compile_options)
        opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, ref))
        rank, world = dist.get_rank(), dist.get_world_size()
        losses, ref_losses = [], []
        for step in range(STEPS):
            g = torch.Generator().manual_seed(step)
            x, y = torch.randn(4 * world, 16, generator=g), torch.randn(4 * world, out, generator=g)
            mine = slice(4 * rank, 4 * rank + 4)
            loss = torch.nn.functional.mse_loss(model(x[mine]), y[mine])
            loss.backward()
            opt.step(); opt.zero_grad()
            ref_loss = torch.nn.functional.mse_loss(ref(x), y)
            ref_loss.backward()
            ref_opt.step(); ref_opt.zero_grad()
            mean = loss.detach().float().clone()
            dist.all_reduce(mean)
            losses.append(mean.item() / world)
            ref_losses.append(ref_loss.item())
        params = {n: model.get_parameter(n).full_tensor().detach().float() for n, _ in ref.named_parameters()}
        result.update(
            losses=losses, loss_err=seq_err(losses, ref_losses),
            param_err=worst(tensor_err(params[n], p) for n, p in ref.named_parameters()),
            params={n: t.flatten().tolist() for n, t in params.items()},
            # rank 0's only: explain also prints, and another rank's print could split rank 0's RESULT line
            collectives=[line.strip() for line in (graphshard.explain(model) if rank == 0 else "").splitlines()
                         if line.strip().startswith(("all_gather", "all_to_all", "reduce_scatter", "all_reduce"))],
            notes=[n for r in storage.state_of(model).explain for n in r.notes if n.startswith("program cache")])
    except Exception as e:  # a setting that fails fresh must fail the same way loaded
        result["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
    after = autograd_cache_counts()
    result["cache"] = {k: after[k] - before[k] for k in after}
    return result


def run(case: str) -> dict:
    stored, changed = CASES[case]
    _same_position(case)
    if os.environ["GS_CACHE_PHASE"] == "store":
        return {"case": case, "stored": [train(s) for s in stored]}
    loaded = train(changed)
    fresh = train(changed, program_cache=False)  # a model of its own id: the collective check names programs by it
    return {"case": case, "changed": loaded, "fresh": fresh}


if __name__ == "__main__":
    run_cases(sys.argv[1:], run)
