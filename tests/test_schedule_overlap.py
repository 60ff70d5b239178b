import copy
import functools
import re
from unittest import mock

import torch
import torch.fx as fx
from expecttest import TestCase

import graphshard
import graphshard.passes.pipeline as pipeline_module
import graphshard.passes.schedule_overlap as schedule_module
from _golden import compiled_stages
from _models import fsdp_plan, mesh1d, seeded, stack
from graphshard._compat import c10d
from graphshard.config import CompileConfig
from graphshard.report import collective_kind
from graphshard.testing.models import MLP
from graphshard.params import AxisGroup


class TestScheduleOverlap(TestCase):
    def test_forward_prefetches_next_unit(self):
        g = compiled_stages(stack(), fsdp_plan(), (torch.randn(4, 8),))
        self.assertExpectedInline(g["forward"], """\
class GraphModule(torch.nn.Module):
    def forward(self, primals_1: "f32[2, 8]", primals_2: "f32[4, 8]", primals_3: "f32[2, 8]", primals_4: "f32[2, 8]"):
        # Annotation: {'graphshard_unit': 'layers.0'} ac_graph_id: 1 - MUST_RECOMPUTE
        pack: "f32[16]" = torch.ops.graphshard.pack.default([primals_1], [16], torch.float32)
        all_gather_into_tensor: "f32[64]" = torch.ops._c10d_functional.all_gather_into_tensor.default(pack, 4, 'dp');  pack = None
        wait_tensor: "f32[64]" = torch.ops._c10d_functional.wait_tensor.default(all_gather_into_tensor);  all_gather_into_tensor = None
        # Annotation: {'graphshard_unit': 'layers.1'} ac_graph_id: 2 - MUST_RECOMPUTE
        pack_1: "f32[16]" = torch.ops.graphshard.pack.default([primals_3], [16], torch.float32)
        all_gather_into_tensor_1: "f32[64]" = torch.ops._c10d_functional.all_gather_into_tensor.default(pack_1, 4, 'dp');  pack_1 = None
        # Annotation: {'graphshard_unit': 'layers.0'} ac_graph_id: 1 - MUST_RECOMPUTE
        unpack = torch.ops.graphshard.unpack.default(wait_tensor, 4, [16]);  wait_tensor = None
        getitem: "f32[64]" = unpack[0];  unpack = None
        view: "f32[8, 8]" = torch.ops.aten.view.default(getitem, [8, 8]);  getitem = None
        t: "f32[8, 8]" = torch.ops.aten.t.default(view);  view = None
        mm: "f32[4, 8]" = torch.ops.aten.mm.default(primals_2, t);  t = None
        relu: "f32[4, 8]" = torch.ops.aten.relu.default(mm);  mm = None
        # Annotation: {'graphshard_unit': 'layers.1'} ac_graph_id: 2 - MUST_RECOMPUTE
        wait_tensor_1: "f32[64]" = torch.ops._c10d_functional.wait_tensor.default(all_gather_into_tensor_1);  all_gather_into_tensor_1 = None
        # Annotation: {'graphshard_unit': 'layers.2'} ac_graph_id: 3 - MUST_RECOMPUTE
        pack_2: "f32[16]" = torch.ops.graphshard.pack.default([primals_4], [16], torch.float32)
        all_gather_into_tensor_2: "f32[64]" = torch.ops._c10d_functional.all_gather_into_tensor.default(pack_2, 4, 'dp');  pack_2 = None
        # Annotation: {'graphshard_unit': 'layers.1'} ac_graph_id: 2 - MUST_RECOMPUTE
        unpack_1 = torch.ops.graphshard.unpack.default(wait_tensor_1, 4, [16]);  wait_tensor_1 = None
        getitem_1: "f32[64]" = unpack_1[0];  unpack_1 = None
        view_1: "f32[8, 8]" = torch.ops.aten.view.default(getitem_1, [8, 8]);  getitem_1 = None
        t_1: "f32[8, 8]" = torch.ops.aten.t.default(view_1);  view_1 = None
        mm_1: "f32[4, 8]" = torch.ops.aten.mm.default(relu, t_1);  t_1 = None
        relu_1: "f32[4, 8]" = torch.ops.aten.relu.default(mm_1);  mm_1 = None
        # Annotation: {'graphshard_unit': 'layers.2'} ac_graph_id: 3 - MUST_RECOMPUTE
        wait_tensor_2: "f32[64]" = torch.ops._c10d_functional.wait_tensor.default(all_gather_into_tensor_2);  all_gather_into_tensor_2 = None
        unpack_2 = torch.ops.graphshard.unpack.default(wait_tensor_2, 4, [16]);  wait_tensor_2 = None
        getitem_2: "f32[64]" = unpack_2[0];  unpack_2 = None
        view_2: "f32[8, 8]" = torch.ops.aten.view.default(getitem_2, [8, 8]);  getitem_2 = None
        t_2: "f32[8, 8]" = torch.ops.aten.t.default(view_2);  view_2 = None
        mm_2: "f32[4, 8]" = torch.ops.aten.mm.default(relu_1, t_2);  t_2 = None
        relu_2: "f32[4, 8]" = torch.ops.aten.relu.default(mm_2);  mm_2 = None
        detach_2: "f32[4, 8]" = torch.ops.aten.detach.default(relu_2)
        detach_3: "f32[4, 8]" = torch.ops.aten.detach.default(detach_2);  detach_2 = None
        return (relu_2, primals_1, primals_2, primals_3, primals_4, relu, relu_1, detach_3)
""")

    def test_backward_prefetches_and_reduce_scatters_early(self):
        # Each reduce-scatter starts as soon as its unit's gradients exist and the next unit's
        # all-gather is issued (FSDP1 never queues that prefetch behind the current unit's
        # reduction); its wait comes right after the next unit's reduce-scatter starts (at
        # most two in flight).
        g = compiled_stages(stack(), fsdp_plan(), (torch.randn(4, 8),))
        self.assertExpectedInline(g["backward"], """\
class GraphModule(torch.nn.Module):
    def forward(self, primals_1: "f32[2, 8]", primals_2: "f32[4, 8]", primals_3: "f32[2, 8]", primals_4: "f32[2, 8]", relu: "f32[4, 8]", relu_1: "f32[4, 8]", detach_3: "f32[4, 8]", tangents_1: "f32[4, 8]"):
        # Annotation: {'graphshard_unit': 'layers.2'} ac_graph_id: 3 - MUST_RECOMPUTE
        pack_2: "f32[16]" = torch.ops.graphshard.pack.default([primals_4], [16], torch.float32);  primals_4 = None
        all_gather_into_tensor_2: "f32[64]" = torch.ops._c10d_functional.all_gather_into_tensor.default(pack_2, 4, 'dp');  pack_2 = None
        threshold_backward: "f32[4, 8]" = torch.ops.aten.threshold_backward.default(tangents_1, detach_3, 0);  tangents_1 = detach_3 = None
        t_3: "f32[8, 4]" = torch.ops.aten.t.default(threshold_backward)
        mm_3: "f32[8, 8]" = torch.ops.aten.mm.default(t_3, relu_1);  t_3 = None
        # Annotation: {'graphshard_unit': 'layers.2'} ac_graph_id: 3 - MUST_RECOMPUTE
        wait_tensor_2: "f32[64]" = torch.ops._c10d_functional.wait_tensor.default(all_gather_into_tensor_2);  all_gather_into_tensor_2 = None
        # Annotation: {'graphshard_unit': 'layers.1'} ac_graph_id: 2 - MUST_RECOMPUTE
        pack_1: "f32[16]" = torch.ops.graphshard.pack.default([primals_3], [16], torch.float32);  primals_3 = None
        all_gather_into_tensor_1: "f32[64]" = torch.ops._c10d_functional.all_gather_into_tensor.default(pack_1, 4, 'dp');  pack_1 = None
        t_4: "f32[8, 8]" = torch.ops.aten.t.default(mm_3);  mm_3 = None
        t_6: "f32[8, 8]" = torch.ops.aten.t.default(t_4);  t_4 = None
        # Annotation: {'graphshard_unit': 'layers.2'}
        pack_grads: "f32[64]" = torch.ops.graphshard.pack_grads.default([t_6], 4, [16], torch.float32);  t_6 = None
        # Annotation: {'graphshard_unit': 'layers.2'} recompute: MUST_SAVE
        reduce_scatter_tensor: "f32[16]" = torch.ops._c10d_functional.reduce_scatter_tensor.default(pack_grads, 'avg', 4, 'dp');  pack_grads = None
        # Annotation: {'graphshard_unit': 'layers.2'} ac_graph_id: 3 - MUST_RECOMPUTE
        unpack_2 = torch.ops.graphshard.unpack.default(wait_tensor_2, 4, [16]);  wait_tensor_2 = None
        getitem_2: "f32[64]" = unpack_2[0];  unpack_2 = None
        view_2: "f32[8, 8]" = torch.ops.aten.view.default(getitem_2, [8, 8]);  getitem_2 = None
        t_2: "f32[8, 8]" = torch.ops.aten.t.default(view_2);  view_2 = None
        t_5: "f32[8, 8]" = torch.ops.aten.t.default(t_2);  t_2 = None
        mm_4: "f32[4, 8]" = torch.ops.aten.mm.default(threshold_backward, t_5);  threshold_backward = t_5 = None
        detach_1: "f32[4, 8]" = torch.ops.aten.detach.default(relu_1);  relu_1 = None
        detach_4: "f32[4, 8]" = torch.ops.aten.detach.default(detach_1);  detach_1 = None
        threshold_backward_1: "f32[4, 8]" = torch.ops.aten.threshold_backward.default(mm_4, detach_4, 0);  mm_4 = detach_4 = None
        t_7: "f32[8, 4]" = torch.ops.aten.t.default(threshold_backward_1)
        mm_5: "f32[8, 8]" = torch.ops.aten.mm.default(t_7, relu);  t_7 = None
        t_8: "f32[8, 8]" = torch.ops.aten.t.default(mm_5);  mm_5 = None
        t_10: "f32[8, 8]" = torch.ops.aten.t.default(t_8);  t_8 = None
        # Annotation: {'graphshard_unit': 'layers.1'}
        pack_grads_1: "f32[64]" = torch.ops.graphshard.pack_grads.default([t_10], 4, [16], torch.float32);  t_10 = None
        # Annotation: {'graphshard_unit': 'layers.1'} recompute: MUST_SAVE
        reduce_scatter_tensor_1: "f32[16]" = torch.ops._c10d_functional.reduce_scatter_tensor.default(pack_grads_1, 'avg', 4, 'dp');  pack_grads_1 = None
        # Annotation: {'graphshard_unit': 'layers.2'} recompute: MUST_SAVE
        wait_tensor_3: "f32[16]" = torch.ops._c10d_functional.wait_tensor.default(reduce_scatter_tensor);  reduce_scatter_tensor = None
        # Annotation: {'graphshard_unit': 'layers.2'}
        unpack_reduced = torch.ops.graphshard.unpack_reduced.default(wait_tensor_3, 1, [16], [16]);  wait_tensor_3 = None
        getitem_3: "f32[16]" = unpack_reduced[0];  unpack_reduced = None
        view_3: "f32[2, 8]" = torch.ops.aten.view.default(getitem_3, [2, 8]);  getitem_3 = None
        # Annotation: {'graphshard_unit': 'layers.1'} ac_graph_id: 2 - MUST_RECOMPUTE
        wait_tensor_1: "f32[64]" = torch.ops._c10d_functional.wait_tensor.default(all_gather_into_tensor_1);  all_gather_into_tensor_1 = None
        unpack_1 = torch.ops.graphshard.unpack.default(wait_tensor_1, 4, [16]);  wait_tensor_1 = None
        getitem_1: "f32[64]" = unpack_1[0];  unpack_1 = None
        view_1: "f32[8, 8]" = torch.ops.aten.view.default(getitem_1, [8, 8]);  getitem_1 = None
        t_1: "f32[8, 8]" = torch.ops.aten.t.default(view_1);  view_1 = None
        t_9: "f32[8, 8]" = torch.ops.aten.t.default(t_1);  t_1 = None
        mm_6: "f32[4, 8]" = torch.ops.aten.mm.default(threshold_backward_1, t_9);  threshold_backward_1 = t_9 = None
        detach: "f32[4, 8]" = torch.ops.aten.detach.default(relu);  relu = None
        detach_5: "f32[4, 8]" = torch.ops.aten.detach.default(detach);  detach = None
        threshold_backward_2: "f32[4, 8]" = torch.ops.aten.threshold_backward.default(mm_6, detach_5, 0);  mm_6 = detach_5 = None
        t_11: "f32[8, 4]" = torch.ops.aten.t.default(threshold_backward_2);  threshold_backward_2 = None
        mm_7: "f32[8, 8]" = torch.ops.aten.mm.default(t_11, primals_2);  t_11 = primals_2 = None
        t_12: "f32[8, 8]" = torch.ops.aten.t.default(mm_7);  mm_7 = None
        t_13: "f32[8, 8]" = torch.ops.aten.t.default(t_12);  t_12 = None
        # Annotation: {'graphshard_unit': 'layers.0'}
        pack_grads_2: "f32[64]" = torch.ops.graphshard.pack_grads.default([t_13], 4, [16], torch.float32);  t_13 = None
        # Annotation: {'graphshard_unit': 'layers.0'} recompute: MUST_SAVE
        reduce_scatter_tensor_2: "f32[16]" = torch.ops._c10d_functional.reduce_scatter_tensor.default(pack_grads_2, 'avg', 4, 'dp');  pack_grads_2 = None
        # Annotation: {'graphshard_unit': 'layers.1'} recompute: MUST_SAVE
        wait_tensor_4: "f32[16]" = torch.ops._c10d_functional.wait_tensor.default(reduce_scatter_tensor_1);  reduce_scatter_tensor_1 = None
        # Annotation: {'graphshard_unit': 'layers.1'}
        unpack_reduced_1 = torch.ops.graphshard.unpack_reduced.default(wait_tensor_4, 1, [16], [16]);  wait_tensor_4 = None
        getitem_4: "f32[16]" = unpack_reduced_1[0];  unpack_reduced_1 = None
        view_4: "f32[2, 8]" = torch.ops.aten.view.default(getitem_4, [2, 8]);  getitem_4 = None
        # Annotation: {'graphshard_unit': 'layers.0'} recompute: MUST_SAVE
        wait_tensor_5: "f32[16]" = torch.ops._c10d_functional.wait_tensor.default(reduce_scatter_tensor_2);  reduce_scatter_tensor_2 = None
        # Annotation: {'graphshard_unit': 'layers.0'}
        unpack_reduced_2 = torch.ops.graphshard.unpack_reduced.default(wait_tensor_5, 1, [16], [16]);  wait_tensor_5 = None
        getitem_5: "f32[16]" = unpack_reduced_2[0];  unpack_reduced_2 = None
        view_5: "f32[2, 8]" = torch.ops.aten.view.default(getitem_5, [2, 8]);  getitem_5 = None
        return (view_5, None, view_4, view_3)
""")

    def test_limit_all_gathers_one_disables_prefetch(self):
        model = stack()
        compiled_stages(model, fsdp_plan(), (torch.randn(4, 8),), limit_all_gathers=1)
        order = model._graphshard.explain[0].order["forward"]
        self.assertExpectedInline(" -> ".join(order), """all_gather(layers.0) -> wait(layers.0) -> compute -> all_gather(layers.1) -> wait(layers.1) -> compute -> all_gather(layers.2) -> wait(layers.2) -> compute""")

    def test_explain_lists_scheduled_order(self):
        model = stack()
        compiled_stages(model, fsdp_plan(), (torch.randn(4, 8),))
        report = model._graphshard.explain[0]
        self.assertExpectedInline(" -> ".join(report.order["forward"]), """all_gather(layers.0) -> wait(layers.0) -> all_gather(layers.1) -> compute -> wait(layers.1) -> all_gather(layers.2) -> compute -> wait(layers.2) -> compute""")
        self.assertExpectedInline(" -> ".join(report.order["backward"]), """all_gather(layers.2) -> compute -> wait(layers.2) -> all_gather(layers.1) -> reduce_scatter(layers.2) -> compute x2 -> reduce_scatter(layers.1) -> wait(layers.2) -> wait(layers.1) -> compute x2 -> reduce_scatter(layers.0) -> wait(layers.1) -> wait(layers.0)""")

    def test_gloo_axis_reduces_gradients_by_all_to_all(self):
        # gloo has no reduce-scatter of its own (c10d runs an all-reduce of the whole bucket):
        # on a gloo axis each unit's gradients go out in one all-to-all, scheduled like the
        # reduce-scatter it stands for. A rank sends only the other ranks' rows (its own split is
        # 0; rank 0 here) and keeps its own, which unpack_reduced averages with the 3 rows it
        # receives: the send and receive buffers are 3 shards each (f32[48]), not the bucket.
        model = stack()
        with mock.patch.object(AxisGroup, "scatter_by_all_to_all", new_callable=mock.PropertyMock, return_value=True):
            g = compiled_stages(model, fsdp_plan(), (torch.randn(4, 8),))
        order = model._graphshard.explain[0].order["backward"]
        self.assertExpectedInline(" -> ".join(order), """all_gather(layers.2) -> compute -> wait(layers.2) -> all_gather(layers.1) -> all_to_all(layers.2) -> compute x2 -> all_to_all(layers.1) -> wait(layers.2) -> wait(layers.1) -> compute x2 -> all_to_all(layers.0) -> wait(layers.1) -> wait(layers.0)""")
        # The graph is the reduce-scatter one's (test above) but for the reduction's nodes:
        reduction = [line.strip() for line in g["backward"].splitlines()
                     if any(op in line for op in ("pack_grads_peers.default", "all_to_all", "unpack_reduced.default"))]
        self.assertExpectedInline("\n".join(reduction), """\
pack_grads_peers = torch.ops.graphshard.pack_grads_peers.default([t_6], 4, 0, [16], torch.float32);  t_6 = None
all_to_all_single: "f32[48]" = torch.ops._c10d_functional.all_to_all_single.default(getitem_3, [0, 16, 16, 16], [0, 16, 16, 16], 'dp');  getitem_3 = None
pack_grads_peers_1 = torch.ops.graphshard.pack_grads_peers.default([t_10], 4, 0, [16], torch.float32);  t_10 = None
all_to_all_single_1: "f32[48]" = torch.ops._c10d_functional.all_to_all_single.default(getitem_6, [0, 16, 16, 16], [0, 16, 16, 16], 'dp');  getitem_6 = None
wait_tensor_3: "f32[48]" = torch.ops._c10d_functional.wait_tensor.default(all_to_all_single);  all_to_all_single = None
unpack_reduced = torch.ops.graphshard.unpack_reduced.default(wait_tensor_3, 3, [16], [16], getitem_4);  wait_tensor_3 = getitem_4 = None
pack_grads_peers_2 = torch.ops.graphshard.pack_grads_peers.default([t_13], 4, 0, [16], torch.float32);  t_13 = None
all_to_all_single_2: "f32[48]" = torch.ops._c10d_functional.all_to_all_single.default(getitem_9, [0, 16, 16, 16], [0, 16, 16, 16], 'dp');  getitem_9 = None
wait_tensor_4: "f32[48]" = torch.ops._c10d_functional.wait_tensor.default(all_to_all_single_1);  all_to_all_single_1 = None
unpack_reduced_1 = torch.ops.graphshard.unpack_reduced.default(wait_tensor_4, 3, [16], [16], getitem_7);  wait_tensor_4 = getitem_7 = None
wait_tensor_5: "f32[48]" = torch.ops._c10d_functional.wait_tensor.default(all_to_all_single_2);  all_to_all_single_2 = None
unpack_reduced_2 = torch.ops.graphshard.unpack_reduced.default(wait_tensor_5, 3, [16], [16], getitem_10);  wait_tensor_5 = getitem_10 = None""")


    def test_gloo_axis_gathers_each_parameter_in_one_coalesced_collective(self):
        # On a gloo axis a unit's parameters are gathered by one coalesced all-gather with an
        # output per parameter: no bucket to pack and no copy-out. Shards that are already
        # flat and whole go in as views; the others (here every one, cast to bf16, and
        # fc2's 7 rows padded to 4 per rank) through one pack, as views of it. The waits sit
        # together at the first use.
        model = seeded(MLP, 10, 30, 7)
        plan = graphshard.Plan(mesh1d("dp"), {"": graphshard.FullyShard(param_dtype=torch.bfloat16)})
        with mock.patch.object(AxisGroup, "gather_coalesced", new_callable=mock.PropertyMock, return_value=True):
            g = compiled_stages(model, plan, (torch.randn(4, 10, dtype=torch.bfloat16),))
        gather = [line.strip() for line in g["forward"].splitlines()
                  if "pack" in line or "split_with_sizes" in line or "_c10d_functional" in line]
        self.assertExpectedInline("\n".join(gather), """\
pack: "bf16[150]" = torch.ops.graphshard.pack.default([view, view_1, view_2, view_3], [80, 8, 60, 2], torch.bfloat16);  view = view_1 = view_2 = view_3 = None
split_with_sizes = torch.ops.aten.split_with_sizes.default(pack, [80, 8, 60, 2]);  pack = None
getitem: "bf16[80]" = split_with_sizes[0]
getitem_1: "bf16[8]" = split_with_sizes[1]
getitem_2: "bf16[60]" = split_with_sizes[2]
getitem_3: "bf16[2]" = split_with_sizes[3];  split_with_sizes = None
all_gather_into_tensor_coalesced = torch.ops._c10d_functional.all_gather_into_tensor_coalesced.default([getitem, getitem_1, getitem_2, getitem_3], 4, 'dp');  getitem = getitem_1 = getitem_2 = getitem_3 = None
wait_tensor: "bf16[320]" = torch.ops._c10d_functional.wait_tensor.default(getitem_4);  getitem_4 = None
wait_tensor_1: "bf16[32]" = torch.ops._c10d_functional.wait_tensor.default(getitem_5);  getitem_5 = None
wait_tensor_2: "bf16[240]" = torch.ops._c10d_functional.wait_tensor.default(getitem_6);  getitem_6 = None
wait_tensor_3: "bf16[8]" = torch.ops._c10d_functional.wait_tensor.default(getitem_7);  getitem_7 = None""")
        self.assertExpectedInline(" -> ".join(model._graphshard.explain[0].order["forward"]), """all_gather(<root>) -> wait(<root>) -> compute x2""")


    def test_every_output_of_a_coalesced_gather_is_waited(self):
        # fc2's backward re-gathers its weight and bias but reads only the weight. c10d keeps
        # a coalesced collective's work registered until each output is waited, and the work
        # holds all of them: the bias's output gets a wait of its own, or the gather leaks.
        model = seeded(MLP, 10, 30, 7)
        plan = graphshard.Plan(mesh1d("dp"), {"fc2": graphshard.FullyShard(), "": graphshard.FullyShard()})
        with mock.patch.object(AxisGroup, "gather_coalesced", new_callable=mock.PropertyMock, return_value=True):
            g = compiled_stages(model, plan, (torch.randn(4, 10),))
        gather = [line.strip() for line in g["backward"].splitlines()
                  if "all_gather_into_tensor_coalesced" in line or "wait_tensor" in line and "getitem" in line]
        self.assertExpectedInline("\n".join(gather), """\
all_gather_into_tensor_coalesced_1 = torch.ops._c10d_functional.all_gather_into_tensor_coalesced.default([view_4, view_5], 4, 'dp');  view_4 = view_5 = None
getitem: "f32[8]" = all_gather_into_tensor_coalesced_1[1]
wait_tensor_default: "f32[8]" = torch.ops._c10d_functional.wait_tensor.default(getitem);  getitem = wait_tensor_default = None
getitem_2: "f32[240]" = all_gather_into_tensor_coalesced_1[0];  all_gather_into_tensor_coalesced_1 = None
wait_tensor_2: "f32[240]" = torch.ops._c10d_functional.wait_tensor.default(getitem_2);  getitem_2 = None""")


class _Sandwich(torch.nn.Module):
    """``block`` applied before and after ``mid``: one unit used at two depths."""

    def __init__(self):
        super().__init__()
        self.inp, self.block, self.mid, self.out = (torch.nn.Linear(8, 8, bias=False) for _ in range(4))

    def forward(self, x):
        for layer in (self.inp, self.block, self.mid, self.block, self.out):
            x = torch.relu(layer(x))
        return x


def _collectives_in(graph: str) -> list[str]:
    """The collective order of a printed graph, one wait per collective (a coalesced
    gather's waits pick its outputs through getitems; the stack has none)."""
    return [collective_kind(m) for m in re.findall(r"torch\.ops\._c10d_functional\.(\w+)\.default", graph)]


def _scheduled_order(settings: dict) -> tuple[dict, dict]:
    """Compiles the 3-unit stack with ``settings``; returns explain's order per stage and the
    settings lines, after checking that the order is the scheduled graph's."""
    model = stack()
    graphs = compiled_stages(model, fsdp_plan(), (torch.randn(4, 8),), **settings)
    report = model._graphshard.explain[0]
    for stage in ("forward", "backward"):
        listed = [e.split("(")[0] for e in report.order[stage] if not e.startswith("compute")]
        assert listed == _collectives_in(graphs[stage]), (stage, listed, graphs[stage])
    return ({stage: " -> ".join(report.order[stage]) for stage in ("forward", "backward")}, report.schedule)


class TestPrefetchSettings(TestCase):
    """FSDP1's prefetch settings as schedules, on the 3-unit stack (the backward re-gathers
    layers.2 then layers.1; layers.0's weight is not needed for its weight gradient). Each
    golden is explain's order, which ``_record`` reads off the scheduled graph (and
    ``_scheduled_order`` checks against the printed graph). In the backward, ``wait(U)``
    right after ``all_gather(U)`` / ``reduce_scatter(U)`` can be either's wait: a gather's
    wait sits right before the first use of what it gathers, a reduce-scatter's right after
    the next reduce-scatter starts."""

    def test_forward_prefetch(self):
        on, schedule = _scheduled_order(dict(forward_prefetch=True))
        # the next unit's all-gather right after this unit's wait, before this unit's compute
        self.assertExpectedInline(on["forward"], """all_gather(layers.0) -> wait(layers.0) -> all_gather(layers.1) -> compute -> wait(layers.1) -> all_gather(layers.2) -> compute -> wait(layers.2) -> compute""")
        self.assertExpectedInline(schedule["forward"], """forward_prefetch=True, limit_all_gathers=2: the next unit's all-gather is issued right after the current unit's all-gather is waited, before the current unit's compute""")
        off, schedule = _scheduled_order(dict(forward_prefetch=False))
        # each all-gather at its first use: after the previous unit's compute
        self.assertExpectedInline(off["forward"], """all_gather(layers.0) -> wait(layers.0) -> compute -> all_gather(layers.1) -> wait(layers.1) -> compute -> all_gather(layers.2) -> wait(layers.2) -> compute""")
        self.assertExpectedInline(schedule["forward"], """forward_prefetch=False, limit_all_gathers=2: each unit's all-gather is issued at its first use, after the previous unit's compute""")
        self.assertEqual(on["backward"], off["backward"])  # forward_prefetch leaves the backward alone

    def test_backward_prefetch_pre(self):
        order, schedule = _scheduled_order(dict(backward_prefetch="pre"))
        # layers.1's all-gather right after layers.2's is waited, before layers.2's input-gradient
        # matmul (its weight-gradient matmul needs no gathered weight and runs first) and
        # before layers.2's reduce-scatter
        self.assertExpectedInline(order["backward"], """all_gather(layers.2) -> compute -> wait(layers.2) -> all_gather(layers.1) -> reduce_scatter(layers.2) -> compute x2 -> reduce_scatter(layers.1) -> wait(layers.2) -> wait(layers.1) -> compute x2 -> reduce_scatter(layers.0) -> wait(layers.1) -> wait(layers.0)""")
        self.assertExpectedInline(schedule["backward"], """backward_prefetch='pre', limit_all_gathers=2: the next unit's all-gather is issued right after the current unit's all-gather is waited (before the gradient computation that reads its parameters), before the current unit's gradient reduction""")

    def test_backward_prefetch_post(self):
        order, schedule = _scheduled_order(dict(backward_prefetch="post"))
        # layers.1's all-gather after both of layers.2's matmuls, and layers.2's reduce-scatter
        # after that all-gather (FSDP1's post-backward: reshard, prefetch, reduce)
        self.assertExpectedInline(order["backward"], """all_gather(layers.2) -> compute -> wait(layers.2) -> compute -> all_gather(layers.1) -> reduce_scatter(layers.2) -> compute -> reduce_scatter(layers.1) -> wait(layers.2) -> wait(layers.1) -> compute x2 -> reduce_scatter(layers.0) -> wait(layers.1) -> wait(layers.0)""")
        self.assertExpectedInline(schedule["backward"], """backward_prefetch='post', limit_all_gathers=2: the next unit's all-gather is issued right after the current unit's gradient computation, before the current unit's gradient reduction""")

    def test_backward_prefetch_none(self):
        order, schedule = _scheduled_order(dict(backward_prefetch=None))
        # each re-gather right before the matmul that reads it, after the previous unit's compute
        self.assertExpectedInline(order["backward"], """compute -> reduce_scatter(layers.2) -> all_gather(layers.2) -> wait(layers.2) -> compute x2 -> reduce_scatter(layers.1) -> wait(layers.2) -> all_gather(layers.1) -> wait(layers.1) -> compute x2 -> reduce_scatter(layers.0) -> wait(layers.1) -> wait(layers.0)""")
        self.assertExpectedInline(schedule["backward"], """backward_prefetch=None, limit_all_gathers=2: each unit's all-gather is issued at its first use, after the previous unit's compute""")

    def test_limit_all_gathers(self):
        one, schedule = _scheduled_order(dict(limit_all_gathers=1))
        self.assertExpectedInline(one["forward"], """all_gather(layers.0) -> wait(layers.0) -> compute -> all_gather(layers.1) -> wait(layers.1) -> compute -> all_gather(layers.2) -> wait(layers.2) -> compute""")
        self.assertExpectedInline(one["backward"], """compute -> reduce_scatter(layers.2) -> all_gather(layers.2) -> wait(layers.2) -> compute x2 -> reduce_scatter(layers.1) -> wait(layers.2) -> all_gather(layers.1) -> wait(layers.1) -> compute x2 -> reduce_scatter(layers.0) -> wait(layers.1) -> wait(layers.0)""")
        self.assertExpectedInline(schedule["backward"], """backward_prefetch='pre', limit_all_gathers=1: each unit's all-gather is issued at its first use, after the previous unit's compute""")
        two, _ = _scheduled_order(dict(limit_all_gathers=2))
        self.assertExpectedInline(two["forward"], """all_gather(layers.0) -> wait(layers.0) -> all_gather(layers.1) -> compute -> wait(layers.1) -> all_gather(layers.2) -> compute -> wait(layers.2) -> compute""")
        self.assertExpectedInline(two["backward"], """all_gather(layers.2) -> compute -> wait(layers.2) -> all_gather(layers.1) -> reduce_scatter(layers.2) -> compute x2 -> reduce_scatter(layers.1) -> wait(layers.2) -> wait(layers.1) -> compute x2 -> reduce_scatter(layers.0) -> wait(layers.1) -> wait(layers.0)""")
        unbounded, schedule = _scheduled_order(dict(limit_all_gathers=None))
        self.assertExpectedInline(unbounded["forward"], """all_gather(layers.0) -> all_gather(layers.1) -> all_gather(layers.2) -> wait(layers.0) -> compute -> wait(layers.1) -> compute -> wait(layers.2) -> compute""")
        self.assertExpectedInline(unbounded["backward"], """all_gather(layers.2) -> all_gather(layers.1) -> compute -> reduce_scatter(layers.2) -> wait(layers.2) -> compute x2 -> reduce_scatter(layers.1) -> wait(layers.2) -> wait(layers.1) -> compute x2 -> reduce_scatter(layers.0) -> wait(layers.1) -> wait(layers.0)""")
        self.assertExpectedInline(schedule["forward"], """forward_prefetch=True, limit_all_gathers=None (unbounded): every unit's all-gather is issued at the start of the graph""")
        # the bound reaches further than one unit: two ahead with 3
        three, schedule = _scheduled_order(dict(limit_all_gathers=3))
        self.assertExpectedInline(three["forward"], """all_gather(layers.0) -> all_gather(layers.1) -> wait(layers.0) -> all_gather(layers.2) -> compute -> wait(layers.1) -> compute -> wait(layers.2) -> compute""")
        self.assertExpectedInline(schedule["forward"], """forward_prefetch=True, limit_all_gathers=3: the all-gather of the unit 2 ahead is issued right after the current unit's all-gather is waited, before the current unit's compute""")

    def test_explain_names_the_settings(self):
        model = stack()
        compiled_stages(model, fsdp_plan(), (torch.randn(4, 8),), forward_prefetch=False, backward_prefetch="post")
        with mock.patch("builtins.print"):
            text = graphshard.explain(model)
        lines = [line.strip() for line in text.splitlines() if line.strip().startswith("scheduling")]
        self.assertExpectedInline("\n".join(lines), """\
scheduling (forward): forward_prefetch=False, limit_all_gathers=2: each unit's all-gather is issued at its first use, after the previous unit's compute
scheduling (backward): backward_prefetch='post', limit_all_gathers=2: the next unit's all-gather is issued right after the current unit's gradient computation, before the current unit's gradient reduction""")

    def test_a_module_applied_twice_holds_back_no_gather(self):
        # `block` runs before and after `mid`. In the backward it is re-gathered once and used
        # twice; under "post" mid's gather follows the gradient computation of block's second
        # application (the first in the backward), not that of its first, which needs mid's
        # input gradient. block's reduce-scatter then comes after mid's gather by data.
        plan = graphshard.Plan(mesh1d("dp"), {name: graphshard.FullyShard() for name in ("inp", "block", "mid", "out", "")})
        orders = {}
        for prefetch in ("pre", "post", None):
            torch._dynamo.reset()
            model = seeded(_Sandwich)
            compiled_stages(model, plan, (torch.randn(4, 8),), backward_prefetch=prefetch)
            orders[prefetch] = " -> ".join(model._graphshard.explain[0].order["backward"])
        self.assertExpectedInline(orders["pre"], """all_gather(out) -> compute -> wait(out) -> all_gather(block) -> reduce_scatter(out) -> compute x2 -> wait(block) -> all_gather(mid) -> compute x2 -> reduce_scatter(mid) -> wait(out) -> wait(mid) -> compute x3 -> reduce_scatter(block) -> wait(mid) -> compute -> reduce_scatter(inp) -> wait(block) -> wait(inp)""")
        self.assertExpectedInline(orders["post"], """all_gather(out) -> compute -> wait(out) -> compute -> all_gather(block) -> reduce_scatter(out) -> compute -> wait(block) -> compute -> all_gather(mid) -> compute -> reduce_scatter(mid) -> wait(out) -> wait(mid) -> compute x3 -> reduce_scatter(block) -> wait(mid) -> compute -> reduce_scatter(inp) -> wait(block) -> wait(inp)""")
        self.assertExpectedInline(orders[None], """compute -> reduce_scatter(out) -> all_gather(out) -> wait(out) -> compute x2 -> all_gather(block) -> wait(block) -> compute x2 -> reduce_scatter(mid) -> wait(out) -> all_gather(mid) -> wait(mid) -> compute x3 -> reduce_scatter(block) -> wait(mid) -> compute -> reduce_scatter(inp) -> wait(block) -> wait(inp)""")

    def test_settings_are_validated(self):
        for bad in (0, -1, True, False, 2.0, "2"):
            with self.subTest(limit_all_gathers=bad), self.assertRaisesRegex(ValueError, "limit_all_gathers"):
                CompileConfig(limit_all_gathers=bad)
        with self.assertRaisesRegex(ValueError, "backward_prefetch='BACKWARD_PRE'"):
            CompileConfig(backward_prefetch="BACKWARD_PRE")
        with self.assertRaisesRegex(ValueError, "forward_prefetch"):
            CompileConfig(forward_prefetch=None)
        CompileConfig(limit_all_gathers=None, backward_prefetch=None, forward_prefetch=False)

    def test_fsdp1_wrapper_maps_its_arguments(self):
        from torch.distributed.fsdp import BackwardPrefetch
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        from graphshard.fsdp import FullyShardedDataParallel as FSDP

        policy = ModuleWrapPolicy({torch.nn.Linear})
        default = FSDP(stack(), auto_wrap_policy=policy)._compile_config()
        self.assertEqual((default.forward_prefetch, default.backward_prefetch, default.limit_all_gathers),
                         (False, "pre", 2))
        for prefetch, expected in ((BackwardPrefetch.BACKWARD_POST, "post"), (None, None)):
            config = FSDP(stack(), auto_wrap_policy=policy, backward_prefetch=prefetch, forward_prefetch=True,
                          limit_all_gathers=False)._compile_config()
            self.assertEqual((config.forward_prefetch, config.backward_prefetch, config.limit_all_gathers),
                             (True, expected, None))


class _StandIns(fx.Interpreter):
    """Runs a partitioned graph in one process with deterministic stand-ins for the
    collectives (every rank holding this rank's data): the settings only reorder nodes, so
    every schedule must compute bitwise the same values."""

    def call_function(self, target, args, kwargs):
        if target == c10d.all_gather_into_tensor.default:
            return torch.cat([args[0]] * args[1])
        if target == c10d.all_gather_into_tensor_coalesced.default:
            return [torch.cat([x] * args[1]) for x in args[0]]
        if target == c10d.reduce_scatter_tensor.default:
            return args[0].chunk(args[2])[0].clone()
        if target in (c10d.all_reduce.default, c10d.all_to_all_single.default):
            return args[0].clone()
        if target == c10d.wait_tensor.default:
            return args[0]
        return super().call_function(target, args, kwargs)


def _inputs_for(gm: fx.GraphModule) -> list:
    out = []
    for i, n in enumerate(gm.graph.find_nodes(op="placeholder")):
        v = n.meta.get("val")
        g = torch.Generator().manual_seed(i)
        if not isinstance(v, torch.Tensor):
            out.append(v)
        elif v.dtype.is_floating_point:
            out.append(torch.randn(v.shape, generator=g).to(v.dtype))
        else:
            out.append(torch.randint(0, 8, v.shape, generator=g, dtype=v.dtype))
    return out


class TestSettingsKeepNumerics(TestCase):
    def test_every_setting_computes_the_same_values(self):
        settings = [dict(), dict(forward_prefetch=False), dict(backward_prefetch="post"), dict(backward_prefetch=None),
                    dict(limit_all_gathers=1), dict(limit_all_gathers=None),
                    dict(backward_prefetch="post", limit_all_gathers=3)]
        results, orders = [], set()
        schedule = schedule_module.schedule_overlap
        for coalesced in (False, True):
            for kw in settings:
                torch._dynamo.reset()
                graphs, unscheduled = {}, {}

                @functools.wraps(schedule)
                def capture(gm, ctx, graphs=graphs, unscheduled=unscheduled):
                    unscheduled[ctx.stage] = copy.deepcopy(gm)  # the pass reorders gm in place
                    graphs[ctx.stage] = schedule(gm, ctx)
                    return graphs[ctx.stage]

                model = seeded(MLP, 10, 30, 7)
                plan = graphshard.Plan(mesh1d("dp"), {"fc1": graphshard.FullyShard(), "fc2": graphshard.FullyShard(),
                                                      "": graphshard.FullyShard()})
                with mock.patch.object(AxisGroup, "gather_coalesced", new_callable=mock.PropertyMock,
                                       return_value=coalesced), \
                        mock.patch.object(pipeline_module, "schedule_overlap", capture):  # where the pipeline reads it
                    compiled_stages(model, plan, (torch.randn(4, 10),), **kw)
                values, reference = {}, {}
                for stage, gm in graphs.items():
                    gm.graph.lint()
                    values[stage] = _StandIns(gm).run(*_inputs_for(gm))
                    # the same graph before scheduling: the reference is not an output of the pass
                    reference[stage] = _StandIns(unscheduled[stage]).run(*_inputs_for(unscheduled[stage]))
                    orders.add((coalesced, stage, tuple(n.name for n in gm.graph.nodes)))
                results.append((coalesced, kw, values, reference))
        self.assertGreater(len(orders), 6)  # the settings did reorder
        for coalesced, kw, values, reference in results:
            self.assertEqual(set(values), {"forward", "backward"})
            for stage in ("forward", "backward"):
                with self.subTest(coalesced=coalesced, stage=stage, **kw):
                    for got, want in zip(values[stage], reference[stage], strict=True):
                        self.assertTrue(got is want is None or torch.equal(got, want))


class TestInductorKeepsTheOrder(TestCase):
    def test_lowered_code_issues_collectives_in_the_scheduled_order(self):
        # Regional lowering (the default) runs communication between compiled regions in the
        # scheduled order; whole-graph lowering leaves the order to Inductor's generated `call`,
        # which must keep it: the all-gathers, waits and reduce-scatters in the order
        # schedule_overlap chose, with compute inside the overlap windows.
        for regional in (True, False):
            with self.subTest(regional=regional):
                torch._dynamo.reset()
                model = stack()
                graphshard.compile(model, fsdp_plan(), lower="inductor", regional=regional)
                model(torch.randn(4, 8)).sum().backward()
                report = model._graphshard.explain[0]
                self.assertEqual(bool(report.regions), regional)

                def collectives(events):
                    return [e.split("(")[0] for e in events if not e.startswith("compute")]

                for stage in ("forward", "backward"):
                    self.assertEqual(collectives(report.order[stage]), collectives(report.lowered_order[stage]), stage)
                fw = report.lowered_order["forward"]
                # the next unit's all-gather is in flight while this unit computes
                self.assertEqual(fw[:5], ["all_gather", "wait", "all_gather", "compute", "wait"])
