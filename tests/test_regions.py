"""Dynamo traces each distinct repeated unit once (graphshard.compiler.regions), on the fake
process group.

The reference is the flat trace: with the repeated blocks marked, dynamo hands over one body
called once per block, and once the backend has inlined the calls and put back each marker's key,
the program the passes see is the flat trace's, node for node. The 2-rank parity of training with
it is in test_multirank.py (every FSDP case marks its blocks) and the model-coverage suite."""

import dataclasses
import re

import pytest
import torch
from expecttest import TestCase
from torch.distributed.device_mesh import init_device_mesh

from _golden import capture_dynamo, render
from _models import TINY, fsdp_plan, seeded
import graphshard
from graphshard import _compat
from graphshard.compiler import regions
from graphshard.compiler.prepare import prepare, trace
from graphshard.config import CompileConfig
from graphshard.passes.tag_recomputation import module_of
from graphshard.testing.models import Block, Transformer, token_batch

DEEP = dataclasses.replace(TINY, n_layers=4)

pytestmark = pytest.mark.skipif(not _compat.HAS_INVOKE_SUBGRAPH, reason="dynamo's subgraph reuse needs torch 2.13")


def sharded(model, plan, mark: bool):
    graphshard.shard(model, plan)
    notes = regions.mark_repeated_units(model, model._graphshard).lines if mark else []
    return model, notes


def calls(gm) -> str:
    """The dynamo graph's ``invoke_subgraph`` calls: body, identifier, operand count."""
    hop = _compat.invoke_subgraph_op()
    return "\n".join(f"{n.args[0].target} {n.args[1]}({len(n.args) - 2} operands)"
                     for n in gm.graph.nodes if n.op == "call_function" and n.target is hop)


def traced(model, plan, x) -> tuple[str, object]:
    """The logical ATen program the passes get (``prepare``, ``trace``), rendered, and its context."""
    gm, example_inputs = capture_dynamo(model, x)
    prepared = trace(prepare(gm, example_inputs), CompileConfig(lower="eager"), (model._graphshard,))
    return render(prepared.graph, plan), prepared


class TestRegions(TestCase):
    def test_dynamo_traces_one_block_for_four(self):
        x, _ = token_batch(0, 2, 8, 32)
        model, notes = sharded(seeded(Transformer, DEEP), fsdp_plan(), mark=True)
        self.assertEqual(notes, ["layers.0 x4: dynamo traces one and reuses its trace where its guards hold"])
        gm, _ = capture_dynamo(model, x)
        # one body, called with each block's 12 parameters and the residual stream
        self.assertExpectedInline(calls(gm), """\
subgraph_0 subgraph_0(13 operands)
subgraph_0 subgraph_0(13 operands)
subgraph_0 subgraph_0(13 operands)
subgraph_0 subgraph_0(13 operands)""")
        # the body names no block: its markers carry the model's key only
        body = gm.get_submodule("subgraph_0")
        keys = {n.args[1] for n in body.graph.nodes if n.op == "call_function" and "graphshard.param" in str(n.target)}
        self.assertEqual(keys, {f"m{model._graphshard.model_id}/?"})

    def test_the_passes_get_the_flat_trace(self):
        x, _ = token_batch(0, 2, 8, 32)
        plan = fsdp_plan()
        flat, flat_ctx = traced(*sharded(seeded(Transformer, DEEP), plan, mark=False)[:1], plan, x)
        model, _ = sharded(seeded(Transformer, DEEP), plan, mark=True)
        marked, ctx = traced(model, plan, x)
        self.assertEqual(ctx.ctx.report.dynamo_bodies, (4, 1, 1))  # the body traced to ATen once
        self.assertEqual(flat_ctx.ctx.report.dynamo_bodies, (0, 0, 0))
        # node for node, each marker with its own parameter's key (keys render as FQNs)
        self.assertEqual(_without_model_id(marked), _without_model_id(flat))
        fqns = [n.args[1].split("/", 1)[1] for n in ctx.graph.graph.nodes
                if n.op == "call_function" and n.target is torch.ops.graphshard.param.default]
        self.assertEqual(fqns[2:14:11], ["layers.0.attn_norm.weight", "layers.0.ffn.w2.bias"])
        self.assertEqual(sorted(fqns), sorted(info.fqn for info in model._graphshard.params.values()
                                              for _ in range(fqns.count(info.fqn))))
        self.assertEqual(len({f for f in fqns if f.startswith("layers.")}), 4 * 12)

    def test_checkpointed_blocks_get_the_flat_trace(self):
        # torch's apply_activation_checkpointing: each block a CheckpointWrapper, whose body dynamo
        # records as tag_activation_checkpoint inside the region body; the DTensor boundary is
        # followed through both, and the body is traced to ATen once
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing

        x, _ = token_batch(0, 2, 8, 32)
        plan = fsdp_plan()

        def model():
            m = seeded(Transformer, DEEP)
            apply_activation_checkpointing(m, check_fn=lambda mod: isinstance(mod, Block))
            return m

        flat, flat_ctx = traced(sharded(model(), plan, mark=False)[0], plan, x)
        marked_model, notes = sharded(model(), plan, mark=True)
        self.assertEqual(notes, ["layers.0 x4: dynamo traces one and reuses its trace where its guards hold"])
        marked, ctx = traced(marked_model, plan, x)
        self.assertEqual(ctx.ctx.report.dynamo_bodies, (4, 1, 1))
        self.assertEqual(_without_model_id(marked), _without_model_id(flat))
        # each copy names its own block's modules (explain and the checkpoint regions read them)
        modules = [[module_of(n) for n in p.graph.graph.nodes] for p in (ctx, flat_ctx)]
        self.assertEqual(modules[0], modules[1])
        self.assertEqual(len({m.split(".")[1] for m in modules[0] if m and m.startswith("layers.")}), 4)

    def test_a_block_that_differs_is_traced_again(self):
        x, _ = token_batch(0, 2, 8, 32)
        model = seeded(Transformer, DEEP)
        model.layers[2].ffn.w1 = torch.nn.Linear(16, 24)  # its own shapes: the body's guards fail there
        model.layers[2].ffn.w2 = torch.nn.Linear(24, 16)
        model, _ = sharded(model, fsdp_plan(), mark=True)
        gm, _ = capture_dynamo(model, x)
        bodies = [line.split()[0] for line in calls(gm).splitlines()]
        self.assertEqual(len(bodies), 3)  # dynamo inlines a body called once
        self.assertEqual(len(set(bodies)), 1)
        _, ctx = traced(model, fsdp_plan(), x)
        self.assertEqual(ctx.ctx.report.dynamo_bodies, (3, 1, 1))

    def test_units_left_unmarked_say_why(self):
        flat, notes = sharded(seeded(Transformer, DEEP), fsdp_plan(flat_params=True), mark=True)
        self.assertEqual(notes, ["layers.0 x4: dynamo traces each (its parameters live in a flat parameter)"])
        self.assertIs(type(flat.layers[0]), Block)
        plan = graphshard.Plan(fsdp_plan().mesh, {"layers.*": graphshard.FullyShard(), "": graphshard.FullyShard()},
                               checkpoint={"layers.*": graphshard.Checkpoint()})
        _, notes = sharded(seeded(Transformer, DEEP), plan, mark=True)
        self.assertEqual(notes, ["layers.0 x4: dynamo traces each (graphshard wraps its forward (a plan's "
                                 "Checkpoint, or the root))"])

    def test_tensor_parallel_blocks_get_the_flat_trace(self):
        # FSDP + TP: the declared layouts inside each block are traced without their module, so
        # dynamo shares one body; the trace to ATen names each copy's layouts after its own block
        self._tensor_parallel_blocks(two_d=True)

    def test_tensor_parallel_alone_marks_the_blocks(self):
        # no data-parallel units: the blocks of the ModuleList are the units marked
        self._tensor_parallel_blocks(two_d=False)

    def test_checkpointed_tensor_parallel_blocks_name_their_layouts(self):
        # torch's apply_activation_checkpointing: the layouts sit in a checkpoint's body, which
        # its own operator traces to ATen; they are named before the trace
        self._tensor_parallel_blocks(two_d=True, checkpoint=True)

    def _tensor_parallel_blocks(self, two_d: bool, checkpoint: bool = False):
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing
        from graphshard.tensor_parallel import ColwiseParallel, RowwiseParallel

        x, _ = token_batch(0, 2, 8, 32)
        mesh = init_device_mesh("cpu", (2, 2) if two_d else (4,), mesh_dim_names=("dp", "tp") if two_d else ("tp",))
        ffn = "_checkpoint_wrapped_module.ffn" if checkpoint else "ffn"

        def plan():
            fsdp = {"layers.*": graphshard.FullyShard(), "": graphshard.FullyShard()} if two_d else {}
            return graphshard.Plan(mesh, {f"layers.*.{ffn}.w1": ColwiseParallel(),
                                          f"layers.*.{ffn}.w2": RowwiseParallel(), **fsdp})

        def model():
            m = seeded(Transformer, DEEP)
            if checkpoint:
                apply_activation_checkpointing(m, check_fn=lambda mod: isinstance(mod, Block))
            return m

        flat, flat_ctx = traced(sharded(model(), plan(), mark=False)[0], plan(), x)
        model, notes = sharded(model(), plan(), mark=True)
        self.assertEqual(notes, ["layers.0 x4: dynamo traces one and reuses its trace where its guards hold"])
        gm, _ = capture_dynamo(model, x)
        places = [n.args[1] for g in gm.get_submodule("subgraph_0").modules() if isinstance(g, torch.fx.GraphModule)
                  for n in g.graph.nodes if n.op == "call_function" and "graphshard.layout" in str(n.target)]
        self.assertEqual(set(places), {f"m{model._graphshard.model_id}/?:{p}" for p in ("in0", "out0")})
        marked, ctx = traced(model, plan(), x)
        self.assertEqual(ctx.ctx.report.dynamo_bodies, (4, 1, 1))
        self.assertEqual(_without_model_id(marked), _without_model_id(flat))
        layouts = [n.args[1].split("/", 1)[1] for n in ctx.graph.graph.nodes
                   if n.op == "call_function" and n.target is torch.ops.graphshard.layout.default]
        self.assertEqual(layouts, [f"layers.{i}.{ffn}.{w}:{p}" for i in range(4)
                                   for w, p in (("w1", "in0"), ("w1", "out0"), ("w2", "in0"), ("w2", "out0"))])

    def test_the_users_class_is_left_alone(self):
        model, _ = sharded(seeded(Transformer, DEEP), fsdp_plan(), mark=True)
        self.assertIsNot(type(model.layers[0]), Block)
        self.assertTrue(isinstance(model.layers[0], Block))
        self.assertFalse(hasattr(Block.forward, "__marked_compile_region_fn__"))
        self.assertIs(type(seeded(Transformer, DEEP).layers[0]), Block)


class KeepsInput(Block):
    """A block that keeps a view of its input for later (as some HF attention layers do): dynamo
    refuses to capture it as a region."""

    def forward(self, x):
        self.kept.append(x.to(x.dtype))
        return super().forward(x)


@pytest.mark.usefixtures("fake_collective_outputs")  # the call runs
def test_a_region_dynamo_cannot_capture_is_unmarked_and_traced_flat(caplog):
    model = seeded(Transformer, DEEP)
    for layer in model.layers:
        layer.__class__, layer.kept = KeepsInput, []
    graphshard.compile(model, fsdp_plan(), lower="eager")
    assert type(model.layers[0]) is not KeepsInput  # marked
    x, _ = token_batch(0, 2, 8, 32)
    with caplog.at_level("WARNING", logger="graphshard"):
        out = model(x)
    assert out.shape == (2, 8, 32) and torch.isfinite(out).all()
    assert all(type(layer) is KeepsInput for layer in model.layers)  # the user's class back
    assert len(model.layers[3].kept) == 1  # the blocks ran once
    text = graphshard.explain(model)
    line = "dynamo traces every block: it could not capture a marked region whole (InternalTorchDynamoError: "
    assert line in text and "graphshard unmarked the units and traced the call again" in text, text
    assert any(line in r.getMessage() for r in caplog.records)
    assert "trace once: 4 units traced as 1 body (layers.0 x4), 1 on their own" in text  # outline still shares them


def _without_model_id(text: str) -> str:
    """The rendered graph without its model's id, and checkpoint regions numbered by first
    appearance (torch numbers them from a process-wide counter)."""
    numbers: dict[str, str] = {}
    text = re.sub(r"ac_graph_id: (\d+)", lambda m: f"ac_graph_id: {numbers.setdefault(m[1], str(len(numbers) + 1))}", text)
    return re.sub(r"m\d+/", "m/", text)
