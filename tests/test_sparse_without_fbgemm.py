"""Sharded embeddings where fbgemm is absent (the GPU machine has none; its CPU build has no CUDA
kernels): graphshard's Triton TBE and its torch KJT ops (``graphshard/ops/kjt.py``).

``ShardEmbedding(kernel="triton")`` on plain ``nn.EmbeddingBag`` modules (row-wise, table-wise
with mean pooling, a column-wise table 12 wide in two 6-wide shards, data-parallel, beside a
FullyShard dense part) trains on 2 gloo ranks in a process where ``import fbgemm_gpu`` fails, the
Triton kernels under Triton's interpreter, and must match the single process on the global batch
(tests/workers/embedding_plan.py). Where fbgemm is installed, its TBE refuses shards whose width
is no multiple of 4 when the plan is made, naming the fix.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

import graphshard
from _launch import torchrun
from graphshard import FullyShard, Plan, ShardEmbedding

TOL = 1e-5
CASE = "dp:rowwise_adagrad:triton:nofbgemm:cw12"

pytestmark = pytest.mark.multirank


@pytest.fixture(scope="module")
def result():
    pytest.importorskip("triton")
    (r,) = torchrun("embedding_plan.py", [CASE], nproc=2)
    return r


def _within(x: float) -> bool:
    return math.isfinite(x) and x <= TOL  # NaN and inf fail


def test_trains_like_the_single_process_without_fbgemm(result):
    r = result
    assert not r["fbgemm_loaded"], "the program imported fbgemm_gpu or called an fbgemm op"
    assert r["keys"] == r["ref_keys"]
    assert _within(r["loss"]), r["loss"]
    assert set(r["params"]) == set(r["ref_keys"]) and all(_within(v) for v in r["params"].values()), r["params"]
    assert "column_wise emb_cw@0,1 | rank 0 fused TBEs: a2a: 1 table shard(s), rowwise_adagrad, triton kernel" \
        in r["explain"]
    assert "fallbacks: none" in r["explain"]


class Bag(nn.Module):
    def __init__(self):
        super().__init__()
        self.bag = nn.EmbeddingBag(10, 12)
        self.head = nn.Linear(12, 1)


def test_fbgemm_refuses_shards_of_width_not_a_multiple_of_4_at_plan_time():
    pytest.importorskip("fbgemm_gpu")
    mesh = DeviceMesh.from_group(dist.group.WORLD, "cpu", mesh_dim_names=("dp",))  # the fake group: 4 ranks
    with pytest.raises(ValueError, match=r"bag: table 'bag' is column_wise in shards \[3\] wide; fbgemm's TBE "
                                         r"\(compute_kernel 'fused'\) needs widths that are multiples of 4\. Use "
                                         r"graphshard's Triton TBE"):
        graphshard.shard(Bag(), Plan(mesh, {"": FullyShard(), "bag": ShardEmbedding("column_wise", kernel="fbgemm")}))
    for kernel in ("auto", "fbgemm"):  # the default picks fbgemm on the CPU where it is installed
        with pytest.raises(ValueError, match="multiples of 4"):
            graphshard.shard(Bag(), Plan(mesh, {"": FullyShard(), "bag": ShardEmbedding("column_wise", kernel=kernel)}))


def test_the_triton_kernel_takes_any_width():
    pytest.importorskip("triton")
    mesh = DeviceMesh.from_group(dist.group.WORLD, "cpu", mesh_dim_names=("dp",))
    model = Bag()
    weight = model.bag.weight.detach().clone()
    graphshard.shard(model, Plan(mesh, {"": FullyShard(), "bag": ShardEmbedding("column_wise", kernel="triton")}))
    local = model.state_dict()["bag.weight"].to_local()  # rank 0's 3-wide column block
    assert torch.equal(local, weight[:, :3])
