"""Section 5: the 4-rank programs on one GPU, through the ``fake`` process group (rank 0 of 4; every
collective returns at once, so values are meaningless: only shapes and the compiled collectives are
checked).

* ``fsdp_tp``: the benchmark ``Transformer`` (untied embeddings) on a ``("dp", "tp") = (2, 2)`` mesh with
  the project's hand tensor-parallel plan (``benchmarks/_tp_worker.tp_plan``, graphshard's styles) plus
  ``FullyShard`` units per block and the root; compiled with Inductor; one forward + backward + AdamW
  step. The collectives of the compiled graphs are counted from ``graphshard.explain``'s records.
* ``sparse``: ``nn.EmbeddingBag`` tables planned with ``ShardEmbedding(kernel="triton")`` (row-wise,
  table-wise on rank 0, column-wise) on a 1-D mesh of 4, beside a ``FullyShard`` dense part; compiled;
  one step; the compiled collectives counted. (The fake group cannot deliver what other ranks send,
  see ``sparse``: hence the table-wise table on rank 0.)
* ``sparse_world1``: the same plan on a real one-rank group (NCCL), in a child process: one step
  with meaningful values (finite output, the table updated by the fused optimizer).
* ``dmp``: graphshard's TorchRec ``DistributedModelParallel`` on a DLRM (table-wise, row-wise,
  column-wise tables), only where torchrec imports.
* ``dmp_world1``: the same on a real one-rank group (NCCL), in a child process
  (``check_dmp_world1.py``): a few steps against the unwrapped model in plain torch.
"""

from __future__ import annotations

from collections import Counter

GPU = dict(dim=512, layers=2, heads=8, vocab=4096, seq=256, batch=4, rows=20000, emb_dim=64, ids_batch=64)
DRY = dict(dim=64, layers=2, heads=4, vocab=256, seq=16, batch=2, rows=60, emb_dim=8, ids_batch=6)


def collective_counts(model) -> Counter:
    """(stage, kind, axis) -> count, over every graph graphshard compiled for ``model``."""
    return Counter((c.stage, c.kind, c.axis) for r in model._graphshard.explain for c in r.collectives)


def report_counts(res, name: str, counts: Counter) -> None:
    res.fig(**{f"{name}_collectives": {" ".join(k): v for k, v in sorted(counts.items())}})
    res.table(["stage", "collective", "mesh axis", "count"], [[*k, v] for k, v in sorted(counts.items())])


def step_adamw(model, loss) -> None:
    import torch

    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def fsdp_tp(res, cfg, dev) -> None:
    import torch
    from torch.distributed.device_mesh import init_device_mesh

    import graphshard
    import graphshard.tensor_parallel as gtp
    from _tp_worker import tp_plan
    from graphshard.testing.models import Transformer, TransformerConfig, lm_loss, token_batch

    mesh = init_device_mesh(dev.type, (2, 2), mesh_dim_names=("dp", "tp"))
    tcfg = TransformerConfig(vocab_size=cfg["vocab"], dim=cfg["dim"], n_layers=cfg["layers"], n_heads=cfg["heads"],
                             max_seq_len=cfg["seq"], tie_embeddings=False)
    torch.manual_seed(0)
    model = Transformer(tcfg).to(dev)
    rules = {**tp_plan(gtp, loss_parallel=False), "layers.*": graphshard.FullyShard(), "": graphshard.FullyShard()}
    res.line(f"FSDP + TP: Transformer dim {cfg['dim']}, {cfg['layers']} layers, {cfg['heads']} heads, vocab "
             f"{cfg['vocab']}; mesh (dp 2, tp 2); batch {cfg['batch']} x seq {cfg['seq']} per dp rank; one step.")
    graphshard.compile(model, graphshard.Plan(mesh, rules))
    x, y = (t.to(dev) for t in token_batch(0, cfg["batch"], cfg["seq"], cfg["vocab"]))
    logits = model(x)
    loss = lm_loss(logits, y)
    step_adamw(model, loss)
    res.check("FSDP + TP logits have the logical shape", tuple(logits.shape) == (cfg["batch"], cfg["seq"], cfg["vocab"]),
              f"{tuple(logits.shape)}")
    shards = {n: tuple(p.to_local().shape) for n, p in model.named_parameters()}
    res.check("parameters are DTensors over both mesh axes after the step",
              all(p.device_mesh.ndim == 2 for p in model.parameters()), f"e.g. layers.0.attn.wq.weight local "
              f"{shards.get('layers.0.attn.wq.weight')}")
    counts = collective_counts(model)
    report_counts(res, "fsdp_tp", counts)
    has = lambda stage, kind, axis: counts.get((stage, kind, axis), 0) > 0  # noqa: E731
    want = {"forward: all_gather over dp (FSDP units)": has("forward", "all_gather", "dp"),
            "forward: all_reduce over tp (row-wise linears)": has("forward", "all_reduce", "tp"),
            "backward: reduce_scatter over dp (gradients)": has("backward", "reduce_scatter", "dp"),
            "backward: all_reduce over tp (column-wise input gradients)": has("backward", "all_reduce", "tp")}
    for what, ok in want.items():
        res.check(f"compiled graphs contain {what}", ok)


class SparseNet:
    """Three ``nn.EmbeddingBag`` tables and an MLP (the class is made on first use: torch is imported late)."""

    @staticmethod
    def make(cfg):
        import torch
        import torch.nn as nn

        class Net(nn.Module):
            def __init__(self):
                super().__init__()
                rows, d = cfg["rows"], cfg["emb_dim"]
                self.emb_rw = nn.EmbeddingBag(rows, d, mode="sum")
                self.emb_tw = nn.EmbeddingBag(rows // 2, d, mode="mean")
                self.emb_cw = nn.EmbeddingBag(rows // 3, d, mode="sum")
                self.up = nn.Linear(3 * d, 64)
                self.down = nn.Linear(64, 1)

            def forward(self, ids_rw, offsets_rw, ids_tw, ids_cw):
                x = torch.cat([self.emb_rw(ids_rw, offsets_rw), self.emb_tw(ids_tw), self.emb_cw(ids_cw)], 1)
                return self.down(torch.relu(self.up(x))).squeeze(1)

        torch.manual_seed(0)
        return Net()


def sparse_plan(mesh, world: int):
    from graphshard import FullyShard, Plan, ShardEmbedding

    kw = dict(optimizer="rowwise_adagrad", learning_rate=0.05, kernel="triton")
    return Plan(mesh, {"": FullyShard(), "emb_rw": ShardEmbedding("row_wise", **kw),
                       "emb_tw": ShardEmbedding("table_wise", ranks=(0,), **kw),  # see `sparse`: rank 0 sends
                       "emb_cw": ShardEmbedding("column_wise", **kw)})


def sparse_step(cfg, dev, world: int, on_compiled=None) -> dict:
    """The sparse model planned and compiled on a 1-D mesh of ``world`` (the default group), one
    step; ``on_compiled(model)`` runs even when the step fails (a compiled program can fail to run)."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh

    import graphshard

    mesh = init_device_mesh(dev.type, (world,), mesh_dim_names=("dp",))
    model = SparseNet.make(cfg).to(dev)
    graphshard.compile(model, sparse_plan(mesh, world))
    B = cfg["ids_batch"]
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(1, 4, (B,), generator=g)
    ids_rw = torch.randint(0, cfg["rows"], (int(lengths.sum()),), generator=g)
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)[:-1]])
    ids_tw = torch.randint(0, cfg["rows"] // 2, (B, 3), generator=g)
    ids_cw = torch.randint(0, cfg["rows"] // 3, (B, 2), generator=g)
    def table():  # the row-wise table as a plain tensor (a DTensor in state_dict())
        t = model.state_dict()["emb_rw.weight"]
        return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()

    before = table() if world == 1 else None
    try:
        out = model(*(t.to(dev) for t in (ids_rw, offsets, ids_tw, ids_cw)))
        loss = out.float().square().mean()
        step_adamw(model, loss)
    finally:
        if on_compiled is not None:
            on_compiled(model)
    rec = {"out_shape": list(out.shape), "batch": B}
    if world == 1:  # a real group: the values mean something
        rec.update(loss=float(loss.detach()), finite=bool(torch.isfinite(out).all()),
                   table_updated=bool((table() != before).any()))
    return rec


def sparse_description(cfg) -> str:
    return (f"tables row-wise {cfg['rows']} x {cfg['emb_dim']}, table-wise (mean) {cfg['rows'] // 2} x "
            f"{cfg['emb_dim']} on rank 0, column-wise {cfg['rows'] // 3} x {cfg['emb_dim']}; "
            "ShardEmbedding(kernel='triton', rowwise_adagrad); dense part FullyShard")


def fake_all_to_all_writes(dev) -> bool:
    """Whether this torch's fake process group writes an all-to-all's output (torch 2.13 copies the
    rank's own input into it; torch 2.11 leaves it as allocated, so sizes sent by an all-to-all are
    uninitialized memory there)."""
    import torch
    import torch.distributed as dist

    out = torch.full((4,), -7, dtype=torch.int64, device=dev)
    dist.all_to_all_single(out, torch.ones(4, dtype=torch.int64, device=dev))
    return bool((out != -7).all())


def sparse(res, cfg, dev) -> None:
    from check_common import Skip

    if not fake_all_to_all_writes(dev):
        raise Skip("this torch's fake process group leaves all-to-all outputs unwritten, so the ids' split sizes "
                   "(sent by an all-to-all of lengths) would be uninitialized memory; part `sparse_world1` runs the "
                   "plan on a real group")
    res.line(f"Sparse at world 4 (fake group, 1-D mesh of 4): {sparse_description(cfg)}. The fake group cannot "
             "deliver what other ranks send: torch 2.13's copies this rank's own input into every receive slot (and "
             "refuses an all-to-all whose input is empty while something is to be received), older ones may leave "
             "outputs unwritten. The ids' split sizes travel by an all-to-all of lengths, so there they are this "
             "rank's own counts (or uninitialized memory); the table-wise table is on rank 0, which then sends in "
             "every all-to-all. Part `sparse_world1` runs the same plan on a real one-rank group.")

    def counted(model):
        counts = collective_counts(model)
        report_counts(res, "sparse", counts)
        res.check("compiled graphs contain all_to_all (ids to the table owners, pooled rows back)",
                  any(k[1] == "all_to_all" for k in counts), "")
        for line in (l for r in model._graphshard.explain for l in r.sparse):
            res.line(f"  - {line}")

    rec = sparse_step(cfg, dev, 4, on_compiled=counted)
    res.check("sparse model output has the per-rank batch shape", rec["out_shape"] == [rec["batch"]],
              f"{rec['out_shape']}")


def child_result(res, cmd: list[str], dry: bool, what: str) -> dict:
    """Runs a world-1 child (``cmd``, plus ``--dry`` in the dry run) within the part's time and
    returns the record it printed as its last ``@@result {json}`` line."""
    import json

    from check_common import child_env, run_launcher

    rc, out = run_launcher(cmd + (["--dry"] if dry else []), child_env(dry), res.left_s() - 2)
    lines = [l for l in out.splitlines() if l.startswith("@@result ")]
    if rc != 0 or not lines:
        tail = "\n".join(out.strip().splitlines()[-4:])
        raise RuntimeError(f"the world-1 {what} run exited {rc}: {tail[-800:]}")
    return json.loads(lines[-1][len("@@result "):])


def sparse_world1(res, cfg, dev, dry: bool) -> None:
    """The sparse plan on a real one-rank group (NCCL; gloo in the dry run), in a child process
    (this one's default group is the fake one)."""
    import sys

    rec = child_result(res, [sys.executable, __file__, "--sparse-world1"], dry, "sparse")
    res.fig(sparse_world1=rec)
    res.line(f"Sparse at world 1 ({'gloo' if dry else 'NCCL'}): loss {rec['loss']:.5f}")
    res.check("world-1 sparse step: output finite and of the batch's shape",
              rec["finite"] and rec["out_shape"] == [rec["batch"]], f"{rec['out_shape']}")
    res.check("world-1 sparse step: the row-wise table was updated by the fused optimizer", rec["table_updated"])


def dmp(res, cfg, dev) -> None:
    from check_common import Skip

    try:
        import torchrec  # noqa: F401
        from fbgemm_gpu.split_embedding_configs import EmbOptimType
    except ImportError as e:
        raise Skip(f"torchrec not importable ({type(e).__name__}: {e})") from None
    if not fake_all_to_all_writes(dev):
        raise Skip("this torch's fake process group leaves all-to-all outputs unwritten (see `sparse`)")
    import torch
    import torch.nn as nn
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.sharding_plan import column_wise, construct_module_sharding_plan, row_wise, table_wise
    from torchrec.distributed.types import ShardingPlan
    from torchrec.models.dlrm import DLRM
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    from graphshard.model_parallel import DistributedModelParallel

    d, rows, B = cfg["emb_dim"], cfg["rows"], cfg["ids_batch"]
    tables = [EmbeddingBagConfig(name=n, embedding_dim=d, num_embeddings=rows, feature_names=[f"f_{n}"])
              for n in ("t_tw", "t_rw", "t_cw")]
    torch.manual_seed(0)
    model = DLRM(embedding_bag_collection=EmbeddingBagCollection(tables=tables, device=torch.device("cpu")),
                 dense_in_features=8, dense_arch_layer_sizes=[16, d], over_arch_layer_sizes=[16, 1])
    ebc = model.sparse_arch.embedding_bag_collection
    per = {"t_tw": table_wise(rank=1, compute_kernel="fused"), "t_rw": row_wise(compute_kernel="fused"),
           "t_cw": column_wise(ranks=[0, 1, 2, 3], compute_kernel="fused")}
    plan = ShardingPlan({"sparse_arch.embedding_bag_collection": construct_module_sharding_plan(
        ebc, per_param_sharding=per, world_size=4, device_type=dev.type)})
    fused = {"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.05, "eps": 1e-8}
    res.line("TorchRec DLRM under graphshard's DistributedModelParallel (tw, rw, cw tables; fused row-wise Adagrad)")
    dmp_model = DistributedModelParallel(model, device=dev, plan=plan,
                                         sharders=[EmbeddingBagCollectionSharder(fused_params=fused)])
    g = torch.Generator().manual_seed(0)
    feats = [t.feature_names[0] for t in tables]
    lengths = torch.randint(0, 4, (len(feats) * B,), generator=g)
    kjt = KeyedJaggedTensor(keys=feats, values=torch.randint(0, rows, (int(lengths.sum()),), generator=g),
                            lengths=lengths)
    out = dmp_model(torch.randn(B, 8, generator=g).to(dev), kjt.to(dev))
    loss = nn.functional.binary_cross_entropy_with_logits(out.reshape(-1).float(), torch.zeros(B, device=dev))
    step_adamw(dmp_model, loss)
    res.check("DMP output has the per-rank batch shape", out.reshape(-1).shape[0] == B, f"{tuple(out.shape)}")


def dmp_world1(res, dry: bool) -> None:
    """``check_dmp_world1.py`` in a child process: losses and parameters against plain torch."""
    import os
    import sys

    from check_common import Skip

    try:
        import fbgemm_gpu  # noqa: F401 - TorchRec's sharder types import it (the CPU build will do)
        import torchrec  # noqa: F401
    except ImportError as e:
        raise Skip(f"torchrec not importable ({type(e).__name__}: {e})") from None
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "check_dmp_world1.py")
    rec = child_result(res, [sys.executable, script], dry, "DMP")
    res.fig(dmp_world1=rec)
    res.line(f"DMP at world 1 ({'gloo' if dry else 'NCCL'}): TorchRec {rec['dense']}; tables tw, rw, cw, "
             f"{rec['rows']} rows x {rec['dim']}, fused row-wise Adagrad, dense SGD; batch {rec['batch']}, "
             f"{rec['steps']} steps; losses {', '.join(f'{l:.6f}' for l in rec['losses'])}")
    for line in rec["kernels"]:
        res.line(f"  - {line}")
    res.check("world-1 DMP: every state-dict entry present and finite", rec["finite"] and not rec["missing_keys"],
              f"missing {rec['missing_keys']}")
    res.check("world-1 DMP: the tables moved (the fused update ran)", rec["tables_moved"] > 1e-4,
              f"{rec['tables_moved']:.2e}")
    res.check("world-1 DMP matches the unwrapped model in plain torch (1e-5)",
              rec["loss_diff"] <= 1e-5 and rec["param_diff"] <= 1e-5,
              f"max |loss diff| {rec['loss_diff']:.2e}, max |param diff| {rec['param_diff']:.2e} "
              f"({rec['worst_param']})")


def run(res, dry: bool) -> None:
    import torch.distributed as dist

    from check_common import device
    from graphshard._compat import fake_process_group_store

    dev = device(dry)
    if dev.type == "cuda":
        import torch

        torch.cuda.set_device(dev)
    dist.init_process_group("fake", store=fake_process_group_store(), rank=0, world_size=4)
    cfg = DRY if dry else GPU
    scale = 3 if dry else 1
    for name, need_s, part in (("fsdp_tp", 30, lambda: fsdp_tp(res, cfg, dev)),
                               ("sparse", 15, lambda: sparse(res, cfg, dev)),
                               ("sparse_world1", 20, lambda: sparse_world1(res, cfg, dev, dry)),
                               ("dmp", 15, lambda: dmp(res, cfg, dev)),
                               ("dmp_world1", 40, lambda: dmp_world1(res, dry))):
        with res.part(name):
            res.need(need_s * scale)  # seconds on an H100, compile included
            part()


if __name__ == "__main__":  # the world-1 sparse run (sparse_world1's child)
    import json
    import os
    import sys

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from check_common import bootstrap, device, init_world1

    bootstrap()
    dry = "--dry" in sys.argv
    init_world1(dry)
    print("@@result " + json.dumps(sparse_step(DRY if dry else GPU, device(dry), 1)), flush=True)
