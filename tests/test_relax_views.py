import torch
from expecttest import TestCase

from _golden import graph_after
from _models import cached_gqa_attention, tp_qkvo_plan

X = (torch.randn(2, 8, 16),)


class TestRelaxViews(TestCase):
    def test_views_become_reshapes(self):
        text = graph_after(cached_gqa_attention(8, 4), tp_qkvo_plan(), X, "relax_views")
        self.assertNotIn("aten.view.default", text)
        self.assertExpectedInline(text, """\
class <lambda>(torch.nn.Module):
    def forward(self, arg0_1: "f32[2, 8, 16]", arg1_1: "f32[4, 16]", arg2_1: "f32[2, 16]", arg3_1: "f32[2, 16]", arg4_1: "f32[16, 4]"):
        layout: "f32[2, 8, 16]" = torch.ops.graphshard.layout.default(arg0_1, 'q_proj:in0', 'tp', 'R', True)
        param: "f32[16, 16]" = torch.ops.graphshard.param.default(arg1_1, 'q_proj.weight', [16, 16], torch.float32);  arg1_1 = None
        t: "f32[16, 16]" = torch.ops.aten.t.default(param);  param = None
        view: "f32[16, 16]" = torch.ops.aten.reshape.default(layout, [16, 16]);  layout = None
        mm: "f32[16, 16]" = torch.ops.aten.mm.default(view, t);  view = t = None
        _unsafe_view: "f32[2, 8, 16]" = torch.ops.aten._unsafe_view.default(mm, [2, 8, 16]);  mm = None
        layout_1: "f32[2, 8, 16]" = torch.ops.graphshard.layout.default(_unsafe_view, 'q_proj:out0', 'tp', 'S(-1)', True);  _unsafe_view = None
        view_1: "f32[2, 8, 8, 2]" = torch.ops.aten.reshape.default(layout_1, [2, 8, -1, 2]);  layout_1 = None
        transpose: "f32[2, 8, 8, 2]" = torch.ops.aten.transpose.int(view_1, 1, 2);  view_1 = None
        layout_2: "f32[2, 8, 16]" = torch.ops.graphshard.layout.default(arg0_1, 'k_proj:in0', 'tp', 'R', True)
        param_1: "f32[8, 16]" = torch.ops.graphshard.param.default(arg2_1, 'k_proj.weight', [8, 16], torch.float32);  arg2_1 = None
        t_1: "f32[16, 8]" = torch.ops.aten.t.default(param_1);  param_1 = None
        view_2: "f32[16, 16]" = torch.ops.aten.reshape.default(layout_2, [16, 16]);  layout_2 = None
        mm_1: "f32[16, 8]" = torch.ops.aten.mm.default(view_2, t_1);  view_2 = t_1 = None
        _unsafe_view_1: "f32[2, 8, 8]" = torch.ops.aten._unsafe_view.default(mm_1, [2, 8, 8]);  mm_1 = None
        layout_3: "f32[2, 8, 8]" = torch.ops.graphshard.layout.default(_unsafe_view_1, 'k_proj:out0', 'tp', 'S(-1)', True);  _unsafe_view_1 = None
        view_3: "f32[2, 8, 4, 2]" = torch.ops.aten.reshape.default(layout_3, [2, 8, -1, 2]);  layout_3 = None
        transpose_1: "f32[2, 4, 8, 2]" = torch.ops.aten.transpose.int(view_3, 1, 2);  view_3 = None
        layout_4: "f32[2, 8, 16]" = torch.ops.graphshard.layout.default(arg0_1, 'v_proj:in0', 'tp', 'R', True);  arg0_1 = None
        param_2: "f32[8, 16]" = torch.ops.graphshard.param.default(arg3_1, 'v_proj.weight', [8, 16], torch.float32);  arg3_1 = None
        t_2: "f32[16, 8]" = torch.ops.aten.t.default(param_2);  param_2 = None
        view_4: "f32[16, 16]" = torch.ops.aten.reshape.default(layout_4, [16, 16]);  layout_4 = None
        mm_2: "f32[16, 8]" = torch.ops.aten.mm.default(view_4, t_2);  view_4 = t_2 = None
        _unsafe_view_2: "f32[2, 8, 8]" = torch.ops.aten._unsafe_view.default(mm_2, [2, 8, 8]);  mm_2 = None
        layout_5: "f32[2, 8, 8]" = torch.ops.graphshard.layout.default(_unsafe_view_2, 'v_proj:out0', 'tp', 'S(-1)', True);  _unsafe_view_2 = None
        view_5: "f32[2, 8, 4, 2]" = torch.ops.aten.reshape.default(layout_5, [2, 8, -1, 2]);  layout_5 = None
        transpose_2: "f32[2, 4, 8, 2]" = torch.ops.aten.transpose.int(view_5, 1, 2);  view_5 = None
        _tensor_constant0: "f32[0]" = self._tensor_constant0
        lift_fresh_copy: "f32[0]" = torch.ops.aten.lift_fresh_copy.default(_tensor_constant0);  _tensor_constant0 = None
        cat: "f32[2, 4, 8, 2]" = torch.ops.aten.cat.default([lift_fresh_copy, transpose_1], -2);  lift_fresh_copy = transpose_1 = None
        _tensor_constant1: "f32[0]" = self._tensor_constant1
        lift_fresh_copy_1: "f32[0]" = torch.ops.aten.lift_fresh_copy.default(_tensor_constant1);  _tensor_constant1 = None
        cat_1: "f32[2, 4, 8, 2]" = torch.ops.aten.cat.default([lift_fresh_copy_1, transpose_2], -2);  lift_fresh_copy_1 = transpose_2 = None
        _scaled_dot_product_flash_attention_for_cpu = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default(transpose, cat, cat_1, 0.0, True);  transpose = cat = cat_1 = None
        getitem: "f32[2, 8, 8, 2]" = _scaled_dot_product_flash_attention_for_cpu[0]
        getitem_1: "f32[2, 8, 8]" = _scaled_dot_product_flash_attention_for_cpu[1];  _scaled_dot_product_flash_attention_for_cpu = getitem_1 = None
        transpose_3: "f32[2, 8, 8, 2]" = torch.ops.aten.transpose.int(getitem, 1, 2);  getitem = None
        view_6: "f32[2, 8, 16]" = torch.ops.aten.reshape.default(transpose_3, [2, 8, -1]);  transpose_3 = None
        layout_6: "f32[2, 8, 16]" = torch.ops.graphshard.layout.default(view_6, 'o_proj:in0', 'tp', 'S(-1)', True);  view_6 = None
        param_3: "f32[16, 16]" = torch.ops.graphshard.param.default(arg4_1, 'o_proj.weight', [16, 16], torch.float32);  arg4_1 = None
        t_3: "f32[16, 16]" = torch.ops.aten.t.default(param_3);  param_3 = None
        view_7: "f32[16, 16]" = torch.ops.aten.reshape.default(layout_6, [16, 16]);  layout_6 = None
        mm_3: "f32[16, 16]" = torch.ops.aten.mm.default(view_7, t_3);  view_7 = t_3 = None
        _unsafe_view_3: "f32[2, 8, 16]" = torch.ops.aten._unsafe_view.default(mm_3, [2, 8, 16]);  mm_3 = None
        layout_7: "f32[2, 8, 16]" = torch.ops.graphshard.layout.default(_unsafe_view_3, 'o_proj:out0', 'tp', 'R', True);  _unsafe_view_3 = None
        return (layout_7,)
""")

    def test_grouped_query_heads_and_cache_stay_sharded(self):
        # 8 query heads, 4 key/value heads over 4 ranks: each rank's query heads are exactly
        # the groups of its key/value heads; the cache's empty start takes no part.
        model = cached_gqa_attention(8, 4)
        text = graph_after(model, tp_qkvo_plan(), X, "localize_shapes")
        self.assertNotIn("all_gather", text)
        self.assertEqual(model._graphshard.explain[-1].fallbacks, [])

    def test_a_view_survives_a_gather_that_changes_strides(self):
        # 2 key/value heads do not divide over 4 ranks, so k and v stay replicated and attention
        # runs on gathered query heads: its output no longer has the strides of the first trace,
        # where merging the heads back was a view ("Cannot view a tensor with shape [2, 8, 4, 4]
        # and strides ..." before relax_views).
        model = cached_gqa_attention(4, 2)
        text = graph_after(model, tp_qkvo_plan(shard_kv=False), X, "localize_shapes")
        self.assertIn("all_gather", text)
        fallbacks = model._graphshard.explain[-1].fallbacks
        self.assertTrue(fallbacks and all("_scaled_dot_product_flash_attention_for_cpu" in f for f in fallbacks), fallbacks)


class BatchNormOverTime(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.bn, self.fc = torch.nn.BatchNorm1d(32), torch.nn.Linear(32, 64)

    def forward(self, h):
        return self.fc(self.bn(h.transpose(1, 2)).transpose(1, 2))


def test_the_fx_lowering_runs_views_whose_run_time_strides_differ():
    # CPU BatchNorm over a transposed input returns a contiguous output where its fake kernel keeps
    # the input's strides, so the Linear's view of the transposed-back result, valid when traced,
    # raised at run time in the partitioned graphs lower="eager" runs as FX (as under
    # torch.compile(backend="aot_eager")); they are relaxed too, and match plain torch
    import copy

    from torch.distributed.device_mesh import init_device_mesh

    import graphshard
    from graphshard.plan import Plan, Replicate

    torch.manual_seed(0)
    ref = BatchNormOverTime()
    model = copy.deepcopy(ref)
    graphshard.compile(model, Plan(init_device_mesh("cpu", (4,), mesh_dim_names=("dp",)), {"": Replicate()}),
                       lower="eager")
    x = torch.randn(2, 16, 32, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    out, out_ref = model(x), ref(x_ref)
    (out * out).sum().backward()
    (out_ref * out_ref).sum().backward()
    torch.testing.assert_close(out, out_ref, rtol=0, atol=1e-6)
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=0, atol=1e-5)  # no collective on the input's gradient
