"""One DMP benchmark run: ``torchrun --nproc-per-node 2 benchmarks/_dmp_worker.py --variant V --sharding S --out F``.

DLRM (``torchrec.models.dlrm.DLRM``): 8 tables of ``--rows`` rows, dim 64, one feature each,
``--batch`` samples per rank with ``--pooling`` ids per bag on average; every table under the
one sharding type S (tw: table-wise round-robin, rw: row-wise, cw: column-wise over all
ranks, dp: data-parallel; planned / trplanned: the plan graphshard's / TorchRec's planner chooses,
told the pooling factor and batch; auto: graphshard.auto_plan's, from an example batch), fused row-wise Adagrad for sharded tables, SGD for the dense part.
V is ``torchrec`` (TorchRec's DistributedModelParallel) or ``graphshard``
(graphshard.model_parallel's): the same model, plan, data and optimizers. Rank 0 writes the
median step time, the bytes this rank's collectives move per step, and peak live memory.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402

TABLES, DIM, DENSE_IN = 8, 64, 13


def parse(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--variant", required=True, choices=["torchrec", "graphshard"])
    p.add_argument("--sharding", required=True, choices=["tw", "rw", "cw", "dp", "planned", "trplanned", "auto"])
    p.add_argument("--rows", type=int, default=100_000)
    p.add_argument("--batch", type=int, default=512)
    p.add_argument("--pooling", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--loop", choices=["pipeline", "torchrec_pipeline", "plain"], default="pipeline",
                   help="pipeline: TorchRec's training loop (DLRMTrain, CombinedOptimizer, TrainPipelineSparseDist: "
                        "each DMP's own, TorchRec's for TorchRec's, graphshard.model_parallel's for graphshard's); "
                        "torchrec_pipeline: the same with TorchRec's pipeline class for both; "
                        "plain: forward, backward, step by hand")
    p.add_argument("--out", required=True)
    return p.parse_args(argv)


def build(args, world):
    import torch
    from torchrec.distributed.sharding_plan import (column_wise, construct_module_sharding_plan, data_parallel,
                                                    row_wise, table_wise)
    from torchrec.distributed.types import ShardingPlan
    from torchrec.models.dlrm import DLRM
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    torch.manual_seed(0)
    tables = [EmbeddingBagConfig(name=f"t{i}", embedding_dim=DIM, num_embeddings=args.rows, feature_names=[f"f{i}"])
              for i in range(TABLES)]
    ebc = EmbeddingBagCollection(tables=tables, device=torch.device("cpu"))
    model = DLRM(embedding_bag_collection=ebc, dense_in_features=DENSE_IN, dense_arch_layer_sizes=[128, DIM],
                 over_arch_layer_sizes=[128, 1])
    if args.loop != "plain":  # TorchRec's training module: forward(Batch) -> (loss, (loss, logits, labels))
        from torchrec.models.dlrm import DLRMTrain

        model = DLRMTrain(model)
    if args.sharding in ("planned", "trplanned"):
        return model, _planned(args, model, world)
    if args.sharding == "auto":
        return model, _auto(args, model, world)
    f = "fused"
    kind = {"tw": lambda i: table_wise(rank=i % world, compute_kernel=f), "rw": lambda i: row_wise(compute_kernel=f),
            "cw": lambda i: column_wise(ranks=list(range(world)), compute_kernel=f),
            "dp": lambda i: data_parallel()}[args.sharding]
    plan = ShardingPlan({_ebc_fqn(args): construct_module_sharding_plan(
        ebc, per_param_sharding={f"t{i}": kind(i) for i in range(TABLES)}, world_size=world, device_type="cpu")})
    return model, plan


def _ebc_fqn(args) -> str:
    return ("model." if args.loop != "plain" else "") + "sparse_arch.embedding_bag_collection"


FUSED = None  # set in run(): the fused optimizer both DMPs and the planners see


def _planned(args, model, world):
    """The plan of a planner, the same on every rank (its collective plan): graphshard's
    (``planned``) or TorchRec's (``trplanned``), told the workload (pooling factor, batch)."""
    import torch.distributed as dist
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.planner.types import ParameterConstraints, Topology

    if args.sharding == "planned":
        from graphshard.model_parallel import EmbeddingShardingPlanner
    else:
        from torchrec.distributed.planner import EmbeddingShardingPlanner
    constraints = {f"t{i}": ParameterConstraints(pooling_factors=[float(args.pooling)]) for i in range(TABLES)}
    planner = EmbeddingShardingPlanner(topology=Topology(world_size=world, compute_device="cpu"),
                                       batch_size=args.batch, constraints=constraints)
    return planner.collective_plan(model, [EmbeddingBagCollectionSharder(fused_params=FUSED)], dist.group.WORLD)


def _auto(args, model, world):
    """``graphshard.auto_plan`` in 1 GiB per rank, from this rank's first batch (the first rank's
    plan is everyone's): graphshard's DMP takes the Plan, TorchRec's its ``torchrec_plan``."""
    import graphshard
    from torch.distributed.device_mesh import init_device_mesh

    import torch.distributed as dist

    x, kjt, y = batches(args, dist.get_rank(), 1)[0]
    batch = (x, kjt)
    if args.loop != "plain":  # DLRMTrain takes TorchRec's Batch
        from torchrec.datasets.utils import Batch

        batch = (Batch(dense_features=x, sparse_features=kjt, labels=y),)
    return graphshard.auto_plan(model, init_device_mesh("cpu", (world,), mesh_dim_names=("dp",)),
                                memory_budget=2**30, batch=batch, optimizer_states=0)


def estimate_ms(args, model, plan, world) -> float:
    """graphshard's cost model's estimate of ``plan`` (any plan: hand, either planner's, auto), the
    busiest rank's embedding step in ms, on TorchRec's default topology and this workload."""
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.planner.types import ParameterConstraints, Topology

    from graphshard.model_parallel import EmbeddingShardingPlanner

    constraints = {f"t{i}": ParameterConstraints(pooling_factors=[float(args.pooling)]) for i in range(TABLES)}
    planner = EmbeddingShardingPlanner(topology=Topology(world_size=world, compute_device="cpu"),
                                       batch_size=args.batch, constraints=constraints)
    est = planner.estimate_plan(model, plan, [EmbeddingBagCollectionSharder(fused_params=FUSED)])
    return max(est.load) * 1e3


def describe(plan) -> str:
    """``table_wise x4 @0, table_wise x4 @1``: the plan's tables by sharding type and ranks."""
    from collections import Counter

    kinds = Counter(f"{ps.sharding_type} @{','.join(map(str, ps.ranks))}" for mp in plan.plan.values()
                    for ps in mp.values())
    return ", ".join(f"{k.split(' ')[0]} x{n} {k.split(' ')[1]}" for k, n in sorted(kinds.items()))


def batches(args, rank, n):
    import torch
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    out = []
    for step in range(n):
        g = torch.Generator().manual_seed(1000 * step + rank)
        lengths = torch.randint(0, 2 * args.pooling + 1, (TABLES * args.batch,), generator=g)
        values = torch.randint(0, args.rows, (int(lengths.sum()),), generator=g)
        kjt = KeyedJaggedTensor(keys=[f"f{i}" for i in range(TABLES)], values=values, lengths=lengths)
        out.append((torch.randn(args.batch, DENSE_IN, generator=g), kjt,
                    torch.randint(0, 2, (args.batch,), generator=g).float()))
    return out


def _pipeline_step(dmp, data, pipeline_class):
    """TorchRec's loop: its ``Batch``, ``CombinedOptimizer`` over the fused tables and the dense part,
    ``TrainPipelineSparseDist`` (``pipeline_class``) driving the model (each call of the step is one
    ``progress``)."""
    import itertools

    import torch
    from torchrec.datasets.utils import Batch
    from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
    from torchrec.optim.optimizers import in_backward_optimizer_filter

    dense = KeyedOptimizerWrapper(dict(in_backward_optimizer_filter(dmp.named_parameters())),
                                  lambda params: torch.optim.SGD(params, lr=0.01))
    optimizer = CombinedOptimizer([dmp.fused_optimizer, dense])
    pipeline = pipeline_class(dmp, optimizer, torch.device("cpu"))
    batches = itertools.cycle([Batch(dense_features=x, sparse_features=kjt, labels=y) for x, kjt, y in data])

    def step(i):
        return pipeline.progress(batches)[0]

    return step


def run(args, ctx):
    import torch
    import torch.distributed as dist
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.types import ShardingEnv

    if args.variant == "torchrec":
        from torchrec.distributed.model_parallel import DistributedModelParallel
    else:
        from graphshard.model_parallel import DistributedModelParallel
    global FUSED
    fused = FUSED = {"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.01, "eps": 1e-8}
    model, plan = build(args, ctx.world)
    est_ms = estimate_ms(args, model, getattr(plan, "torchrec_plan", None) or plan, ctx.world)
    if args.variant == "torchrec" and hasattr(plan, "torchrec_plan"):  # auto: TorchRec runs the tables' plan
        plan = plan.torchrec_plan
    t0 = time.perf_counter()
    dmp = DistributedModelParallel(model, env=ShardingEnv.from_process_group(dist.group.WORLD),
                                   device=torch.device("cpu"), plan=plan,
                                   sharders=[EmbeddingBagCollectionSharder(fused_params=fused)])
    setup_s = time.perf_counter() - t0
    data = batches(args, ctx.rank, 8)
    if args.loop in ("pipeline", "torchrec_pipeline"):
        from torchrec.distributed.train_pipeline import TrainPipelineSparseDist

        if args.variant == "graphshard" and args.loop == "pipeline":
            from graphshard.model_parallel import TrainPipelineSparseDist
        step = _pipeline_step(dmp, data, TrainPipelineSparseDist)
    else:
        dense = torch.optim.SGD([p for _, p in dmp.named_parameters() if p.requires_grad], lr=0.01)

        def step(i):
            x, kjt, y = data[i % len(data)]
            loss = torch.nn.functional.binary_cross_entropy_with_logits(dmp(x, kjt).squeeze(1), y)
            loss.backward()
            dense.step()
            dense.zero_grad(set_to_none=True)
            return loss

    first, times, losses, cpu_s = C.time_steps(ctx, step, args.warmup, args.steps)
    comm = C.count_collectives(lambda: step(0))
    peak, resident, _, method = C.peak_live_bytes(ctx, lambda: step(1))
    per_rank = C.gather_to_rank0({"step_s": statistics.median(times), "bytes": comm["in_bytes"],
                                  "calls": comm["calls"], "peak": peak})
    if ctx.rank != 0:
        return None
    return {"status": "ok", "setup_s": setup_s, "first_step_s": first, "step_s": max(r["step_s"] for r in per_rank),
            "cpu_s": cpu_s, "bytes_per_step": sum(r["bytes"] for r in per_rank) / len(per_rank),
            "collectives_per_step": comm["calls"], "peak_live_mib": max(r["peak"] for r in per_rank) / 2**20,
            "resident_mib": resident / 2**20, "memory_method": method, "loss_last": losses[-1],
            "by_kind": comm["by_kind"], "plan": describe(getattr(plan, "torchrec_plan", None) or plan),
            "est_ms": est_ms}


if __name__ == "__main__":
    a = parse()
    ctx = C.init_dist()
    sys.exit(C.run_worker(run, a, ctx, {"variant": a.variant, "sharding": a.sharding}))
