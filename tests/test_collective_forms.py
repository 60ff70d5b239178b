"""Plan(collectives=...): which form a unit's data-parallel collectives take.

The fake process group's backend is neither gloo nor NCCL, so its graphs show NCCL's forms
(test_schedule_overlap.py). Here the axes report gloo (``backend_on`` patched): "auto" then
gives gloo's forms, and "nccl" gives NCCL's, graph for graph the ones the fake (NCCL-form)
group gets: what the multi-rank ``nccl_forms`` cases run on gloo.
"""

from unittest import mock

import pytest
import torch
from expecttest import TestCase
from torch.distributed.device_mesh import init_device_mesh

import graphshard
from _golden import compiled_stages
from _models import mesh1d, stack


def _plan(mesh=None, **kwargs):
    mesh = mesh if mesh is not None else mesh1d("dp")
    return graphshard.Plan(mesh, {"layers.*": graphshard.FullyShard(), "": graphshard.FullyShard()}, **kwargs)


def _on_gloo(plan):
    with mock.patch("graphshard.storage.backend_on", return_value="gloo"):
        model = stack()
        graphshard.shard(model, plan)
    return model


def _collective_lines(text: str) -> str:
    keep = ("graphshard.pack", "graphshard.unpack", "all_gather", "reduce_scatter", "all_to_all", "all_reduce")
    return "\n".join(line.strip() for line in text.splitlines() if any(k in line for k in keep))


class TestCollectiveForms(TestCase):
    def test_nccl_forms_on_gloo_are_the_nccl_graphs(self):
        model = _on_gloo(_plan(collectives="nccl"))
        info = next(iter(model._graphshard.params.values()))
        self.assertEqual((info.shard.backend, info.shard.collectives), ("gloo", "nccl"))
        self.assertFalse(info.shard.gather_coalesced or info.shard.scatter_by_all_to_all)
        g = compiled_stages(model, model._graphshard.plan, (torch.randn(4, 8),))
        torch._dynamo.reset()
        fake = stack()
        self.assertEqual(g, compiled_stages(fake, _plan(), (torch.randn(4, 8),)))
        # Forward: per unit, pack -> all_gather_into_tensor -> unpack (FULL_SHARD: again in backward).
        self.assertExpectedInline(_collective_lines(g["forward"]), """\
pack: "f32[16]" = torch.ops.graphshard.pack.default([primals_1], [16], torch.float32)
all_gather_into_tensor: "f32[64]" = torch.ops._c10d_functional.all_gather_into_tensor.default(pack, 4, 'dp');  pack = None
wait_tensor: "f32[64]" = torch.ops._c10d_functional.wait_tensor.default(all_gather_into_tensor);  all_gather_into_tensor = None
pack_1: "f32[16]" = torch.ops.graphshard.pack.default([primals_3], [16], torch.float32)
all_gather_into_tensor_1: "f32[64]" = torch.ops._c10d_functional.all_gather_into_tensor.default(pack_1, 4, 'dp');  pack_1 = None
unpack = torch.ops.graphshard.unpack.default(wait_tensor, 4, [16]);  wait_tensor = None
wait_tensor_1: "f32[64]" = torch.ops._c10d_functional.wait_tensor.default(all_gather_into_tensor_1);  all_gather_into_tensor_1 = None
pack_2: "f32[16]" = torch.ops.graphshard.pack.default([primals_4], [16], torch.float32)
all_gather_into_tensor_2: "f32[64]" = torch.ops._c10d_functional.all_gather_into_tensor.default(pack_2, 4, 'dp');  pack_2 = None
unpack_1 = torch.ops.graphshard.unpack.default(wait_tensor_1, 4, [16]);  wait_tensor_1 = None
wait_tensor_2: "f32[64]" = torch.ops._c10d_functional.wait_tensor.default(all_gather_into_tensor_2);  all_gather_into_tensor_2 = None
unpack_2 = torch.ops.graphshard.unpack.default(wait_tensor_2, 4, [16]);  wait_tensor_2 = None""")
        # Backward: per unit, pack_grads -> reduce_scatter_tensor("avg") -> unpack_reduced(rows=1).
        self.assertExpectedInline(_collective_lines(g["backward"]), """\
pack_2: "f32[16]" = torch.ops.graphshard.pack.default([primals_4], [16], torch.float32);  primals_4 = None
all_gather_into_tensor_2: "f32[64]" = torch.ops._c10d_functional.all_gather_into_tensor.default(pack_2, 4, 'dp');  pack_2 = None
wait_tensor_2: "f32[64]" = torch.ops._c10d_functional.wait_tensor.default(all_gather_into_tensor_2);  all_gather_into_tensor_2 = None
pack_1: "f32[16]" = torch.ops.graphshard.pack.default([primals_3], [16], torch.float32);  primals_3 = None
all_gather_into_tensor_1: "f32[64]" = torch.ops._c10d_functional.all_gather_into_tensor.default(pack_1, 4, 'dp');  pack_1 = None
pack_grads: "f32[64]" = torch.ops.graphshard.pack_grads.default([t_6], 4, [16], torch.float32);  t_6 = None
reduce_scatter_tensor: "f32[16]" = torch.ops._c10d_functional.reduce_scatter_tensor.default(pack_grads, 'avg', 4, 'dp');  pack_grads = None
unpack_2 = torch.ops.graphshard.unpack.default(wait_tensor_2, 4, [16]);  wait_tensor_2 = None
pack_grads_1: "f32[64]" = torch.ops.graphshard.pack_grads.default([t_10], 4, [16], torch.float32);  t_10 = None
reduce_scatter_tensor_1: "f32[16]" = torch.ops._c10d_functional.reduce_scatter_tensor.default(pack_grads_1, 'avg', 4, 'dp');  pack_grads_1 = None
wait_tensor_3: "f32[16]" = torch.ops._c10d_functional.wait_tensor.default(reduce_scatter_tensor);  reduce_scatter_tensor = None
unpack_reduced = torch.ops.graphshard.unpack_reduced.default(wait_tensor_3, 1, [16], [16]);  wait_tensor_3 = None
wait_tensor_1: "f32[64]" = torch.ops._c10d_functional.wait_tensor.default(all_gather_into_tensor_1);  all_gather_into_tensor_1 = None
unpack_1 = torch.ops.graphshard.unpack.default(wait_tensor_1, 4, [16]);  wait_tensor_1 = None
pack_grads_2: "f32[64]" = torch.ops.graphshard.pack_grads.default([t_13], 4, [16], torch.float32);  t_13 = None
reduce_scatter_tensor_2: "f32[16]" = torch.ops._c10d_functional.reduce_scatter_tensor.default(pack_grads_2, 'avg', 4, 'dp');  pack_grads_2 = None
wait_tensor_4: "f32[16]" = torch.ops._c10d_functional.wait_tensor.default(reduce_scatter_tensor_1);  reduce_scatter_tensor_1 = None
unpack_reduced_1 = torch.ops.graphshard.unpack_reduced.default(wait_tensor_4, 1, [16], [16]);  wait_tensor_4 = None
wait_tensor_5: "f32[16]" = torch.ops._c10d_functional.wait_tensor.default(reduce_scatter_tensor_2);  reduce_scatter_tensor_2 = None
unpack_reduced_2 = torch.ops.graphshard.unpack_reduced.default(wait_tensor_5, 1, [16], [16]);  wait_tensor_5 = None""")

    def test_auto_on_gloo_gives_gloo_forms(self):
        model = _on_gloo(_plan())
        g = compiled_stages(model, model._graphshard.plan, (torch.randn(4, 8),))
        lines = _collective_lines(g["forward"] + g["backward"])
        self.assertIn("all_gather_into_tensor_coalesced", lines)
        self.assertIn("all_to_all_single", lines)
        self.assertNotIn("reduce_scatter_tensor", lines)
        self.assertNotIn("graphshard.unpack.default", lines)

    def test_hybrid_nccl_forms_reduce_scatter_then_all_reduce(self):
        # HSDP: the shard axis's reduce-scatter ("avg", nothing left to average), then the
        # replicate axis's all-reduce ("avg") of the reduced shard.
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
        model = _on_gloo(_plan(mesh, collectives="nccl"))
        g = compiled_stages(model, model._graphshard.plan, (torch.randn(4, 8),))
        self.assertExpectedInline(_collective_lines(g["backward"]), """\
pack_2: "f32[32]" = torch.ops.graphshard.pack.default([primals_4], [32], torch.float32);  primals_4 = None
all_gather_into_tensor_2: "f32[64]" = torch.ops._c10d_functional.all_gather_into_tensor.default(pack_2, 2, 'shard');  pack_2 = None
wait_tensor_2: "f32[64]" = torch.ops._c10d_functional.wait_tensor.default(all_gather_into_tensor_2);  all_gather_into_tensor_2 = None
pack_1: "f32[32]" = torch.ops.graphshard.pack.default([primals_3], [32], torch.float32);  primals_3 = None
all_gather_into_tensor_1: "f32[64]" = torch.ops._c10d_functional.all_gather_into_tensor.default(pack_1, 2, 'shard');  pack_1 = None
pack_grads: "f32[64]" = torch.ops.graphshard.pack_grads.default([t_6], 2, [32], torch.float32);  t_6 = None
reduce_scatter_tensor: "f32[32]" = torch.ops._c10d_functional.reduce_scatter_tensor.default(pack_grads, 'avg', 2, 'shard');  pack_grads = None
unpack_2 = torch.ops.graphshard.unpack.default(wait_tensor_2, 2, [32]);  wait_tensor_2 = None
pack_grads_1: "f32[64]" = torch.ops.graphshard.pack_grads.default([t_10], 2, [32], torch.float32);  t_10 = None
reduce_scatter_tensor_1: "f32[32]" = torch.ops._c10d_functional.reduce_scatter_tensor.default(pack_grads_1, 'avg', 2, 'shard');  pack_grads_1 = None
wait_tensor_3: "f32[32]" = torch.ops._c10d_functional.wait_tensor.default(reduce_scatter_tensor);  reduce_scatter_tensor = None
all_reduce: "f32[32]" = torch.ops._c10d_functional.all_reduce.default(wait_tensor_3, 'avg', 'replicate');  wait_tensor_3 = None
wait_tensor_1: "f32[64]" = torch.ops._c10d_functional.wait_tensor.default(all_gather_into_tensor_1);  all_gather_into_tensor_1 = None
unpack_1 = torch.ops.graphshard.unpack.default(wait_tensor_1, 2, [32]);  wait_tensor_1 = None
pack_grads_2: "f32[64]" = torch.ops.graphshard.pack_grads.default([t_13], 2, [32], torch.float32);  t_13 = None
reduce_scatter_tensor_2: "f32[32]" = torch.ops._c10d_functional.reduce_scatter_tensor.default(pack_grads_2, 'avg', 2, 'shard');  pack_grads_2 = None
wait_tensor_5: "f32[32]" = torch.ops._c10d_functional.wait_tensor.default(reduce_scatter_tensor_1);  reduce_scatter_tensor_1 = None
all_reduce_1: "f32[32]" = torch.ops._c10d_functional.all_reduce.default(wait_tensor_5, 'avg', 'replicate');  wait_tensor_5 = None
wait_tensor_4: "f32[32]" = torch.ops._c10d_functional.wait_tensor.default(all_reduce);  all_reduce = None
unpack_reduced = torch.ops.graphshard.unpack_reduced.default(wait_tensor_4, 1, [32], [32]);  wait_tensor_4 = None
wait_tensor_7: "f32[32]" = torch.ops._c10d_functional.wait_tensor.default(reduce_scatter_tensor_2);  reduce_scatter_tensor_2 = None
all_reduce_2: "f32[32]" = torch.ops._c10d_functional.all_reduce.default(wait_tensor_7, 'avg', 'replicate');  wait_tensor_7 = None
wait_tensor_6: "f32[32]" = torch.ops._c10d_functional.wait_tensor.default(all_reduce_1);  all_reduce_1 = None
unpack_reduced_1 = torch.ops.graphshard.unpack_reduced.default(wait_tensor_6, 1, [32], [32]);  wait_tensor_6 = None
wait_tensor_8: "f32[32]" = torch.ops._c10d_functional.wait_tensor.default(all_reduce_2);  all_reduce_2 = None
unpack_reduced_2 = torch.ops.graphshard.unpack_reduced.default(wait_tensor_8, 1, [32], [32]);  wait_tensor_8 = None""")


def test_collectives_must_be_a_known_form():
    with pytest.raises(ValueError, match=r"Plan\(collectives='gloo'\): expected one of \('auto', 'nccl'\)"):
        _plan(collectives="gloo")
