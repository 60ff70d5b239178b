import torch
from expecttest import TestCase

from _golden import graph_after
from _models import fsdp_plan, tiny_transformer
from graphshard.ops import ops
from graphshard.ops.dense import _coalesced_inputs
from graphshard.testing.models import token_batch


class TestBucketCollectives(TestCase):
    def test_one_unshard_per_unit_and_tied_weight_gathered_once(self):
        x, _ = token_batch(0, 2, 8, 32)
        text = graph_after(tiny_transformer(), fsdp_plan(), (x,), "bucket_collectives")
        # Units: the root (embeddings, final norm, tied output) and layers.0.
        self.assertEqual(text.count("graphshard.unshard.default("), 2)
        self.assertEqual(text.count("'tok_embeddings.weight'"), 1)
        self.assertExpectedInline(text, """\
class <lambda>(torch.nn.Module):
    def forward(self, arg0_1: "i64[2, 8]", arg1_1: "f32[8, 16]", arg2_1: "f32[2, 16]", arg3_1: "f32[4]", arg4_1: "f32[4]", arg5_1: "f32[4, 16]", arg6_1: "f32[4, 16]", arg7_1: "f32[4, 16]", arg8_1: "f32[4, 16]", arg9_1: "f32[4]", arg10_1: "f32[4]", arg11_1: "f32[16, 16]", arg12_1: "f32[16]", arg13_1: "f32[4, 64]", arg14_1: "f32[4]", arg15_1: "f32[4]", arg16_1: "f32[4]"):
        arange: "i64[8]" = torch.ops.aten.arange.default(8, device = device(type='cpu'), pin_memory = False)
        unshard_default_17 = torch.ops.graphshard.unshard.default([arg1_1, arg2_1, arg15_1, arg16_1], ['tok_embeddings.weight', 'pos_embeddings.weight', 'norm.weight', 'norm.bias']);  arg1_1 = arg2_1 = arg15_1 = arg16_1 = None
        getitem_29: "f32[16]" = unshard_default_17[3]
        getitem_28: "f32[16]" = unshard_default_17[2]
        getitem_27: "f32[8, 16]" = unshard_default_17[1]
        getitem_26: "f32[32, 16]" = unshard_default_17[0];  unshard_default_17 = None
        embedding: "f32[2, 8, 16]" = torch.ops.aten.embedding.default(getitem_26, arg0_1);  arg0_1 = None
        embedding_1: "f32[8, 16]" = torch.ops.aten.embedding.default(getitem_27, arange);  getitem_27 = arange = None
        add: "f32[2, 8, 16]" = torch.ops.aten.add.Tensor(embedding, embedding_1);  embedding = embedding_1 = None
        unshard_default_18 = torch.ops.graphshard.unshard.default([arg3_1, arg4_1, arg5_1, arg6_1, arg7_1, arg8_1, arg9_1, arg10_1, arg11_1, arg12_1, arg13_1, arg14_1], ['layers.0.attn_norm.weight', 'layers.0.attn_norm.bias', 'layers.0.attn.wq.weight', 'layers.0.attn.wk.weight', 'layers.0.attn.wv.weight', 'layers.0.attn.wo.weight', 'layers.0.ffn_norm.weight', 'layers.0.ffn_norm.bias', 'layers.0.ffn.w1.weight', 'layers.0.ffn.w1.bias', 'layers.0.ffn.w2.weight', 'layers.0.ffn.w2.bias']);  arg3_1 = arg4_1 = arg5_1 = arg6_1 = arg7_1 = arg8_1 = arg9_1 = arg10_1 = arg11_1 = arg12_1 = arg13_1 = arg14_1 = None
        getitem_41: "f32[16]" = unshard_default_18[11]
        getitem_40: "f32[16, 64]" = unshard_default_18[10]
        getitem_39: "f32[64]" = unshard_default_18[9]
        getitem_38: "f32[64, 16]" = unshard_default_18[8]
        getitem_37: "f32[16]" = unshard_default_18[7]
        getitem_36: "f32[16]" = unshard_default_18[6]
        getitem_35: "f32[16, 16]" = unshard_default_18[5]
        getitem_34: "f32[16, 16]" = unshard_default_18[4]
        getitem_33: "f32[16, 16]" = unshard_default_18[3]
        getitem_32: "f32[16, 16]" = unshard_default_18[2]
        getitem_31: "f32[16]" = unshard_default_18[1]
        getitem_30: "f32[16]" = unshard_default_18[0];  unshard_default_18 = None
        native_layer_norm = torch.ops.aten.native_layer_norm.default(add, [16], getitem_30, getitem_31, 1e-05);  getitem_30 = getitem_31 = None
        getitem: "f32[2, 8, 16]" = native_layer_norm[0]
        getitem_1: "f32[2, 8, 1]" = native_layer_norm[1];  getitem_1 = None
        getitem_2: "f32[2, 8, 1]" = native_layer_norm[2];  native_layer_norm = getitem_2 = None
        t: "f32[16, 16]" = torch.ops.aten.t.default(getitem_32);  getitem_32 = None
        view: "f32[16, 16]" = torch.ops.aten.reshape.default(getitem, [16, 16])
        mm: "f32[16, 16]" = torch.ops.aten.mm.default(view, t);  view = t = None
        _unsafe_view: "f32[2, 8, 16]" = torch.ops.aten._unsafe_view.default(mm, [2, 8, 16]);  mm = None
        view_1: "f32[2, 8, 4, 4]" = torch.ops.aten.reshape.default(_unsafe_view, [2, 8, 4, 4]);  _unsafe_view = None
        transpose: "f32[2, 4, 8, 4]" = torch.ops.aten.transpose.int(view_1, 1, 2);  view_1 = None
        t_1: "f32[16, 16]" = torch.ops.aten.t.default(getitem_33);  getitem_33 = None
        view_2: "f32[16, 16]" = torch.ops.aten.reshape.default(getitem, [16, 16])
        mm_1: "f32[16, 16]" = torch.ops.aten.mm.default(view_2, t_1);  view_2 = t_1 = None
        _unsafe_view_1: "f32[2, 8, 16]" = torch.ops.aten._unsafe_view.default(mm_1, [2, 8, 16]);  mm_1 = None
        view_3: "f32[2, 8, 4, 4]" = torch.ops.aten.reshape.default(_unsafe_view_1, [2, 8, 4, 4]);  _unsafe_view_1 = None
        transpose_1: "f32[2, 4, 8, 4]" = torch.ops.aten.transpose.int(view_3, 1, 2);  view_3 = None
        t_2: "f32[16, 16]" = torch.ops.aten.t.default(getitem_34);  getitem_34 = None
        view_4: "f32[16, 16]" = torch.ops.aten.reshape.default(getitem, [16, 16]);  getitem = None
        mm_2: "f32[16, 16]" = torch.ops.aten.mm.default(view_4, t_2);  view_4 = t_2 = None
        _unsafe_view_2: "f32[2, 8, 16]" = torch.ops.aten._unsafe_view.default(mm_2, [2, 8, 16]);  mm_2 = None
        view_5: "f32[2, 8, 4, 4]" = torch.ops.aten.reshape.default(_unsafe_view_2, [2, 8, 4, 4]);  _unsafe_view_2 = None
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
        add_1: "f32[2, 4, 8, 8]" = torch.ops.aten.add.Tensor(div, triu);  div = triu = None
        _softmax: "f32[2, 4, 8, 8]" = torch.ops.aten._softmax.default(add_1, -1, False);  add_1 = None
        expand_2: "f32[2, 4, 8, 8]" = torch.ops.aten.expand.default(_softmax, [2, 4, 8, 8]);  _softmax = None
        view_6: "f32[8, 8, 8]" = torch.ops.aten.reshape.default(expand_2, [8, 8, 8]);  expand_2 = None
        expand_3: "f32[2, 4, 8, 4]" = torch.ops.aten.expand.default(transpose_2, [2, 4, 8, 4]);  transpose_2 = None
        clone_2: "f32[2, 4, 8, 4]" = torch.ops.aten.clone.default(expand_3, memory_format = torch.contiguous_format);  expand_3 = None
        _unsafe_view_6: "f32[8, 8, 4]" = torch.ops.aten._unsafe_view.default(clone_2, [8, 8, 4]);  clone_2 = None
        bmm_1: "f32[8, 8, 4]" = torch.ops.aten.bmm.default(view_6, _unsafe_view_6);  view_6 = _unsafe_view_6 = None
        _unsafe_view_7: "f32[2, 4, 8, 4]" = torch.ops.aten._unsafe_view.default(bmm_1, [2, 4, 8, 4]);  bmm_1 = None
        transpose_4: "f32[2, 8, 4, 4]" = torch.ops.aten.transpose.int(_unsafe_view_7, 1, 2);  _unsafe_view_7 = None
        clone_3: "f32[2, 8, 4, 4]" = torch.ops.aten.clone.default(transpose_4, memory_format = torch.contiguous_format);  transpose_4 = None
        _unsafe_view_8: "f32[2, 8, 16]" = torch.ops.aten._unsafe_view.default(clone_3, [2, 8, 16]);  clone_3 = None
        t_3: "f32[16, 16]" = torch.ops.aten.t.default(getitem_35);  getitem_35 = None
        view_7: "f32[16, 16]" = torch.ops.aten.reshape.default(_unsafe_view_8, [16, 16]);  _unsafe_view_8 = None
        mm_3: "f32[16, 16]" = torch.ops.aten.mm.default(view_7, t_3);  view_7 = t_3 = None
        _unsafe_view_9: "f32[2, 8, 16]" = torch.ops.aten._unsafe_view.default(mm_3, [2, 8, 16]);  mm_3 = None
        add_2: "f32[2, 8, 16]" = torch.ops.aten.add.Tensor(add, _unsafe_view_9);  add = _unsafe_view_9 = None
        native_layer_norm_1 = torch.ops.aten.native_layer_norm.default(add_2, [16], getitem_36, getitem_37, 1e-05);  getitem_36 = getitem_37 = None
        getitem_3: "f32[2, 8, 16]" = native_layer_norm_1[0]
        getitem_4: "f32[2, 8, 1]" = native_layer_norm_1[1];  getitem_4 = None
        getitem_5: "f32[2, 8, 1]" = native_layer_norm_1[2];  native_layer_norm_1 = getitem_5 = None
        view_8: "f32[16, 16]" = torch.ops.aten.reshape.default(getitem_3, [16, 16]);  getitem_3 = None
        t_4: "f32[16, 64]" = torch.ops.aten.t.default(getitem_38);  getitem_38 = None
        addmm: "f32[16, 64]" = torch.ops.aten.addmm.default(getitem_39, view_8, t_4);  getitem_39 = view_8 = t_4 = None
        view_9: "f32[2, 8, 64]" = torch.ops.aten.reshape.default(addmm, [2, 8, 64]);  addmm = None
        gelu: "f32[2, 8, 64]" = torch.ops.aten.gelu.default(view_9);  view_9 = None
        view_10: "f32[16, 64]" = torch.ops.aten.reshape.default(gelu, [16, 64]);  gelu = None
        t_5: "f32[64, 16]" = torch.ops.aten.t.default(getitem_40);  getitem_40 = None
        addmm_1: "f32[16, 16]" = torch.ops.aten.addmm.default(getitem_41, view_10, t_5);  getitem_41 = view_10 = t_5 = None
        view_11: "f32[2, 8, 16]" = torch.ops.aten.reshape.default(addmm_1, [2, 8, 16]);  addmm_1 = None
        add_3: "f32[2, 8, 16]" = torch.ops.aten.add.Tensor(add_2, view_11);  add_2 = view_11 = None
        native_layer_norm_2 = torch.ops.aten.native_layer_norm.default(add_3, [16], getitem_28, getitem_29, 1e-05);  add_3 = getitem_28 = getitem_29 = None
        getitem_6: "f32[2, 8, 16]" = native_layer_norm_2[0]
        getitem_7: "f32[2, 8, 1]" = native_layer_norm_2[1];  getitem_7 = None
        getitem_8: "f32[2, 8, 1]" = native_layer_norm_2[2];  native_layer_norm_2 = getitem_8 = None
        t_6: "f32[16, 32]" = torch.ops.aten.t.default(getitem_26);  getitem_26 = None
        view_12: "f32[16, 16]" = torch.ops.aten.reshape.default(getitem_6, [16, 16]);  getitem_6 = None
        mm_4: "f32[16, 32]" = torch.ops.aten.mm.default(view_12, t_6);  view_12 = t_6 = None
        _unsafe_view_10: "f32[2, 8, 32]" = torch.ops.aten._unsafe_view.default(mm_4, [2, 8, 32]);  mm_4 = None
        return (_unsafe_view_10,)
""")


class TestUnpackReduced(TestCase):
    def test_averages_the_rows_an_all_to_all_received(self):
        # Two source ranks' copies of a bucket of two gradients (numels 6 and 4, the first
        # padded from 5): each gradient is the mean of its rows, cut to its unpadded size.
        table = torch.arange(20, dtype=torch.float32).view(2, 10)
        a, b = ops.unpack_reduced(table.view(-1), 2, [6, 4], [5, 4])
        mean = table.mean(0)
        torch.testing.assert_close(a, mean[:5], rtol=0, atol=0)
        torch.testing.assert_close(b, mean[6:], rtol=0, atol=0)

    def test_one_row_is_copied_out_of_the_collective_buffer(self):
        buf = torch.arange(10, dtype=torch.float32)
        a, b = ops.unpack_reduced(buf, 1, [6, 4], [5, 4])
        torch.testing.assert_close(a, buf[:5], rtol=0, atol=0)
        torch.testing.assert_close(b, buf[6:], rtol=0, atol=0)
        buf.zero_()  # the gradients do not alias the buffer the collective wrote
        torch.testing.assert_close(a, torch.arange(5, dtype=torch.float32), rtol=0, atol=0)


class TestCoalescedInputs(TestCase):
    def test_pads_each_shard_to_its_chunk_with_zeros_and_casts(self):
        a, b = torch.arange(6.0).view(2, 3), torch.arange(4.0)
        fa, fb = _coalesced_inputs([a, b], [9, 4], torch.bfloat16)
        torch.testing.assert_close(fa, torch.tensor([0, 1, 2, 3, 4, 5, 0, 0, 0], dtype=torch.bfloat16), rtol=0, atol=0)
        torch.testing.assert_close(fb, b.to(torch.bfloat16), rtol=0, atol=0)


class TestFlatParams(TestCase):
    def test_a_flat_units_views_move_before_its_one_gather(self):
        """FullyShard(flat_params=True): the parameters are views of one flat input, read where the
        model reads them; the unit's single unshard needs them all first, so they move up to it."""
        import graphshard
        from _models import mesh1d, mlp

        plan = graphshard.Plan(mesh1d("dp"), {"": graphshard.FullyShard(flat_params=True)})
        text = graph_after(mlp(), plan, (torch.randn(2, 16),), "bucket_collectives")
        self.assertEqual(text.count("graphshard.unshard.default("), 1)
        self.assertExpectedInline(text, """\
class <lambda>(torch.nn.Module):
    def forward(self, arg0_1: "f32[202]", arg1_1: "f32[2, 16]"):
        slice_1: "f32[128]" = torch.ops.aten.slice.Tensor(arg0_1, 0, 0, 128)
        view: "f32[8, 16]" = torch.ops.aten.reshape.default(slice_1, [8, 16]);  slice_1 = None
        slice_2: "f32[8]" = torch.ops.aten.slice.Tensor(arg0_1, 0, 128, 136)
        view_1: "f32[8]" = torch.ops.aten.reshape.default(slice_2, [8]);  slice_2 = None
        slice_3: "f32[64]" = torch.ops.aten.slice.Tensor(arg0_1, 0, 136, 200)
        view_2: "f32[2, 32]" = torch.ops.aten.reshape.default(slice_3, [2, 32]);  slice_3 = None
        slice_4: "f32[2]" = torch.ops.aten.slice.Tensor(arg0_1, 0, 200, 202);  arg0_1 = None
        view_3: "f32[2]" = torch.ops.aten.reshape.default(slice_4, [2]);  slice_4 = None
        unshard_default_4 = torch.ops.graphshard.unshard.default([view, view_1, view_2, view_3], ['fc1.weight', 'fc1.bias', 'fc2.weight', 'fc2.bias']);  view = view_1 = view_2 = view_3 = None
        getitem_7: "f32[8]" = unshard_default_4[3]
        getitem_6: "f32[8, 32]" = unshard_default_4[2]
        getitem_5: "f32[32]" = unshard_default_4[1]
        getitem_4: "f32[32, 16]" = unshard_default_4[0];  unshard_default_4 = None
        t: "f32[16, 32]" = torch.ops.aten.t.default(getitem_4);  getitem_4 = None
        addmm: "f32[2, 32]" = torch.ops.aten.addmm.default(getitem_5, arg1_1, t);  getitem_5 = arg1_1 = t = None
        gelu: "f32[2, 32]" = torch.ops.aten.gelu.default(addmm);  addmm = None
        t_1: "f32[32, 8]" = torch.ops.aten.t.default(getitem_6);  getitem_6 = None
        addmm_1: "f32[2, 8]" = torch.ops.aten.addmm.default(getitem_7, gelu, t_1);  getitem_7 = gelu = t_1 = None
        return (addmm_1,)
""")
