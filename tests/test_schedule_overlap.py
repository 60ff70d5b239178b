import torch
from expecttest import TestCase

import graphshard
from _golden import compiled_stages
from _models import fsdp_plan, stack


class TestScheduleOverlap(TestCase):
    def test_forward_prefetches_next_unit(self):
        g = compiled_stages(stack(), fsdp_plan(), (torch.randn(4, 8),))
        self.assertExpectedInline(g["forward"], """\
class GraphModule(torch.nn.Module):
    def forward(self, primals_1: "f32[2, 8]", primals_2: "f32[4, 8]", primals_3: "f32[2, 8]", primals_4: "f32[2, 8]"):
        # Annotation: {'graphshard_unit': 'layers.0'} ac_graph_id: 0 - MUST_RECOMPUTE No stacktrace found for following nodes
        view: "f32[16]" = torch.ops.aten.view.default(primals_1, [-1])
        all_gather_into_tensor: "f32[64]" = torch.ops._c10d_functional.all_gather_into_tensor.default(view, 4, 'dp');  view = None
        wait_tensor: "f32[64]" = torch.ops._c10d_functional.wait_tensor.default(all_gather_into_tensor);  all_gather_into_tensor = None
        # Annotation: {'graphshard_unit': 'layers.1'} ac_graph_id: 1 - MUST_RECOMPUTE No stacktrace found for following nodes
        view_3: "f32[16]" = torch.ops.aten.view.default(primals_3, [-1])
        all_gather_into_tensor_1: "f32[64]" = torch.ops._c10d_functional.all_gather_into_tensor.default(view_3, 4, 'dp');  view_3 = None
        # Annotation: {'graphshard_unit': 'layers.0'} ac_graph_id: 0 - MUST_RECOMPUTE No stacktrace found for following nodes
        view_1: "f32[4, 16]" = torch.ops.aten.view.default(wait_tensor, [4, -1]);  wait_tensor = None
        view_2: "f32[8, 8]" = torch.ops.aten.view.default(view_1, [8, 8]);  view_1 = None
        # No stacktrace found for following nodes
        t: "f32[8, 8]" = torch.ops.aten.t.default(view_2);  view_2 = None
        mm: "f32[4, 8]" = torch.ops.aten.mm.default(primals_2, t);  t = None
        relu: "f32[4, 8]" = torch.ops.aten.relu.default(mm);  mm = None
        # Annotation: {'graphshard_unit': 'layers.1'} ac_graph_id: 1 - MUST_RECOMPUTE No stacktrace found for following nodes
        wait_tensor_1: "f32[64]" = torch.ops._c10d_functional.wait_tensor.default(all_gather_into_tensor_1);  all_gather_into_tensor_1 = None
        # Annotation: {'graphshard_unit': 'layers.2'} ac_graph_id: 2 - MUST_RECOMPUTE No stacktrace found for following nodes
        view_6: "f32[16]" = torch.ops.aten.view.default(primals_4, [-1])
        all_gather_into_tensor_2: "f32[64]" = torch.ops._c10d_functional.all_gather_into_tensor.default(view_6, 4, 'dp');  view_6 = None
        # Annotation: {'graphshard_unit': 'layers.1'} ac_graph_id: 1 - MUST_RECOMPUTE No stacktrace found for following nodes
        view_4: "f32[4, 16]" = torch.ops.aten.view.default(wait_tensor_1, [4, -1]);  wait_tensor_1 = None
        view_5: "f32[8, 8]" = torch.ops.aten.view.default(view_4, [8, 8]);  view_4 = None
        # No stacktrace found for following nodes
        t_1: "f32[8, 8]" = torch.ops.aten.t.default(view_5);  view_5 = None
        mm_1: "f32[4, 8]" = torch.ops.aten.mm.default(relu, t_1);  t_1 = None
        relu_1: "f32[4, 8]" = torch.ops.aten.relu.default(mm_1);  mm_1 = None
        # Annotation: {'graphshard_unit': 'layers.2'} ac_graph_id: 2 - MUST_RECOMPUTE No stacktrace found for following nodes
        wait_tensor_2: "f32[64]" = torch.ops._c10d_functional.wait_tensor.default(all_gather_into_tensor_2);  all_gather_into_tensor_2 = None
        view_7: "f32[4, 16]" = torch.ops.aten.view.default(wait_tensor_2, [4, -1]);  wait_tensor_2 = None
        view_8: "f32[8, 8]" = torch.ops.aten.view.default(view_7, [8, 8]);  view_7 = None
        # No stacktrace found for following nodes
        t_2: "f32[8, 8]" = torch.ops.aten.t.default(view_8);  view_8 = None
        mm_2: "f32[4, 8]" = torch.ops.aten.mm.default(relu_1, t_2);  t_2 = None
        relu_2: "f32[4, 8]" = torch.ops.aten.relu.default(mm_2);  mm_2 = None
        detach_2: "f32[4, 8]" = torch.ops.aten.detach.default(relu_2)
        detach_3: "f32[4, 8]" = torch.ops.aten.detach.default(detach_2);  detach_2 = None
        return (relu_2, primals_1, primals_2, primals_3, primals_4, relu, relu_1, detach_3)
""")

    def test_backward_prefetches_and_reduce_scatters_early(self):
        g = compiled_stages(stack(), fsdp_plan(), (torch.randn(4, 8),))
        self.assertExpectedInline(g["backward"], """\
class GraphModule(torch.nn.Module):
    def forward(self, primals_1: "f32[2, 8]", primals_2: "f32[4, 8]", primals_3: "f32[2, 8]", primals_4: "f32[2, 8]", relu: "f32[4, 8]", relu_1: "f32[4, 8]", detach_3: "f32[4, 8]", tangents_1: "f32[4, 8]"):
        # Annotation: {'graphshard_unit': 'layers.2'} ac_graph_id: 2 - MUST_RECOMPUTE No stacktrace found for following nodes
        view_6: "f32[16]" = torch.ops.aten.view.default(primals_4, [-1]);  primals_4 = None
        all_gather_into_tensor_2: "f32[64]" = torch.ops._c10d_functional.all_gather_into_tensor.default(view_6, 4, 'dp');  view_6 = None
        # No stacktrace found for following nodes
        threshold_backward: "f32[4, 8]" = torch.ops.aten.threshold_backward.default(tangents_1, detach_3, 0);  tangents_1 = detach_3 = None
        t_3: "f32[8, 4]" = torch.ops.aten.t.default(threshold_backward)
        mm_3: "f32[8, 8]" = torch.ops.aten.mm.default(t_3, relu_1);  t_3 = None
        t_4: "f32[8, 8]" = torch.ops.aten.t.default(mm_3);  mm_3 = None
        t_6: "f32[8, 8]" = torch.ops.aten.t.default(t_4);  t_4 = None
        # Annotation: {'graphshard_unit': 'layers.2'} No stacktrace found for following nodes
        view_9: "f32[64]" = torch.ops.aten.view.default(t_6, [-1]);  t_6 = None
        view_10: "f32[4, 16]" = torch.ops.aten.view.default(view_9, [4, -1]);  view_9 = None
        view_11: "f32[64]" = torch.ops.aten.view.default(view_10, [-1]);  view_10 = None
        # Annotation: {'graphshard_unit': 'layers.2'} recompute: MUST_SAVE No stacktrace found for following nodes
        reduce_scatter_tensor: "f32[16]" = torch.ops._c10d_functional.reduce_scatter_tensor.default(view_11, 'sum', 4, 'dp');  view_11 = None
        # Annotation: {'graphshard_unit': 'layers.2'} ac_graph_id: 2 - MUST_RECOMPUTE No stacktrace found for following nodes
        wait_tensor_2: "f32[64]" = torch.ops._c10d_functional.wait_tensor.default(all_gather_into_tensor_2);  all_gather_into_tensor_2 = None
        # Annotation: {'graphshard_unit': 'layers.1'} ac_graph_id: 1 - MUST_RECOMPUTE No stacktrace found for following nodes
        view_3: "f32[16]" = torch.ops.aten.view.default(primals_3, [-1]);  primals_3 = None
        all_gather_into_tensor_1: "f32[64]" = torch.ops._c10d_functional.all_gather_into_tensor.default(view_3, 4, 'dp');  view_3 = None
        # Annotation: {'graphshard_unit': 'layers.2'} ac_graph_id: 2 - MUST_RECOMPUTE No stacktrace found for following nodes
        view_7: "f32[4, 16]" = torch.ops.aten.view.default(wait_tensor_2, [4, -1]);  wait_tensor_2 = None
        view_8: "f32[8, 8]" = torch.ops.aten.view.default(view_7, [8, 8]);  view_7 = None
        # No stacktrace found for following nodes
        t_2: "f32[8, 8]" = torch.ops.aten.t.default(view_8);  view_8 = None
        t_5: "f32[8, 8]" = torch.ops.aten.t.default(t_2);  t_2 = None
        mm_4: "f32[4, 8]" = torch.ops.aten.mm.default(threshold_backward, t_5);  threshold_backward = t_5 = None
        detach_1: "f32[4, 8]" = torch.ops.aten.detach.default(relu_1);  relu_1 = None
        detach_4: "f32[4, 8]" = torch.ops.aten.detach.default(detach_1);  detach_1 = None
        threshold_backward_1: "f32[4, 8]" = torch.ops.aten.threshold_backward.default(mm_4, detach_4, 0);  mm_4 = detach_4 = None
        t_7: "f32[8, 4]" = torch.ops.aten.t.default(threshold_backward_1)
        mm_5: "f32[8, 8]" = torch.ops.aten.mm.default(t_7, relu);  t_7 = None
        t_8: "f32[8, 8]" = torch.ops.aten.t.default(mm_5);  mm_5 = None
        t_10: "f32[8, 8]" = torch.ops.aten.t.default(t_8);  t_8 = None
        # Annotation: {'graphshard_unit': 'layers.1'} No stacktrace found for following nodes
        view_13: "f32[64]" = torch.ops.aten.view.default(t_10, [-1]);  t_10 = None
        view_14: "f32[4, 16]" = torch.ops.aten.view.default(view_13, [4, -1]);  view_13 = None
        view_15: "f32[64]" = torch.ops.aten.view.default(view_14, [-1]);  view_14 = None
        # Annotation: {'graphshard_unit': 'layers.1'} recompute: MUST_SAVE No stacktrace found for following nodes
        reduce_scatter_tensor_1: "f32[16]" = torch.ops._c10d_functional.reduce_scatter_tensor.default(view_15, 'sum', 4, 'dp');  view_15 = None
        # Annotation: {'graphshard_unit': 'layers.1'} ac_graph_id: 1 - MUST_RECOMPUTE No stacktrace found for following nodes
        wait_tensor_1: "f32[64]" = torch.ops._c10d_functional.wait_tensor.default(all_gather_into_tensor_1);  all_gather_into_tensor_1 = None
        view_4: "f32[4, 16]" = torch.ops.aten.view.default(wait_tensor_1, [4, -1]);  wait_tensor_1 = None
        view_5: "f32[8, 8]" = torch.ops.aten.view.default(view_4, [8, 8]);  view_4 = None
        # No stacktrace found for following nodes
        t_1: "f32[8, 8]" = torch.ops.aten.t.default(view_5);  view_5 = None
        t_9: "f32[8, 8]" = torch.ops.aten.t.default(t_1);  t_1 = None
        mm_6: "f32[4, 8]" = torch.ops.aten.mm.default(threshold_backward_1, t_9);  threshold_backward_1 = t_9 = None
        detach: "f32[4, 8]" = torch.ops.aten.detach.default(relu);  relu = None
        detach_5: "f32[4, 8]" = torch.ops.aten.detach.default(detach);  detach = None
        threshold_backward_2: "f32[4, 8]" = torch.ops.aten.threshold_backward.default(mm_6, detach_5, 0);  mm_6 = detach_5 = None
        t_11: "f32[8, 4]" = torch.ops.aten.t.default(threshold_backward_2);  threshold_backward_2 = None
        mm_7: "f32[8, 8]" = torch.ops.aten.mm.default(t_11, primals_2);  t_11 = primals_2 = None
        t_12: "f32[8, 8]" = torch.ops.aten.t.default(mm_7);  mm_7 = None
        t_13: "f32[8, 8]" = torch.ops.aten.t.default(t_12);  t_12 = None
        # Annotation: {'graphshard_unit': 'layers.0'} No stacktrace found for following nodes
        view_17: "f32[64]" = torch.ops.aten.view.default(t_13, [-1]);  t_13 = None
        view_18: "f32[4, 16]" = torch.ops.aten.view.default(view_17, [4, -1]);  view_17 = None
        view_19: "f32[64]" = torch.ops.aten.view.default(view_18, [-1]);  view_18 = None
        # Annotation: {'graphshard_unit': 'layers.0'} recompute: MUST_SAVE No stacktrace found for following nodes
        reduce_scatter_tensor_2: "f32[16]" = torch.ops._c10d_functional.reduce_scatter_tensor.default(view_19, 'sum', 4, 'dp');  view_19 = None
        # Annotation: {'graphshard_unit': 'layers.2'} recompute: MUST_SAVE No stacktrace found for following nodes
        wait_tensor_3: "f32[16]" = torch.ops._c10d_functional.wait_tensor.default(reduce_scatter_tensor);  reduce_scatter_tensor = None
        # Annotation: {'graphshard_unit': 'layers.2'} No stacktrace found for following nodes
        div: "f32[16]" = torch.ops.aten.div.Tensor(wait_tensor_3, 4);  wait_tensor_3 = None
        view_12: "f32[2, 8]" = torch.ops.aten.view.default(div, [2, 8]);  div = None
        # Annotation: {'graphshard_unit': 'layers.1'} recompute: MUST_SAVE No stacktrace found for following nodes
        wait_tensor_4: "f32[16]" = torch.ops._c10d_functional.wait_tensor.default(reduce_scatter_tensor_1);  reduce_scatter_tensor_1 = None
        # Annotation: {'graphshard_unit': 'layers.1'} No stacktrace found for following nodes
        div_1: "f32[16]" = torch.ops.aten.div.Tensor(wait_tensor_4, 4);  wait_tensor_4 = None
        view_16: "f32[2, 8]" = torch.ops.aten.view.default(div_1, [2, 8]);  div_1 = None
        # Annotation: {'graphshard_unit': 'layers.0'} recompute: MUST_SAVE No stacktrace found for following nodes
        wait_tensor_5: "f32[16]" = torch.ops._c10d_functional.wait_tensor.default(reduce_scatter_tensor_2);  reduce_scatter_tensor_2 = None
        # Annotation: {'graphshard_unit': 'layers.0'} No stacktrace found for following nodes
        div_2: "f32[16]" = torch.ops.aten.div.Tensor(wait_tensor_5, 4);  wait_tensor_5 = None
        view_20: "f32[2, 8]" = torch.ops.aten.view.default(div_2, [2, 8]);  div_2 = None
        return (view_20, None, view_16, view_12)
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
        self.assertExpectedInline(" -> ".join(report.order["backward"]), """all_gather(layers.2) -> compute -> reduce_scatter(layers.2) -> wait(layers.2) -> all_gather(layers.1) -> compute x2 -> reduce_scatter(layers.1) -> wait(layers.1) -> compute x2 -> reduce_scatter(layers.0) -> wait(layers.2) -> wait(layers.1) -> wait(layers.0)""")
