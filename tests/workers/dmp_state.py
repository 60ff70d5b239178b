"""DMP state worker: ``torchrun --nproc-per-node 2 tests/workers/dmp_state.py DIR CASE [CASE ...]``.

- ``dcp``: graphshard's DMP (the DLRM of tests/workers/dmp.py, plan A) trains two steps and saves
  its state dict with ``torch.distributed.checkpoint`` to DIR/dcp (rank 0 also writes the full
  tensors to DIR/full.pt); a fresh DMP under plan B (every table under another sharding type
  or rank) loads it: its tables and dense parameters must equal the saved ones, and one more
  step of both gives the same loss. A fresh DMP under plan A that also loads the fused
  optimizer's state (row-wise Adagrad's per-row sums) takes exactly the same next step.
- ``load_other_world``: run after ``dcp`` on another world size: DIR/dcp loads into a DMP there.
- ``interchange``: TorchRec's DMP (plan A) trains two steps; its state dict (ShardedTensor
  tables) loads into graphshard's DMP with ``load_state_dict``; graphshard's state saved with
  DCP loads into a fresh TorchRec DMP. Each side's tables must equal the other's.
- ``keyed``: TorchRec's optimizer classes on graphshard's ``fused_optimizer`` beside TorchRec's DMP
  (plan A): the same parameter keys and per-table state names as TorchRec's; ``CombinedOptimizer``
  with a ``KeyedOptimizerWrapper`` over the dense parameters, a torch LR scheduler and a
  ``WarmupOptimizer`` set the kernels' learning rate; the combined state dict round-trips.
- ``combined``: ``CombinedOptimizer([fused_optimizer, KeyedOptimizerWrapper(dense, Adagrad)])`` trains
  two steps under plan A; model and combined optimizer state saved with DCP load under plan C
  (tables moved to other sharding types and ranks, the column-wise one's blocks on ranks [1, 0]):
  the optimizer state must equal the saved one and the next step the writer's.
- ``combined_other_world``: run after ``combined`` on 4 ranks (state equal) or 1 (refused by name).
- ``sequence``: the same for an ``EmbeddingCollection`` (the ``seq`` model of tests/workers/dmp.py):
  graphshard's DCP checkpoint loads under another plan (and gives the same next step) and into
  TorchRec's DMP; TorchRec's state dict, after two steps of its own, loads into graphshard's.

graphshard's DMPs run their compiled graphs as FX (``lower="eager"``): what a state dict holds and
loads does not depend on the lowering, and every case builds several fresh DMPs, so Inductor here
only added CI time. The DMP's dense part under Inductor trains against the single process and
TorchRec's DMP in ``tests/test_model_parallel.py``.
"""

from __future__ import annotations

import copy
import os
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.tensor import DTensor

import dmp as common
from _compare import tensor_err, worst
from _runner import run_cases

MODEL, OPT = "dlrm", "rowwise_adagrad"


def _plan_b(module, world):
    from torchrec.distributed.sharding_plan import column_wise, construct_module_sharding_plan, row_wise, table_wise
    from torchrec.distributed.types import ShardingPlan

    f = "fused"
    sharding = {"t_tw": row_wise(compute_kernel=f), "t_mean": column_wise(ranks=list(range(world)), compute_kernel=f),
                "t_rw": table_wise(rank=world - 1, compute_kernel=f), "t_cw": table_wise(rank=0, compute_kernel=f),
                "t_dp": row_wise(compute_kernel=f)}
    ebc = module.sparse_arch.embedding_bag_collection
    return ShardingPlan({"sparse_arch.embedding_bag_collection": construct_module_sharding_plan(
        ebc, per_param_sharding=sharding, world_size=world, device_type="cpu")})


def _gs(base, plan_fn, world, model=MODEL):
    from torchrec.distributed.types import ShardingEnv

    from graphshard.model_parallel import DistributedModelParallel

    m = copy.deepcopy(base)
    return DistributedModelParallel(m, env=ShardingEnv.from_process_group(dist.group.WORLD), device=torch.device("cpu"),
                                    plan=plan_fn(m, world), sharders=[common._sharder(model, common._fused(OPT))],
                                    lower="eager")  # see the module docstring


def _tr(base, world, model=MODEL):
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.types import ShardingEnv

    m = copy.deepcopy(base)
    return DistributedModelParallel(m, env=ShardingEnv.from_process_group(dist.group.WORLD), device=torch.device("cpu"),
                                    plan=common._plan(model, m, world),
                                    sharders=[common._sharder(model, common._fused(OPT))])


def _seq_plan_b(module, world):
    from torchrec.distributed.sharding_plan import column_wise, construct_module_sharding_plan, row_wise, table_wise
    from torchrec.distributed.types import ShardingPlan

    f = "fused"
    sharding = {"t_tw": row_wise(compute_kernel=f), "t_rw": column_wise(ranks=list(range(world)), compute_kernel=f),
                "t_cw": table_wise(rank=world - 1, compute_kernel=f), "t_tw2": row_wise(compute_kernel=f),
                "t_dp": column_wise(ranks=list(range(world)), compute_kernel=f)}
    return ShardingPlan({"ec": construct_module_sharding_plan(module.ec, per_param_sharding=sharding, world_size=world,
                                                              device_type="cpu")})


def _init_torchrec(tr, init: dict) -> None:
    """TorchRec re-initializes its tables on the CPU (sharded and data-parallel ones): start from the
    module's weights."""
    with torch.no_grad():
        for k, v in tr.state_dict().items():
            if common._compat_sharded(v):
                for s in v.local_shards():
                    (r, c), (nr, nc) = s.metadata.shard_offsets, s.metadata.shard_sizes
                    s.tensor.copy_(init[k][r:r + nr, c:c + nc])
            else:
                v.copy_(init[k])


def _reader(model: str = MODEL):
    """The model with other weights than the writer's (every value 7 + noise, far from any trained
    one), so a reader passes only if the load writes every value, untrained rows included."""
    m = common.build(model)
    g = torch.Generator().manual_seed(1234)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(7.0 + 0.1 * torch.randn(p.shape, generator=g))
    return m


def _full_state(model) -> dict:
    return {k: common._full(v) for k, v in model.state_dict().items()}


def _diff(a: dict, b: dict) -> float:
    assert sorted(a) == sorted(b), (sorted(a), sorted(b))
    return worst(tensor_err(a[k], b[k]) for k in a)


def run(case: str) -> dict:
    out_dir = sys.argv[1]
    rank, world = dist.get_rank(), dist.get_world_size()
    base = common.build(MODEL)
    plan_a = lambda m, w: common._plan(MODEL, m, w)  # noqa: E731
    if case == "dcp":
        gs = _gs(base, plan_a, world)
        common._train(gs, MODEL, range(2), rank, world)
        saved = _full_state(gs)
        path = os.path.join(out_dir, "dcp")
        dcp.save(gs.state_dict(), checkpoint_id=path)
        if rank == 0:
            torch.save(saved, os.path.join(out_dir, "full.pt"))
        other = _gs(_reader(), _plan_b, world)
        reader_start = _diff(_full_state(other), saved)
        state = other.state_dict()
        dcp.load(state, checkpoint_id=path)
        other.load_state_dict(state)
        loaded = _full_state(other)
        # the same plan, with the fused optimizer's state: the next step is the same step
        full_path = os.path.join(out_dir, "dcp_with_optim")
        dcp.save({"model": gs.state_dict(), "optim": gs.fused_optimizer.state_dict()}, checkpoint_id=full_path)
        same = _gs(_reader(), plan_a, world)
        both = {"model": same.state_dict(), "optim": same.fused_optimizer.state_dict()}
        dcp.load(both, checkpoint_id=full_path)
        same.load_state_dict(both["model"])
        same.fused_optimizer.load_state_dict(both["optim"])
        next_a = common._train(gs, MODEL, range(2, 3), rank, world)
        next_b = common._train(other, MODEL, range(2, 3), rank, world)
        common._train(same, MODEL, range(2, 3), rank, world)  # its state is compared below
        return {"case": case, "reshard_diff": _diff(loaded, saved), "next_loss_diff": abs(next_a[0] - next_b[0]),
                "reader_start_diff": reader_start,
                "optim_resume_diff": _diff(_full_state(same), _full_state(gs)),
                "optim_entries": _all_ranks_keys(gs.fused_optimizer.state_dict()["state"]),
                "trained": worst(tensor_err(saved[k], v) for k, v in base.state_dict().items())}
    if case == "load_other_world":  # the 2-rank "dcp" checkpoint, on this world size, plan A
        saved = torch.load(os.path.join(out_dir, "full.pt"))
        gs = _gs(_reader(), plan_a, world)
        state = gs.state_dict()
        dcp.load(state, checkpoint_id=os.path.join(out_dir, "dcp"))
        gs.load_state_dict(state)
        return {"case": case, "world": world, "reshard_diff": _diff(_full_state(gs), saved)}
    if case == "sequence":  # an EmbeddingCollection: DCP across plans, and TorchRec interchange
        seq = common.build("seq")
        gs = _gs(seq, lambda m, w: common._plan("seq", m, w), world, "seq")
        common._train(gs, "seq", range(2), rank, world)
        saved = _full_state(gs)
        path = os.path.join(out_dir, "seq_dcp")
        dcp.save(gs.state_dict(), checkpoint_id=path)
        other = _gs(_reader("seq"), _seq_plan_b, world, "seq")
        reader_start = _diff(_full_state(other), saved)
        state = other.state_dict()
        dcp.load(state, checkpoint_id=path)
        other.load_state_dict(state)
        reshard = _diff(_full_state(other), saved)
        next_a = common._train(gs, "seq", range(2, 3), rank, world)
        next_b = common._train(other, "seq", range(2, 3), rank, world)
        tr = _tr(_reader("seq"), world, "seq")
        state = tr.state_dict()
        dcp.load(state, checkpoint_id=path)  # graphshard's checkpoint into TorchRec's DMP
        tr.load_state_dict(state)
        into_tr = _diff(_full_state(tr), saved)
        common._train(tr, "seq", range(2, 4), rank, world)
        fresh = _gs(_reader("seq"), lambda m, w: common._plan("seq", m, w), world, "seq")
        fresh.load_state_dict(tr.state_dict())  # TorchRec's state dict (ShardedTensors) into graphshard's
        into_gs = _diff(_full_state(fresh), _full_state(tr))
        return {"case": case, "reshard_diff": reshard, "next_loss_diff": abs(next_a[0] - next_b[0]),
                "reader_start_diff": reader_start,
                "graphshard_to_torchrec": into_tr, "torchrec_to_graphshard": into_gs,
                "trained": worst(tensor_err(saved[k], v) for k, v in seq.state_dict().items())}
    if case == "keyed":
        return _keyed(base, plan_a, world, rank)
    if case == "combined":
        return _combined_dcp(base, plan_a, out_dir, world, rank)
    if case == "combined_other_world":
        return _combined_other_world(out_dir, world, rank)
    if case == "interchange":
        tr = _tr(base, world)
        _init_torchrec(tr, base.state_dict())
        common._train(tr, MODEL, range(2), rank, world)
        tr_state = _full_state(tr)
        gs = _gs(_reader(), plan_a, world)  # other weights: everything must come from the load
        gs.load_state_dict(tr.state_dict())
        into_gs = _diff(_full_state(gs), tr_state)
        common._train(gs, MODEL, range(2, 3), rank, world)
        gs_state = _full_state(gs)
        path = os.path.join(out_dir, "gs_to_tr")
        dcp.save(gs.state_dict(), checkpoint_id=path)
        tr2 = _tr(_reader(), world)
        state = tr2.state_dict()
        dcp.load(state, checkpoint_id=path)
        tr2.load_state_dict(state)
        into_tr = _diff(_full_state(tr2), gs_state)
        return {"case": case, "torchrec_to_graphshard": into_gs, "graphshard_to_torchrec": into_tr}
    raise ValueError(case)


def _keyed(base, plan_a, world: int, rank: int) -> dict:
    from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizer, KeyedOptimizerWrapper
    from torchrec.optim.optimizers import in_backward_optimizer_filter
    from torchrec.optim.warmup import WarmupOptimizer, WarmupPolicy, WarmupStage

    gs, tr = _gs(base, plan_a, world), _tr(base, world)

    def layout(opt) -> dict:  # parameter keys and each one's state names, as TorchRec lays them out
        return {k: sorted(v) for k, v in opt.state_dict()["state"].items()}

    def kernel_lrs() -> list[float]:
        return sorted({round(float(t.lr), 9) for c in gs._collections for t in c.fused()})

    same = layout(gs.fused_optimizer) == layout(tr.fused_optimizer) and sorted(gs.fused_optimizer.params) == sorted(
        tr.fused_optimizer.params)
    out = {"case": "keyed", "keyed": isinstance(gs.fused_optimizer, KeyedOptimizer),
           "layout": layout(gs.fused_optimizer), "torchrec_layout": layout(tr.fused_optimizer),
           "same_layout_as_torchrec_every_rank": _all_ranks_max(0.0 if same else 1.0) == 0.0}
    dense = KeyedOptimizerWrapper(dict(in_backward_optimizer_filter(gs.named_parameters())),
                                  lambda params: torch.optim.SGD(params, lr=common.LR))
    combined = CombinedOptimizer([gs.fused_optimizer, dense])
    scheduler = torch.optim.lr_scheduler.StepLR(combined, step_size=1, gamma=0.5)
    x, y = common.batch(MODEL, 0, rank)
    common.loss_of(gs(*x), y).backward()
    combined.step()
    combined.zero_grad()
    scheduler.step()
    out["lrs_after_schedule"] = kernel_lrs()  # 0.05 * 0.5
    warm = WarmupOptimizer(combined, stages=[WarmupStage(policy=WarmupPolicy.LINEAR, max_iters=4, value=0.5)], lr=0.2)
    out["lrs_after_warmup_start"] = kernel_lrs()  # 0.2 * 0.5 (the first stage's start)

    def local_state() -> dict:  # this rank's pieces of every table's state
        return {(k, n): v.to_local().clone() for k, d in gs.fused_optimizer.state_dict()["state"].items()
                for n, v in d.items()}

    def moved_from_saved() -> float:
        now = local_state()
        return _all_ranks_max(max(tensor_err(v, now[k]) for k, v in saved.items()))

    saved_sd = {"state": {k: {n: _copy(v) for n, v in d.items()}
                          for k, d in warm.state_dict()["state"].items() if not k.startswith("__")}}
    saved = local_state()
    warm.step()
    x, y = common.batch(MODEL, 1, rank)
    common.loss_of(gs(*x), y).backward()  # the fused update changes the tables' state
    changed = moved_from_saved()
    gs.fused_optimizer.load_state_dict(saved_sd)
    restored = moved_from_saved()
    out.update(state_changed_by_step=changed, state_restored_err=restored)
    return out


def _plan_c(module, world):
    """Plan A's tables moved where each one's optimizer state keeps its meaning: table-wise to
    row-wise and back, to other ranks; the column-wise table keeps its blocks (row-wise Adagrad
    keeps one value per row *per column block*, so a table's state loads only where it has the
    same blocks); the data-parallel table stays in the dense optimizer."""
    from torchrec.distributed.sharding_plan import (column_wise, construct_module_sharding_plan, data_parallel,
                                                    row_wise, table_wise)
    from torchrec.distributed.types import ShardingPlan

    f = "fused"
    sharding = {"t_tw": row_wise(compute_kernel=f), "t_mean": table_wise(rank=world - 1, compute_kernel=f),
                "t_rw": table_wise(rank=0, compute_kernel=f), "t_cw": column_wise(ranks=[1, 0], compute_kernel=f),
                "t_dp": data_parallel()}
    ebc = module.sparse_arch.embedding_bag_collection
    return ShardingPlan({"sparse_arch.embedding_bag_collection": construct_module_sharding_plan(
        ebc, per_param_sharding=sharding, world_size=world, device_type="cpu")})


def _plan_world(module, world):
    """Plan A at another world size (at least 2), the column-wise table kept in two blocks (on ranks 0
    and 1) so its optimizer state keeps its meaning; on one rank it is table-wise."""
    from torchrec.distributed.sharding_plan import column_wise, construct_module_sharding_plan, row_wise, table_wise
    from torchrec.distributed.sharding_plan import data_parallel
    from torchrec.distributed.types import ShardingPlan

    f = "fused"
    sharding = {"t_tw": table_wise(rank=0, compute_kernel=f), "t_mean": table_wise(rank=world - 1, compute_kernel=f),
                "t_rw": row_wise(compute_kernel=f),
                "t_cw": column_wise(ranks=[0, 1], compute_kernel=f) if world > 1 else table_wise(rank=0, compute_kernel=f),
                "t_dp": data_parallel()}
    ebc = module.sparse_arch.embedding_bag_collection
    return ShardingPlan({"sparse_arch.embedding_bag_collection": construct_module_sharding_plan(
        ebc, per_param_sharding=sharding, world_size=world, device_type="cpu")})


def _combined(gs):
    """TorchRec's combination: the fused tables' optimizer and Adagrad over the dense part."""
    from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
    from torchrec.optim.optimizers import in_backward_optimizer_filter

    dense = KeyedOptimizerWrapper(dict(in_backward_optimizer_filter(gs.named_parameters())),
                                  lambda params: torch.optim.Adagrad(params, lr=common.LR))
    return CombinedOptimizer([gs.fused_optimizer, dense])


def _train_combined(gs, optimizer, steps, rank: int, world: int) -> list[float]:
    losses = []
    for step in steps:
        x, y = common.batch(MODEL, step, rank)
        loss = common.loss_of(gs(*x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(float(mean) / world)
    return losses


def _optim_full(optimizer) -> dict:
    """Every tensor of ``optimizer``'s state as a full tensor, by "<param>/<state>", on every rank.
    A rank's fused state holds only its tables, so pieces travel as objects (no per-table collective)."""
    from torch.distributed.tensor import Replicate

    mine = {}
    for k, d in optimizer.state_dict()["state"].items():
        for n, v in d.items():
            if not torch.is_tensor(v):
                continue
            if not isinstance(v, DTensor):
                mine[f"{k}/{n}"] = (tuple(v.shape), [([0] * v.dim(), v.detach().clone())])
                continue
            coord, p = v.device_mesh.get_coordinate(), v.placements[0]
            start = [0] * v.dim()
            if coord is not None and not isinstance(p, Replicate):
                chunk = -(-v.shape[p.dim] // v.device_mesh.size())
                start[p.dim] = min(chunk * coord[0], v.shape[p.dim])
            mine[f"{k}/{n}"] = (tuple(v.shape), [(start, v.to_local().detach().clone())])
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, mine)
    out = {}
    for part in parts:
        for key, (shape, pieces) in part.items():
            full = out.setdefault(key, torch.zeros(shape))
            for start, t in pieces:
                full[tuple(slice(a, a + n) for a, n in zip(start, t.shape))] = t
    return out


def _combined_dcp(base, plan_a, out_dir: str, world: int, rank: int) -> dict:
    """The combined optimizer's state (fused tables and dense part) saved with DCP under plan A,
    loaded under plan C; the reader's next step is the writer's."""
    gs = _gs(base, plan_a, world)
    opt = _combined(gs)
    _train_combined(gs, opt, range(2), rank, world)
    saved_optim = _optim_full(opt)
    path = os.path.join(out_dir, "combined")
    dcp.save({"model": gs.state_dict(), "optim": opt.state_dict()}, checkpoint_id=path)
    if rank == 0:
        torch.save(saved_optim, os.path.join(out_dir, "combined_optim.pt"))
    reader = _gs(_reader(), _plan_c, world)
    reader_opt = _combined(reader)
    _train_combined(reader, reader_opt, range(5, 6), rank, world)  # its own optimizer state first
    start = _diff(_optim_full(reader_opt), saved_optim)
    both = {"model": reader.state_dict(), "optim": reader_opt.state_dict()}
    dcp.load(both, checkpoint_id=path)
    reader.load_state_dict(both["model"])
    reader_opt.load_state_dict(both["optim"])
    loaded = _diff(_optim_full(reader_opt), saved_optim)
    next_a = _train_combined(gs, opt, range(2, 3), rank, world)
    next_b = _train_combined(reader, reader_opt, range(2, 3), rank, world)
    return {"case": "combined", "optim_keys": len(saved_optim), "reader_optim_start_diff": start,
            "optim_reshard_diff": loaded, "next_loss_diff": abs(next_a[0] - next_b[0]),
            "next_state_diff": _diff(_full_state(reader), _full_state(gs)),
            "next_optim_diff": _diff(_optim_full(reader_opt), _optim_full(opt))}


def _combined_other_world(out_dir: str, world: int, rank: int) -> dict:
    """The 2-rank ``combined`` checkpoint, model and combined optimizer state, on this world size. On
    one rank the column-wise table has one block, where row-wise Adagrad's state has two: DCP must
    refuse it, naming the entry."""
    saved = torch.load(os.path.join(out_dir, "combined_optim.pt"))
    gs = _gs(_reader(), _plan_world, world)
    opt = _combined(gs)
    both = {"model": gs.state_dict(), "optim": opt.state_dict()}
    if world == 1:  # the column-wise table is one block here: its per-block state cannot load, by name
        try:
            dcp.load(both, checkpoint_id=os.path.join(out_dir, "combined"))
        except dcp.CheckpointException as e:  # DCP's wrapper of each rank's error (a ValueError here)
            return {"case": "combined_other_world", "world": world, "refused": str(e)}
        return {"case": "combined_other_world", "world": world, "refused": None}
    dcp.load(both, checkpoint_id=os.path.join(out_dir, "combined"))
    gs.load_state_dict(both["model"])
    opt.load_state_dict(both["optim"])
    return {"case": "combined_other_world", "world": world, "optim_reshard_diff": _diff(_optim_full(opt), saved)}


def _copy(v):
    """A DTensor with a copy of ``v``'s local piece, laid out as ``v``."""
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(v.to_local().clone(), v.device_mesh, v.placements, run_check=False, shape=v.shape,
                              stride=v.stride())


def _all_ranks_keys(state: dict) -> int:
    """How many distinct keys ``state`` has over all ranks (each rank's optimizer holds its own tables)."""
    keys = [None] * dist.get_world_size()
    dist.all_gather_object(keys, sorted(state))
    return len({k for ks in keys for k in ks})


def _all_ranks_max(x: float) -> float:
    t = torch.tensor(x, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


if __name__ == "__main__":
    run_cases(sys.argv[2:], run)
