import torch
from expecttest import TestCase

from _golden import graph_after
from _models import fsdp_plan, fsdp_tp_qnorm, mlp, tp_mlp_plan
import graphshard


class TestInsertCollectives(TestCase):
    def test_tp_mlp_all_reduce_only_after_rowwise(self):
        text = graph_after(mlp(), tp_mlp_plan(), (torch.randn(4, 16),), "insert_collectives")
        self.assertEqual(text.count("graphshard.all_reduce"), 1)
        self.assertNotIn("graphshard.all_gather", text)
        self.assertExpectedInline(text, """\
class <lambda>(torch.nn.Module):
    def forward(self, arg0_1: "f32[8, 16]", arg1_1: "f32[8]", arg2_1: "f32[4, 16]", arg3_1: "f32[8, 8]", arg4_1: "f32[8]"):
        to_partial_default: "f32[8]" = torch.ops.graphshard.to_partial.default(arg4_1, 0);  arg4_1 = None
        alias_default: "f32[32, 16]" = torch.ops.aten.alias.default(arg0_1);  arg0_1 = None
        alias_default_1: "f32[32]" = torch.ops.aten.alias.default(arg1_1);  arg1_1 = None
        t: "f32[16, 32]" = torch.ops.aten.t.default(alias_default);  alias_default = None
        addmm: "f32[4, 32]" = torch.ops.aten.addmm.default(alias_default_1, arg2_1, t);  alias_default_1 = arg2_1 = t = None
        gelu: "f32[4, 32]" = torch.ops.aten.gelu.default(addmm);  addmm = None
        alias_default_2: "f32[8, 32]" = torch.ops.aten.alias.default(arg3_1);  arg3_1 = None
        t_1: "f32[32, 8]" = torch.ops.aten.t.default(alias_default_2);  alias_default_2 = None
        addmm_1: "f32[4, 8]" = torch.ops.aten.addmm.default(to_partial_default, gelu, t_1);  to_partial_default = gelu = t_1 = None
        all_reduce_default: "f32[4, 8]" = torch.ops.graphshard.all_reduce.default(addmm_1, 'tp', 4);  addmm_1 = None
        return (all_reduce_default,)
""")

    def test_fsdp_markers_become_unshard(self):
        plan = graphshard.Plan(fsdp_plan().mesh, {"": graphshard.FullyShard()})
        text = graph_after(mlp(), plan, (torch.randn(4, 16),), "insert_collectives")
        self.assertNotIn("graphshard.param", text)
        self.assertExpectedInline(text, """\
class <lambda>(torch.nn.Module):
    def forward(self, arg0_1: "f32[8, 16]", arg1_1: "f32[8]", arg2_1: "f32[4, 16]", arg3_1: "f32[2, 32]", arg4_1: "f32[2]"):
        unshard_default = torch.ops.graphshard.unshard.default([arg0_1], ['fc1.weight']);  arg0_1 = None
        getitem: "f32[32, 16]" = unshard_default[0];  unshard_default = None
        unshard_default_1 = torch.ops.graphshard.unshard.default([arg1_1], ['fc1.bias']);  arg1_1 = None
        getitem_1: "f32[32]" = unshard_default_1[0];  unshard_default_1 = None
        t: "f32[16, 32]" = torch.ops.aten.t.default(getitem);  getitem = None
        addmm: "f32[4, 32]" = torch.ops.aten.addmm.default(getitem_1, arg2_1, t);  getitem_1 = arg2_1 = t = None
        gelu: "f32[4, 32]" = torch.ops.aten.gelu.default(addmm);  addmm = None
        unshard_default_2 = torch.ops.graphshard.unshard.default([arg3_1], ['fc2.weight']);  arg3_1 = None
        getitem_2: "f32[8, 32]" = unshard_default_2[0];  unshard_default_2 = None
        unshard_default_3 = torch.ops.graphshard.unshard.default([arg4_1], ['fc2.bias']);  arg4_1 = None
        getitem_3: "f32[8]" = unshard_default_3[0];  unshard_default_3 = None
        t_1: "f32[32, 8]" = torch.ops.aten.t.default(getitem_2);  getitem_2 = None
        addmm_1: "f32[4, 8]" = torch.ops.aten.addmm.default(getitem_3, gelu, t_1);  getitem_3 = gelu = t_1 = None
        return (addmm_1,)
""")

    def test_replicated_input_of_sharded_op_gets_grad_all_reduce(self):
        # The input x of the column-parallel fc1 comes from a parameter-dependent value
        # (a replicated pre-layer), so its gradient from fc1 is partial: all-reduced in backward.
        class Pre(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.pre = torch.nn.Linear(16, 16)
                self.mlp = mlp()

            def forward(self, x):
                return self.mlp(self.pre(x))

        from torch.distributed.tensor import Shard

        plan = graphshard.Plan(tp_mlp_plan().mesh, {
            "mlp.fc1": graphshard.ShardParams("tp", weight=Shard(0), bias=Shard(0)),
            "mlp.fc2": graphshard.ShardParams("tp", weight=Shard(1)),
        })
        torch.manual_seed(0)
        text = graph_after(Pre(), plan, (torch.randn(4, 16),), "insert_collectives")
        self.assertEqual(text.count("graphshard.grad_all_reduce"), 1)
        self.assertExpectedInline(text, """\
class <lambda>(torch.nn.Module):
    def forward(self, arg0_1: "f32[16, 16]", arg1_1: "f32[16]", arg2_1: "f32[4, 16]", arg3_1: "f32[8, 16]", arg4_1: "f32[8]", arg5_1: "f32[8, 8]", arg6_1: "f32[8]"):
        to_partial_default: "f32[8]" = torch.ops.graphshard.to_partial.default(arg6_1, 0);  arg6_1 = None
        t: "f32[16, 16]" = torch.ops.aten.t.default(arg0_1);  arg0_1 = None
        addmm: "f32[4, 16]" = torch.ops.aten.addmm.default(arg1_1, arg2_1, t);  arg1_1 = arg2_1 = t = None
        grad_all_reduce_default: "f32[4, 16]" = torch.ops.graphshard.grad_all_reduce.default(addmm, 'tp', 4);  addmm = None
        alias_default: "f32[32, 16]" = torch.ops.aten.alias.default(arg3_1);  arg3_1 = None
        alias_default_1: "f32[32]" = torch.ops.aten.alias.default(arg4_1);  arg4_1 = None
        t_1: "f32[16, 32]" = torch.ops.aten.t.default(alias_default);  alias_default = None
        addmm_1: "f32[4, 32]" = torch.ops.aten.addmm.default(alias_default_1, grad_all_reduce_default, t_1);  alias_default_1 = grad_all_reduce_default = t_1 = None
        gelu: "f32[4, 32]" = torch.ops.aten.gelu.default(addmm_1);  addmm_1 = None
        alias_default_2: "f32[8, 32]" = torch.ops.aten.alias.default(arg5_1);  arg5_1 = None
        t_2: "f32[32, 8]" = torch.ops.aten.t.default(alias_default_2);  alias_default_2 = None
        addmm_2: "f32[4, 8]" = torch.ops.aten.addmm.default(to_partial_default, gelu, t_2);  to_partial_default = gelu = t_2 = None
        all_reduce_default: "f32[4, 8]" = torch.ops.graphshard.all_reduce.default(addmm_2, 'tp', 4);  addmm_2 = None
        return (all_reduce_default,)
""")

    def test_replicated_weight_of_sharded_heads_gets_grad_all_reduce_under_fullyshard(self):
        # q_norm.weight is replicated over "tp" but scales head-sharded values: each tp rank's
        # gradient is a partial sum and must be all-reduced over "tp", also when FullyShard has
        # replaced its marker by a data-parallel gather (it was left partial: Qwen3 under FSDP + TP).
        model, plan = fsdp_tp_qnorm()
        text = graph_after(model, plan, (torch.randn(2, 8, 16),), "insert_collectives")
        gathered = next(l.split(":")[0].strip() for l in text.splitlines() if "unshard_default_1[0]" in l)
        self.assertIn(f"graphshard.grad_all_reduce.default({gathered}, 'tp', 2)", text)


def _units_of(order: list[str], kind: str) -> list[str]:
    return [e[len(kind) + 1:-1] for e in order if e.startswith(kind + "(")]


def test_one_all_gather_and_one_reduce_scatter_per_unit_at_any_depth():
    # FSDP's invariant, not a count read off a golden graph: each unit is gathered once in the
    # forward; in the backward each unit's gradient is reduce-scattered once and each unit resharded
    # after forward is gathered again once (the root is not resharded: it keeps its gather).
    from torch.distributed.device_mesh import init_device_mesh

    from graphshard.testing.models import Transformer, TransformerConfig

    for depth in (2, 4):
        model = Transformer(TransformerConfig(vocab_size=32, dim=16, n_layers=depth, n_heads=2, max_seq_len=8))
        mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("dp",))
        spec = graphshard.FullyShard()
        graphshard.compile(model, graphshard.Plan(mesh, {"layers.*": spec, "": spec}), lower="eager")
        model(torch.randint(0, 32, (2, 8))).sum().backward()
        (report,) = model._graphshard.explain
        layers = [f"layers.{i}" for i in range(depth)]
        assert sorted(_units_of(report.order["forward"], "all_gather")) == sorted(["<root>", *layers]), depth
        assert sorted(_units_of(report.order["backward"], "reduce_scatter")) == sorted(["<root>", *layers]), depth
        assert sorted(_units_of(report.order["backward"], "all_gather")) == sorted(layers), depth
