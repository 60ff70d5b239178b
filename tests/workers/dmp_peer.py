"""TorchRec's own sharding harness, graphshard's DMP in place of TorchRec's:
``torchrun --nproc-per-node 2 tests/workers/dmp_peer.py CASE [CASE ...]``.

TorchRec's harness (``torchrec.distributed.test_utils.test_sharding.sharding_single_rank_test``) cannot
be imported from the torchrec 1.9.2 wheel: that module imports ``torchrec.distributed.tests``, which the
wheel does not ship. This worker builds the same comparison from the pieces that do ship, as the harness
wires them: TorchRec's test model ``test_model.TestSparseNN`` (dense arch, an unweighted and a weighted
``EmbeddingBagCollection``, or an ``EmbeddingCollection`` for ``EmbeddingConfig`` tables, TorchRec's over
arch and loss), its input generator ``ModelInput.generate`` (a global batch and each rank's part of it;
``variable_batch_size``: ranks with fewer samples), the sharders of ``test_utils.emb_sharder``
(``TestEBCSharder`` / ``TestECSharder``: one sharding type, the ``fused`` kernel, EXACT_SGD at the
harness's learning rate 0.1), TorchRec's own ``EmbeddingShardingPlanner`` with ``ParameterConstraints``
(``min_partition=4`` for column-wise kinds, as TorchRec's cw/twcw tests ask), the model built with its
tables on the meta device, ``DistributedModelParallel``, ``KeyedOptimizerWrapper`` (SGD 0.1) over
``in_backward_optimizer_filter(named_parameters())`` combined with ``fused_optimizer``, the global
model's weights copied in, one training step and a prediction. The tables are TorchRec's test tables
(``ModelParallelTestShared._build_tables_and_groups``, copied: that class sits in the same unimportable
module): four tables of 16 to 40 columns, two more that look up ``feature_0`` and ``feature_1`` again
(shared features), two weighted tables.

Each CASE is ``kind[:flag...]``: kind ``tw`` | ``rw`` | ``cw`` | ``twcw`` | ``twrw`` | ``dp`` (the
sharder's one sharding type); flags ``mean`` (mean-pooled tables), ``vb`` (``variable_batch_size``),
``ec`` (``EmbeddingConfig`` tables: TestSparseNN's ``EmbeddingCollection`` arch, no weighted tables),
``uneven`` (column-wise blocks of unequal width: TorchRec's ``column_wise(size_per_rank=...)`` on the
planner's plan), ``noshared`` (without the two tables that look a feature up again), ``inbackward``
(TorchRec's ``apply_optimizer_in_backward`` SGD on the tables instead of ``fused_params``), ``vbe``
(variable batch per feature: ``ModelInput.generate_variable_batch_input``). The same program runs on
graphshard's DMP, on TorchRec's DMP under the same plan, and unsharded (TorchRec's harness reference:
SGD 0.1 on the global batch), for ``STEPS`` steps; rank 0 reports losses, the predictions after the
steps, every state-dict entry, state-dict keys and shapes and ``named_parameters`` names of each. Where
TorchRec's DMP raises, its error is the result (the test decides whether that is a known CPU limit).
"""

from __future__ import annotations

import os
import sys
import traceback

import torch
import torch.distributed as dist

from _compare import seq_err, tensor_err, worst
from _runner import lowering, run_cases
from dmp import _full

STEPS = 2
BATCH = 4          # per rank, the harness's default
FLOAT_FEATURES = 16
LR = 0.1           # create_test_sharder's fused learning rate and the harness's dense SGD
KINDS = {"tw": "table_wise", "rw": "row_wise", "cw": "column_wise", "twcw": "table_column_wise",
         "twrw": "table_row_wise", "dp": "data_parallel"}


def tables(flags: list[str]):
    """TorchRec's ``ModelParallelTestShared._build_tables_and_groups`` (4 features, 2 shared, 2 weighted)."""
    from torchrec.modules.embedding_configs import EmbeddingBagConfig, EmbeddingConfig, PoolingType

    n, shared, nw = 4, 2, 2
    names = [f"table_{i}" for i in range(n + shared)]
    pooling = {"pooling": PoolingType.MEAN} if "mean" in flags else {}
    if "ec" in flags:  # a sequence collection's tables share one dim
        make = lambda i, name: EmbeddingConfig(num_embeddings=(i + 1) * 10, embedding_dim=16, name=name,
                                               feature_names=[f"feature_{i}"])
    else:
        make = lambda i, name: EmbeddingBagConfig(num_embeddings=(i + 1) * 10, embedding_dim=(i + 2) * 8, name=name,
                                                  feature_names=[f"feature_{i}"], **pooling)
    if "noshared" in flags:  # no feature looked up twice (what graphshard took before shared features)
        shared = 0
    unweighted = [make(i, names[i]) for i in range(n)] + [make(i, names[i + n]) for i in range(shared)]
    weighted = [] if "ec" in flags else [
        EmbeddingBagConfig(num_embeddings=(i + 1) * 10, embedding_dim=(i + 2) * 4, name=f"weighted_table_{i}",
                           feature_names=[f"weighted_feature_{i}"]) for i in range(nw)]
    shared_features = [f"feature_{i}" for i in range(shared)]
    groups = {"group_0": [f"{f}@{t.name}" if f in shared_features else f for t in unweighted for f in t.feature_names]}
    return unweighted, weighted, groups


def _model(unweighted, weighted, groups, sparse_device):
    from torchrec.distributed.test_utils.test_model import TestSparseNN

    return TestSparseNN(tables=unweighted, weighted_tables=weighted or None, embedding_groups=groups,
                        num_float_features=FLOAT_FEATURES, dense_device=torch.device("cpu"),
                        sparse_device=sparse_device)


def _sharders(kind: str, flags: list[str]):
    from torchrec.distributed.test_utils.emb_sharder import TestEBCSharder, TestECSharder

    fused = {} if "inbackward" in flags else {"learning_rate": LR}  # create_test_sharder's default
    cls = TestECSharder if "ec" in flags else TestEBCSharder
    return [cls(KINDS[kind], "fused" if kind != "dp" else "dense", fused, {})]


def _plan(kind: str, flags: list[str], model, sharders, world: int):
    from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology

    names = [c.name for m in model.modules() if hasattr(m, "embedding_bag_configs") or hasattr(m, "embedding_configs")
             for c in (m.embedding_bag_configs() if hasattr(m, "embedding_bag_configs") else m.embedding_configs())]
    constraints = {n: ParameterConstraints(min_partition=4) for n in names} if kind in ("cw", "twcw") else None
    planner = EmbeddingShardingPlanner(topology=Topology(world_size=world, compute_device="cpu",
                                                         local_world_size=world), constraints=constraints)
    plan = planner.collective_plan(model, sharders, dist.group.WORLD)
    if "uneven" in flags:  # TorchRec's planner cuts equal blocks; its column_wise(size_per_rank=) helper does not
        from torchrec.distributed.sharding_plan import column_wise, construct_module_sharding_plan

        for fqn in plan.plan:
            module = model.get_submodule(fqn)
            configs = module.embedding_bag_configs() if hasattr(module, "embedding_bag_configs") else \
                module.embedding_configs()
            plan.plan[fqn] = construct_module_sharding_plan(module, per_param_sharding={
                c.name: column_wise(size_per_rank=[4, c.embedding_dim - 4], compute_kernel="fused") for c in configs},
                world_size=world, device_type="cpu", sharder=sharders[0])
    return plan


def inputs(unweighted, weighted, flags: list[str], world: int):
    """``STEPS`` (global batch, [each rank's batch]) from TorchRec's generators."""
    from torchrec.distributed.test_utils.test_model import ModelInput

    out = []
    for step in range(STEPS):
        if "vbe" in flags:
            out.append(ModelInput.generate_variable_batch_input(
                average_batch_size=BATCH, world_size=world, num_float_features=FLOAT_FEATURES, tables=unweighted,
                weighted_tables=weighted, random_seed=100 + step))
        else:
            out.append(ModelInput.generate(batch_size=BATCH, world_size=world, num_float_features=FLOAT_FEATURES,
                                           tables=unweighted, weighted_tables=weighted,
                                           variable_batch_size="vb" in flags, random_seed=100 + step))
    return out


def _in_backward(model) -> None:
    """The harness's ``apply_optimizer_in_backward_config``: SGD on every table."""
    from torch.distributed.optim import _apply_optimizer_in_backward as apply_optimizer_in_backward

    params = [p for n, p in model.named_parameters() if "embedding_bags" in n or "embeddings" in n]
    apply_optimizer_in_backward(torch.optim.SGD, params, {"lr": LR})


def _copy_in(dmp, glob: dict) -> None:
    """The harness's ``copy_state_dict``: the global model's weights into each sharded piece (TorchRec's
    ShardedTensors and DTensors by their shards' offsets; graphshard's through ``load_state_dict``,
    which takes full tensors)."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    if not hasattr(dmp, "_plan_estimate"):  # TorchRec's DMP
        with torch.no_grad():
            for k, v in dmp.state_dict().items():
                if isinstance(v, ShardedTensor):
                    for s in v.local_shards():
                        (r, c), (nr, nc) = s.metadata.shard_offsets, s.metadata.shard_sizes
                        s.tensor.copy_(glob[k][r:r + nr, c:c + nc])
                elif hasattr(v, "to_local") and hasattr(v.to_local(), "local_shards"):
                    w = v.to_local()
                    for piece, off in zip(w.local_shards(), w.local_offsets()):
                        piece.copy_(glob[k][off[0]:off[0] + piece.shape[0], off[1]:off[1] + piece.shape[1]])
                elif k in glob:
                    v.copy_(glob[k])
        return
    dmp.load_state_dict({k: v for k, v in glob.items()})


def _train(dmp, batches, rank: int) -> tuple[list[float], torch.Tensor]:
    """The harness's ``gen_full_pred_after_one_step`` per step (CombinedOptimizer of the fused one and
    SGD on the dense parameters), then the prediction in eval mode."""
    from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
    from torchrec.optim.optimizers import in_backward_optimizer_filter

    dense = KeyedOptimizerWrapper(dict(in_backward_optimizer_filter(dmp.named_parameters())),
                                  lambda params: torch.optim.SGD(params, lr=LR))
    opt = CombinedOptimizer([dmp.fused_optimizer, dense])
    losses = []
    for _, local in batches:
        opt.zero_grad()
        dmp.train(True)
        loss, _ = dmp(local[rank])
        loss.backward()
        opt.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(float(mean) / dist.get_world_size())
    with torch.no_grad():
        dmp.train(False)
        pred = dmp(batches[-1][1][rank])
    parts = [None] * dist.get_world_size()  # the ranks' batches may differ (variable_batch_size)
    dist.all_gather_object(parts, pred.detach())
    return losses, torch.cat(parts)


def _reference(global_model, batches) -> tuple[list[float], torch.Tensor]:
    """TorchRec's harness reference: the unsharded model, SGD 0.1 on the global batch."""
    opt = torch.optim.SGD(global_model.parameters(), lr=LR)
    losses = []
    for glob, _ in batches:
        opt.zero_grad()
        global_model.train(True)
        loss, _ = global_model(glob)
        loss.backward()
        opt.step()
        losses.append(float(loss))
    with torch.no_grad():
        global_model.train(False)
        return losses, global_model(batches[-1][0])


def _side(which: str, kind, flags, unweighted, weighted, groups, glob_state, batches, rank, world):
    """One DMP (graphshard's or TorchRec's) through the harness: its results, or its error."""
    from torchrec.distributed.types import ShardingEnv

    local = _model(unweighted, weighted, groups, torch.device("meta"))
    if "inbackward" in flags:
        _in_backward(local)
    sharders = _sharders(kind, flags)
    plan = _plan(kind, flags, local, sharders, world)
    env = ShardingEnv.from_process_group(dist.group.WORLD)
    if which == "graphshard":
        from graphshard.model_parallel import DistributedModelParallel

        dmp = DistributedModelParallel(local, env=env, device=torch.device("cpu"), plan=plan, sharders=sharders,
                                       lower=lowering())
    else:
        from torchrec.distributed.model_parallel import DistributedModelParallel

        dmp = DistributedModelParallel(local, env=env, device=torch.device("cpu"), plan=plan, sharders=sharders)
    _copy_in(dmp, glob_state)
    losses, pred = _train(dmp, batches, rank)
    state = dmp.state_dict()
    report = ""
    if which == "graphshard" and rank == 0:
        import graphshard

        report = graphshard.explain(dmp)
    return {
        "explain": report,
        "losses": losses, "pred": pred,
        "state": {k: _full(v) for k, v in state.items()},
        "shapes": {k: list(v.shape) if hasattr(v, "shape") else list(v.size()) for k, v in state.items()},
        "names": [n for n, _ in dmp.named_parameters()],
        "names_prefixed": [n for n, _ in dmp.named_parameters(prefix="m")],
        "names_shallow": [n for n, _ in dmp.named_parameters(recurse=False)],
        "plan": {t: [ps.sharding_type, [(md.placement.rank(), md.shard_offsets[1], md.shard_sizes[1])
                                        for md in ps.sharding_spec.shards] if ps.sharding_spec else None]
                 for mp in plan.plan.values() for t, ps in mp.items()},
    }


def _error(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:400]


def run(case: str) -> dict:
    kind, *flags = case.split(":")
    rank, world = dist.get_rank(), dist.get_world_size()
    unweighted, weighted, groups = tables(flags)
    torch.manual_seed(0)
    global_model = _model(unweighted, weighted, groups, torch.device("cpu"))
    if "inbackward" in flags:
        _in_backward(global_model)
    batches = inputs(unweighted, weighted, flags, world)
    glob_state = {k: v.detach().clone() for k, v in global_model.state_dict().items()}
    try:
        ref_losses, ref_pred = _reference(global_model, batches)
    except Exception as e:  # noqa: BLE001 - TorchRec's own model cannot run this configuration even unsharded
        return {"case": case, "lowering": lowering(), "errors": {"reference": _error(e)}}
    ref_state = {k: v.detach().clone() for k, v in global_model.state_dict().items()}

    sides, errors = {}, {}
    for which in ("graphshard", "torchrec"):
        try:
            sides[which] = _side(which, kind, flags, unweighted, weighted, groups, glob_state, batches, rank, world)
        except Exception as e:  # noqa: BLE001 - the error is the result (a refusal, or the peer's CPU limit)
            errors[which] = _error(e)
            if os.environ.get("GS_PEER_TRACE"):
                traceback.print_exc()
            dist.barrier()

    def against(a: dict, b_losses, b_pred, b_state) -> dict:
        return {"loss": seq_err(a["losses"], b_losses), "pred": tensor_err(a["pred"], b_pred),
                "params": {k: tensor_err(a["state"][k], b_state[k]) for k in b_state
                           if k in a["state"] and b_state[k].is_floating_point()
                           and tuple(a["state"][k].shape) == tuple(b_state[k].shape)},
                "keys_missing": sorted(set(b_state) - set(a["state"])),
                "keys_extra": sorted(set(a["state"]) - set(b_state))}

    gs, tr = sides.get("graphshard"), sides.get("torchrec")
    out = {"case": case, "lowering": lowering(), "errors": errors,
           "moved": {k: tensor_err(ref_state[k], glob_state[k]) for k in ref_state if k.endswith(".weight")},
           "tables": [k for k in ref_state if ".embedding_bags." in k or ".embeddings." in k]}
    if gs:
        out["gs_ref"] = against(gs, ref_losses, ref_pred, ref_state)
        out["plan"] = gs["plan"]
        out["gs_shapes"], out["gs_names"], out["explain"] = gs["shapes"], gs["names"], gs["explain"]
        out["gs_names_prefixed"], out["gs_names_shallow"] = gs["names_prefixed"], gs["names_shallow"]
    if tr:
        out["tr_ref"] = against(tr, ref_losses, ref_pred, ref_state)
        out["tr_shapes"], out["tr_names"] = tr["shapes"], tr["names"]
        out["tr_names_prefixed"], out["tr_names_shallow"] = tr["names_prefixed"], tr["names_shallow"]
        out.setdefault("plan", tr["plan"])
    if gs and tr:
        out["gs_tr"] = against(gs, tr["losses"], tr["pred"], tr["state"])
    for key in ("gs_ref", "tr_ref", "gs_tr"):
        if key in out:
            out[key]["worst_param"] = worst(out[key]["params"].values())
    return out


if __name__ == "__main__":
    run_cases(sys.argv[1:], run)
