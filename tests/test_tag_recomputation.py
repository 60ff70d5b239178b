import torch
from expecttest import TestCase

from _golden import compiled_stages, graph_after
from _models import fsdp_plan, stack, tiny_transformer
from graphshard.testing.models import lm_loss, token_batch


def _tags(text_model, plan):
    import graphshard
    from _golden import capture_dynamo
    from graphshard.compiler.prepare import prepare, trace
    from graphshard.config import CompileConfig
    from graphshard.passes.pipeline import pre_autograd_passes, run_passes

    graphshard.shard(text_model, plan)
    gm, inputs = capture_dynamo(text_model, torch.randn(4, 8))
    prepared = trace(prepare(gm, inputs), CompileConfig(lower="eager"), (text_model._graphshard,))
    g = run_passes(prepared.graph, prepared.ctx, pre_autograd_passes())
    return [f"{n.name}: {n.meta['recompute'].name}" for n in g.graph.nodes if "recompute" in n.meta]


class TestTagRecomputation(TestCase):
    def test_graph_after_tag_recomputation(self):
        # The unshard nodes (and their getitems) carry the recompute policy and unit as annotations.
        text = graph_after(stack(), fsdp_plan(), (torch.randn(4, 8),), "tag_recomputation")
        self.assertEqual(text.count("MUST_RECOMPUTE"), 6)
        self.assertExpectedInline(text, """\
class <lambda>(torch.nn.Module):
    def forward(self, arg0_1: "f32[2, 8]", arg1_1: "f32[4, 8]", arg2_1: "f32[2, 8]", arg3_1: "f32[2, 8]"):
        # Annotation: {'graphshard_unit': 'layers.0'} ac_graph_id: 1 - MUST_RECOMPUTE
        unshard_default = torch.ops.graphshard.unshard.default([arg0_1], ['layers.0.weight']);  arg0_1 = None
        # ac_graph_id: 1 - MUST_RECOMPUTE
        getitem: "f32[8, 8]" = unshard_default[0];  unshard_default = None
        t: "f32[8, 8]" = torch.ops.aten.t.default(getitem);  getitem = None
        mm: "f32[4, 8]" = torch.ops.aten.mm.default(arg1_1, t);  arg1_1 = t = None
        relu: "f32[4, 8]" = torch.ops.aten.relu.default(mm);  mm = None
        # Annotation: {'graphshard_unit': 'layers.1'} ac_graph_id: 2 - MUST_RECOMPUTE
        unshard_default_1 = torch.ops.graphshard.unshard.default([arg2_1], ['layers.1.weight']);  arg2_1 = None
        # ac_graph_id: 2 - MUST_RECOMPUTE
        getitem_1: "f32[8, 8]" = unshard_default_1[0];  unshard_default_1 = None
        t_1: "f32[8, 8]" = torch.ops.aten.t.default(getitem_1);  getitem_1 = None
        mm_1: "f32[4, 8]" = torch.ops.aten.mm.default(relu, t_1);  relu = t_1 = None
        relu_1: "f32[4, 8]" = torch.ops.aten.relu.default(mm_1);  mm_1 = None
        # Annotation: {'graphshard_unit': 'layers.2'} ac_graph_id: 3 - MUST_RECOMPUTE
        unshard_default_2 = torch.ops.graphshard.unshard.default([arg3_1], ['layers.2.weight']);  arg3_1 = None
        # ac_graph_id: 3 - MUST_RECOMPUTE
        getitem_2: "f32[8, 8]" = unshard_default_2[0];  unshard_default_2 = None
        t_2: "f32[8, 8]" = torch.ops.aten.t.default(getitem_2);  getitem_2 = None
        mm_2: "f32[4, 8]" = torch.ops.aten.mm.default(relu_1, t_2);  relu_1 = t_2 = None
        relu_2: "f32[4, 8]" = torch.ops.aten.relu.default(mm_2);  mm_2 = None
        return (relu_2,)
""")

    def test_full_shard_tags_recompute(self):
        self.assertExpectedInline("\n".join(_tags(stack(), fsdp_plan())), """\
unshard_default: MUST_RECOMPUTE
getitem: MUST_RECOMPUTE
unshard_default_1: MUST_RECOMPUTE
getitem_1: MUST_RECOMPUTE
unshard_default_2: MUST_RECOMPUTE
getitem_2: MUST_RECOMPUTE""")

    def test_shard_grad_op_tags_save(self):
        self.assertExpectedInline("\n".join(_tags(stack(), fsdp_plan(reshard_after_forward=False))), """\
unshard_default: MUST_SAVE
getitem: MUST_SAVE
unshard_default_1: MUST_SAVE
getitem_1: MUST_SAVE
unshard_default_2: MUST_SAVE
getitem_2: MUST_SAVE""")

    def test_full_shard_regathers_in_backward_shard_grad_op_does_not(self):
        full = compiled_stages(stack(), fsdp_plan(), (torch.randn(4, 8),))
        # layers.1 and layers.2 need their weights for the input gradient; layers.0's input
        # needs no gradient, so its weight is not gathered again.
        self.assertEqual(full["backward"].count("all_gather_into_tensor.default("), 2)
        sgo = compiled_stages(stack(), fsdp_plan(reshard_after_forward=False), (torch.randn(4, 8),))
        self.assertEqual(sgo["backward"].count("all_gather_into_tensor.default("), 0)
        self.assertEqual(sgo["backward"].count("reduce_scatter_tensor.default("), 3)

    def test_root_unit_keeps_its_parameters_as_fsdp2s_root_does(self):
        # The backward starts with the output head, the root's tied embedding: the root unit is
        # not resharded after forward (FULL_SHARD or not), so the backward gathers layers.0 only.
        x, y = token_batch(0, 2, 8, 32)
        g = compiled_stages(tiny_transformer(), fsdp_plan(), (x,), loss_fn=lambda out: lm_loss(out, y))
        self.assertEqual(g["forward"].count("all_gather_into_tensor.default("), 2)
        self.assertEqual(g["backward"].count("all_gather_into_tensor.default("), 1)
        self.assertIn("Annotation: {'graphshard_unit': 'layers.0'} ac_graph_id: 2 - MUST_RECOMPUTE", g["backward"])


def _region_graph(spec):
    """A chain of relu nodes, one per ``(trace number, module path)`` (None: untagged), as dynamo's
    trace tags them."""
    from torch.utils.checkpoint import CheckpointPolicy

    g = torch.fx.Graph()
    x = g.placeholder("x")
    nodes = []
    for number, path in spec:
        x = g.call_function(torch.relu, (x,))
        if number is not None:
            x.meta.update(recompute=CheckpointPolicy.PREFER_RECOMPUTE, ac_graph_id=number,
                          nn_module_stack={path: (path, torch.nn.Module)})
        nodes.append(x)
    g.output(x)
    return torch.fx.GraphModule(torch.nn.Module(), g), nodes


class TestRegionNumbers(TestCase):
    """torch 2.11's trace numbers a checkpoint nested in another apart (torch 2.13's does not);
    the pass gives it the outer region's number either way."""

    def numbers(self, spec):
        from graphshard.passes.tag_recomputation import _number_regions

        gm, nodes = _region_graph(spec)
        count = _number_regions(gm, set())
        return count, [n.meta.get("ac_graph_id") for n in nodes]

    def test_nested_inside_takes_the_outer_number(self):
        spec = [(40, "L['self'].layers[0].a"), (41, "L['self'].layers[0].ffn.w1"), (41, "L['self'].layers[0].ffn.w2"),
                (40, "L['self'].layers[0]"), (42, "L['self'].layers[1].a"), (43, "L['self'].layers[1].ffn.w1"),
                (42, "L['self'].layers[1]")]
        self.assertEqual(self.numbers(spec), (2, [1, 1, 1, 1, 2, 2, 2]))

    def test_nested_at_the_outer_end_takes_the_outer_number(self):
        # the block's own op (a residual add) then its checkpointed ffn, the last thing it does
        spec = [(7, "L['self'].layers[0]"), (8, "L['self'].layers[0].ffn.w1"), (8, "L['self'].layers[0].ffn.w2"),
                (9, "L['self'].layers[1]"), (10, "L['self'].layers[1].ffn.w1")]
        self.assertEqual(self.numbers(spec), (2, [1, 1, 1, 2, 2]))

    def test_checkpoints_of_two_submodules_stay_apart(self):
        # checkpoint(layer.attn) then checkpoint(layer.ffn): siblings, whatever the trace's numbers
        spec = [(1, "L['self'].layers[0].attn"), (2, "L['self'].layers[0].ffn"), (3, "L['self'].layers[1].attn")]
        self.assertEqual(self.numbers(spec), (3, [1, 2, 3]))

    def test_sibling_regions_stay_apart(self):
        # a region of another module after the first, with user code between: two regions
        spec = [(3, "L['self'].layers[0]"), (None, ""), (5, "L['self'].layers[1]"), (6, "L['self'].head")]
        self.assertEqual(self.numbers(spec), (3, [1, None, 2, 3]))
