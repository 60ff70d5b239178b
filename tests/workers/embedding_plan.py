"""``ShardEmbedding`` plan specs on plain ``nn.EmbeddingBag`` modules:
``torchrun --nproc-per-node N tests/workers/embedding_plan.py CASE [CASE ...]``.

CASE is ``mesh:optimizer[:flag ...]``: ``dp`` (a 1-D mesh; the dense layers FullyShard), ``dp_tp`` (a
2 x 2 mesh; the MLP tensor-parallel on "tp", FullyShard on "dp") or ``auto`` (a 1-D mesh, the
plan from ``graphshard.auto_plan`` in a small memory budget), ``optimizer`` sgd |
rowwise_adagrad; flags ``triton`` (the tables on graphshard's Triton TBE), ``cw12`` (the
column-wise table 12 wide: shards 6 wide on 2 ranks, which fbgemm's TBE cannot hold),
``nofbgemm`` (``fbgemm_gpu`` cannot be imported in this process: the whole program runs without
it; give such a case a job of its own). Four bags: row-wise (1-D ids with offsets), table-wise on rank 1 (mean), column-wise,
data-parallel (2-D ids), over the "dp" axis. The model trains 4 steps with
``graphshard.compile`` and in one process on the global batch (dense parameters and the
data-parallel table: SGD; sharded tables: the fused optimizer's update written in torch, on the
global batch's mean gradient). Rank 0 reports the largest differences (parameters read back
through ``state_dict()``) and the state-dict keys.
"""

from __future__ import annotations

import copy
import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn

if any("nofbgemm" in case for case in sys.argv[1:]):
    sys.modules["fbgemm_gpu"] = None  # `import fbgemm_gpu` raises ImportError from here on

from _compare import seq_err, tensor_err, worst  # noqa: E402
from _runner import lowering, run_cases  # noqa: E402
from dmp import _full as _full_1d  # noqa: E402  # a state-dict entry as the full tensor on every rank (1-D meshes)


def _full(v, copies: int = 1):
    """``copies``: how many groups along the embedding axis hold the same table (the tp size).
    Each copy's pieces are summed with the others' (``_full_1d`` reduces over the whole world), so
    the result is their mean; ``_copies_spread`` checks that the copies are equal."""
    from torch.distributed.tensor import DTensor

    if isinstance(v, DTensor) and v.device_mesh.ndim > 1:  # the dense parameters on the 2-D mesh
        return v.full_tensor()
    full = _full_1d(v)
    return full / copies if isinstance(v, DTensor) else full


def _copies_spread(v) -> float:
    """How far apart the copies of a table held by several groups are: every rank's local piece is
    compared with the pieces of the ranks at the same coordinate of their own group (0.0: equal)."""
    from torch.distributed.tensor import DTensor

    if not isinstance(v, DTensor) or v.device_mesh.ndim > 1:
        return 0.0
    pieces = [None] * dist.get_world_size()
    dist.all_gather_object(pieces, (tuple(v.device_mesh.get_coordinate() or ()), v.to_local().detach()))
    by_coord: dict = {}
    for coord, piece in pieces:
        by_coord.setdefault(coord, []).append(piece)
    return worst(tensor_err(p, same[0]) for same in by_coord.values() for p in same)

STEPS, BATCH, LR, EPS = 4, 6, 0.05, 1e-8
SHARDED = {"emb_rw": "row_wise", "emb_tw": "table_wise", "emb_cw": "column_wise", "emb_dp": "data_parallel"}


class Net(nn.Module):
    def __init__(self, cw_dim: int = 8):
        super().__init__()
        torch.manual_seed(0)
        self.emb_rw = nn.EmbeddingBag(50, 8, mode="sum")
        self.emb_tw = nn.EmbeddingBag(30, 8, mode="mean")
        self.emb_cw = nn.EmbeddingBag(24, cw_dim, mode="sum")
        self.emb_dp = nn.EmbeddingBag(12, 8, mode="sum")
        self.up = nn.Linear(24 + cw_dim, 16)
        self.down = nn.Linear(16, 1)

    def forward(self, ids_rw, offsets_rw, ids_tw, ids_cw, ids_dp):
        x = torch.cat([self.emb_rw(ids_rw, offsets_rw), self.emb_tw(ids_tw), self.emb_cw(ids_cw), self.emb_dp(ids_dp)], 1)
        return self.down(torch.relu(self.up(x))).squeeze(1)


def batch(step: int, rank: int):
    g = torch.Generator().manual_seed(100 * step + rank)
    lengths = torch.randint(0, 4, (BATCH,), generator=g)
    ids_rw = torch.randint(0, 50, (int(lengths.sum()),), generator=g)
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)[:-1]])
    return (ids_rw, offsets, torch.randint(0, 30, (BATCH, 3), generator=g), torch.randint(0, 24, (BATCH, 2), generator=g),
            torch.randint(0, 12, (BATCH, 2), generator=g)), torch.randint(0, 2, (BATCH,), generator=g).float()


def global_batch(step: int, world: int):
    parts = [batch(step, r) for r in range(world)]
    ids = torch.cat([p[0][0] for p in parts])
    starts, at = [], 0
    for p in parts:
        starts.append(p[0][1] + at)
        at += p[0][0].numel()
    return (ids, torch.cat(starts), *(torch.cat([p[0][i] for p in parts]) for i in (2, 3, 4))), torch.cat([p[1] for p in parts])


def loss_of(out, y):
    return nn.functional.binary_cross_entropy_with_logits(out, y)


def reference(base, optimizer: str, world: int, sharded: dict | None = None) -> tuple[dict, list]:
    """``sharded``: module -> sharding type (default ``SHARDED``; column-wise over every rank)."""
    sharded = SHARDED if sharded is None else sharded
    ref = copy.deepcopy(base)
    state, losses = {}, []
    for step in range(STEPS):
        x, y = global_batch(step, world)
        loss = loss_of(ref(*x), y)
        loss.backward()
        losses.append(float(loss))
        with torch.no_grad():
            for name, p in ref.named_parameters():
                mod = name.split(".")[0]
                if sharded.get(mod, "data_parallel") != "data_parallel" and optimizer == "rowwise_adagrad":
                    dim = p.shape[1]
                    blocks = ([(0, dim)] if sharded[mod] != "column_wise"
                              else [(c * dim // world, dim // world) for c in range(world)])
                    for c0, nc in blocks:
                        g, w = p.grad[:, c0:c0 + nc], p[:, c0:c0 + nc]
                        st = state.setdefault((name, c0), torch.zeros(p.shape[0]))
                        st += (g * g).mean(1)
                        w -= LR * g / (st.sqrt() + EPS).unsqueeze(1)
                else:
                    p -= LR * p.grad
                p.grad = None
    return {k: v.detach().clone() for k, v in ref.state_dict().items()}, losses


def run(case: str) -> dict:
    import graphshard
    from graphshard import FullyShard, Plan, ShardEmbedding
    from graphshard.tensor_parallel import ColwiseParallel, RowwiseParallel
    from torch.distributed.device_mesh import init_device_mesh

    mesh_kind, optimizer, *flags = case.split(":")
    rank, world = dist.get_rank(), dist.get_world_size()
    base = Net(cw_dim=12 if "cw12" in flags else 8)
    model = copy.deepcopy(base)
    kw = dict(optimizer=optimizer, learning_rate=LR, eps=EPS)
    if "triton" in flags:  # graphshard's Triton TBE (under Triton's interpreter on the CPU)
        if not torch.cuda.is_available():
            os.environ["TRITON_INTERPRET"] = "1"  # read when the Triton kernels are first imported
        kw["kernel"] = "triton"
    embeddings = {"emb_rw": ShardEmbedding("row_wise", **kw), "emb_tw": ShardEmbedding("table_wise", ranks=(1,), **kw),
                  "emb_cw": ShardEmbedding("column_wise", **kw), "emb_dp": ShardEmbedding("data_parallel")}
    if mesh_kind == "dp":
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
        plan = Plan(mesh, {"": FullyShard(), **embeddings})
        dp_world, dp_rank = world, rank
    elif mesh_kind == "auto":  # graphshard.auto_plan chooses the dense units' and the tables' layouts
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
        plan = graphshard.auto_plan(model, mesh, memory_budget=8192, batch=batch(0, rank)[0], optimizer_states=0,
                                    table_optimizer=optimizer, learning_rate=LR)
        dp_world, dp_rank = world, rank
    else:
        mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))
        plan = Plan(mesh, {"": FullyShard(), "up": ColwiseParallel(), "down": RowwiseParallel(), **embeddings})
        dp_world, dp_rank = world // 2, mesh.get_local_rank("dp")
    graphshard.compile(model, plan, lower=lowering())
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR)
    losses = []
    for step in range(STEPS):
        x, y = batch(step, dp_rank)  # the tp ranks of one dp rank read the same batch
        loss = loss_of(model(*x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(float(mean) / world)
    state = {k: _full(v, world // dp_world) for k, v in model.state_dict().items()}
    spread = worst([_copies_spread(v) for v in model.state_dict().values()])  # every rank runs every gather
    chosen = {k: v.sharding_type for k, v in plan.rules.items() if isinstance(v, ShardEmbedding)}
    ref_state, ref_losses = reference(base, optimizer, dp_world, chosen)
    return {"case": case, "lowering": lowering(), "keys": sorted(state), "ref_keys": sorted(ref_state), "chosen": chosen,
            "notes": list(plan.notes),
            "loss": seq_err(losses, ref_losses), "copies_spread": spread,
            "params": {k: tensor_err(state[k], ref_state[k]) for k in ref_state if k in state},
            "explain": graphshard.explain(model) if rank == 0 else "",
            "fbgemm_loaded": sys.modules.get("fbgemm_gpu") is not None or hasattr(torch.ops.fbgemm, "permute_2D_sparse_data")}


if __name__ == "__main__":
    run_cases(sys.argv[1:], run)
