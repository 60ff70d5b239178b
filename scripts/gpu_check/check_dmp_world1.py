"""Section 6's part ``dmp_world1``: graphshard's TorchRec ``DistributedModelParallel`` on a real
one-rank group (NCCL on the GPU; gloo and the Triton interpreter in the dry run), in a child process
(the section's own default group is the fake one):

    python scripts/gpu_check/check_dmp_world1.py [--dry]     # prints one "@@result {json}" line

TorchRec's ``DLRM`` with dense sizes that are no multiples of 4 (dense in 7, dense arch [13, D],
over arch [11, 1]: their gradients are cut from one reduced bucket, see
``tests/test_bucket_ops.py``), three tables (table-wise, row-wise, column-wise; a column-wise table
in two blocks on one rank has no DTensor form and is refused by name), the tables' fused row-wise Adagrad from the sharder's ``fused_params``
(TorchRec's ``"fused"`` kernel: graphshard's Triton TBE on CUDA) and SGD on the dense part, for
``STEPS`` steps. The reference is the unwrapped model on the same device in plain torch: SGD on the
dense parameters and row-wise Adagrad written out on each table's column blocks.
"""

from __future__ import annotations

import copy
import json
import os
import sys

STEPS = 3
LR, EPS = 0.05, 1e-8
GPU = dict(rows=20000, dim=64, batch=512)
DRY = dict(rows=60, dim=8, batch=6)
TABLES = ("t_tw", "t_rw", "t_cw")


def build(cfg):
    import torch
    from torchrec.models.dlrm import DLRM
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    tables = [EmbeddingBagConfig(name=n, embedding_dim=cfg["dim"], num_embeddings=cfg["rows"] // (i + 1),
                                 feature_names=[f"f_{n}"]) for i, n in enumerate(TABLES)]
    torch.manual_seed(0)
    return DLRM(embedding_bag_collection=EmbeddingBagCollection(tables=tables, device=torch.device("cpu")),
                dense_in_features=7, dense_arch_layer_sizes=[13, cfg["dim"]], over_arch_layer_sizes=[11, 1])


def batches(cfg, dev):
    import torch
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(STEPS):
        B = cfg["batch"]
        lengths = torch.randint(0, 5, (len(TABLES) * B,), generator=g)
        ids = torch.cat([torch.randint(0, cfg["rows"] // (i + 1), (int(n),), generator=g)
                         for i, n in enumerate(lengths.view(len(TABLES), B).sum(1))])
        # a few hot rows, so the fused update sums several occurrences of one row
        ids[::7] = 0  # row 0 of each table
        kjt = KeyedJaggedTensor(keys=[f"f_{n}" for n in TABLES], values=ids, lengths=lengths)
        out.append((torch.randn(B, 7, generator=g).to(dev), kjt.to(dev), torch.rand(B, generator=g).round().to(dev)))
    return out


def loss_of(out, labels):
    import torch.nn.functional as F

    return F.binary_cross_entropy_with_logits(out.reshape(-1).float(), labels)


def column_blocks(plan) -> dict:
    """table name -> the (first column, width) of each of its shards."""
    return {t: sorted({(md.shard_offsets[1], md.shard_sizes[1]) for md in ps.sharding_spec.shards})
            for t, ps in plan.items()}


def reference(base, data, blocks: dict, dev) -> tuple[list[float], dict]:
    """The unwrapped model in plain torch: dense SGD; each table's row-wise Adagrad per column block."""
    import torch

    ref = copy.deepcopy(base).to(dev)
    state: dict = {}
    losses = []
    for dense, kjt, labels in data:
        loss = loss_of(ref(dense, kjt), labels)
        loss.backward()
        with torch.no_grad():
            for name, p in ref.named_parameters():
                table = name.split(".")[-2]
                if table in blocks:
                    for c0, nc in blocks[table]:
                        g, w = p.grad[:, c0:c0 + nc], p[:, c0:c0 + nc]
                        st = state.setdefault((name, c0), torch.zeros(p.shape[0], device=dev))
                        st += (g * g).mean(1)
                        w -= LR * g / (st.sqrt() + EPS).unsqueeze(1)
                else:
                    p -= LR * p.grad
                p.grad = None
        losses.append(float(loss))
    return losses, {k: v.detach() for k, v in ref.state_dict().items()}


def full(value):
    """A state-dict entry as one tensor (a ShardedTensor's local shards assembled: world 1 holds all)."""
    import torch
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    if isinstance(value, ShardedTensor):
        shards = value.local_shards()
        out = torch.zeros(value.size(), dtype=shards[0].tensor.dtype, device=shards[0].tensor.device)
        for s in shards:
            (r, c), (nr, nc) = s.metadata.shard_offsets, s.metadata.shard_sizes
            out[r:r + nr, c:c + nc] = s.tensor
        return out
    return value.full_tensor() if hasattr(value, "full_tensor") else value.detach()


def run(dry: bool) -> dict:
    import torch
    import torch.distributed as dist
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.sharding_plan import column_wise, construct_module_sharding_plan, row_wise, table_wise
    from torchrec.distributed.types import ShardingPlan

    import graphshard
    from graphshard.model_parallel import DistributedModelParallel

    cfg = DRY if dry else GPU
    dev = torch.device("cpu") if dry else torch.device("cuda", 0)
    base = build(cfg)
    model = copy.deepcopy(base)
    ebc = model.sparse_arch.embedding_bag_collection
    per = {"t_tw": table_wise(rank=0, compute_kernel="fused"), "t_rw": row_wise(compute_kernel="fused"),
           "t_cw": column_wise(ranks=[0], compute_kernel="fused")}
    module_plan = construct_module_sharding_plan(ebc, per_param_sharding=per, world_size=dist.get_world_size(),
                                                 device_type=dev.type)
    fused = {"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": LR, "eps": EPS}
    dmp = DistributedModelParallel(model, device=dev, plan=ShardingPlan({"sparse_arch.embedding_bag_collection":
                                                                          module_plan}),
                                   sharders=[EmbeddingBagCollectionSharder(fused_params=fused)])
    data = batches(cfg, dev)
    dense = torch.optim.SGD([p for p in dmp.parameters() if p.requires_grad], lr=LR)
    losses = []
    for x, kjt, labels in data:
        loss = loss_of(dmp(x, kjt), labels)
        loss.backward()
        dense.step()
        dense.zero_grad(set_to_none=True)
        losses.append(float(loss))
    got = {k: full(v) for k, v in dmp.state_dict().items()}
    ref_losses, want = reference(base, data, column_blocks(module_plan), dev)
    init = base.state_dict()
    diffs = {k: float((got[k].float() - want[k].float()).abs().max()) for k in want if k in got}
    report = graphshard.explain(dmp.module)
    return {"losses": losses, "ref_losses": ref_losses, "loss_diff": max(abs(a - b) for a, b in zip(losses, ref_losses)),
            "param_diff": max(diffs.values()), "worst_param": max(diffs, key=diffs.get),
            "missing_keys": sorted(set(want) - set(got)), "finite": all(bool(torch.isfinite(v).all())
                                                                      for v in got.values()),
            "tables_moved": min(float((want[k].cpu() - init[k]).abs().max()) for k in want if k.endswith(".weight")
                                and k.split(".")[-2] in TABLES),
            "kernels": [l.strip() for l in report.splitlines() if any(w in l.lower() for w in ("kernel", "fbgemm", "triton", "tbe"))][:6],
            "dense": "DLRM dense 7 -> [13, %d], over [11, 1]" % cfg["dim"], "batch": cfg["batch"],
            "rows": cfg["rows"], "dim": cfg["dim"], "steps": STEPS}


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from check_common import bootstrap, init_world1

    bootstrap()
    dry = "--dry" in sys.argv
    init_world1(dry)
    print("@@result " + json.dumps(run(dry)), flush=True)
