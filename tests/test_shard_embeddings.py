"""shard_embeddings: each logical lookup of a sharded embedding collection -> its per-rank program.

Golden graphs on the fake process group (world size 4, this process is rank 0), right after the
pass, one per sharding type: the input distribution (fbgemm permutes / bucketizes, the lengths'
all-to-all, the ids' all-to-all with data-dependent sizes), the fused TBE lookup, and the
output distribution (all-to-all, reduce-scatter), then the columns in the module's order.
Numerics are checked on 2 gloo ranks (tests/test_model_parallel.py).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from expecttest import TestCase

pytest.importorskip("torchrec")

from torch.distributed.device_mesh import DeviceMesh  # noqa: E402
from torchrec.distributed.embedding import EmbeddingCollectionSharder  # noqa: E402
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder  # noqa: E402
from torchrec.distributed.sharding_plan import (  # noqa: E402
    column_wise,
    construct_module_sharding_plan,
    data_parallel,
    row_wise,
    table_row_wise,
    table_wise,
)
from torchrec.distributed.types import ShardingEnv, ShardingPlan  # noqa: E402
from torchrec.modules.embedding_configs import EmbeddingBagConfig, EmbeddingConfig, PoolingType  # noqa: E402
from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection  # noqa: E402
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor  # noqa: E402

from _golden import capture_dynamo, render  # noqa: E402
import graphshard  # noqa: E402
from graphshard import _compat  # noqa: E402
from graphshard.compiler.prepare import prepare, trace  # noqa: E402
from graphshard.config import CompileConfig  # noqa: E402
from graphshard.model_parallel import DistributedModelParallel  # noqa: E402
from graphshard.passes.pipeline import pre_autograd_passes, run_passes  # noqa: E402
from graphshard.sparse.input_dist import attach  # noqa: E402

FUSED = "fused"


class Sparse(nn.Module):
    def __init__(self, tables):
        super().__init__()
        self.ebc = EmbeddingBagCollection(tables=tables, device=torch.device("cpu"))

    def forward(self, kjt):
        return self.ebc(kjt).values()


class Sequence(nn.Module):
    """An ``EmbeddingCollection``: each feature's rows, one per id, summed into a result."""

    def __init__(self, tables):
        super().__init__()
        self.ebc = EmbeddingCollection(tables=tables, device=torch.device("cpu"))

    def forward(self, kjt):
        return torch.cat([jt.values() for jt in self.ebc(kjt).values()]).sum(0)


def _kjt(features, batch=2):
    lengths = torch.tensor([1, 2] * len(features))[: len(features) * batch]
    return KeyedJaggedTensor(keys=features, values=torch.arange(int(lengths.sum())) % 8, lengths=lengths)


def after_pass(tables, sharding, upto="shard_embeddings", ahead=None):
    """The graph after ``upto``. ``ahead``: ``(groups, tensors)`` attached to the KJT as a training
    pipeline attaches the ids it exchanged a batch ahead (`graphshard.sparse.input_dist`)."""
    torch.manual_seed(0)
    sequence = isinstance(tables[0], EmbeddingConfig)
    model = (Sequence if sequence else Sparse)(tables)
    plan = ShardingPlan({"ebc": construct_module_sharding_plan(model.ebc, per_param_sharding=sharding,
                                                               world_size=dist.get_world_size(), device_type="cpu")})
    sharder = (EmbeddingCollectionSharder if sequence else EmbeddingBagCollectionSharder)(fused_params={})
    dmp = DistributedModelParallel(model, env=ShardingEnv.from_process_group(dist.group.WORLD), plan=plan,
                                   sharders=[sharder], init_data_parallel=False)
    mesh = DeviceMesh.from_group(dist.group.WORLD, "cpu", mesh_dim_names=("dp",))
    gs_plan = graphshard.Plan(mesh, dmp._dense_rules(), ignored_params=dmp._whole_gradients())  # DMP's own
    graphshard.shard(dmp.module, gs_plan)
    dmp.module._graphshard.collections.extend(dmp._collections)  # as DMP's init_data_parallel records them
    features = list(dict.fromkeys(f for t in tables for f in t.feature_names))  # a feature of two tables: one key
    kjt = _kjt(features)
    if ahead is not None:
        attach(kjt, dmp._collections[0].layout.key, *ahead)
    with _compat.trace_data_dependent_outputs():
        gm, inputs = capture_dynamo(dmp.module, kjt)
    prepared = trace(prepare(gm, inputs), CompileConfig(lower="eager"), (dmp.module._graphshard,))
    passes = pre_autograd_passes()
    names = [p.__name__ for p in passes]
    g = run_passes(prepared.graph, prepared.ctx, passes[: names.index(upto) + 1])
    text = render(g, gs_plan)
    layout = dmp._collections[0].layout
    for group, name in ((layout.host_group, "host"), (layout.cross_group, "cross")):
        if group is not None:
            text = text.replace(f"'{group}'", f"'{name}'")
    return text, prepared.ctx.report


def T(name, features, rows=8, dim=4, pooling=PoolingType.SUM):
    return EmbeddingBagConfig(name=name, embedding_dim=dim, num_embeddings=rows, feature_names=features, pooling=pooling)


def S(name, features, rows=8, dim=4):
    return EmbeddingConfig(name=name, embedding_dim=dim, num_embeddings=rows, feature_names=features)


class TestShardEmbeddings(TestCase):
    def test_before_the_pass_one_logical_lookup(self):
        text, _ = after_pass([T("a", ["f0"])], {"a": table_wise(rank=0, compute_kernel=FUSED)}, upto="localize_random")
        self.assertEqual(text.count("graphshard.embedding_bags.default("), 1)
        self.assertNotIn("all_to_all", text)

    def test_table_wise(self):
        # two tables on ranks 0 and 2, a mean-pooled one: features go to their owner by an
        # all-to-all of lengths (static sizes) then of ids (sizes from the lengths: unbacked)
        text, report = after_pass([T("a", ["f0", "f1"]), T("b", ["f2"], pooling=PoolingType.MEAN)],
                                  {"a": table_wise(rank=0, compute_kernel=FUSED), "b": table_wise(rank=2, compute_kernel=FUSED)})
        self.assertIn("ebc: table_wise a@0 b@2", report.sparse[0])
        self.assertExpectedInline(text, """\
class <lambda>(torch.nn.Module):
    def forward(self, arg0_1: "f32[0]", arg1_1: "f32[32]", arg2_1: "f32[0]", arg3_1: "f32[]", arg4_1: "i64[6]", arg5_1: "i64[9]"):
        _sparse_a2a_weights_offsets: "i64[2]" = self._sparse_a2a_weights_offsets
        _sparse_a2a_d_offsets: "i32[3]" = self._sparse_a2a_D_offsets
        _sparse_a2a_hash_size_cumsum: "i64[3]" = self._sparse_a2a_hash_size_cumsum
        _sparse_a2a_momentum_offsets: "i64[1]" = self._sparse_a2a_momentum_offsets
        _sparse_a2a_rows: "i64[2]" = self._sparse_a2a_rows
        view: "i64[3, 2]" = torch.ops.aten.view.default(arg4_1, [3, 2])
        check_ids: "i64[9]" = torch.ops.graphshard.check_ids.default(arg5_1, arg4_1, [8, 8, 8], "feature 'f0' (table 'a')\\nfeature 'f1' (table 'a')\\nfeature 'f2' (table 'b')");  arg5_1 = arg4_1 = None
        view_1: "i64[6]" = torch.ops.aten.view.default(view, [-1])
        _sparse_const: "i64[3]" = self._sparse_const
        lift_fresh_copy: "i64[3]" = torch.ops.aten.lift_fresh_copy.default(_sparse_const);  _sparse_const = None
        zeros: "i64[4]" = torch.ops.aten.zeros.default([4], dtype = torch.int64, device = device(type='cpu'), pin_memory = False)
        sum_1: "i64[3]" = torch.ops.aten.sum.dim_IntList(view, [1])
        index_add: "i64[4]" = torch.ops.aten.index_add.default(zeros, 0, lift_fresh_copy, sum_1);  zeros = lift_fresh_copy = sum_1 = None
        all_to_all: "i64[16]" = torch.ops.graphshard.all_to_all.default(view_1, [4, 4, 4, 4], [4, 0, 2, 0], 'dp');  view_1 = None
        view_2: "i64[4, 4]" = torch.ops.aten.view.default(all_to_all, [4, 4])
        sum_2: "i64[4]" = torch.ops.aten.sum.dim_IntList(view_2, [1]);  view_2 = None
        unbind = torch.ops.aten.unbind.int(index_add);  index_add = None
        getitem: "i64[]" = unbind[0]
        getitem_1: "i64[]" = unbind[1]
        getitem_2: "i64[]" = unbind[2]
        getitem_3: "i64[]" = unbind[3];  unbind = None
        _local_scalar_dense: "Sym(u0)" = torch.ops.aten._local_scalar_dense.default(getitem);  getitem = None
        _local_scalar_dense_1: "Sym(u1)" = torch.ops.aten._local_scalar_dense.default(getitem_1);  getitem_1 = None
        _local_scalar_dense_2: "Sym(u2)" = torch.ops.aten._local_scalar_dense.default(getitem_2);  getitem_2 = None
        _local_scalar_dense_3: "Sym(u3)" = torch.ops.aten._local_scalar_dense.default(getitem_3);  getitem_3 = None
        unbind_1 = torch.ops.aten.unbind.int(sum_2);  sum_2 = None
        getitem_4: "i64[]" = unbind_1[0]
        getitem_5: "i64[]" = unbind_1[1]
        getitem_6: "i64[]" = unbind_1[2]
        getitem_7: "i64[]" = unbind_1[3];  unbind_1 = None
        _local_scalar_dense_4: "Sym(u4)" = torch.ops.aten._local_scalar_dense.default(getitem_4);  getitem_4 = None
        _local_scalar_dense_5: "Sym(u5)" = torch.ops.aten._local_scalar_dense.default(getitem_5);  getitem_5 = None
        _local_scalar_dense_6: "Sym(u6)" = torch.ops.aten._local_scalar_dense.default(getitem_6);  getitem_6 = None
        _local_scalar_dense_7: "Sym(u7)" = torch.ops.aten._local_scalar_dense.default(getitem_7);  getitem_7 = None
        all_to_all_1: "i64[u4 + u5 + u6 + u7]" = torch.ops.graphshard.all_to_all.default(check_ids, [_local_scalar_dense_4, _local_scalar_dense_5, _local_scalar_dense_6, _local_scalar_dense_7], [_local_scalar_dense, _local_scalar_dense_1, _local_scalar_dense_2, _local_scalar_dense_3], 'dp');  check_ids = _local_scalar_dense_4 = _local_scalar_dense_5 = _local_scalar_dense_6 = _local_scalar_dense_7 = _local_scalar_dense = _local_scalar_dense_1 = _local_scalar_dense_2 = _local_scalar_dense_3 = None
        view_3: "i64[8, 2]" = torch.ops.aten.view.default(all_to_all, [8, 2]);  all_to_all = None
        _sparse_const_1: "i32[8]" = self._sparse_const_1
        lift_fresh_copy_1: "i32[8]" = torch.ops.aten.lift_fresh_copy.default(_sparse_const_1);  _sparse_const_1 = None
        permute_2d_sparse_data = torch.ops.fbgemm.permute_2D_sparse_data.default(lift_fresh_copy_1, view_3, all_to_all_1);  lift_fresh_copy_1 = view_3 = all_to_all_1 = None
        getitem_8: "i64[8, 2]" = permute_2d_sparse_data[0]
        getitem_9: "i64[u8]" = permute_2d_sparse_data[1];  permute_2d_sparse_data = None
        view_4: "i64[16]" = torch.ops.aten.view.default(getitem_8, [-1]);  getitem_8 = None
        asynchronous_complete_cumsum: "i64[17]" = torch.ops.fbgemm.asynchronous_complete_cumsum.default(view_4);  view_4 = None
        tbe_lookup: "f32[8, 8]" = torch.ops.graphshard.tbe_lookup.default(arg0_1, arg1_1, arg2_1, arg3_1, _sparse_a2a_weights_offsets, _sparse_a2a_d_offsets, _sparse_a2a_hash_size_cumsum, _sparse_a2a_momentum_offsets, _sparse_a2a_rows, getitem_9, asynchronous_complete_cumsum, None, 8, 4, 4, 0, 'sgd', [1e-08, 0.0, 0.0, 0.0], "feature 'f0' (table 'a')\\nfeature 'f1' (table 'a')", [0, 0], False, 0.25);  arg0_1 = arg1_1 = arg2_1 = arg3_1 = _sparse_a2a_weights_offsets = _sparse_a2a_d_offsets = _sparse_a2a_hash_size_cumsum = _sparse_a2a_momentum_offsets = _sparse_a2a_rows = getitem_9 = asynchronous_complete_cumsum = None
        view_5: "f32[64]" = torch.ops.aten.view.default(tbe_lookup, [-1]);  tbe_lookup = None
        all_to_all_2: "f32[24]" = torch.ops.graphshard.all_to_all.default(view_5, [16, 0, 8, 0], [16, 16, 16, 16], 'dp');  view_5 = None
        split_with_sizes = torch.ops.aten.split_with_sizes.default(all_to_all_2, [16, 0, 8, 0]);  all_to_all_2 = None
        getitem_11: "f32[16]" = split_with_sizes[0]
        getitem_13: "f32[8]" = split_with_sizes[2];  split_with_sizes = None
        view_6: "f32[2, 8]" = torch.ops.aten.view.default(getitem_11, [2, 8]);  getitem_11 = None
        view_7: "f32[2, 4]" = torch.ops.aten.view.default(getitem_13, [2, 4]);  getitem_13 = None
        cat: "f32[2, 12]" = torch.ops.aten.cat.default([view_6, view_7], 1);  view_6 = view_7 = None
        _sparse_const_2: "i64[12]" = self._sparse_const_2
        lift_fresh_copy_2: "i64[12]" = torch.ops.aten.lift_fresh_copy.default(_sparse_const_2);  _sparse_const_2 = None
        index_select: "i64[12, 2]" = torch.ops.aten.index_select.default(view, 0, lift_fresh_copy_2);  view = lift_fresh_copy_2 = None
        t: "i64[2, 12]" = torch.ops.aten.t.default(index_select);  index_select = None
        _sparse_const_3: "b8[12]" = self._sparse_const_3
        lift_fresh_copy_3: "b8[12]" = torch.ops.aten.lift_fresh_copy.default(_sparse_const_3);  _sparse_const_3 = None
        clamp: "i64[2, 12]" = torch.ops.aten.clamp.default(t, 1);  t = None
        _to_copy: "f32[2, 12]" = torch.ops.aten._to_copy.default(clamp, dtype = torch.float32);  clamp = None
        masked_fill: "f32[2, 12]" = torch.ops.aten.masked_fill.Scalar(_to_copy, lift_fresh_copy_3, 1.0);  _to_copy = lift_fresh_copy_3 = None
        div: "f32[2, 12]" = torch.ops.aten.div.Tensor(cat, masked_fill);  cat = masked_fill = None
        return (div,)
""")

    def test_row_wise(self):
        # ids bucketized by row block (fbgemm), exchanged, looked up in this rank's block; the
        # partial sums reduce-scattered back to the samples' ranks
        text, _ = after_pass([T("a", ["f0"], rows=10)], {"a": row_wise(compute_kernel=FUSED)})
        self.assertExpectedInline(text, """\
class <lambda>(torch.nn.Module):
    def forward(self, arg0_1: "f32[0]", arg1_1: "f32[12]", arg2_1: "f32[0]", arg3_1: "f32[]", arg4_1: "i64[2]", arg5_1: "i64[3]"):
        _sparse_rw_weights_offsets: "i64[1]" = self._sparse_rw_weights_offsets
        _sparse_rw_d_offsets: "i32[2]" = self._sparse_rw_D_offsets
        _sparse_rw_hash_size_cumsum: "i64[2]" = self._sparse_rw_hash_size_cumsum
        _sparse_rw_momentum_offsets: "i64[1]" = self._sparse_rw_momentum_offsets
        _sparse_rw_rows: "i64[1]" = self._sparse_rw_rows
        view: "i64[1, 2]" = torch.ops.aten.view.default(arg4_1, [1, 2])
        check_ids: "i64[3]" = torch.ops.graphshard.check_ids.default(arg5_1, arg4_1, [10], "feature 'f0' (table 'a')");  arg5_1 = arg4_1 = None
        _sparse_const: "i64[1]" = self._sparse_const
        lift_fresh_copy: "i64[1]" = torch.ops.aten.lift_fresh_copy.default(_sparse_const);  _sparse_const = None
        view_1: "i64[2]" = torch.ops.aten.view.default(view, [-1]);  view = None
        block_bucketize_sparse_features = torch.ops.fbgemm.block_bucketize_sparse_features.default(view_1, check_ids, False, False, lift_fresh_copy, 4);  view_1 = check_ids = lift_fresh_copy = None
        getitem: "i64[8]" = block_bucketize_sparse_features[0]
        getitem_1: "i64[3]" = block_bucketize_sparse_features[1];  block_bucketize_sparse_features = None
        view_2: "i64[4, 2]" = torch.ops.aten.view.default(getitem, [4, 2]);  getitem = None
        view_3: "i64[8]" = torch.ops.aten.view.default(view_2, [-1])
        _sparse_const_1: "i64[4]" = self._sparse_const_1
        lift_fresh_copy_1: "i64[4]" = torch.ops.aten.lift_fresh_copy.default(_sparse_const_1);  _sparse_const_1 = None
        zeros: "i64[4]" = torch.ops.aten.zeros.default([4], dtype = torch.int64, device = device(type='cpu'), pin_memory = False)
        sum_1: "i64[4]" = torch.ops.aten.sum.dim_IntList(view_2, [1]);  view_2 = None
        index_add: "i64[4]" = torch.ops.aten.index_add.default(zeros, 0, lift_fresh_copy_1, sum_1);  zeros = lift_fresh_copy_1 = sum_1 = None
        all_to_all: "i64[8]" = torch.ops.graphshard.all_to_all.default(view_3, [2, 2, 2, 2], [2, 2, 2, 2], 'dp');  view_3 = None
        view_4: "i64[4, 2]" = torch.ops.aten.view.default(all_to_all, [4, 2])
        sum_2: "i64[4]" = torch.ops.aten.sum.dim_IntList(view_4, [1]);  view_4 = None
        unbind = torch.ops.aten.unbind.int(index_add);  index_add = None
        getitem_5: "i64[]" = unbind[0]
        getitem_6: "i64[]" = unbind[1]
        getitem_7: "i64[]" = unbind[2]
        getitem_8: "i64[]" = unbind[3];  unbind = None
        _local_scalar_dense: "Sym(u0)" = torch.ops.aten._local_scalar_dense.default(getitem_5);  getitem_5 = None
        _local_scalar_dense_1: "Sym(u1)" = torch.ops.aten._local_scalar_dense.default(getitem_6);  getitem_6 = None
        _local_scalar_dense_2: "Sym(u2)" = torch.ops.aten._local_scalar_dense.default(getitem_7);  getitem_7 = None
        _local_scalar_dense_3: "Sym(u3)" = torch.ops.aten._local_scalar_dense.default(getitem_8);  getitem_8 = None
        unbind_1 = torch.ops.aten.unbind.int(sum_2);  sum_2 = None
        getitem_9: "i64[]" = unbind_1[0]
        getitem_10: "i64[]" = unbind_1[1]
        getitem_11: "i64[]" = unbind_1[2]
        getitem_12: "i64[]" = unbind_1[3];  unbind_1 = None
        _local_scalar_dense_4: "Sym(u4)" = torch.ops.aten._local_scalar_dense.default(getitem_9);  getitem_9 = None
        _local_scalar_dense_5: "Sym(u5)" = torch.ops.aten._local_scalar_dense.default(getitem_10);  getitem_10 = None
        _local_scalar_dense_6: "Sym(u6)" = torch.ops.aten._local_scalar_dense.default(getitem_11);  getitem_11 = None
        _local_scalar_dense_7: "Sym(u7)" = torch.ops.aten._local_scalar_dense.default(getitem_12);  getitem_12 = None
        all_to_all_1: "i64[u4 + u5 + u6 + u7]" = torch.ops.graphshard.all_to_all.default(getitem_1, [_local_scalar_dense_4, _local_scalar_dense_5, _local_scalar_dense_6, _local_scalar_dense_7], [_local_scalar_dense, _local_scalar_dense_1, _local_scalar_dense_2, _local_scalar_dense_3], 'dp');  getitem_1 = _local_scalar_dense_4 = _local_scalar_dense_5 = _local_scalar_dense_6 = _local_scalar_dense_7 = _local_scalar_dense = _local_scalar_dense_1 = _local_scalar_dense_2 = _local_scalar_dense_3 = None
        view_5: "i64[4, 2]" = torch.ops.aten.view.default(all_to_all, [4, 2]);  all_to_all = None
        view_6: "i64[8]" = torch.ops.aten.view.default(view_5, [-1]);  view_5 = None
        asynchronous_complete_cumsum: "i64[9]" = torch.ops.fbgemm.asynchronous_complete_cumsum.default(view_6);  view_6 = None
        tbe_lookup: "f32[8, 4]" = torch.ops.graphshard.tbe_lookup.default(arg0_1, arg1_1, arg2_1, arg3_1, _sparse_rw_weights_offsets, _sparse_rw_d_offsets, _sparse_rw_hash_size_cumsum, _sparse_rw_momentum_offsets, _sparse_rw_rows, all_to_all_1, asynchronous_complete_cumsum, None, 4, 4, 2, 0, 'sgd', [1e-08, 0.0, 0.0, 0.0], "feature 'f0' (table 'a')", [0], False, 0.25);  arg0_1 = arg1_1 = arg2_1 = arg3_1 = _sparse_rw_weights_offsets = _sparse_rw_d_offsets = _sparse_rw_hash_size_cumsum = _sparse_rw_momentum_offsets = _sparse_rw_rows = all_to_all_1 = asynchronous_complete_cumsum = None
        reduce_scatter: "f32[2, 4]" = torch.ops.graphshard.reduce_scatter.default(tbe_lookup, 0, 'dp', 4, 0);  tbe_lookup = None
        return (reduce_scatter,)
""")

    def test_row_wise_ids_exchanged_ahead(self):
        # a pipeline exchanged the ids a batch ahead: the program starts at the lookup, reading
        # what arrived (this rank's block's ids from the 4 ranks, feature-major); no check, no
        # bucketize, no all-to-all of lengths or ids in the step
        arrived = [torch.tensor([1, 0, 2, 0, 0, 1, 0, 0]), torch.tensor([1, 0, 1, 2])]
        text, report = after_pass([T("a", ["f0"], rows=10)], {"a": row_wise(compute_kernel=FUSED)},
                                  ahead=(["rw"], arrived))
        self.assertIn("ids exchanged a batch ahead (rw)", report.sparse[0])
        self.assertNotIn("all_to_all", text)
        self.assertNotIn("check_ids", text)
        self.assertExpectedInline(text, """\
class <lambda>(torch.nn.Module):
    def forward(self, arg0_1: "f32[0]", arg1_1: "f32[12]", arg2_1: "f32[0]", arg3_1: "f32[]", arg4_1: "i64[2]", arg5_1: "i64[3]", arg6_1: "i64[8]", arg7_1: "i64[4]"):
        _sparse_rw_weights_offsets: "i64[1]" = self._sparse_rw_weights_offsets
        _sparse_rw_d_offsets: "i32[2]" = self._sparse_rw_D_offsets
        _sparse_rw_hash_size_cumsum: "i64[2]" = self._sparse_rw_hash_size_cumsum
        _sparse_rw_momentum_offsets: "i64[1]" = self._sparse_rw_momentum_offsets
        _sparse_rw_rows: "i64[1]" = self._sparse_rw_rows
        asynchronous_complete_cumsum: "i64[9]" = torch.ops.fbgemm.asynchronous_complete_cumsum.default(arg6_1);  arg6_1 = None
        tbe_lookup: "f32[8, 4]" = torch.ops.graphshard.tbe_lookup.default(arg0_1, arg1_1, arg2_1, arg3_1, _sparse_rw_weights_offsets, _sparse_rw_d_offsets, _sparse_rw_hash_size_cumsum, _sparse_rw_momentum_offsets, _sparse_rw_rows, arg7_1, asynchronous_complete_cumsum, None, 4, 4, 2, 0, 'sgd', [1e-08, 0.0, 0.0, 0.0], "feature 'f0' (table 'a')", [0], False, 0.25);  arg0_1 = arg1_1 = arg2_1 = arg3_1 = _sparse_rw_weights_offsets = _sparse_rw_d_offsets = _sparse_rw_hash_size_cumsum = _sparse_rw_momentum_offsets = _sparse_rw_rows = arg7_1 = asynchronous_complete_cumsum = None
        reduce_scatter: "f32[2, 4]" = torch.ops.graphshard.reduce_scatter.default(tbe_lookup, 0, 'dp', 4, 0);  tbe_lookup = None
        return (reduce_scatter,)
""")

    def test_row_wise_without_fbgemm(self):
        # the same program beside graphshard's Triton TBE ('fused_triton'): graphshard's own KJT ops
        # (kjt_bucketize, a cumsum for the offsets) where fbgemm's were, the Triton lookup
        from _triton import import_kernel

        import_kernel("graphshard.ops.tbe_triton")  # on the CPU: under Triton's interpreter (the capture runs the model once)
        text, _ = after_pass([T("a", ["f0"], rows=10)], {"a": row_wise(compute_kernel="fused_triton")})
        self.assertNotIn("fbgemm", text)
        self.assertExpectedInline(text, """\
class <lambda>(torch.nn.Module):
    def forward(self, arg0_1: "f32[0]", arg1_1: "f32[12]", arg2_1: "f32[0]", arg3_1: "f32[]", arg4_1: "i64[2]", arg5_1: "i64[3]"):
        _sparse_rw_triton_weights_offsets: "i64[1]" = self._sparse_rw_triton_weights_offsets
        _sparse_rw_triton_row_offsets: "i64[1]" = self._sparse_rw_triton_row_offsets
        _sparse_rw_triton_table_rows: "i64[1]" = self._sparse_rw_triton_table_rows
        _sparse_rw_triton_d_offsets: "i32[2]" = self._sparse_rw_triton_D_offsets
        _sparse_rw_triton_feature_table_map: "i32[1]" = self._sparse_rw_triton_feature_table_map
        view: "i64[1, 2]" = torch.ops.aten.view.default(arg4_1, [1, 2])
        check_ids: "i64[3]" = torch.ops.graphshard.check_ids.default(arg5_1, arg4_1, [10], "feature 'f0' (table 'a')");  arg5_1 = arg4_1 = None
        _sparse_const: "i64[1]" = self._sparse_const
        lift_fresh_copy: "i64[1]" = torch.ops.aten.lift_fresh_copy.default(_sparse_const);  _sparse_const = None
        view_1: "i64[2]" = torch.ops.aten.view.default(view, [-1]);  view = None
        kjt_bucketize = torch.ops.graphshard.kjt_bucketize.default(view_1, check_ids, lift_fresh_copy, 4);  view_1 = check_ids = lift_fresh_copy = None
        getitem: "i64[8]" = kjt_bucketize[0]
        getitem_1: "i64[3]" = kjt_bucketize[1];  kjt_bucketize = None
        view_2: "i64[4, 2]" = torch.ops.aten.view.default(getitem, [4, 2]);  getitem = None
        view_3: "i64[8]" = torch.ops.aten.view.default(view_2, [-1])
        _sparse_const_1: "i64[4]" = self._sparse_const_1
        lift_fresh_copy_1: "i64[4]" = torch.ops.aten.lift_fresh_copy.default(_sparse_const_1);  _sparse_const_1 = None
        zeros: "i64[4]" = torch.ops.aten.zeros.default([4], dtype = torch.int64, device = device(type='cpu'), pin_memory = False)
        sum_1: "i64[4]" = torch.ops.aten.sum.dim_IntList(view_2, [1]);  view_2 = None
        index_add: "i64[4]" = torch.ops.aten.index_add.default(zeros, 0, lift_fresh_copy_1, sum_1);  zeros = lift_fresh_copy_1 = sum_1 = None
        all_to_all: "i64[8]" = torch.ops.graphshard.all_to_all.default(view_3, [2, 2, 2, 2], [2, 2, 2, 2], 'dp');  view_3 = None
        view_4: "i64[4, 2]" = torch.ops.aten.view.default(all_to_all, [4, 2])
        sum_2: "i64[4]" = torch.ops.aten.sum.dim_IntList(view_4, [1]);  view_4 = None
        unbind = torch.ops.aten.unbind.int(index_add);  index_add = None
        getitem_4: "i64[]" = unbind[0]
        getitem_5: "i64[]" = unbind[1]
        getitem_6: "i64[]" = unbind[2]
        getitem_7: "i64[]" = unbind[3];  unbind = None
        _local_scalar_dense: "Sym(u0)" = torch.ops.aten._local_scalar_dense.default(getitem_4);  getitem_4 = None
        _local_scalar_dense_1: "Sym(u1)" = torch.ops.aten._local_scalar_dense.default(getitem_5);  getitem_5 = None
        _local_scalar_dense_2: "Sym(u2)" = torch.ops.aten._local_scalar_dense.default(getitem_6);  getitem_6 = None
        _local_scalar_dense_3: "Sym(u3)" = torch.ops.aten._local_scalar_dense.default(getitem_7);  getitem_7 = None
        unbind_1 = torch.ops.aten.unbind.int(sum_2);  sum_2 = None
        getitem_8: "i64[]" = unbind_1[0]
        getitem_9: "i64[]" = unbind_1[1]
        getitem_10: "i64[]" = unbind_1[2]
        getitem_11: "i64[]" = unbind_1[3];  unbind_1 = None
        _local_scalar_dense_4: "Sym(u4)" = torch.ops.aten._local_scalar_dense.default(getitem_8);  getitem_8 = None
        _local_scalar_dense_5: "Sym(u5)" = torch.ops.aten._local_scalar_dense.default(getitem_9);  getitem_9 = None
        _local_scalar_dense_6: "Sym(u6)" = torch.ops.aten._local_scalar_dense.default(getitem_10);  getitem_10 = None
        _local_scalar_dense_7: "Sym(u7)" = torch.ops.aten._local_scalar_dense.default(getitem_11);  getitem_11 = None
        all_to_all_1: "i64[u4 + u5 + u6 + u7]" = torch.ops.graphshard.all_to_all.default(getitem_1, [_local_scalar_dense_4, _local_scalar_dense_5, _local_scalar_dense_6, _local_scalar_dense_7], [_local_scalar_dense, _local_scalar_dense_1, _local_scalar_dense_2, _local_scalar_dense_3], 'dp');  getitem_1 = _local_scalar_dense_4 = _local_scalar_dense_5 = _local_scalar_dense_6 = _local_scalar_dense_7 = _local_scalar_dense = _local_scalar_dense_1 = _local_scalar_dense_2 = _local_scalar_dense_3 = None
        view_5: "i64[4, 2]" = torch.ops.aten.view.default(all_to_all, [4, 2]);  all_to_all = None
        view_6: "i64[8]" = torch.ops.aten.view.default(view_5, [-1]);  view_5 = None
        new_zeros: "i64[1]" = torch.ops.aten.new_zeros.default(view_6, [1], pin_memory = False)
        cumsum: "i64[8]" = torch.ops.aten.cumsum.default(view_6, 0, dtype = torch.int64);  view_6 = None
        cat: "i64[9]" = torch.ops.aten.cat.default([new_zeros, cumsum]);  new_zeros = cumsum = None
        triton_tbe_lookup: "f32[8, 4]" = torch.ops.graphshard.triton_tbe_lookup.default(arg0_1, arg1_1, arg2_1, arg3_1, _sparse_rw_triton_weights_offsets, _sparse_rw_triton_row_offsets, _sparse_rw_triton_table_rows, _sparse_rw_triton_d_offsets, _sparse_rw_triton_feature_table_map, all_to_all_1, cat, None, [3, 4], [0], 4, 'sgd', [1e-08, 0.0, 0.0, 0.0], False, 0.25);  arg0_1 = arg1_1 = arg2_1 = arg3_1 = _sparse_rw_triton_weights_offsets = _sparse_rw_triton_row_offsets = _sparse_rw_triton_table_rows = _sparse_rw_triton_d_offsets = _sparse_rw_triton_feature_table_map = all_to_all_1 = cat = None
        reduce_scatter: "f32[2, 4]" = torch.ops.graphshard.reduce_scatter.default(triton_tbe_lookup, 0, 'dp', 4, 0);  triton_tbe_lookup = None
        return (reduce_scatter,)
""")

    def test_shared_feature_and_column_blocks_on_one_rank(self):
        # TorchRec's TestSparseNN shape: f0 is looked up by two tables (its output names f0@a, f0@b).
        # a is table-wise on rank 0; b (8 columns) is column-wise in two blocks, both on rank 0 (TorchRec's
        # planner makes such layouts with min_partition). f0's ids go to rank 0 once per lookup (three
        # slots: a, b's block 0, b's block 1), and the columns come back in the tables' order; the bounds
        # check holds f0 to the smaller table
        text, report = after_pass([T("a", ["f0"], rows=6), T("b", ["f0", "f1"], dim=8)],
                                  {"a": table_wise(rank=0, compute_kernel=FUSED),
                                   "b": column_wise(ranks=[0, 0], compute_kernel=FUSED)})
        self.assertIn("graphshard.tbe_lookup", text)
        self.assertIn("[6, 8]", text)  # f0 checked against a (6 rows), f1 against b (8)
        self.assertExpectedInline(text, """\
class <lambda>(torch.nn.Module):
    def forward(self, arg0_1: "f32[0]", arg1_1: "f32[88]", arg2_1: "f32[0]", arg3_1: "f32[]", arg4_1: "i64[4]", arg5_1: "i64[6]"):
        _sparse_a2a_weights_offsets: "i64[5]" = self._sparse_a2a_weights_offsets
        _sparse_a2a_d_offsets: "i32[6]" = self._sparse_a2a_D_offsets
        _sparse_a2a_hash_size_cumsum: "i64[6]" = self._sparse_a2a_hash_size_cumsum
        _sparse_a2a_momentum_offsets: "i64[3]" = self._sparse_a2a_momentum_offsets
        _sparse_a2a_rows: "i64[5]" = self._sparse_a2a_rows
        view: "i64[2, 2]" = torch.ops.aten.view.default(arg4_1, [2, 2])
        check_ids: "i64[6]" = torch.ops.graphshard.check_ids.default(arg5_1, arg4_1, [6, 8], "feature 'f0' (table 'a')\\nfeature 'f1' (table 'b')");  arg5_1 = arg4_1 = None
        _sparse_const: "i32[5]" = self._sparse_const
        lift_fresh_copy: "i32[5]" = torch.ops.aten.lift_fresh_copy.default(_sparse_const);  _sparse_const = None
        permute_2d_sparse_data = torch.ops.fbgemm.permute_2D_sparse_data.default(lift_fresh_copy, view, check_ids);  lift_fresh_copy = view = check_ids = None
        getitem: "i64[5, 2]" = permute_2d_sparse_data[0]
        getitem_1: "i64[u0]" = permute_2d_sparse_data[1];  permute_2d_sparse_data = None
        view_1: "i64[10]" = torch.ops.aten.view.default(getitem, [-1])
        _sparse_const_1: "i64[5]" = self._sparse_const_1
        lift_fresh_copy_1: "i64[5]" = torch.ops.aten.lift_fresh_copy.default(_sparse_const_1);  _sparse_const_1 = None
        zeros: "i64[4]" = torch.ops.aten.zeros.default([4], dtype = torch.int64, device = device(type='cpu'), pin_memory = False)
        sum_1: "i64[5]" = torch.ops.aten.sum.dim_IntList(getitem, [1]);  getitem = None
        index_add: "i64[4]" = torch.ops.aten.index_add.default(zeros, 0, lift_fresh_copy_1, sum_1);  zeros = lift_fresh_copy_1 = sum_1 = None
        all_to_all: "i64[40]" = torch.ops.graphshard.all_to_all.default(view_1, [10, 10, 10, 10], [10, 0, 0, 0], 'dp');  view_1 = None
        view_2: "i64[4, 10]" = torch.ops.aten.view.default(all_to_all, [4, 10])
        sum_2: "i64[4]" = torch.ops.aten.sum.dim_IntList(view_2, [1]);  view_2 = None
        unbind = torch.ops.aten.unbind.int(index_add);  index_add = None
        getitem_3: "i64[]" = unbind[0]
        getitem_4: "i64[]" = unbind[1]
        getitem_5: "i64[]" = unbind[2]
        getitem_6: "i64[]" = unbind[3];  unbind = None
        _local_scalar_dense: "Sym(u1)" = torch.ops.aten._local_scalar_dense.default(getitem_3);  getitem_3 = None
        _local_scalar_dense_1: "Sym(u2)" = torch.ops.aten._local_scalar_dense.default(getitem_4);  getitem_4 = None
        _local_scalar_dense_2: "Sym(u3)" = torch.ops.aten._local_scalar_dense.default(getitem_5);  getitem_5 = None
        _local_scalar_dense_3: "Sym(u4)" = torch.ops.aten._local_scalar_dense.default(getitem_6);  getitem_6 = None
        unbind_1 = torch.ops.aten.unbind.int(sum_2);  sum_2 = None
        getitem_7: "i64[]" = unbind_1[0]
        getitem_8: "i64[]" = unbind_1[1]
        getitem_9: "i64[]" = unbind_1[2]
        getitem_10: "i64[]" = unbind_1[3];  unbind_1 = None
        _local_scalar_dense_4: "Sym(u5)" = torch.ops.aten._local_scalar_dense.default(getitem_7);  getitem_7 = None
        _local_scalar_dense_5: "Sym(u6)" = torch.ops.aten._local_scalar_dense.default(getitem_8);  getitem_8 = None
        _local_scalar_dense_6: "Sym(u7)" = torch.ops.aten._local_scalar_dense.default(getitem_9);  getitem_9 = None
        _local_scalar_dense_7: "Sym(u8)" = torch.ops.aten._local_scalar_dense.default(getitem_10);  getitem_10 = None
        all_to_all_1: "i64[u5 + u6 + u7 + u8]" = torch.ops.graphshard.all_to_all.default(getitem_1, [_local_scalar_dense_4, _local_scalar_dense_5, _local_scalar_dense_6, _local_scalar_dense_7], [_local_scalar_dense, _local_scalar_dense_1, _local_scalar_dense_2, _local_scalar_dense_3], 'dp');  getitem_1 = _local_scalar_dense_4 = _local_scalar_dense_5 = _local_scalar_dense_6 = _local_scalar_dense_7 = _local_scalar_dense = _local_scalar_dense_1 = _local_scalar_dense_2 = _local_scalar_dense_3 = None
        view_3: "i64[20, 2]" = torch.ops.aten.view.default(all_to_all, [20, 2]);  all_to_all = None
        _sparse_const_2: "i32[20]" = self._sparse_const_2
        lift_fresh_copy_2: "i32[20]" = torch.ops.aten.lift_fresh_copy.default(_sparse_const_2);  _sparse_const_2 = None
        permute_2d_sparse_data_1 = torch.ops.fbgemm.permute_2D_sparse_data.default(lift_fresh_copy_2, view_3, all_to_all_1);  lift_fresh_copy_2 = view_3 = all_to_all_1 = None
        getitem_11: "i64[20, 2]" = permute_2d_sparse_data_1[0]
        getitem_12: "i64[u9]" = permute_2d_sparse_data_1[1];  permute_2d_sparse_data_1 = None
        view_4: "i64[40]" = torch.ops.aten.view.default(getitem_11, [-1]);  getitem_11 = None
        asynchronous_complete_cumsum: "i64[41]" = torch.ops.fbgemm.asynchronous_complete_cumsum.default(view_4);  view_4 = None
        tbe_lookup: "f32[8, 20]" = torch.ops.graphshard.tbe_lookup.default(arg0_1, arg1_1, arg2_1, arg3_1, _sparse_a2a_weights_offsets, _sparse_a2a_d_offsets, _sparse_a2a_hash_size_cumsum, _sparse_a2a_momentum_offsets, _sparse_a2a_rows, getitem_12, asynchronous_complete_cumsum, None, 20, 4, 5, 0, 'sgd', [1e-08, 0.0, 0.0, 0.0], "feature 'f0' (table 'a')\\nfeature 'f0' (table 'b')\\nfeature 'f1' (table 'b')\\nfeature 'f0' (table 'b')\\nfeature 'f1' (table 'b')", [0, 0, 0, 0, 0], False, 0.25);  arg0_1 = arg1_1 = arg2_1 = arg3_1 = _sparse_a2a_weights_offsets = _sparse_a2a_d_offsets = _sparse_a2a_hash_size_cumsum = _sparse_a2a_momentum_offsets = _sparse_a2a_rows = getitem_12 = asynchronous_complete_cumsum = None
        view_5: "f32[160]" = torch.ops.aten.view.default(tbe_lookup, [-1]);  tbe_lookup = None
        all_to_all_2: "f32[40]" = torch.ops.graphshard.all_to_all.default(view_5, [40, 0, 0, 0], [40, 40, 40, 40], 'dp');  view_5 = None
        split_with_sizes = torch.ops.aten.split_with_sizes.default(all_to_all_2, [40, 0, 0, 0]);  all_to_all_2 = None
        getitem_14: "f32[40]" = split_with_sizes[0];  split_with_sizes = None
        view_6: "f32[2, 20]" = torch.ops.aten.view.default(getitem_14, [2, 20]);  getitem_14 = None
        _sparse_const_3: "i64[20]" = self._sparse_const_3
        lift_fresh_copy_3: "i64[20]" = torch.ops.aten.lift_fresh_copy.default(_sparse_const_3);  _sparse_const_3 = None
        index_select: "f32[2, 20]" = torch.ops.aten.index_select.default(view_6, 1, lift_fresh_copy_3);  view_6 = lift_fresh_copy_3 = None
        return (index_select,)
""")

    def test_column_wise(self):
        # the feature goes to both column blocks' ranks; the pooled blocks come back side by side
        text, _ = after_pass([T("a", ["f0"], dim=8)], {"a": column_wise(ranks=[0, 1], compute_kernel=FUSED)})
        self.assertExpectedInline(text, """\
class <lambda>(torch.nn.Module):
    def forward(self, arg0_1: "f32[0]", arg1_1: "f32[32]", arg2_1: "f32[0]", arg3_1: "f32[]", arg4_1: "i64[2]", arg5_1: "i64[3]"):
        _sparse_a2a_weights_offsets: "i64[1]" = self._sparse_a2a_weights_offsets
        _sparse_a2a_d_offsets: "i32[2]" = self._sparse_a2a_D_offsets
        _sparse_a2a_hash_size_cumsum: "i64[2]" = self._sparse_a2a_hash_size_cumsum
        _sparse_a2a_momentum_offsets: "i64[1]" = self._sparse_a2a_momentum_offsets
        _sparse_a2a_rows: "i64[1]" = self._sparse_a2a_rows
        view: "i64[1, 2]" = torch.ops.aten.view.default(arg4_1, [1, 2])
        check_ids: "i64[3]" = torch.ops.graphshard.check_ids.default(arg5_1, arg4_1, [8], "feature 'f0' (table 'a')");  arg5_1 = arg4_1 = None
        _sparse_const: "i32[2]" = self._sparse_const
        lift_fresh_copy: "i32[2]" = torch.ops.aten.lift_fresh_copy.default(_sparse_const);  _sparse_const = None
        permute_2d_sparse_data = torch.ops.fbgemm.permute_2D_sparse_data.default(lift_fresh_copy, view, check_ids);  lift_fresh_copy = view = check_ids = None
        getitem: "i64[2, 2]" = permute_2d_sparse_data[0]
        getitem_1: "i64[u0]" = permute_2d_sparse_data[1];  permute_2d_sparse_data = None
        view_1: "i64[4]" = torch.ops.aten.view.default(getitem, [-1])
        _sparse_const_1: "i64[2]" = self._sparse_const_1
        lift_fresh_copy_1: "i64[2]" = torch.ops.aten.lift_fresh_copy.default(_sparse_const_1);  _sparse_const_1 = None
        zeros: "i64[4]" = torch.ops.aten.zeros.default([4], dtype = torch.int64, device = device(type='cpu'), pin_memory = False)
        sum_1: "i64[2]" = torch.ops.aten.sum.dim_IntList(getitem, [1]);  getitem = None
        index_add: "i64[4]" = torch.ops.aten.index_add.default(zeros, 0, lift_fresh_copy_1, sum_1);  zeros = lift_fresh_copy_1 = sum_1 = None
        all_to_all: "i64[8]" = torch.ops.graphshard.all_to_all.default(view_1, [2, 2, 2, 2], [2, 2, 0, 0], 'dp');  view_1 = None
        view_2: "i64[4, 2]" = torch.ops.aten.view.default(all_to_all, [4, 2])
        sum_2: "i64[4]" = torch.ops.aten.sum.dim_IntList(view_2, [1]);  view_2 = None
        unbind = torch.ops.aten.unbind.int(index_add);  index_add = None
        getitem_3: "i64[]" = unbind[0]
        getitem_4: "i64[]" = unbind[1]
        getitem_5: "i64[]" = unbind[2]
        getitem_6: "i64[]" = unbind[3];  unbind = None
        _local_scalar_dense: "Sym(u1)" = torch.ops.aten._local_scalar_dense.default(getitem_3);  getitem_3 = None
        _local_scalar_dense_1: "Sym(u2)" = torch.ops.aten._local_scalar_dense.default(getitem_4);  getitem_4 = None
        _local_scalar_dense_2: "Sym(u3)" = torch.ops.aten._local_scalar_dense.default(getitem_5);  getitem_5 = None
        _local_scalar_dense_3: "Sym(u4)" = torch.ops.aten._local_scalar_dense.default(getitem_6);  getitem_6 = None
        unbind_1 = torch.ops.aten.unbind.int(sum_2);  sum_2 = None
        getitem_7: "i64[]" = unbind_1[0]
        getitem_8: "i64[]" = unbind_1[1]
        getitem_9: "i64[]" = unbind_1[2]
        getitem_10: "i64[]" = unbind_1[3];  unbind_1 = None
        _local_scalar_dense_4: "Sym(u5)" = torch.ops.aten._local_scalar_dense.default(getitem_7);  getitem_7 = None
        _local_scalar_dense_5: "Sym(u6)" = torch.ops.aten._local_scalar_dense.default(getitem_8);  getitem_8 = None
        _local_scalar_dense_6: "Sym(u7)" = torch.ops.aten._local_scalar_dense.default(getitem_9);  getitem_9 = None
        _local_scalar_dense_7: "Sym(u8)" = torch.ops.aten._local_scalar_dense.default(getitem_10);  getitem_10 = None
        all_to_all_1: "i64[u5 + u6 + u7 + u8]" = torch.ops.graphshard.all_to_all.default(getitem_1, [_local_scalar_dense_4, _local_scalar_dense_5, _local_scalar_dense_6, _local_scalar_dense_7], [_local_scalar_dense, _local_scalar_dense_1, _local_scalar_dense_2, _local_scalar_dense_3], 'dp');  getitem_1 = _local_scalar_dense_4 = _local_scalar_dense_5 = _local_scalar_dense_6 = _local_scalar_dense_7 = _local_scalar_dense = _local_scalar_dense_1 = _local_scalar_dense_2 = _local_scalar_dense_3 = None
        view_3: "i64[4, 2]" = torch.ops.aten.view.default(all_to_all, [4, 2]);  all_to_all = None
        view_4: "i64[8]" = torch.ops.aten.view.default(view_3, [-1]);  view_3 = None
        asynchronous_complete_cumsum: "i64[9]" = torch.ops.fbgemm.asynchronous_complete_cumsum.default(view_4);  view_4 = None
        tbe_lookup: "f32[8, 4]" = torch.ops.graphshard.tbe_lookup.default(arg0_1, arg1_1, arg2_1, arg3_1, _sparse_a2a_weights_offsets, _sparse_a2a_d_offsets, _sparse_a2a_hash_size_cumsum, _sparse_a2a_momentum_offsets, _sparse_a2a_rows, all_to_all_1, asynchronous_complete_cumsum, None, 4, 4, 4, 0, 'sgd', [1e-08, 0.0, 0.0, 0.0], "feature 'f0' (table 'a')", [0], False, 0.25);  arg0_1 = arg1_1 = arg2_1 = arg3_1 = _sparse_a2a_weights_offsets = _sparse_a2a_d_offsets = _sparse_a2a_hash_size_cumsum = _sparse_a2a_momentum_offsets = _sparse_a2a_rows = all_to_all_1 = asynchronous_complete_cumsum = None
        view_5: "f32[32]" = torch.ops.aten.view.default(tbe_lookup, [-1]);  tbe_lookup = None
        all_to_all_2: "f32[16]" = torch.ops.graphshard.all_to_all.default(view_5, [8, 8, 0, 0], [8, 8, 8, 8], 'dp');  view_5 = None
        split_with_sizes = torch.ops.aten.split_with_sizes.default(all_to_all_2, [8, 8, 0, 0]);  all_to_all_2 = None
        getitem_11: "f32[8]" = split_with_sizes[0]
        getitem_12: "f32[8]" = split_with_sizes[1];  split_with_sizes = None
        view_6: "f32[2, 4]" = torch.ops.aten.view.default(getitem_11, [2, 4]);  getitem_11 = None
        view_7: "f32[2, 4]" = torch.ops.aten.view.default(getitem_12, [2, 4]);  getitem_12 = None
        cat: "f32[2, 8]" = torch.ops.aten.cat.default([view_6, view_7], 1);  view_6 = view_7 = None
        return (cat,)
""")

    def test_data_parallel(self):
        # a replicated table: every rank's lengths all-gathered and ids sent to every rank, every
        # rank's bags looked up here, this rank's kept (graphshard.shard: its gradient is gathered
        # from every rank in the backward, so the table's gradient is whole here, scaled to the
        # mean: no all-reduce of it, and no unshard of the plain replicated parameter)
        text, _ = after_pass([T("a", ["f0"])], {"a": data_parallel()})
        self.assertNotIn("unshard", text)
        self.assertExpectedInline(text, """\
class <lambda>(torch.nn.Module):
    def forward(self, arg0_1: "f32[8, 4]", arg1_1: "i64[2]", arg2_1: "i64[3]"):
        view: "i64[1, 2]" = torch.ops.aten.view.default(arg1_1, [1, 2])
        check_ids: "i64[3]" = torch.ops.graphshard.check_ids.default(arg2_1, arg1_1, [8], "feature 'f0' (table 'a')");  arg2_1 = arg1_1 = None
        view_1: "i64[2]" = torch.ops.aten.view.default(view, [-1]);  view = None
        all_gather: "i64[8]" = torch.ops.graphshard.all_gather.default(view_1, 0, 8, 'dp', 4, 0);  view_1 = None
        view_2: "i64[4, 2]" = torch.ops.aten.view.default(all_gather, [4, -1])
        sum_1: "i64[4]" = torch.ops.aten.sum.dim_IntList(view_2, [1]);  view_2 = None
        unbind = torch.ops.aten.unbind.int(sum_1);  sum_1 = None
        getitem: "i64[]" = unbind[0]
        getitem_1: "i64[]" = unbind[1]
        getitem_2: "i64[]" = unbind[2]
        getitem_3: "i64[]" = unbind[3];  unbind = None
        _local_scalar_dense: "Sym(u0)" = torch.ops.aten._local_scalar_dense.default(getitem);  getitem = None
        _local_scalar_dense_1: "Sym(u1)" = torch.ops.aten._local_scalar_dense.default(getitem_1);  getitem_1 = None
        _local_scalar_dense_2: "Sym(u2)" = torch.ops.aten._local_scalar_dense.default(getitem_2);  getitem_2 = None
        _local_scalar_dense_3: "Sym(u3)" = torch.ops.aten._local_scalar_dense.default(getitem_3);  getitem_3 = None
        repeat: "i64[12]" = torch.ops.aten.repeat.default(check_ids, [4]);  check_ids = None
        all_to_all: "i64[u0 + u1 + u2 + u3]" = torch.ops.graphshard.all_to_all.default(repeat, [_local_scalar_dense, _local_scalar_dense_1, _local_scalar_dense_2, _local_scalar_dense_3], [3, 3, 3, 3], 'dp');  repeat = _local_scalar_dense = _local_scalar_dense_1 = _local_scalar_dense_2 = _local_scalar_dense_3 = None
        asynchronous_complete_cumsum: "i64[9]" = torch.ops.fbgemm.asynchronous_complete_cumsum.default(all_gather);  all_gather = None
        _embedding_bag = torch.ops.aten._embedding_bag.default(arg0_1, all_to_all, asynchronous_complete_cumsum, False, 0, False, None, True);  arg0_1 = all_to_all = asynchronous_complete_cumsum = None
        getitem_4: "f32[8, 4]" = _embedding_bag[0];  _embedding_bag = None
        shard: "f32[2, 4]" = torch.ops.graphshard.shard.default(getitem_4, 0, 'dp', 4, 0);  getitem_4 = None
        scale_grad: "f32[2, 4]" = torch.ops.graphshard.scale_grad.default(shard, 0.25);  shard = None
        view_3: "f32[1, 2, 4]" = torch.ops.aten.view.default(scale_grad, [1, 2, 4]);  scale_grad = None
        transpose: "f32[2, 1, 4]" = torch.ops.aten.transpose.int(view_3, 0, 1);  view_3 = None
        view_4: "f32[2, 4]" = torch.ops.aten.view.default(transpose, [2, 4]);  transpose = None
        return (view_4,)
""")

    def test_table_row_wise(self):
        # 4 ranks as 2 hosts x 2: the ids go to the table's host, bucketized by row block among its
        # ranks (one all-to-all over the world); the partial sums are reduce-scattered within the
        # host ('host' group) and sent across hosts ('cross' group, the ranks with this local index)
        import os

        os.environ["LOCAL_WORLD_SIZE"] = "2"
        try:
            def fused(host):
                def make(*args, **kwargs):
                    ps = table_row_wise(host_index=host)(*args, **kwargs)
                    ps.compute_kernel = FUSED
                    return ps
                return make

            text, report = after_pass([T("a", ["f0"], rows=10), T("b", ["f1"], rows=6)], {"a": fused(0), "b": fused(1)})
        finally:
            del os.environ["LOCAL_WORLD_SIZE"]
        self.assertIn("ebc: table_row_wise a@0,1 b@2,3", report.sparse[0])
        self.assertExpectedInline(text, """\
class <lambda>(torch.nn.Module):
    def forward(self, arg0_1: "f32[0]", arg1_1: "f32[20]", arg2_1: "f32[0]", arg3_1: "f32[]", arg4_1: "i64[4]", arg5_1: "i64[6]"):
        _sparse_twrw_weights_offsets: "i64[1]" = self._sparse_twrw_weights_offsets
        _sparse_twrw_d_offsets: "i32[2]" = self._sparse_twrw_D_offsets
        _sparse_twrw_hash_size_cumsum: "i64[2]" = self._sparse_twrw_hash_size_cumsum
        _sparse_twrw_momentum_offsets: "i64[1]" = self._sparse_twrw_momentum_offsets
        _sparse_twrw_rows: "i64[1]" = self._sparse_twrw_rows
        view: "i64[2, 2]" = torch.ops.aten.view.default(arg4_1, [2, 2])
        check_ids: "i64[6]" = torch.ops.graphshard.check_ids.default(arg5_1, arg4_1, [10, 6], "feature 'f0' (table 'a')\\nfeature 'f1' (table 'b')");  arg5_1 = arg4_1 = None
        _sparse_const: "i64[2]" = self._sparse_const
        lift_fresh_copy: "i64[2]" = torch.ops.aten.lift_fresh_copy.default(_sparse_const);  _sparse_const = None
        view_1: "i64[4]" = torch.ops.aten.view.default(view, [-1]);  view = None
        block_bucketize_sparse_features = torch.ops.fbgemm.block_bucketize_sparse_features.default(view_1, check_ids, False, False, lift_fresh_copy, 2);  view_1 = check_ids = lift_fresh_copy = None
        getitem: "i64[8]" = block_bucketize_sparse_features[0]
        getitem_1: "i64[6]" = block_bucketize_sparse_features[1];  block_bucketize_sparse_features = None
        view_2: "i64[4, 2]" = torch.ops.aten.view.default(getitem, [4, 2]);  getitem = None
        _sparse_const_1: "i32[4]" = self._sparse_const_1
        lift_fresh_copy_1: "i32[4]" = torch.ops.aten.lift_fresh_copy.default(_sparse_const_1);  _sparse_const_1 = None
        permute_2d_sparse_data = torch.ops.fbgemm.permute_2D_sparse_data.default(lift_fresh_copy_1, view_2, getitem_1);  lift_fresh_copy_1 = view_2 = getitem_1 = None
        getitem_5: "i64[4, 2]" = permute_2d_sparse_data[0]
        getitem_6: "i64[u0]" = permute_2d_sparse_data[1];  permute_2d_sparse_data = None
        view_3: "i64[8]" = torch.ops.aten.view.default(getitem_5, [-1])
        _sparse_const_2: "i64[4]" = self._sparse_const_2
        lift_fresh_copy_2: "i64[4]" = torch.ops.aten.lift_fresh_copy.default(_sparse_const_2);  _sparse_const_2 = None
        zeros: "i64[4]" = torch.ops.aten.zeros.default([4], dtype = torch.int64, device = device(type='cpu'), pin_memory = False)
        sum_1: "i64[4]" = torch.ops.aten.sum.dim_IntList(getitem_5, [1]);  getitem_5 = None
        index_add: "i64[4]" = torch.ops.aten.index_add.default(zeros, 0, lift_fresh_copy_2, sum_1);  zeros = lift_fresh_copy_2 = sum_1 = None
        all_to_all: "i64[8]" = torch.ops.graphshard.all_to_all.default(view_3, [2, 2, 2, 2], [2, 2, 2, 2], 'dp');  view_3 = None
        view_4: "i64[4, 2]" = torch.ops.aten.view.default(all_to_all, [4, 2])
        sum_2: "i64[4]" = torch.ops.aten.sum.dim_IntList(view_4, [1]);  view_4 = None
        unbind = torch.ops.aten.unbind.int(index_add);  index_add = None
        getitem_8: "i64[]" = unbind[0]
        getitem_9: "i64[]" = unbind[1]
        getitem_10: "i64[]" = unbind[2]
        getitem_11: "i64[]" = unbind[3];  unbind = None
        _local_scalar_dense: "Sym(u1)" = torch.ops.aten._local_scalar_dense.default(getitem_8);  getitem_8 = None
        _local_scalar_dense_1: "Sym(u2)" = torch.ops.aten._local_scalar_dense.default(getitem_9);  getitem_9 = None
        _local_scalar_dense_2: "Sym(u3)" = torch.ops.aten._local_scalar_dense.default(getitem_10);  getitem_10 = None
        _local_scalar_dense_3: "Sym(u4)" = torch.ops.aten._local_scalar_dense.default(getitem_11);  getitem_11 = None
        unbind_1 = torch.ops.aten.unbind.int(sum_2);  sum_2 = None
        getitem_12: "i64[]" = unbind_1[0]
        getitem_13: "i64[]" = unbind_1[1]
        getitem_14: "i64[]" = unbind_1[2]
        getitem_15: "i64[]" = unbind_1[3];  unbind_1 = None
        _local_scalar_dense_4: "Sym(u5)" = torch.ops.aten._local_scalar_dense.default(getitem_12);  getitem_12 = None
        _local_scalar_dense_5: "Sym(u6)" = torch.ops.aten._local_scalar_dense.default(getitem_13);  getitem_13 = None
        _local_scalar_dense_6: "Sym(u7)" = torch.ops.aten._local_scalar_dense.default(getitem_14);  getitem_14 = None
        _local_scalar_dense_7: "Sym(u8)" = torch.ops.aten._local_scalar_dense.default(getitem_15);  getitem_15 = None
        all_to_all_1: "i64[u5 + u6 + u7 + u8]" = torch.ops.graphshard.all_to_all.default(getitem_6, [_local_scalar_dense_4, _local_scalar_dense_5, _local_scalar_dense_6, _local_scalar_dense_7], [_local_scalar_dense, _local_scalar_dense_1, _local_scalar_dense_2, _local_scalar_dense_3], 'dp');  getitem_6 = _local_scalar_dense_4 = _local_scalar_dense_5 = _local_scalar_dense_6 = _local_scalar_dense_7 = _local_scalar_dense = _local_scalar_dense_1 = _local_scalar_dense_2 = _local_scalar_dense_3 = None
        view_5: "i64[4, 2]" = torch.ops.aten.view.default(all_to_all, [4, 2]);  all_to_all = None
        view_6: "i64[8]" = torch.ops.aten.view.default(view_5, [-1]);  view_5 = None
        asynchronous_complete_cumsum: "i64[9]" = torch.ops.fbgemm.asynchronous_complete_cumsum.default(view_6);  view_6 = None
        tbe_lookup: "f32[8, 4]" = torch.ops.graphshard.tbe_lookup.default(arg0_1, arg1_1, arg2_1, arg3_1, _sparse_twrw_weights_offsets, _sparse_twrw_d_offsets, _sparse_twrw_hash_size_cumsum, _sparse_twrw_momentum_offsets, _sparse_twrw_rows, all_to_all_1, asynchronous_complete_cumsum, None, 4, 4, 3, 0, 'sgd', [1e-08, 0.0, 0.0, 0.0], "feature 'f0' (table 'a')", [0], False, 0.25);  arg0_1 = arg1_1 = arg2_1 = arg3_1 = _sparse_twrw_weights_offsets = _sparse_twrw_d_offsets = _sparse_twrw_hash_size_cumsum = _sparse_twrw_momentum_offsets = _sparse_twrw_rows = all_to_all_1 = asynchronous_complete_cumsum = None
        view_7: "f32[4, 2, 4]" = torch.ops.aten.view.default(tbe_lookup, [4, 2, 4]);  tbe_lookup = None
        _sparse_const_3: "i64[4]" = self._sparse_const_3
        lift_fresh_copy_3: "i64[4]" = torch.ops.aten.lift_fresh_copy.default(_sparse_const_3);  _sparse_const_3 = None
        index_select: "f32[4, 2, 4]" = torch.ops.aten.index_select.default(view_7, 0, lift_fresh_copy_3);  view_7 = lift_fresh_copy_3 = None
        view_8: "f32[8, 4]" = torch.ops.aten.view.default(index_select, [8, 4]);  index_select = None
        reduce_scatter: "f32[4, 4]" = torch.ops.graphshard.reduce_scatter.default(view_8, 0, 'host', 2, 0);  view_8 = None
        view_9: "f32[16]" = torch.ops.aten.view.default(reduce_scatter, [-1]);  reduce_scatter = None
        all_to_all_2: "f32[16]" = torch.ops.graphshard.all_to_all.default(view_9, [8, 8], [8, 8], 'cross');  view_9 = None
        split_with_sizes = torch.ops.aten.split_with_sizes.default(all_to_all_2, [8, 8]);  all_to_all_2 = None
        getitem_16: "f32[8]" = split_with_sizes[0]
        getitem_17: "f32[8]" = split_with_sizes[1];  split_with_sizes = None
        view_10: "f32[2, 4]" = torch.ops.aten.view.default(getitem_16, [2, 4]);  getitem_16 = None
        view_11: "f32[2, 4]" = torch.ops.aten.view.default(getitem_17, [2, 4]);  getitem_17 = None
        cat: "f32[2, 8]" = torch.ops.aten.cat.default([view_10, view_11], 1);  view_10 = view_11 = None
        return (cat,)
""")

    def test_sequence_table_and_column_wise(self):
        # an EmbeddingCollection: table "a" on rank 0 (width 8), "b" column-wise over ranks 0, 1
        # (width 4): one exchange per width; each id's row comes back by an all-to-all with the
        # ids' splits swapped, in the order the ids were sent; b's column blocks side by side
        text, report = after_pass([S("a", ["f0"], dim=8), S("b", ["f1"], dim=8)],
                                  {"a": table_wise(rank=0, compute_kernel=FUSED),
                                   "b": column_wise(ranks=[0, 1], compute_kernel=FUSED)})
        self.assertIn("column_wise b@0,1", report.sparse[0])
        self.assertIn("a2a_d4: 1 table shard(s), sgd, a2a_d8: 1 table shard(s)", report.sparse[0])
        self.assertExpectedInline(text, """\
class <lambda>(torch.nn.Module):
    def forward(self, arg0_1: "i64[4]", arg1_1: "f32[0]", arg2_1: "f32[32]", arg3_1: "f32[0]", arg4_1: "f32[]", arg5_1: "f32[0]", arg6_1: "f32[64]", arg7_1: "f32[0]", arg8_1: "f32[]", arg9_1: "i64[6]"):
        _sparse_a2a_d4_weights_offsets: "i64[1]" = self._sparse_a2a_d4_weights_offsets
        _sparse_a2a_d4_d_offsets: "i32[2]" = self._sparse_a2a_d4_D_offsets
        _sparse_a2a_d4_hash_size_cumsum: "i64[2]" = self._sparse_a2a_d4_hash_size_cumsum
        _sparse_a2a_d4_momentum_offsets: "i64[1]" = self._sparse_a2a_d4_momentum_offsets
        _sparse_a2a_d4_rows: "i64[1]" = self._sparse_a2a_d4_rows
        _sparse_a2a_d8_weights_offsets: "i64[1]" = self._sparse_a2a_d8_weights_offsets
        _sparse_a2a_d8_d_offsets: "i32[2]" = self._sparse_a2a_d8_D_offsets
        _sparse_a2a_d8_hash_size_cumsum: "i64[2]" = self._sparse_a2a_d8_hash_size_cumsum
        _sparse_a2a_d8_momentum_offsets: "i64[1]" = self._sparse_a2a_d8_momentum_offsets
        _sparse_a2a_d8_rows: "i64[1]" = self._sparse_a2a_d8_rows
        view_1: "i64[2, 2]" = torch.ops.aten.view.default(arg0_1, [2, 2])
        check_ids: "i64[6]" = torch.ops.graphshard.check_ids.default(arg9_1, arg0_1, [8, 8], "feature 'f0' (table 'a')\\nfeature 'f1' (table 'b')");  arg9_1 = arg0_1 = None
        sum_2: "i64[2]" = torch.ops.aten.sum.dim_IntList(view_1, [1])
        unbind = torch.ops.aten.unbind.int(sum_2);  sum_2 = None
        getitem_2: "i64[]" = unbind[0]
        getitem_3: "i64[]" = unbind[1];  unbind = None
        _local_scalar_dense: "Sym(u2)" = torch.ops.aten._local_scalar_dense.default(getitem_2);  getitem_2 = None
        _local_scalar_dense_1: "Sym(u3)" = torch.ops.aten._local_scalar_dense.default(getitem_3);  getitem_3 = None
        add_2: "Sym(u3)" = 0 + _local_scalar_dense_1
        add_3: "Sym(2*u3)" = add_2 + _local_scalar_dense_1;  add_2 = None
        _sparse_const: "i32[2]" = self._sparse_const
        lift_fresh_copy: "i32[2]" = torch.ops.aten.lift_fresh_copy.default(_sparse_const);  _sparse_const = None
        permute_2d_sparse_data = torch.ops.fbgemm.permute_2D_sparse_data.default(lift_fresh_copy, view_1, check_ids, None, add_3);  lift_fresh_copy = add_3 = None
        getitem_4: "i64[2, 2]" = permute_2d_sparse_data[0]
        getitem_5: "i64[2*u3]" = permute_2d_sparse_data[1];  permute_2d_sparse_data = None
        add_4: "Sym(u3)" = 0 + _local_scalar_dense_1
        add_5: "Sym(u3)" = 0 + _local_scalar_dense_1
        view_2: "i64[4]" = torch.ops.aten.view.default(getitem_4, [-1]);  getitem_4 = None
        all_to_all: "i64[8]" = torch.ops.graphshard.all_to_all.default(view_2, [2, 2, 2, 2], [2, 2, 0, 0], 'dp');  view_2 = None
        view_3: "i64[4, 2]" = torch.ops.aten.view.default(all_to_all, [4, 2]);  all_to_all = None
        sum_3: "i64[4]" = torch.ops.aten.sum.dim_IntList(view_3, [1]);  view_3 = None
        unbind_1 = torch.ops.aten.unbind.int(sum_3);  sum_3 = None
        getitem_7: "i64[]" = unbind_1[0]
        getitem_8: "i64[]" = unbind_1[1]
        getitem_9: "i64[]" = unbind_1[2]
        getitem_10: "i64[]" = unbind_1[3];  unbind_1 = None
        _local_scalar_dense_2: "Sym(u4)" = torch.ops.aten._local_scalar_dense.default(getitem_7);  getitem_7 = None
        _local_scalar_dense_3: "Sym(u5)" = torch.ops.aten._local_scalar_dense.default(getitem_8);  getitem_8 = None
        _local_scalar_dense_4: "Sym(u6)" = torch.ops.aten._local_scalar_dense.default(getitem_9);  getitem_9 = None
        _local_scalar_dense_5: "Sym(u7)" = torch.ops.aten._local_scalar_dense.default(getitem_10);  getitem_10 = None
        all_to_all_1: "i64[u4 + u5 + u6 + u7]" = torch.ops.graphshard.all_to_all.default(getitem_5, [_local_scalar_dense_2, _local_scalar_dense_3, _local_scalar_dense_4, _local_scalar_dense_5], [add_4, add_5, 0, 0], 'dp');  getitem_5 = None
        sym_size_int_2: "Sym(u4 + u5 + u6 + u7)" = torch.ops.aten.sym_size.int(all_to_all_1, 0)
        add_6: "Sym(u4 + u5 + u6 + u7 + 1)" = sym_size_int_2 + 1;  sym_size_int_2 = None
        arange: "i64[u4 + u5 + u6 + u7 + 1]" = torch.ops.aten.arange.default(add_6, dtype = torch.int64, device = device(type='cpu'), pin_memory = False);  add_6 = None
        tbe_lookup: "f32[u4 + u5 + u6 + u7, 4]" = torch.ops.graphshard.tbe_lookup.default(arg1_1, arg2_1, arg3_1, arg4_1, _sparse_a2a_d4_weights_offsets, _sparse_a2a_d4_d_offsets, _sparse_a2a_d4_hash_size_cumsum, _sparse_a2a_d4_momentum_offsets, _sparse_a2a_d4_rows, all_to_all_1, arange, None, 4, 4, 4, 0, 'sgd', [1e-08, 0.0, 0.0, 0.0], "the stacked shards of ['b']", [0], False, 0.25);  arg1_1 = arg2_1 = arg3_1 = arg4_1 = _sparse_a2a_d4_weights_offsets = _sparse_a2a_d4_d_offsets = _sparse_a2a_d4_hash_size_cumsum = _sparse_a2a_d4_momentum_offsets = _sparse_a2a_d4_rows = all_to_all_1 = arange = None
        all_to_all_2: "f32[2*u3, 4]" = torch.ops.graphshard.all_to_all.default(tbe_lookup, [add_4, add_5, 0, 0], [_local_scalar_dense_2, _local_scalar_dense_3, _local_scalar_dense_4, _local_scalar_dense_5], 'dp');  tbe_lookup = add_4 = add_5 = _local_scalar_dense_2 = _local_scalar_dense_3 = _local_scalar_dense_4 = _local_scalar_dense_5 = None
        split_with_sizes = torch.ops.aten.split_with_sizes.default(all_to_all_2, [_local_scalar_dense_1, _local_scalar_dense_1]);  all_to_all_2 = _local_scalar_dense_1 = None
        getitem_11: "f32[u3, 4]" = split_with_sizes[0]
        getitem_12: "f32[u3, 4]" = split_with_sizes[1];  split_with_sizes = None
        add_7: "Sym(u2)" = 0 + _local_scalar_dense
        _sparse_const_1: "i32[1]" = self._sparse_const_1
        lift_fresh_copy_1: "i32[1]" = torch.ops.aten.lift_fresh_copy.default(_sparse_const_1);  _sparse_const_1 = None
        permute_2d_sparse_data_1 = torch.ops.fbgemm.permute_2D_sparse_data.default(lift_fresh_copy_1, view_1, check_ids, None, add_7);  lift_fresh_copy_1 = view_1 = check_ids = add_7 = None
        getitem_13: "i64[1, 2]" = permute_2d_sparse_data_1[0]
        getitem_14: "i64[u2]" = permute_2d_sparse_data_1[1];  permute_2d_sparse_data_1 = None
        add_8: "Sym(u2)" = 0 + _local_scalar_dense
        view_5: "i64[2]" = torch.ops.aten.view.default(getitem_13, [-1]);  getitem_13 = None
        all_to_all_3: "i64[8]" = torch.ops.graphshard.all_to_all.default(view_5, [2, 2, 2, 2], [2, 0, 0, 0], 'dp');  view_5 = None
        view_6: "i64[4, 2]" = torch.ops.aten.view.default(all_to_all_3, [4, 2]);  all_to_all_3 = None
        sum_5: "i64[4]" = torch.ops.aten.sum.dim_IntList(view_6, [1]);  view_6 = None
        unbind_2 = torch.ops.aten.unbind.int(sum_5);  sum_5 = None
        getitem_16: "i64[]" = unbind_2[0]
        getitem_17: "i64[]" = unbind_2[1]
        getitem_18: "i64[]" = unbind_2[2]
        getitem_19: "i64[]" = unbind_2[3];  unbind_2 = None
        _local_scalar_dense_6: "Sym(u8)" = torch.ops.aten._local_scalar_dense.default(getitem_16);  getitem_16 = None
        _local_scalar_dense_7: "Sym(u9)" = torch.ops.aten._local_scalar_dense.default(getitem_17);  getitem_17 = None
        _local_scalar_dense_8: "Sym(u10)" = torch.ops.aten._local_scalar_dense.default(getitem_18);  getitem_18 = None
        _local_scalar_dense_9: "Sym(u11)" = torch.ops.aten._local_scalar_dense.default(getitem_19);  getitem_19 = None
        all_to_all_4: "i64[u10 + u11 + u8 + u9]" = torch.ops.graphshard.all_to_all.default(getitem_14, [_local_scalar_dense_6, _local_scalar_dense_7, _local_scalar_dense_8, _local_scalar_dense_9], [add_8, 0, 0, 0], 'dp');  getitem_14 = None
        sym_size_int_3: "Sym(u10 + u11 + u8 + u9)" = torch.ops.aten.sym_size.int(all_to_all_4, 0)
        add_9: "Sym(u10 + u11 + u8 + u9 + 1)" = sym_size_int_3 + 1;  sym_size_int_3 = None
        arange_1: "i64[u10 + u11 + u8 + u9 + 1]" = torch.ops.aten.arange.default(add_9, dtype = torch.int64, device = device(type='cpu'), pin_memory = False);  add_9 = None
        tbe_lookup_1: "f32[u10 + u11 + u8 + u9, 8]" = torch.ops.graphshard.tbe_lookup.default(arg5_1, arg6_1, arg7_1, arg8_1, _sparse_a2a_d8_weights_offsets, _sparse_a2a_d8_d_offsets, _sparse_a2a_d8_hash_size_cumsum, _sparse_a2a_d8_momentum_offsets, _sparse_a2a_d8_rows, all_to_all_4, arange_1, None, 8, 8, 4, 0, 'sgd', [1e-08, 0.0, 0.0, 0.0], "the stacked shards of ['a']", [0], False, 0.25);  arg5_1 = arg6_1 = arg7_1 = arg8_1 = _sparse_a2a_d8_weights_offsets = _sparse_a2a_d8_d_offsets = _sparse_a2a_d8_hash_size_cumsum = _sparse_a2a_d8_momentum_offsets = _sparse_a2a_d8_rows = all_to_all_4 = arange_1 = None
        all_to_all_5: "f32[u2, 8]" = torch.ops.graphshard.all_to_all.default(tbe_lookup_1, [add_8, 0, 0, 0], [_local_scalar_dense_6, _local_scalar_dense_7, _local_scalar_dense_8, _local_scalar_dense_9], 'dp');  tbe_lookup_1 = add_8 = _local_scalar_dense_6 = _local_scalar_dense_7 = _local_scalar_dense_8 = _local_scalar_dense_9 = None
        split_with_sizes_1 = torch.ops.aten.split_with_sizes.default(all_to_all_5, [_local_scalar_dense]);  all_to_all_5 = _local_scalar_dense = None
        getitem_20: "f32[u2, 8]" = split_with_sizes_1[0];  split_with_sizes_1 = None
        cat_1: "f32[u3, 8]" = torch.ops.aten.cat.default([getitem_11, getitem_12], 1);  getitem_11 = getitem_12 = None
        sym_size_int: "Sym(u0)" = torch.ops.aten.sym_size.int(getitem_20, 0)
        ge: "Sym(u0 >= 0)" = sym_size_int >= 0;  sym_size_int = None
        _assert_scalar = torch.ops.aten._assert_scalar.default(ge, "Runtime assertion failed for expression u0 >= 0 on node 'ge'");  ge = _assert_scalar = None
        sym_size_int_1: "Sym(u1)" = torch.ops.aten.sym_size.int(cat_1, 0)
        ge_1: "Sym(u1 >= 0)" = sym_size_int_1 >= 0;  sym_size_int_1 = None
        _assert_scalar_1 = torch.ops.aten._assert_scalar.default(ge_1, "Runtime assertion failed for expression u1 >= 0 on node 'ge_1'");  ge_1 = _assert_scalar_1 = None
        cat: "f32[u0 + u1, 8]" = torch.ops.aten.cat.default([getitem_20, cat_1]);  getitem_20 = cat_1 = None
        sum_1: "f32[8]" = torch.ops.aten.sum.dim_IntList(cat, [0]);  cat = None
        return (sum_1,)
""")

    def test_sequence_row_wise(self):
        # row-wise: ids bucketized by row block (sequence=True keeps the permutation back to the
        # ids' order), each rank's rows of the stacked table, back by an all-to-all, unbucketized
        text, _ = after_pass([S("a", ["f0", "f1"])], {"a": row_wise(compute_kernel=FUSED)})
        self.assertExpectedInline(text, """\
class <lambda>(torch.nn.Module):
    def forward(self, arg0_1: "i64[4]", arg1_1: "f32[0]", arg2_1: "f32[8]", arg3_1: "f32[0]", arg4_1: "f32[]", arg5_1: "i64[6]"):
        _sparse_rw_weights_offsets: "i64[1]" = self._sparse_rw_weights_offsets
        _sparse_rw_d_offsets: "i32[2]" = self._sparse_rw_D_offsets
        _sparse_rw_hash_size_cumsum: "i64[2]" = self._sparse_rw_hash_size_cumsum
        _sparse_rw_momentum_offsets: "i64[1]" = self._sparse_rw_momentum_offsets
        _sparse_rw_rows: "i64[1]" = self._sparse_rw_rows
        view_1: "i64[2, 2]" = torch.ops.aten.view.default(arg0_1, [2, 2])
        check_ids: "i64[6]" = torch.ops.graphshard.check_ids.default(arg5_1, arg0_1, [8, 8], "feature 'f0' (table 'a')\\nfeature 'f1' (table 'a')");  arg5_1 = arg0_1 = None
        sum_2: "i64[2]" = torch.ops.aten.sum.dim_IntList(view_1, [1])
        unbind = torch.ops.aten.unbind.int(sum_2);  sum_2 = None
        getitem_2: "i64[]" = unbind[0]
        getitem_3: "i64[]" = unbind[1];  unbind = None
        _local_scalar_dense: "Sym(u2)" = torch.ops.aten._local_scalar_dense.default(getitem_2);  getitem_2 = None
        _local_scalar_dense_1: "Sym(u3)" = torch.ops.aten._local_scalar_dense.default(getitem_3);  getitem_3 = None
        _sparse_const: "i64[2]" = self._sparse_const
        lift_fresh_copy: "i64[2]" = torch.ops.aten.lift_fresh_copy.default(_sparse_const);  _sparse_const = None
        view_2: "i64[4]" = torch.ops.aten.view.default(view_1, [-1]);  view_1 = None
        block_bucketize_sparse_features = torch.ops.fbgemm.block_bucketize_sparse_features.default(view_2, check_ids, False, True, lift_fresh_copy, 4);  view_2 = check_ids = lift_fresh_copy = None
        getitem_4: "i64[16]" = block_bucketize_sparse_features[0]
        getitem_5: "i64[6]" = block_bucketize_sparse_features[1]
        getitem_8: "i64[6]" = block_bucketize_sparse_features[4];  block_bucketize_sparse_features = None
        view_3: "i64[8, 2]" = torch.ops.aten.view.default(getitem_4, [8, 2]);  getitem_4 = None
        view_4: "i64[16]" = torch.ops.aten.view.default(view_3, [-1])
        _sparse_const_1: "i64[8]" = self._sparse_const_1
        lift_fresh_copy_1: "i64[8]" = torch.ops.aten.lift_fresh_copy.default(_sparse_const_1);  _sparse_const_1 = None
        zeros: "i64[4]" = torch.ops.aten.zeros.default([4], dtype = torch.int64, device = device(type='cpu'), pin_memory = False)
        sum_3: "i64[8]" = torch.ops.aten.sum.dim_IntList(view_3, [1]);  view_3 = None
        index_add: "i64[4]" = torch.ops.aten.index_add.default(zeros, 0, lift_fresh_copy_1, sum_3);  zeros = lift_fresh_copy_1 = sum_3 = None
        all_to_all: "i64[16]" = torch.ops.graphshard.all_to_all.default(view_4, [4, 4, 4, 4], [4, 4, 4, 4], 'dp');  view_4 = None
        view_5: "i64[4, 4]" = torch.ops.aten.view.default(all_to_all, [4, 4]);  all_to_all = None
        sum_4: "i64[4]" = torch.ops.aten.sum.dim_IntList(view_5, [1]);  view_5 = None
        unbind_1 = torch.ops.aten.unbind.int(index_add);  index_add = None
        getitem_9: "i64[]" = unbind_1[0]
        getitem_10: "i64[]" = unbind_1[1]
        getitem_11: "i64[]" = unbind_1[2]
        getitem_12: "i64[]" = unbind_1[3];  unbind_1 = None
        _local_scalar_dense_2: "Sym(u4)" = torch.ops.aten._local_scalar_dense.default(getitem_9);  getitem_9 = None
        _local_scalar_dense_3: "Sym(u5)" = torch.ops.aten._local_scalar_dense.default(getitem_10);  getitem_10 = None
        _local_scalar_dense_4: "Sym(u6)" = torch.ops.aten._local_scalar_dense.default(getitem_11);  getitem_11 = None
        _local_scalar_dense_5: "Sym(u7)" = torch.ops.aten._local_scalar_dense.default(getitem_12);  getitem_12 = None
        unbind_2 = torch.ops.aten.unbind.int(sum_4);  sum_4 = None
        getitem_13: "i64[]" = unbind_2[0]
        getitem_14: "i64[]" = unbind_2[1]
        getitem_15: "i64[]" = unbind_2[2]
        getitem_16: "i64[]" = unbind_2[3];  unbind_2 = None
        _local_scalar_dense_6: "Sym(u8)" = torch.ops.aten._local_scalar_dense.default(getitem_13);  getitem_13 = None
        _local_scalar_dense_7: "Sym(u9)" = torch.ops.aten._local_scalar_dense.default(getitem_14);  getitem_14 = None
        _local_scalar_dense_8: "Sym(u10)" = torch.ops.aten._local_scalar_dense.default(getitem_15);  getitem_15 = None
        _local_scalar_dense_9: "Sym(u11)" = torch.ops.aten._local_scalar_dense.default(getitem_16);  getitem_16 = None
        all_to_all_1: "i64[u10 + u11 + u8 + u9]" = torch.ops.graphshard.all_to_all.default(getitem_5, [_local_scalar_dense_6, _local_scalar_dense_7, _local_scalar_dense_8, _local_scalar_dense_9], [_local_scalar_dense_2, _local_scalar_dense_3, _local_scalar_dense_4, _local_scalar_dense_5], 'dp');  getitem_5 = None
        sym_size_int_2: "Sym(u10 + u11 + u8 + u9)" = torch.ops.aten.sym_size.int(all_to_all_1, 0)
        add_4: "Sym(u10 + u11 + u8 + u9 + 1)" = sym_size_int_2 + 1;  sym_size_int_2 = None
        arange: "i64[u10 + u11 + u8 + u9 + 1]" = torch.ops.aten.arange.default(add_4, dtype = torch.int64, device = device(type='cpu'), pin_memory = False);  add_4 = None
        tbe_lookup: "f32[u10 + u11 + u8 + u9, 4]" = torch.ops.graphshard.tbe_lookup.default(arg1_1, arg2_1, arg3_1, arg4_1, _sparse_rw_weights_offsets, _sparse_rw_d_offsets, _sparse_rw_hash_size_cumsum, _sparse_rw_momentum_offsets, _sparse_rw_rows, all_to_all_1, arange, None, 4, 4, 2, 0, 'sgd', [1e-08, 0.0, 0.0, 0.0], "the stacked shards of ['a']", [0], False, 0.25);  arg1_1 = arg2_1 = arg3_1 = arg4_1 = _sparse_rw_weights_offsets = _sparse_rw_d_offsets = _sparse_rw_hash_size_cumsum = _sparse_rw_momentum_offsets = _sparse_rw_rows = all_to_all_1 = arange = None
        all_to_all_2: "f32[u4 + u5 + u6 + u7, 4]" = torch.ops.graphshard.all_to_all.default(tbe_lookup, [_local_scalar_dense_2, _local_scalar_dense_3, _local_scalar_dense_4, _local_scalar_dense_5], [_local_scalar_dense_6, _local_scalar_dense_7, _local_scalar_dense_8, _local_scalar_dense_9], 'dp');  tbe_lookup = _local_scalar_dense_2 = _local_scalar_dense_3 = _local_scalar_dense_4 = _local_scalar_dense_5 = _local_scalar_dense_6 = _local_scalar_dense_7 = _local_scalar_dense_8 = _local_scalar_dense_9 = None
        index_select: "f32[6, 4]" = torch.ops.aten.index_select.default(all_to_all_2, 0, getitem_8);  all_to_all_2 = getitem_8 = None
        split_with_sizes = torch.ops.aten.split_with_sizes.default(index_select, [_local_scalar_dense, _local_scalar_dense_1]);  index_select = _local_scalar_dense = _local_scalar_dense_1 = None
        getitem_17: "f32[u2, 4]" = split_with_sizes[0]
        getitem_18: "f32[u3, 4]" = split_with_sizes[1];  split_with_sizes = None
        sym_size_int: "Sym(u0)" = torch.ops.aten.sym_size.int(getitem_17, 0)
        ge: "Sym(u0 >= 0)" = sym_size_int >= 0;  sym_size_int = None
        _assert_scalar = torch.ops.aten._assert_scalar.default(ge, "Runtime assertion failed for expression u0 >= 0 on node 'ge'");  ge = _assert_scalar = None
        sym_size_int_1: "Sym(u1)" = torch.ops.aten.sym_size.int(getitem_18, 0)
        ge_1: "Sym(u1 >= 0)" = sym_size_int_1 >= 0;  sym_size_int_1 = None
        _assert_scalar_1 = torch.ops.aten._assert_scalar.default(ge_1, "Runtime assertion failed for expression u1 >= 0 on node 'ge_1'");  ge_1 = _assert_scalar_1 = None
        cat: "f32[u0 + u1, 4]" = torch.ops.aten.cat.default([getitem_17, getitem_18]);  getitem_17 = getitem_18 = None
        sum_1: "f32[4]" = torch.ops.aten.sum.dim_IntList(cat, [0]);  cat = None
        return (sum_1,)
""")


@pytest.mark.parametrize("limits", [[8, 8, 8], [8, 6, 8], [8, -1, 8]], ids=["same_rows", "mixed_rows", "unused_feature"])
def test_check_ids_names_the_feature(limits):
    """``graphshard::check_ids`` (the pass puts it where the KJT enters): in-range ids pass through;
    the first id outside its feature's table (a negative limit: an unused feature, only the sign)
    is refused naming the feature, whichever of its checks (one min/max pass, or one per feature)
    ran."""
    names = "feature 'f0' (table 'a')\nfeature 'f1' (table 'b')\nfeature 'f2' (table 'a')"
    lengths = torch.tensor([1, 2, 2, 0, 1, 1])  # 3 features x batch 2
    ids = torch.tensor([7, 0, 5, 1, 2, 3, 4])
    assert torch.equal(torch.ops.graphshard.check_ids(ids, lengths, limits, names), ids)
    for at, bad, feature in [(1, -1, "f0"), (4, limits[1] if limits[1] > 0 else -2, "f1"), (6, 8, "f2")]:
        wrong = ids.clone()
        wrong[at] = bad
        with pytest.raises(ValueError, match=f"id {bad} of feature '{feature}'"):
            torch.ops.graphshard.check_ids(wrong, lengths, limits, names)
