"""TorchRec's documented training loop, on TorchRec's DMP and on graphshard's, side by side:
``torchrun --nproc-per-node 2 tests/workers/dmp_loop.py CASE [CASE ...]``.

The loop is TorchRec's own, unchanged for either DMP: a ``DLRMTrain``, row-wise Adagrad fused into
the tables with ``apply_optimizer_in_backward``, the default planner (TorchRec's for its DMP,
graphshard's for graphshard's), the dense parameters under a ``KeyedOptimizerWrapper``, both in a
``CombinedOptimizer`` that a ``StepLR`` halves every two steps, ``TrainPipelineSparseDist`` driving
batches of ``RandomRecDataset`` through a ``DataLoader`` (each rank its own stream).

- ``cpu``: the model built on the CPU. graphshard's DMP (its default planner's plan) and TorchRec's
  on the same plan start from the module's weights (TorchRec re-draws its tables on the CPU: they
  are copied in). Both must give the single process's loss at every step, the same losses as
  each other and the same state at the end. TorchRec's DMP with its own default planner runs
  too, for the record, and graphshard's DMP under TorchRec's ``TrainPipelineBase``.
- ``pipeline``: graphshard's DMP under graphshard's ``TrainPipelineSparseDist`` (the next batch's
  ids exchanged during a step) beside TorchRec's DMP under TorchRec's, on the plan of graphshard's
  planner (table-wise), row-wise and column-wise: the same losses, the single process's where
  the optimizer means the same (not column-wise: row-wise Adagrad keeps a state per column block),
  one compiled program (no recompile for the batches' ids), and ``explain`` saying it.
- ``meta``: the whole model built on the meta device, as TorchRec's DMP docstring builds it; each
  DMP initializes it (``init_parameters=True``). graphshard's rows must lie in the tables' init
  bounds and fill them, and its dense parameters agree over ranks. Then graphshard's DMP loads
  TorchRec's state dict (same plan) and both train as in ``cpu``.
"""

from __future__ import annotations

import math
import sys

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

import dmp as common
from dmp_state import _init_torchrec
from _compare import tensor_err, worst
from _runner import lowering, run_cases

KEYS = ["f0", "f1", "f2", "f3"]
ROWS = [100, 37, 200, 64]
DIM = 8
DENSE_IN = 7  # not a multiple of 4, nor are the dense layers' sizes
STEPS = 6
LR = 0.05


def _model(on: str):
    from torchrec.models.dlrm import DLRM, DLRMTrain
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
    from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

    torch.manual_seed(0)
    tables = [EmbeddingBagConfig(name=f"t{i}", embedding_dim=DIM, num_embeddings=n, feature_names=[k])
              for i, (k, n) in enumerate(zip(KEYS, ROWS))]
    ebc = EmbeddingBagCollection(tables=tables, device=torch.device(on))
    model = DLRMTrain(DLRM(embedding_bag_collection=ebc, dense_in_features=DENSE_IN, dense_arch_layer_sizes=[10, DIM],
                           over_arch_layer_sizes=[6, 1], dense_device=torch.device(on)))
    apply_optimizer_in_backward(RowWiseAdagrad, model.model.sparse_arch.parameters(), {"lr": LR})
    return model


def _dmp(which: str, model, plan=None):
    if which == "graphshard":
        from graphshard.model_parallel import DistributedModelParallel

        return DistributedModelParallel(model, device=torch.device("cpu"), plan=plan, lower=lowering())
    from torchrec.distributed.model_parallel import DistributedModelParallel

    return DistributedModelParallel(model, device=torch.device("cpu"), plan=plan)


def _loader(rank: int | None = None):
    """Rank ``rank``'s batches (this rank's by default), as TorchRec's examples load them."""
    from torch.utils.data import DataLoader
    from torchrec.datasets.random import RandomRecDataset

    data = RandomRecDataset(keys=KEYS, batch_size=8, hash_sizes=ROWS, ids_per_features=[2, 1, 3, 2],
                            num_dense=DENSE_IN, manual_seed=dist.get_rank() if rank is None else rank)
    return DataLoader(data, batch_size=None, batch_sampler=None)


def _train(dmp, pipeline_class="TrainPipelineSparseDist") -> list[float]:
    """TorchRec's loop: its optimizers around the DMP, a pipeline driving it (TorchRec's class of that
    name, or the class given). The losses of this rank."""
    from torchrec.distributed import train_pipeline
    from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
    from torchrec.optim.optimizers import in_backward_optimizer_filter

    dense = KeyedOptimizerWrapper(dict(in_backward_optimizer_filter(dmp.named_parameters())),
                                  lambda params: torch.optim.Adagrad(params, lr=LR))
    optimizer = CombinedOptimizer([dmp.fused_optimizer, dense])
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    if isinstance(pipeline_class, str):
        pipeline_class = getattr(train_pipeline, pipeline_class)
    pipeline = pipeline_class(dmp, optimizer, torch.device("cpu"))
    batches = iter(_loader())
    losses = []
    for _ in range(STEPS):
        loss, _logits, _labels = pipeline.progress(batches)
        losses.append(float(loss))
        scheduler.step()
    return losses


def _cat_kjt(parts):
    """KJTs of the same keys side by side along the batch (each key's bags: the parts' in order)."""
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    keys = parts[0].keys()
    lengths = [k.lengths().view(len(keys), -1) for k in parts]
    values = [k.values().split(l.sum(1).tolist()) for k, l in zip(parts, lengths)]
    return KeyedJaggedTensor(keys=keys, values=torch.cat([v[i] for i in range(len(keys)) for v in values]),
                             lengths=torch.cat(lengths, 1).reshape(-1))


def _reference(init: dict) -> list[float]:
    """The single process on the global batch (every rank's batches side by side) from the weights
    ``init``: the unwrapped model, whose in-backward row-wise Adagrad updates the tables on the
    global batch's gradient, Adagrad on the dense part, the learning rate halved every two steps
    by hand."""
    from torchrec.datasets.utils import Batch
    from torchrec.optim.optimizers import in_backward_optimizer_filter

    model = _model("cpu")
    model.load_state_dict(init)
    dense = torch.optim.Adagrad([p for _, p in in_backward_optimizer_filter(model.named_parameters())], lr=LR)
    in_backward = {id(o): o for p in model.parameters() for o in getattr(p, "_in_backward_optimizers", [])}
    optimizers = [dense, *in_backward.values()]
    streams = [iter(_loader(rank)) for rank in range(dist.get_world_size())]
    losses = []
    for step in range(STEPS):
        for o in optimizers:
            for g in o.param_groups:
                g["lr"] = LR * 0.5 ** (step // 2)
        parts = [next(s) for s in streams]
        batch = Batch(dense_features=torch.cat([b.dense_features for b in parts]),
                      sparse_features=_cat_kjt([b.sparse_features for b in parts]),
                      labels=torch.cat([b.labels for b in parts]))
        dense.zero_grad()
        loss, _ = model(batch)
        loss.backward()
        dense.step()
        losses.append(float(loss))
    return losses


def _full_state(dmp) -> dict:
    return {k: common._full(v) for k, v in dmp.state_dict().items()}


def _all_ranks_max(x: float) -> float:
    t = torch.tensor(x, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def _compare(gs, tr, init: dict) -> dict:
    """graphshard's and TorchRec's DMP (one plan, the weights ``init``) through TorchRec's loop, and
    the single process: losses step by step (a rank's loss is its batch's; their mean over ranks
    is the global batch's, the single process's), and the state at the end."""
    gs_losses, tr_losses, ref = _train(gs), _train(tr), _reference(init)
    a, b = _full_state(gs), _full_state(tr)
    gs_mean, tr_mean = _mean_over_ranks(gs_losses), _mean_over_ranks(tr_losses)
    return {"losses": gs_mean, "torchrec_losses": tr_mean, "reference_losses": ref,
            "finite": all(math.isfinite(x) for x in gs_losses + tr_losses + ref),
            "reference_diff": max(abs(x - y) for x, y in zip(gs_mean, ref)),
            "torchrec_reference_diff": max(abs(x - y) for x, y in zip(tr_mean, ref)),
            "loss_diff": _all_ranks_max(max(abs(x - y) for x, y in zip(gs_losses, tr_losses))),
            "state_keys_match": sorted(a) == sorted(b),
            "state_diff": _all_ranks_max(worst(tensor_err(a[k], b[k]) for k in a if k in b)),
            "trained": max(abs(x - y) for x, y in zip(ref, ref[1:]))}


def _mean_over_ranks(losses: list[float]) -> list[float]:
    t = torch.tensor(losses, dtype=torch.float64)
    dist.all_reduce(t)
    return (t / dist.get_world_size()).tolist()


def _meta_init(gs) -> dict:
    """graphshard's tables as it drew them, per table: this rank's rows within the table's init
    bounds and filling them; dense parameters drawn (not constant) and the same on every rank."""
    fill, over, values = [], [], 0
    for i, n in enumerate(ROWS):
        local = gs.state_dict()[f"model.sparse_arch.embedding_bag_collection.embedding_bags.t{i}.weight"].to_local()
        if local.numel():
            top, bound = float(local.abs().max()), math.sqrt(1 / n)
            over.append(top - bound)
            fill.append(top / bound)
            values += int(local.unique().numel() == local.numel())
    dense = {k: v.to_local() if isinstance(v, DTensor) else v for k, v in gs.state_dict().items()
             if "embedding_bags" not in k}
    spread = []
    for v in dense.values():
        lo, hi = v.detach().clone(), v.detach().clone()
        dist.all_reduce(lo, op=dist.ReduceOp.MIN)
        dist.all_reduce(hi, op=dist.ReduceOp.MAX)
        spread.append(float((hi - lo).abs().max()))
    return {"tables_here": len(fill), "tables_all_distinct": values == len(fill),
            "over_bound": _all_ranks_max(max(over)), "least_fill": -_all_ranks_max(-min(fill)),
            "dense_rank_spread": _all_ranks_max(max(spread)),
            "dense_least_std": -_all_ranks_max(-min(float(v.float().std()) for v in dense.values() if v.numel() > 1))}


def run(case: str) -> dict:
    if case == "cpu":
        init = {k: v.detach().clone() for k, v in _model("cpu").state_dict().items()}
        gs = _dmp("graphshard", _model("cpu"))
        tr = _dmp("torchrec", _model("cpu"), plan=gs.plan)
        _init_torchrec(tr, init)
        out = {"case": case, "lowering": lowering(), "plan": _plan_of(gs), **_compare(gs, tr, init)}
        # TorchRec's DMP with its own default planner: the same loop, the same weights
        tr_default = _dmp("torchrec", _model("cpu"))
        _init_torchrec(tr_default, init)
        out["torchrec_default_plan"] = _plan_of(tr_default)
        out["torchrec_default_reference_diff"] = max(
            abs(x - y) for x, y in zip(_mean_over_ranks(_train(tr_default)), out["reference_losses"]))
        # TorchRec's base pipeline (no input distribution ahead) drives graphshard's DMP too
        base = _mean_over_ranks(_train(_dmp("graphshard", _model("cpu")), "TrainPipelineBase"))
        out["base_pipeline_reference_diff"] = max(abs(x - y) for x, y in zip(base, out["reference_losses"]))
        return out
    if case == "pipeline":
        return {"case": case, "lowering": lowering(), **_pipelines()}
    if case == "meta":
        gs = _dmp("graphshard", _model("meta"))
        out = {"case": case, "lowering": lowering(), **_meta_init(gs)}
        tr = _dmp("torchrec", _model("meta"), plan=gs.plan)
        gs.load_state_dict(tr.state_dict())  # the same start for both (each drew its own)
        init = _full_state(gs)
        return {**out, **_compare(gs, tr, init)}
    raise ValueError(f"unknown case {case!r}")


def _pipelines() -> dict:
    """Each plan's graphshard DMP + graphshard's pipeline against TorchRec's DMP + TorchRec's pipeline."""
    import graphshard
    from graphshard.model_parallel import TrainPipelineSparseDist
    from graphshard.storage import state_of
    from torchrec.distributed.sharding_plan import column_wise, construct_module_sharding_plan, row_wise
    from torchrec.distributed.types import ShardingPlan

    init = {k: v.detach().clone() for k, v in _model("cpu").state_dict().items()}
    ref = _reference(init)
    out = {}
    for name, spec in (("planned", None), ("rw", row_wise), ("cw", lambda: column_wise(ranks=[0, 1]))):
        plan = None
        if spec is not None:
            ebc = _model("cpu").model.sparse_arch.embedding_bag_collection
            plan = ShardingPlan({"model.sparse_arch.embedding_bag_collection": construct_module_sharding_plan(
                ebc, {f"t{i}": spec() for i in range(len(KEYS))})})
        gs = _dmp("graphshard", _model("cpu"), plan=plan)
        tr = _dmp("torchrec", _model("cpu"), plan=gs.plan)
        _init_torchrec(tr, init)
        gs_losses, tr_losses = _train(gs, TrainPipelineSparseDist), _train(tr)
        mean = _mean_over_ranks(gs_losses)
        out[name] = {"plan": sorted(set(_plan_of(gs).values())),
                     "finite": all(math.isfinite(x) for x in gs_losses + tr_losses),
                     "loss_diff": _all_ranks_max(max(abs(x - y) for x, y in zip(gs_losses, tr_losses))),
                     "reference_diff": max(abs(x - y) for x, y in zip(mean, ref)),
                     "programs": len(state_of(gs.module).explain),
                     "ahead": "ids exchanged a batch ahead" in graphshard.explain(gs)}
    return out


def _plan_of(dmp) -> dict:
    return {t: f"{ps.sharding_type}/{ps.compute_kernel}" for mp in dmp.plan.plan.values() for t, ps in mp.items()}


if __name__ == "__main__":
    run_cases(sys.argv[1:], run)
