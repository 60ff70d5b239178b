import torch
from expecttest import TestCase

from _golden import compiled_stages, graph_after
from _models import fsdp_plan, stack
from graphshard.passes._graph import aten


def _tags(text_model, plan):
    import graphshard
    from _golden import capture_dynamo
    from graphshard.backend import prepare
    from graphshard.config import CompileConfig
    from graphshard.passes.pipeline import pre_autograd_passes, run_passes

    graphshard.shard(text_model, plan)
    gm, inputs = capture_dynamo(text_model, torch.randn(4, 8))
    prepared = prepare(gm, inputs, CompileConfig(lower="eager"))
    g = run_passes(prepared.graph, prepared.ctx, pre_autograd_passes())
    return [f"{n.name}: {n.meta['recompute'].name}" for n in g.graph.nodes if "recompute" in n.meta]


class TestTagResharding(TestCase):
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
