"""DistributedModelParallel parity worker: ``torchrun --nproc-per-node N tests/workers/dmp.py CASE [CASE ...]``.

Each CASE is ``model:optimizer``: ``model`` dlrm (TorchRec's ``torchrec.models.dlrm.DLRM``, five
tables: table-wise, table-wise with mean pooling, row-wise, column-wise, data-parallel), dlrm4
(4 ranks as 2 hosts x 2: table-row-wise on each host, one with mean pooling, table-wise,
row-wise, data-parallel), weighted (a weighted collection: per-sample weights in the KJT;
table-wise, row-wise, column-wise), seq (an ``EmbeddingCollection`` with ``need_indices``, one row per id, scaled by its id's
parity, and a head over each feature's padded sequence: table-wise, row-wise, column-wise, a second table-wise
table beside a column block, data-parallel), seqtwo (a two-tower retrieval model: query and
item towers holding one ``EmbeddingCollection``, a dot-product score; table-wise and row-wise tables) or twotower (two towers holding one ``EmbeddingBagCollection`` under two FQNs: table-wise and
row-wise tables); TorchRec's own models: dcn (``DLRM_DCN``), projection (``DLRM_Projection``),
dlrmtrain (``DLRMTrain`` around ``DLRM``: a ``torchrec.datasets.utils.Batch`` in, its own loss out),
deepfm (``SimpleDeepFMNN``: ``DeepFM`` and ``FactorizationMachine``, a probability out) and sparsenn
(its test suite's ``TestSparseNN``: a ``ModelInput`` in, (loss, pred) out; an unweighted and a weighted
collection), four tables each, their plan without a flag cycling through the four types below;
flags ``tw`` | ``rw`` | ``cw`` | ``dp``: every table of the model table-wise (round-robin over the
ranks), row-wise, column-wise (over every rank) or data-parallel (then the dense SGD runs at
``LR_DP``), instead of the model's mixed plan (on ``seq``, ``dp`` keeps its meaning: its ``t_dp``
data-parallel in its mixed plan); flag ``planned``: ``plan=None``, graphshard's planner chooses,
TorchRec's DMP and the reference follow its plan (``gs_dmp.plan``); flag ``fsdp``: graphshard's dense part sharded (``FullyShardDense``; TorchRec's stays DDP);
flag ``ac``: the dense part (DLRM's dense and over arch) under torch's ``apply_activation_checkpointing``;
``optimizer`` the tables' fused optimizer: sgd | adagrad | rowwise_adagrad (from the sharder's
``fused_params``), or inbackward_<one of those> (from TorchRec's ``apply_optimizer_in_backward``).

The same program trains three times on one batch stream: with graphshard's
``DistributedModelParallel``, with TorchRec's (same plan, same fused optimizer, the same
initial weights copied into its shards), and unwrapped in one process on the global batch
(dense parameters and data-parallel tables: SGD on the mean loss; sharded tables: the fused
optimizer's update, written out in torch, on the same gradient: the kernels apply the global
batch's mean gradient, TorchRec's default gradient division). Rank 0 reports the largest loss
and parameter differences of each against the single process and of the two against each other.
graphshard's side lowers with Inductor, or as FX where the launch sets ``GS_TEST_LOWER=eager``.
Where TorchRec's DMP is known to raise on the program (``_torchrec_known_failure``: an
``EmbeddingCollection`` with a data-parallel table), that one error is caught and reported instead.
"""

from __future__ import annotations

import copy
import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn

from _compare import seq_err, tensor_err
from _runner import lowering, run_cases

STEPS = 4
BATCH = 8      # per rank
DENSE_IN = 7   # dense layers whose sizes are no multiples of 4 (their gradients, cut from one reduced
               # bucket, once failed Inductor's alignment check: tests/test_bucket_ops.py)
DIM = 8
SEQ = 4        # a sequence feature's padded length (ids per sample are 0..3)
LR = 0.05
LR_DP = 0.5    # the dense SGD's rate in a ``dp`` case (every table data-parallel, so trained by it):
               # DLRM_Projection's tables get small gradients (through the product of its interaction
               # branches) and at LR moved only ~2e-5 in STEPS steps, too little for a 1e-5 parity check
               # to tell an update from a partial one; at LR_DP they move ~1.3e-4
EPS = 1e-8


def _trec():
    from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    return EmbeddingBagConfig, PoolingType, EmbeddingBagCollection


def _tables(model: str):
    EmbeddingBagConfig, PoolingType, _ = _trec()
    if model == "seqtwo":
        from torchrec.modules.embedding_configs import EmbeddingConfig

        return [
            EmbeddingConfig(name="t_tw", embedding_dim=DIM, num_embeddings=40, feature_names=["f0"]),
            EmbeddingConfig(name="t_rw", embedding_dim=DIM, num_embeddings=50, feature_names=["f1", "f2"]),
        ]
    if model == "seq":
        from torchrec.modules.embedding_configs import EmbeddingConfig

        return [
            EmbeddingConfig(name="t_tw", embedding_dim=DIM, num_embeddings=40, feature_names=["f0", "f1"]),
            EmbeddingConfig(name="t_rw", embedding_dim=DIM, num_embeddings=50, feature_names=["f2"]),
            EmbeddingConfig(name="t_cw", embedding_dim=DIM, num_embeddings=24, feature_names=["f3"]),
            EmbeddingConfig(name="t_tw2", embedding_dim=DIM, num_embeddings=20, feature_names=["f4"]),
            EmbeddingConfig(name="t_dp", embedding_dim=DIM, num_embeddings=12, feature_names=["f5"]),
        ]
    if model == "dlrm4":
        return [
            EmbeddingBagConfig(name="t_twrw0", embedding_dim=DIM, num_embeddings=45, feature_names=["f0", "f1"]),
            EmbeddingBagConfig(name="t_twrw1", embedding_dim=DIM, num_embeddings=33, feature_names=["f2"],
                               pooling=PoolingType.MEAN),
            EmbeddingBagConfig(name="t_tw", embedding_dim=DIM, num_embeddings=30, feature_names=["f3"]),
            EmbeddingBagConfig(name="t_rw", embedding_dim=DIM, num_embeddings=50, feature_names=["f4"]),
            EmbeddingBagConfig(name="t_dp", embedding_dim=DIM, num_embeddings=12, feature_names=["f5"]),
        ]
    if model == "weighted":
        return [
            EmbeddingBagConfig(name="t_tw", embedding_dim=DIM, num_embeddings=40, feature_names=["f0", "f1"]),
            EmbeddingBagConfig(name="t_rw", embedding_dim=DIM, num_embeddings=50, feature_names=["f2"]),
            EmbeddingBagConfig(name="t_cw", embedding_dim=DIM, num_embeddings=24, feature_names=["f3"]),
        ]
    if model == "dlrm":
        return [
            EmbeddingBagConfig(name="t_tw", embedding_dim=DIM, num_embeddings=40, feature_names=["f0", "f1"]),
            EmbeddingBagConfig(name="t_mean", embedding_dim=DIM, num_embeddings=30, feature_names=["f2"],
                               pooling=PoolingType.MEAN),
            EmbeddingBagConfig(name="t_rw", embedding_dim=DIM, num_embeddings=50, feature_names=["f3"]),
            EmbeddingBagConfig(name="t_cw", embedding_dim=DIM, num_embeddings=24, feature_names=["f4"]),
            EmbeddingBagConfig(name="t_dp", embedding_dim=DIM, num_embeddings=12, feature_names=["f5"]),
        ]
    if model in ("dcn", "projection", "dlrmtrain", "deepfm"):  # one dimension (DLRM's and DeepFM's interactions)
        return [
            EmbeddingBagConfig(name="t0", embedding_dim=DIM, num_embeddings=40, feature_names=["f0", "f1"]),
            EmbeddingBagConfig(name="t1", embedding_dim=DIM, num_embeddings=30, feature_names=["f2"],
                               pooling=PoolingType.MEAN),
            EmbeddingBagConfig(name="t2", embedding_dim=DIM, num_embeddings=50, feature_names=["f3"]),
            EmbeddingBagConfig(name="t3", embedding_dim=DIM, num_embeddings=24, feature_names=["f4"]),
        ]
    if model == "sparsenn":
        return [t for ts in _collections(model).values() for t in ts]
    return [
        EmbeddingBagConfig(name="t_tw", embedding_dim=DIM, num_embeddings=40, feature_names=["f0"]),
        EmbeddingBagConfig(name="t_rw", embedding_dim=DIM, num_embeddings=50, feature_names=["f1", "f2"]),
    ]


def _collections(model: str) -> dict:
    """The model's embedding modules: FQN -> its tables (TestSparseNN has an unweighted and a weighted one)."""
    if model == "sparsenn":
        EmbeddingBagConfig, PoolingType, _ = _trec()
        return {
            "sparse.ebc": [
                EmbeddingBagConfig(name="t0", embedding_dim=DIM, num_embeddings=40, feature_names=["f0", "f1"]),
                EmbeddingBagConfig(name="t1", embedding_dim=DIM, num_embeddings=30, feature_names=["f2"],
                                   pooling=PoolingType.MEAN),
            ],
            "sparse.weighted_ebc": [
                EmbeddingBagConfig(name="w0", embedding_dim=DIM, num_embeddings=24, feature_names=["fw0"]),
                EmbeddingBagConfig(name="w1", embedding_dim=DIM, num_embeddings=20, feature_names=["fw1", "fw2"]),
            ],
        }
    return {_ebc_fqn(model): _tables(model)}


ONE_TYPE = ("tw", "rw", "cw", "dp")
"""The flags that put every table of the model under one sharding type (tests/test_model_parallel.py's grid)."""


def _one_type(model: str) -> str | None:
    """The case's one-sharding-type flag (every table of the model under it), if any. On ``seq``
    (not a grid model) ``dp`` keeps its own meaning: its mixed plan with ``t_dp`` data-parallel."""
    kinds = [f for f in _FLAGS if f in ONE_TYPE]
    if len(kinds) > 1:
        raise ValueError(f"one sharding type per case, not {kinds}")
    return kinds[0] if kinds and model != "seq" else None


def _sharding(model: str, world: int, fqn: str) -> dict:
    """The module ``fqn``'s tables -> TorchRec's parameter-sharding generators."""
    from torchrec.distributed.sharding_plan import column_wise, data_parallel, row_wise, table_row_wise, table_wise

    fused = _KERNEL[0]  # TorchRec's helpers default to the dense kernel on the CPU (no fused optimizer)
    kind = _one_type(model)
    if kind is not None or model not in _MIXED:
        # every table under one type (table-wise: round-robin over the ranks, counting the model's
        # tables across its modules); without a flag a new model's tables cycle through the four
        index = {t.name: i for i, t in enumerate(t for ts in _collections(model).values() for t in ts)}
        make = {"tw": lambda i: table_wise(rank=i % world, compute_kernel=fused),
                "rw": lambda i: row_wise(compute_kernel=fused),
                "cw": lambda i: column_wise(ranks=list(range(world)), compute_kernel=fused),
                "dp": lambda i: data_parallel()}
        return {t.name: make[kind or ONE_TYPE[index[t.name] % len(ONE_TYPE)]](index[t.name])
                for t in _collections(model)[fqn]}
    if model == "dlrm4":  # 4 ranks as 2 hosts x 2 (LOCAL_WORLD_SIZE=2)
        return {"t_twrw0": _fused_kernel(table_row_wise(host_index=0)), "t_twrw1": _fused_kernel(table_row_wise(host_index=1)),
                "t_tw": table_wise(rank=3, compute_kernel=fused), "t_rw": row_wise(compute_kernel=fused),
                "t_dp": data_parallel()}
    if model == "seq":  # t_tw2 on the rank that holds a column block of t_cw: two widths there
        return {"t_tw": table_wise(rank=0, compute_kernel=fused), "t_rw": row_wise(compute_kernel=fused),
                "t_cw": column_wise(ranks=list(range(world)), compute_kernel=fused),
                "t_tw2": table_wise(rank=world - 1, compute_kernel=fused),
                "t_dp": data_parallel() if "dp" in _FLAGS else table_wise(rank=0, compute_kernel=fused)}
    if model == "weighted":
        return {"t_tw": table_wise(rank=world - 1, compute_kernel=fused), "t_rw": row_wise(compute_kernel=fused),
                "t_cw": column_wise(ranks=list(range(world)), compute_kernel=fused)}
    if model == "dlrm":
        return {"t_tw": table_wise(rank=0, compute_kernel=fused), "t_mean": table_wise(rank=world - 1, compute_kernel=fused),
                "t_rw": row_wise(compute_kernel=fused), "t_cw": column_wise(ranks=list(range(world)), compute_kernel=fused),
                "t_dp": data_parallel()}
    return {"t_tw": table_wise(rank=world - 1, compute_kernel=fused), "t_rw": row_wise(compute_kernel=fused)}  # twotower, seqtwo


_MIXED = ("dlrm", "dlrm4", "seq", "weighted", "twotower", "seqtwo")
"""The models with their own mixed plan (without a one-type flag)."""


def _fused_kernel(generator):
    """TorchRec's ``table_row_wise`` helper takes no compute kernel (the CPU default is dense)."""
    def make(*args, **kwargs):
        ps = generator(*args, **kwargs)
        ps.compute_kernel = _KERNEL[0]
        return ps
    return make


class Tower(nn.Module):
    def __init__(self, ebc: nn.Module, width: int):
        super().__init__()
        self.ebc = ebc
        self.proj = nn.Linear(width, 8)

    def forward(self, kjt):
        return self.proj(self.ebc(kjt).values())


class Weighted(nn.Module):
    """One weighted ``EmbeddingBagCollection`` (per-sample weights in the KJT) and a head."""

    def __init__(self, ebc: nn.Module, width: int):
        super().__init__()
        self.ebc = ebc
        self.head = nn.Linear(width, 1)

    def forward(self, kjt):
        return self.head(self.ebc(kjt).values())


class Sequence(nn.Module):
    """An ``EmbeddingCollection`` (one row per id) and a head over each feature's padded sequence."""

    def __init__(self, ec: nn.Module, features: list[str]):
        super().__init__()
        self.ec = ec
        self.features = features
        self.head = nn.Linear(len(features) * SEQ * DIM, 1)

    def forward(self, kjt):
        return self.head(_padded(self.ec(kjt), self.features))


def _padded(seqs: dict, features: list[str]) -> torch.Tensor:
    """Each feature's rows padded to ``SEQ`` per sample, side by side: ``[batch, features * SEQ * DIM]``."""
    from torchrec.sparse.jagged_tensor import JaggedTensor

    x = []
    for f in features:
        jt = seqs[f]
        if jt.weights_or_none() is not None:  # need_indices: each row scaled by its id's parity
            jt = JaggedTensor(values=jt.values() * (1 + jt.weights() % 2).unsqueeze(1).to(jt.values().dtype),
                              lengths=jt.lengths())
        x.append(jt.to_padded_dense(SEQ).flatten(1))
    return torch.cat(x, dim=1)


class SeqTower(nn.Module):
    def __init__(self, ec: nn.Module, features: list[str]):
        super().__init__()
        self.ec = ec
        self.features = features
        self.proj = nn.Linear(len(features) * SEQ * DIM, 8)

    def forward(self, kjt):
        return self.proj(_padded(self.ec(kjt), self.features))


class SeqTwoTower(nn.Module):
    """Two towers holding one ``EmbeddingCollection`` (the shared sequence module)."""

    def __init__(self, ec: nn.Module, features: list[str]):
        super().__init__()
        self.query = SeqTower(ec, features)
        self.item = SeqTower(ec, features)

    def forward(self, query, item):
        return (self.query(query) * self.item(item)).sum(1)


class TwoTower(nn.Module):
    def __init__(self, ebc: nn.Module, width: int):
        super().__init__()
        self.query = Tower(ebc, width)
        self.item = Tower(ebc, width)

    def forward(self, query, item):
        return (self.query(query) * self.item(item)).sum(1)


def build(model: str) -> nn.Module:
    _, _, EmbeddingBagCollection = _trec()
    torch.manual_seed(0)
    tables = _tables(model)
    if model in ("seq", "seqtwo"):
        from torchrec.modules.embedding_modules import EmbeddingCollection

        ec = EmbeddingCollection(tables=tables, device=torch.device("cpu"), need_indices=model == "seq")
        return (Sequence if model == "seq" else SeqTwoTower)(ec, [f for t in tables for f in t.feature_names])
    if model == "sparsenn":  # TorchRec's test model: an unweighted and a weighted collection, its own loss
        from torchrec.distributed.test_utils.test_model import TestSparseNN

        colls = _collections(model)
        return TestSparseNN(tables=colls["sparse.ebc"], num_float_features=DENSE_IN,
                            weighted_tables=colls["sparse.weighted_ebc"],
                            submodule_kwargs={"dense_arch_out_size": 13, "dense_arch_hidden_sizes": [11],
                                              "over_arch_out_size": 7})
    ebc = EmbeddingBagCollection(tables=tables, device=torch.device("cpu"), is_weighted=model == "weighted")
    if model == "weighted":
        return Weighted(ebc, sum(t.embedding_dim * len(t.feature_names) for t in tables))
    dlrm = dict(embedding_bag_collection=ebc, dense_in_features=DENSE_IN, dense_arch_layer_sizes=[13, DIM],
                over_arch_layer_sizes=[11, 1])
    if model in ("dlrm", "dlrm4"):
        from torchrec.models.dlrm import DLRM

        return DLRM(**dlrm)
    if model == "dlrmtrain":  # TorchRec's training module: forward(Batch) -> (loss, (loss, logits, labels))
        from torchrec.models.dlrm import DLRM, DLRMTrain

        return DLRMTrain(DLRM(**dlrm))
    if model == "dcn":
        from torchrec.models.dlrm import DLRM_DCN

        return DLRM_DCN(**dlrm, dcn_num_layers=2, dcn_low_rank_dim=5)
    if model == "projection":
        from torchrec.models.dlrm import DLRM_Projection

        return DLRM_Projection(**dlrm, interaction_branch1_layer_sizes=[13, 2 * DIM],
                               interaction_branch2_layer_sizes=[11, 3 * DIM])
    if model == "deepfm":  # DeepFM and FactorizationMachine (torchrec.modules.deepfm); ends in a sigmoid
        from torchrec.models.deepfm import SimpleDeepFMNN

        return SimpleDeepFMNN(num_dense_features=DENSE_IN, embedding_bag_collection=ebc, hidden_layer_size=13,
                              deep_fm_dimension=11)
    return TwoTower(ebc, sum(t.embedding_dim * len(t.feature_names) for t in tables))


def _kjt(tables: list, gen: torch.Generator, weighted: bool = False):
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    feats = [f for t in tables for f in t.feature_names]
    lengths = torch.randint(0, 4, (len(feats) * BATCH,), generator=gen)
    values = []
    for i, f in enumerate(feats):
        rows = next(t for t in tables if f in t.feature_names).num_embeddings
        values.append(torch.randint(0, rows, (int(lengths[i * BATCH:(i + 1) * BATCH].sum()),), generator=gen))
    order = list(reversed(range(len(feats))))  # the KJT's keys in another order than the tables'
    l2 = lengths.view(len(feats), BATCH)[order].reshape(-1)
    v2 = torch.cat([values[i] for i in order])
    weights = torch.rand(v2.shape, generator=gen) if weighted else None
    return KeyedJaggedTensor(keys=[feats[i] for i in order], values=v2, lengths=l2, weights=weights)


def batch(model: str, step: int, rank: int):
    gen = torch.Generator().manual_seed(1000 * step + rank)
    labels = torch.randint(0, 2, (BATCH,), generator=gen).float()
    tables = _tables(model)
    if model == "sparsenn":  # TestSparseNN's ModelInput: the unweighted and the weighted (id-score) features
        from torchrec.distributed.test_utils.test_model import ModelInput

        colls = _collections(model)
        dense = torch.randn(BATCH, DENSE_IN, generator=gen)
        return (ModelInput(float_features=dense, idlist_features=_kjt(colls["sparse.ebc"], gen),
                           idscore_features=_kjt(colls["sparse.weighted_ebc"], gen, weighted=True), label=labels),), labels
    if model == "dlrmtrain":
        from torchrec.datasets.utils import Batch

        dense = torch.randn(BATCH, DENSE_IN, generator=gen)
        return (Batch(dense_features=dense, sparse_features=_kjt(tables, gen), labels=labels),), labels
    if model in ("dlrm", "dlrm4", "dcn", "projection", "deepfm"):
        return (torch.randn(BATCH, DENSE_IN, generator=gen), _kjt(tables, gen)), labels
    if model in ("weighted", "seq"):
        return (_kjt(tables, gen, weighted=model == "weighted"),), labels
    return (_kjt(tables, gen), _kjt(tables, gen)), labels


def loss_of(out, labels, model: str = ""):
    if isinstance(out, tuple):  # the model's own loss: DLRMTrain's (loss, (loss, logits, labels)), TestSparseNN's (loss, pred)
        return out[0]
    if model == "deepfm":  # SimpleDeepFMNN's output is a probability (its over arch ends in a sigmoid)
        return nn.functional.binary_cross_entropy(out.reshape(-1), labels)
    return nn.functional.binary_cross_entropy_with_logits(out.reshape(-1), labels)


_FLAGS: list[str] = []  # the running case's flags
_DENSE_LR = [LR]        # the running case's dense SGD rate (dense parameters and data-parallel tables)
_KERNEL = ["fused"]
"""The sharded tables' compute kernel in the plans ``_sharding`` builds: ``fused_triton`` for
graphshard's DMP in a ``triton`` case (TorchRec's DMP and the reference keep ``fused``: the same
math with fbgemm's kernel)."""


def _fused(optimizer: str) -> dict:
    from fbgemm_gpu.split_embedding_configs import EmbOptimType

    kind = {"sgd": EmbOptimType.EXACT_SGD, "adagrad": EmbOptimType.EXACT_ADAGRAD,
            "rowwise_adagrad": EmbOptimType.EXACT_ROWWISE_ADAGRAD}[optimizer]
    return {"optimizer": kind, "learning_rate": LR, "eps": EPS}


_PLANNED: list = []
"""``planned``: the plan graphshard's DMP chose with ``plan=None`` (its planner's collective plan),
which TorchRec's DMP and the reference then follow."""


def _plan(model: str, module: nn.Module, world: int):
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan
    from torchrec.distributed.types import ShardingPlan

    if _PLANNED:
        return _PLANNED[0]
    return ShardingPlan({fqn: construct_module_sharding_plan(module.get_submodule(fqn),
                                                             per_param_sharding=_sharding(model, world, fqn),
                                                             world_size=world, device_type="cpu")
                         for fqn in _collections(model)})


def _ebc_fqn(model: str) -> str:
    dlrm = "sparse_arch.embedding_bag_collection"
    return {"dlrm": dlrm, "dlrm4": dlrm, "dcn": dlrm, "projection": dlrm, "deepfm": dlrm,
            "dlrmtrain": "model." + dlrm, "weighted": "ebc", "seq": "ec", "seqtwo": "query.ec"}.get(model, "query.ebc")


def _attr(model: str) -> str:
    return "embeddings" if model.startswith("seq") else "embedding_bags"


def _table_fqns(model: str) -> list[str]:
    return [f"{fqn}.{_attr(model)}.{t.name}.weight" for fqn, tables in _collections(model).items() for t in tables]


def _sharder(model: str, fused: dict):
    if model.startswith("seq"):
        from torchrec.distributed.embedding import EmbeddingCollectionSharder

        return EmbeddingCollectionSharder(fused_params=dict(fused))
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder

    return EmbeddingBagCollectionSharder(fused_params=dict(fused))


def _compat_sharded(value) -> bool:
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    return isinstance(value, ShardedTensor)


def _full(value) -> torch.Tensor:
    """A state-dict entry as the full tensor on every rank (sharded tensors: pieces summed over ranks)."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor
    from torch.distributed.tensor import DTensor

    if isinstance(value, ShardedTensor):
        full = torch.zeros(value.size())
        for s in value.local_shards():
            (r, c), (nr, nc) = s.metadata.shard_offsets, s.metadata.shard_sizes
            full[r:r + nr, c:c + nc] = s.tensor
        dist.all_reduce(full)
        return full
    if isinstance(value, DTensor):
        return _full_dtensor(value)
    return value.detach().clone()


def _full_dtensor(value) -> torch.Tensor:
    from torch.distributed.tensor import Replicate

    full = torch.zeros(value.shape)
    mesh = value.device_mesh
    coord = mesh.get_coordinate()
    if coord is not None:
        local = value.to_local()
        p = value.placements[0]
        if isinstance(p, Replicate):
            if coord[0] == 0:
                full.copy_(local)
        else:
            n = value.shape[p.dim]
            chunk = -(-n // mesh.size())
            start = min(chunk * coord[0], n)
            full.narrow(p.dim, start, local.shape[p.dim]).copy_(local)
    dist.all_reduce(full)
    return full


def _step_reference(model, ref: nn.Module, opt_state: dict, optimizer: str, step: int, world: int) -> float:
    inputs = [batch(model, step, r) for r in range(world)]
    outs = [ref(*x) for x, _ in inputs]
    loss = sum(loss_of(o, y, model) for o, (_, y) in zip(outs, inputs)) / world
    loss.backward()
    with torch.no_grad():
        for fqn, mp in _plan(model, ref, world).plan.items():  # each sharded table once (a shared module too)
            tables = getattr(ref.get_submodule(fqn), _attr(model))
            for table, ps in mp.items():
                p = tables[table].weight
                if ps.sharding_type == "data_parallel" or p.grad is None:
                    continue
                # the fused optimizer's update on each shard's columns (row-wise Adagrad keeps one
                # value per row of each column block: a column-wise table's differs from a whole one's)
                blocks = sorted((md.shard_offsets[1], md.shard_sizes[1]) for md in ps.sharding_spec.shards)
                for c0, nc in dict.fromkeys(blocks):
                    g, w = p.grad[:, c0:c0 + nc], p[:, c0:c0 + nc]
                    st = opt_state.setdefault((id(p), c0), torch.zeros(p.shape[0]) if optimizer == "rowwise_adagrad"
                                              else torch.zeros_like(w))
                    if optimizer == "sgd":
                        w -= LR * g
                    elif optimizer == "adagrad":
                        st += g * g
                        w -= LR * g / (st.sqrt() + EPS)
                    else:
                        st += (g * g).mean(1)
                        w -= LR * g / (st.sqrt() + EPS).unsqueeze(1)
                p.grad = None
        for p in ref.parameters():  # dense parameters and data-parallel tables: SGD
            if p.grad is not None:
                p -= _DENSE_LR[0] * p.grad
                p.grad = None
    return float(loss)


def _train(dmp, model: str, step_range, rank: int, world: int) -> list[float]:
    dense = torch.optim.SGD([p for _, p in dmp.named_parameters() if p.requires_grad], lr=_DENSE_LR[0])
    losses = []
    for step in step_range:
        x, y = batch(model, step, rank)
        loss = loss_of(dmp(*x), y, model)
        loss.backward()
        dense.step()
        dense.zero_grad(set_to_none=True)
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(float(mean) / world)
    return losses


def _in_backward(model: str, module: nn.Module, optimizer: str, world: int) -> None:
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
    from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

    cls = {"sgd": torch.optim.SGD, "adagrad": torch.optim.Adagrad, "rowwise_adagrad": RowWiseAdagrad}[optimizer]
    params = [getattr(module.get_submodule(fqn), _attr(model))[t].weight
              for fqn, mp in _plan(model, module, world).plan.items() for t, ps in mp.items()
              if ps.sharding_type != "data_parallel"]
    kwargs = {"lr": LR} if optimizer == "sgd" else {"lr": LR, "eps": EPS}
    apply_optimizer_in_backward(cls, params, kwargs)


def _torchrec(model, base, init, env, fused, in_backward, optimizer, rank, world):
    """TorchRec's DMP on the same program: (losses, full state, None), or (None, None, its error)
    where TorchRec cannot run it (the error is the test's evidence)."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor
    from torchrec.distributed.model_parallel import DistributedModelParallel as TorchRecDMP

    tr_model = copy.deepcopy(base)
    if in_backward:
        _in_backward(model, tr_model, optimizer, world)
    tr = TorchRecDMP(tr_model, env=env, device=torch.device("cpu"), plan=_plan(model, tr_model, world),
                     sharders=[_sharder(model, fused)])
    with torch.no_grad():  # TorchRec re-initializes its shards on the CPU: copy the same initial weights in
        for k, v in tr.state_dict().items():
            if isinstance(v, ShardedTensor):
                for s in v.local_shards():
                    (r, c), (nr, nc) = s.metadata.shard_offsets, s.metadata.shard_sizes
                    s.tensor.copy_(init[k][r:r + nr, c:c + nc])
            elif k in init:
                v.copy_(init[k])
    known = _torchrec_known_failure(model, tr.plan)
    try:
        losses = _train(tr, model, range(STEPS), rank, world)
    except RuntimeError as e:
        if known is None or known not in str(e):
            raise
        return None, None, str(e).splitlines()[0]
    return losses, {k: _full(v) for k, v in tr.state_dict().items()}, None


TORCHREC_EC_DATA_PARALLEL = "split_with_sizes expects split_sizes to sum exactly to"
"""TorchRec (1.9.2) cannot train a data-parallel table of an ``EmbeddingCollection`` on the CPU:
its lookup, fbgemm's ``DenseTableBatchedEmbeddingBagsCodegen`` with ``PoolingMode.NONE``, pools
per bag there (one row per sample, not per id), and its output split raises this."""


def _torchrec_known_failure(model: str, plan) -> str | None:
    """The error TorchRec's DMP is known to raise training this model under ``plan`` (None: it must
    run): only that error is caught and reported; any other propagates."""
    if _attr(model) == "embeddings" and any(ps.sharding_type == "data_parallel"
                                            for mp in plan.plan.values() for ps in mp.values()):
        return TORCHREC_EC_DATA_PARALLEL
    return None


def run(case: str) -> dict:
    model, optimizer, *flags = case.split(":")
    _FLAGS[:] = flags
    _DENSE_LR[0] = LR_DP if _one_type(model) == "dp" else LR
    rank, world = dist.get_rank(), dist.get_world_size()
    if model == "dlrm4":
        os.environ["LOCAL_WORLD_SIZE"] = "2"  # 2 hosts x 2 ranks (TorchRec and graphshard read it)
    from torchrec.distributed.types import ShardingEnv

    from graphshard.model_parallel import DistributedModelParallel as GraphshardDMP

    base = build(model)
    if "ac" in flags:  # activation checkpointing on the dense part, torch's helper (all three runs have it)
        import functools

        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
            CheckpointImpl, apply_activation_checkpointing, checkpoint_wrapper)

        apply_activation_checkpointing(base, checkpoint_wrapper_fn=functools.partial(
            checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT),
            check_fn=lambda m: type(m).__name__ in ("DenseArch", "OverArch"))
    init = {k: v.detach().clone() for k, v in base.state_dict().items()}
    env = ShardingEnv.from_process_group(dist.group.WORLD)
    in_backward = optimizer.startswith("inbackward_")
    if in_backward:  # the tables' optimizer from apply_optimizer_in_backward, no fused_params
        optimizer = optimizer[len("inbackward_"):]
    fused = {} if in_backward else _fused(optimizer)

    gs_model = copy.deepcopy(base)
    if in_backward:
        _in_backward(model, gs_model, optimizer, world)
    from graphshard.model_parallel import FullyShardDense

    _PLANNED.clear()
    if "triton" in flags and not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"  # read when graphshard's Triton kernels are first imported
    _KERNEL[0] = "fused_triton" if "triton" in flags else "fused"
    if "auto" in flags:  # graphshard.auto_plan: the tables and the dense part in one budget
        import graphshard
        from torch.distributed.device_mesh import init_device_mesh

        plan = graphshard.auto_plan(gs_model, init_device_mesh("cpu", (world,), mesh_dim_names=("dp",)),
                                    memory_budget=64 * 2**10, batch=batch(model, 0, rank)[0], optimizer_states=0,
                                    table_optimizer=optimizer, learning_rate=LR)
    else:
        plan = None if "planned" in flags else _plan(model, gs_model, world)
    gs = GraphshardDMP(gs_model, env=env, device=torch.device("cpu"), plan=plan,
                       sharders=[_sharder(model, fused)],
                       data_parallel_wrapper=FullyShardDense() if "fsdp" in flags else None, lower=lowering())
    _KERNEL[0] = "fused"
    plans = [None] * world
    dist.all_gather_object(plans, repr(gs.plan))
    if "planned" in flags or "auto" in flags:
        _PLANNED.append(gs.plan)
    gs_losses = _train(gs, model, range(STEPS), rank, world)
    gs_state = {k: _full(v) for k, v in gs.state_dict().items()}
    import graphshard

    report = graphshard.explain(gs.module) if rank == 0 else ""

    tr_losses, tr_state, tr_error = _torchrec(model, base, init, env, fused, in_backward, optimizer, rank, world)

    ref = copy.deepcopy(base)
    opt_state: dict = {}
    ref_losses = [_step_reference(model, ref, opt_state, optimizer, s, world) for s in range(STEPS)]
    ref_state = {k: v.detach() for k, v in ref.state_dict().items()}

    def diff(a: dict, b: dict) -> dict:
        return {k: tensor_err(a[k], b[k]) for k in b if k in a and a[k].is_floating_point()}

    return {
        "case": case,
        "lowering": lowering(),
        "keys_graphshard": sorted(gs_state),
        "keys_torchrec": sorted(tr_state) if tr_state else None,
        "torchrec_error": tr_error,
        "keys_reference": sorted(ref_state),
        "loss_gs_ref": seq_err(gs_losses, ref_losses),
        "loss_tr_ref": seq_err(tr_losses, ref_losses) if tr_losses else None,
        "loss_gs_tr": seq_err(gs_losses, tr_losses) if tr_losses else None,
        "param_gs_ref": diff(gs_state, ref_state),
        "param_tr_ref": diff(tr_state, ref_state) if tr_state else None,
        "param_gs_tr": diff(gs_state, tr_state) if tr_state else None,
        "tables": _table_fqns(model),
        "moved": {k: tensor_err(ref_state[k], init[k]) for k in ref_state if k in init},
        "explain": report,
        "recomputed_ops": sum(r.recompute.get("ops", 0) for r in gs.module._graphshard.explain),
        "graphs": sum(1 for line in report.splitlines() if line.startswith("graph ")),
        "plans_equal": len(set(plans)) == 1,
        "sharding": {t: ps.sharding_type for mp in gs.plan.plan.values() for t, ps in mp.items()},
    }


if __name__ == "__main__":
    run_cases(sys.argv[1:], run)
