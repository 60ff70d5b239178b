import torch
from expecttest import TestCase

from _golden import graph_after
from _models import attention, mlp, tp_attention_plan, tp_mlp_plan


class TestAnnotatePlacements(TestCase):
    def test_colwise_rowwise_mlp(self):
        # fc1 column-sharded, fc2 row-sharded: the activation between them is S(1),
        # fc2's output is Partial, and only the graph output needs Replicate.
        text = graph_after(mlp(), tp_mlp_plan(), (torch.randn(4, 16),), "annotate_placements", placements=True)
        self.assertExpectedInline(text, """\
class <lambda>(torch.nn.Module):
    def forward(self, arg0_1: "f32[8, 16]", arg1_1: "f32[8]", arg2_1: "f32[4, 16]", arg3_1: "f32[8, 8]", arg4_1: "f32[8]"):
        param: "f32[32, 16]" = torch.ops.graphshard.param.default(arg0_1, 'fc1.weight', [32, 16]);  arg0_1 = None
        param_1: "f32[32]" = torch.ops.graphshard.param.default(arg1_1, 'fc1.bias', [32]);  arg1_1 = None
        t: "f32[16, 32]" = torch.ops.aten.t.default(param);  param = None
        addmm: "f32[4, 32]" = torch.ops.aten.addmm.default(param_1, arg2_1, t);  param_1 = arg2_1 = t = None
        gelu: "f32[4, 32]" = torch.ops.aten.gelu.default(addmm);  addmm = None
        param_2: "f32[8, 32]" = torch.ops.graphshard.param.default(arg3_1, 'fc2.weight', [8, 32]);  arg3_1 = None
        param_3: "f32[8]" = torch.ops.graphshard.param.default(arg4_1, 'fc2.bias', [8]);  arg4_1 = None
        t_1: "f32[32, 8]" = torch.ops.aten.t.default(param_2);  param_2 = None
        addmm_1: "f32[4, 8]" = torch.ops.aten.addmm.default(param_3, gelu, t_1);  param_3 = gelu = t_1 = None
        return (addmm_1,)
arg0_1: {tp: R}
arg1_1: {tp: R}
arg2_1: {tp: R}
arg3_1: {tp: R}
arg4_1: {tp: R}
param: {tp: S(0)}
param_1: {tp: S(0)}
t: {tp: S(1)}
addmm: {tp: S(1)}
gelu: {tp: S(1)}
param_2: {tp: S(1)}
param_3: {tp: R}
t_1: {tp: S(0)}
addmm_1: {tp: P}
""")

    def test_attention_with_hard_coded_heads(self):
        text = graph_after(attention(), tp_attention_plan(), (torch.randn(2, 8, 16),), "annotate_placements",
                           placements=True)
        self.assertExpectedInline(text, """\
class <lambda>(torch.nn.Module):
    def forward(self, arg0_1: "f32[2, 8, 16]", arg1_1: "f32[4, 16]", arg2_1: "f32[4, 16]", arg3_1: "f32[4, 16]", arg4_1: "f32[16, 4]"):
        param: "f32[16, 16]" = torch.ops.graphshard.param.default(arg1_1, 'wq.weight', [16, 16]);  arg1_1 = None
        t: "f32[16, 16]" = torch.ops.aten.t.default(param);  param = None
        view: "f32[16, 16]" = torch.ops.aten.view.default(arg0_1, [16, 16])
        mm: "f32[16, 16]" = torch.ops.aten.mm.default(view, t);  view = t = None
        _unsafe_view: "f32[2, 8, 16]" = torch.ops.aten._unsafe_view.default(mm, [2, 8, 16]);  mm = None
        view_1: "f32[2, 8, 4, 4]" = torch.ops.aten.view.default(_unsafe_view, [2, 8, 4, 4]);  _unsafe_view = None
        transpose: "f32[2, 4, 8, 4]" = torch.ops.aten.transpose.int(view_1, 1, 2);  view_1 = None
        param_1: "f32[16, 16]" = torch.ops.graphshard.param.default(arg2_1, 'wk.weight', [16, 16]);  arg2_1 = None
        t_1: "f32[16, 16]" = torch.ops.aten.t.default(param_1);  param_1 = None
        view_2: "f32[16, 16]" = torch.ops.aten.view.default(arg0_1, [16, 16])
        mm_1: "f32[16, 16]" = torch.ops.aten.mm.default(view_2, t_1);  view_2 = t_1 = None
        _unsafe_view_1: "f32[2, 8, 16]" = torch.ops.aten._unsafe_view.default(mm_1, [2, 8, 16]);  mm_1 = None
        view_3: "f32[2, 8, 4, 4]" = torch.ops.aten.view.default(_unsafe_view_1, [2, 8, 4, 4]);  _unsafe_view_1 = None
        transpose_1: "f32[2, 4, 8, 4]" = torch.ops.aten.transpose.int(view_3, 1, 2);  view_3 = None
        param_2: "f32[16, 16]" = torch.ops.graphshard.param.default(arg3_1, 'wv.weight', [16, 16]);  arg3_1 = None
        t_2: "f32[16, 16]" = torch.ops.aten.t.default(param_2);  param_2 = None
        view_4: "f32[16, 16]" = torch.ops.aten.view.default(arg0_1, [16, 16]);  arg0_1 = None
        mm_2: "f32[16, 16]" = torch.ops.aten.mm.default(view_4, t_2);  view_4 = t_2 = None
        _unsafe_view_2: "f32[2, 8, 16]" = torch.ops.aten._unsafe_view.default(mm_2, [2, 8, 16]);  mm_2 = None
        view_5: "f32[2, 8, 4, 4]" = torch.ops.aten.view.default(_unsafe_view_2, [2, 8, 4, 4]);  _unsafe_view_2 = None
        transpose_2: "f32[2, 4, 8, 4]" = torch.ops.aten.transpose.int(view_5, 1, 2);  view_5 = None
        transpose_3: "f32[2, 4, 4, 8]" = torch.ops.aten.transpose.int(transpose_1, -2, -1);  transpose_1 = None
        expand: "f32[2, 4, 8, 4]" = torch.ops.aten.expand.default(transpose, [2, 4, 8, 4]);  transpose = None
        clone: "f32[2, 4, 8, 4]" = torch.ops.aten.clone.default(expand, memory_format = torch.contiguous_format);  expand = None
        _unsafe_view_3: "f32[8, 8, 4]" = torch.ops.aten._unsafe_view.default(clone, [8, 8, 4]);  clone = None
        expand_1: "f32[2, 4, 4, 8]" = torch.ops.aten.expand.default(transpose_3, [2, 4, 4, 8]);  transpose_3 = None
        clone_1: "f32[2, 4, 4, 8]" = torch.ops.aten.clone.default(expand_1, memory_format = torch.contiguous_format);  expand_1 = None
        _unsafe_view_4: "f32[8, 4, 8]" = torch.ops.aten._unsafe_view.default(clone_1, [8, 4, 8]);  clone_1 = None
        bmm: "f32[8, 8, 8]" = torch.ops.aten.bmm.default(_unsafe_view_3, _unsafe_view_4);  _unsafe_view_3 = _unsafe_view_4 = None
        _unsafe_view_5: "f32[2, 4, 8, 8]" = torch.ops.aten._unsafe_view.default(bmm, [2, 4, 8, 8]);  bmm = None
        div: "f32[2, 4, 8, 8]" = torch.ops.aten.div.Tensor(_unsafe_view_5, 2.0);  _unsafe_view_5 = None
        full: "f32[8, 8]" = torch.ops.aten.full.default([8, 8], -inf, device = device(type='cpu'), pin_memory = False)
        triu: "f32[8, 8]" = torch.ops.aten.triu.default(full, 1);  full = None
        add: "f32[2, 4, 8, 8]" = torch.ops.aten.add.Tensor(div, triu);  div = triu = None
        _softmax: "f32[2, 4, 8, 8]" = torch.ops.aten._softmax.default(add, -1, False);  add = None
        expand_2: "f32[2, 4, 8, 8]" = torch.ops.aten.expand.default(_softmax, [2, 4, 8, 8]);  _softmax = None
        view_6: "f32[8, 8, 8]" = torch.ops.aten.view.default(expand_2, [8, 8, 8]);  expand_2 = None
        expand_3: "f32[2, 4, 8, 4]" = torch.ops.aten.expand.default(transpose_2, [2, 4, 8, 4]);  transpose_2 = None
        clone_2: "f32[2, 4, 8, 4]" = torch.ops.aten.clone.default(expand_3, memory_format = torch.contiguous_format);  expand_3 = None
        _unsafe_view_6: "f32[8, 8, 4]" = torch.ops.aten._unsafe_view.default(clone_2, [8, 8, 4]);  clone_2 = None
        bmm_1: "f32[8, 8, 4]" = torch.ops.aten.bmm.default(view_6, _unsafe_view_6);  view_6 = _unsafe_view_6 = None
        _unsafe_view_7: "f32[2, 4, 8, 4]" = torch.ops.aten._unsafe_view.default(bmm_1, [2, 4, 8, 4]);  bmm_1 = None
        transpose_4: "f32[2, 8, 4, 4]" = torch.ops.aten.transpose.int(_unsafe_view_7, 1, 2);  _unsafe_view_7 = None
        clone_3: "f32[2, 8, 4, 4]" = torch.ops.aten.clone.default(transpose_4, memory_format = torch.contiguous_format);  transpose_4 = None
        _unsafe_view_8: "f32[2, 8, 16]" = torch.ops.aten._unsafe_view.default(clone_3, [2, 8, 16]);  clone_3 = None
        param_3: "f32[16, 16]" = torch.ops.graphshard.param.default(arg4_1, 'wo.weight', [16, 16]);  arg4_1 = None
        t_3: "f32[16, 16]" = torch.ops.aten.t.default(param_3);  param_3 = None
        view_7: "f32[16, 16]" = torch.ops.aten.view.default(_unsafe_view_8, [16, 16]);  _unsafe_view_8 = None
        mm_3: "f32[16, 16]" = torch.ops.aten.mm.default(view_7, t_3);  view_7 = t_3 = None
        _unsafe_view_9: "f32[2, 8, 16]" = torch.ops.aten._unsafe_view.default(mm_3, [2, 8, 16]);  mm_3 = None
        return (_unsafe_view_9,)
arg0_1: {tp: R}
arg1_1: {tp: R}
arg2_1: {tp: R}
arg3_1: {tp: R}
arg4_1: {tp: R}
param: {tp: S(0)}
t: {tp: S(1)}
view: {tp: R}
mm: {tp: S(1)}
_unsafe_view: {tp: S(2)}
view_1: {tp: S(2)}
transpose: {tp: S(1)}
param_1: {tp: S(0)}
t_1: {tp: S(1)}
view_2: {tp: R}
mm_1: {tp: S(1)}
_unsafe_view_1: {tp: S(2)}
view_3: {tp: S(2)}
transpose_1: {tp: S(1)}
param_2: {tp: S(0)}
t_2: {tp: S(1)}
view_4: {tp: R}
mm_2: {tp: S(1)}
_unsafe_view_2: {tp: S(2)}
view_5: {tp: S(2)}
transpose_2: {tp: S(1)}
transpose_3: {tp: S(1)}
expand: {tp: S(1)}
clone: {tp: S(1)}
_unsafe_view_3: {tp: S(0/2)}
expand_1: {tp: S(1)}
clone_1: {tp: S(1)}
_unsafe_view_4: {tp: S(0/2)}
bmm: {tp: S(0/2)}
_unsafe_view_5: {tp: S(1)}
div: {tp: S(1)}
full: {tp: R}
triu: {tp: R}
add: {tp: S(1)}
_softmax: {tp: S(1)}
expand_2: {tp: S(1)}
view_6: {tp: S(0/2)}
expand_3: {tp: S(1)}
clone_2: {tp: S(1)}
_unsafe_view_6: {tp: S(0/2)}
bmm_1: {tp: S(0/2)}
_unsafe_view_7: {tp: S(1)}
transpose_4: {tp: S(2)}
clone_3: {tp: S(2)}
_unsafe_view_8: {tp: S(2)}
param_3: {tp: S(1)}
t_3: {tp: S(0)}
view_7: {tp: S(1)}
mm_3: {tp: P}
_unsafe_view_9: {tp: P}
""")

    def test_data_parallel_only_graph_is_untouched(self):
        from _models import fsdp_plan, tiny_transformer
        from graphshard.testing.models import token_batch

        x, _ = token_batch(0, 2, 8, 32)
        text = graph_after(tiny_transformer(), fsdp_plan(), (x,), "annotate_placements", placements=True)
        self.assertNotIn("placement", text)
        self.assertIn("graphshard.param.default", text)
