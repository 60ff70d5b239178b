"""Trace once per distinct unit (graphshard.compiler.outline), on the fake process group.

The outlined graph aot_autograd traces (golden), and what must not change: the partitioned
forward and backward after the bodies are put back, which every later pass and the lowering
read. The 2-rank parity of training with it is in test_multirank.py (the ``transformer4``
cases) and the model-coverage suite (the ``deep`` cases: 4 blocks of each architecture)."""

import collections
import dataclasses
import math
import re

import pytest
import torch
from expecttest import TestCase

from _golden import capture_dynamo, compiled_stages
from _models import TINY, fsdp_plan, mesh1d, seeded
import graphshard
import graphshard.tensor_parallel as gtp
from graphshard.compiler.prepare import prepare, trace
from graphshard.compiler import outline
from graphshard.compiler.outline import outline_units
from graphshard.config import CompileConfig
from graphshard.passes.pipeline import pre_autograd_passes, run_passes
from graphshard.testing.models import Transformer, token_batch

DEEP = dataclasses.replace(TINY, n_layers=4)


def outlined_graph(model, plan, inputs):
    graphshard.shard(model, plan)
    gm, example_inputs = capture_dynamo(model, *inputs)
    prepared = trace(prepare(gm, example_inputs), CompileConfig(lower="eager"), (model._graphshard,))
    g = run_passes(prepared.graph, prepared.ctx, pre_autograd_passes())
    return g, outline_units(g, prepared.ctx.params, prepared.ctx.input_requires_grad)


def calls(g) -> str:
    """The outlined calls of ``g`` and what each reads, by position (the body's name for them)."""
    return "\n".join(f"{n.args[0].target}({len(n.args) - 2} inputs) -> {len(n.users)} outputs"
                     for n in g.graph.nodes if n.op == "call_function" and n.target is outline.call_body)


class TestOutline(TestCase):
    def test_repeated_blocks_share_one_body(self):
        x, _ = token_batch(0, 2, 8, 32)
        g, outlined = outlined_graph(seeded(Transformer, DEEP), fsdp_plan(), (x,))
        # the four blocks are one structure: layers.3's segment runs on into the tail, and its
        # beginning, the block, is the body too. The root's segment (the embeddings) is in line.
        self.assertEqual(outlined.describe(), "4 units traced as 1 body (layers.0 x4), 1 on their own")
        # each call reads its unit's 12 shards and the residual stream, and hands on the stream
        self.assertExpectedInline(calls(g), """\
_graphshard_unit_body_0(13 inputs) -> 1 outputs
_graphshard_unit_body_0(13 inputs) -> 1 outputs
_graphshard_unit_body_0(13 inputs) -> 1 outputs
_graphshard_unit_body_0(13 inputs) -> 1 outputs""")
        body = g.get_submodule("_graphshard_unit_body_0")
        ops = [str(n.target) for n in body.graph.nodes if n.op == "call_function"]
        self.assertEqual(ops[0], "graphshard.unshard.default")  # the unit's gather is in the body
        self.assertEqual(ops.count("graphshard.unshard.default"), 1)
        keys = next(n for n in body.graph.nodes if n.op == "call_function").args[1]
        self.assertTrue(all(k.split("/", 1)[1].startswith("layers.0.") for k in keys), keys)

    def test_dump_graphs_writes_the_outlined_graph(self):
        import glob
        import os
        import tempfile

        x, _ = token_batch(0, 2, 8, 32)
        model = seeded(Transformer, DEEP)
        with tempfile.TemporaryDirectory() as d:
            graphshard.compile(model, fsdp_plan(), lower="eager", dump_graphs=d, trace_once=True)
            model(x).sum().backward()
            files = glob.glob(os.path.join(d, "g0_pre_autograd_*_outline_units_after.txt"))
            self.assertEqual(len(files), 1, sorted(os.listdir(d)))
            with open(files[0]) as f:
                text = f.read()
            calls_made = [line for line in text.splitlines() if "call_body(" in line]
            self.assertEqual(len(calls_made), 4, text[-3000:])  # the four blocks, each a call of the one body
            self.assertEqual(len({line.split("'")[1] for line in calls_made}), 1, calls_made)  # one identifier

    def test_partitioned_programs_keep_the_flat_ones_collectives_and_matmuls(self):
        # what aot_autograd hands on (forward and backward after the post-partition passes) has the
        # flat program's collectives in the same scheduled order, each annotated with its own unit
        # and region, and its matmuls. Not the same listing: a body computes the causal mask
        # itself (the flat trace computes it once for every layer), and its forward makes the
        # views of what it saves, which the flat backward makes.
        x, _ = token_batch(0, 2, 8, 32)
        flat = compiled_stages(seeded(Transformer, DEEP), fsdp_plan(), (x,), trace_once=False)
        once = compiled_stages(seeded(Transformer, DEEP), fsdp_plan(), (x,), trace_once=True)
        for stage in ("forward", "backward"):
            self.assertEqual(_skeleton(once[stage]), _skeleton(flat[stage]), stage)
        self.assertEqual(once["backward"].count("all_gather_into_tensor.default("), 4)  # FULL_SHARD re-gathers

    def test_an_hf_body_begins_with_its_norm_and_saves_as_the_flat_program(self):
        # HF Llama, no checkpointing: the nodes copied from dynamo's shared layer body carry no module
        # stack, so the block each was copied for (``BLOCK``) says that the norm's steps before the
        # layer's gather are the layer's (`outline._begin_at_blocks`). Cut at the gather, each body
        # handed the next layer's normalized input on, and each call kept it beside the layer output
        # it is made from: one activation a layer more than the flat program saves
        pytest.importorskip("transformers")
        import workers.hf_archs as hf_archs

        def build():
            return hf_archs.build("llama", layers=4)

        ids = hf_archs.batch("llama", 0, 2)["input_ids"]
        (flat, _), (once, notes) = (_hf_saved(build, ids, trace_once) for trace_once in (False, True))
        self.assertEqual(notes, ["trace once: 4 units traced as 1 body (model.layers.0 x4), 1 on their own"])
        # a value a layer hands on is f32[2, 8, 32] (or its f32[16, 32] view); the calls save as many
        # of them as the flat program, and the attention's tensors too (2 * 4 * 8 * 8 = 512 elements)
        activation = 2 * 8 * 32
        self.assertEqual(_elements(once, activation), _elements(flat, activation))
        self.assertEqual(_elements(flat, activation), 30 * activation)
        # the rotary cos and sin: the flat program saves their common argument and recomputes both,
        # the calls read both as inputs (one of each for all calls)
        self.assertEqual((flat["f32[1, 8, 8]"], once["f32[1, 8, 8]"]), (1, 2))

    def test_a_value_every_call_makes_alike_is_made_once(self):
        # HF Llama as the benchmark builds it (sdpa, no cache, training): each layer turns the boolean
        # mask the model makes once into the float mask its attention adds (``where``). The flat trace's
        # CSE makes it once; each call of a body made its own and kept it for its backward, until
        # `outline._hoist_shared` made it once before the calls
        transformers = pytest.importorskip("transformers")

        def build():
            cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=128, num_hidden_layers=4,
                                           num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=8,
                                           tie_word_embeddings=False, use_cache=False)
            cfg._attn_implementation = "sdpa"
            return transformers.LlamaForCausalLM(cfg)

        ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
        (flat, _), (once, notes) = (_hf_saved(build, ids, trace_once) for trace_once in (False, True))
        self.assertEqual((flat["f32[2, 1, 8, 8]"], once["f32[2, 1, 8, 8]"]), (1, 1))  # 4 calls kept 4
        self.assertEqual(notes, ["trace once: 4 units traced as 1 body (model.layers.0 x4), 1 on their own; "
                                 "1 value(s) every call reads made once before the calls"])
        activation = 2 * 8 * 32
        self.assertEqual(_elements(once, activation), _elements(flat, activation))

    def test_units_of_different_shapes_are_not_shared(self):
        x, _ = token_batch(0, 2, 8, 32)
        model = seeded(Transformer, DEEP)
        model.layers[1].ffn.w1 = torch.nn.Linear(16, 32)  # its own structure now
        model.layers[1].ffn.w2 = torch.nn.Linear(32, 16)
        _, outlined = outlined_graph(model, fsdp_plan(), (x,))
        # layers 0, 2 and 3 (its beginning) still share a body; layers.1 is traced on its own, as is the root
        self.assertEqual(outlined.describe(), "3 units traced as 1 body (layers.0 x3), 2 on their own")
        self.assertEqual([c.units for c in outlined.calls], [["layers.0"], ["layers.2"], ["layers.3"]])

    def test_a_block_that_shares_its_beginning_empties_its_group(self):
        # layers.2 is a block and one step more, so its beginning joins the body and its own group is
        # left empty; layers.3, of other shapes, then looked through the groups for a body to share
        # its beginning with and indexed the empty one (an IndexError, on SmolLM3, whose fourth layer
        # skips the rotary embedding)
        x, _ = token_batch(0, 2, 8, 32)
        model = seeded(Transformer, DEEP)
        model.layers[2] = _Doubled(model.layers[2])
        model.layers[3].ffn.w1 = torch.nn.Linear(16, 32)
        model.layers[3].ffn.w2 = torch.nn.Linear(32, 16)
        _, outlined = outlined_graph(model, fsdp_plan(), (x,))
        self.assertEqual(outlined.describe(), "3 units traced as 1 body (layers.0 x3), 2 on their own")
        self.assertEqual([c.units for c in outlined.calls], [["layers.0"], ["layers.1"], ["layers.2"]])

    def test_two_bodies_where_one_reads_the_others_output(self):
        # units at two linears of each block (FSDP1's per-module wrapping does this): the w1 units'
        # body reads the residual stream the wq units' calls now give. It is built from what its
        # nodes read after the first group's segments became calls (it failed with a KeyError).
        x, _ = token_batch(0, 2, 8, 32)
        plan = graphshard.Plan(fsdp_plan().mesh, {"layers.*.attn.wq": graphshard.FullyShard(),
                                                   "layers.*.ffn.w1": graphshard.FullyShard(),
                                                   "": graphshard.FullyShard()})
        g, outlined = outlined_graph(seeded(Transformer, DEEP), plan, (x,))
        self.assertEqual(outlined.describe(),
                         "7 units traced as 2 bodies (layers.0.attn.wq x4, layers.0.ffn.w1 x3), 2 on their own")
        self.assertExpectedInline(calls(g), """\
_graphshard_unit_body_0(8 inputs) -> 2 outputs
_graphshard_unit_body_1(8 inputs) -> 2 outputs
_graphshard_unit_body_0(8 inputs) -> 2 outputs
_graphshard_unit_body_1(8 inputs) -> 2 outputs
_graphshard_unit_body_0(8 inputs) -> 2 outputs
_graphshard_unit_body_1(8 inputs) -> 2 outputs
_graphshard_unit_body_0(8 inputs) -> 2 outputs""")
        g.graph.lint()
        for name in outlined.bodies:
            g.get_submodule(name).graph.lint()

    def test_tensor_parallel_blocks_are_cut_at_dynamos_blocks(self):
        # tensor parallelism alone gathers no unit, so outline cuts before each block's first node
        # (the trace to ATen marks what it copied from a block's shared body). The partitioned
        # programs keep the flat ones' collectives in their order, and their matmuls.
        x, _ = token_batch(0, 2, 8, 32)
        flat = compiled_stages(seeded(Transformer, DEEP), _tp_plan(), (x,), trace_once=False)
        model = seeded(Transformer, DEEP)
        once = compiled_stages(model, _tp_plan(), (x,), trace_once=True)
        notes = [n for r in model._graphshard.explain for n in r.notes if n.startswith("trace once")]
        self.assertEqual(notes, ["trace once: 4 units traced as 1 body (layers.0 x4), 0 on their own"])
        for stage in ("forward", "backward"):
            self.assertEqual(_skeleton(once[stage]), _skeleton(flat[stage]), stage)
        self.assertEqual(once["forward"].count("graphshard.all_reduce.default(") + once["forward"].count(
            "_c10d_functional.all_reduce.default("), 8)  # each block's two row-parallel outputs


def _hf_saved(build, ids, trace_once: bool) -> tuple[collections.Counter, list[str]]:
    """What an HF causal LM's compiled forward keeps for its backward (shape string -> count), each
    ``model.layers`` block and the root a unit, and ``explain``'s trace-once note."""
    torch._dynamo.reset()
    model = seeded(build)
    plan = graphshard.Plan(mesh1d("dp"), {"model.layers.*": graphshard.FullyShard(), "": graphshard.FullyShard()})
    forward = compiled_stages(model, plan, (ids,), loss_fn=lambda out: out.logits.sum(), trace_once=trace_once)["forward"]
    shapes = dict(re.findall(r"^ +(\w+): \"([^\"]+)\" =", forward, re.M))
    returned = re.search(r"^ +return \((.*)\)$", forward, re.M).group(1).split(", ")
    notes = [n for n in model._graphshard.explain[0].notes if n.startswith("trace once")]
    return collections.Counter(shapes.get(n) for n in dict.fromkeys(returned)), notes


def _elements(saved: collections.Counter, numel: int) -> int:
    """The elements saved in tensors of ``numel`` elements (``saved``: shape string -> count)."""
    total = 0
    for shape, count in saved.items():
        dims = re.fullmatch(r"f32\[([\d, ]*)\]", shape or "")
        if dims and math.prod(int(d) for d in dims.group(1).split(", ") if d) == numel:
            total += numel * count
    return total


class _Doubled(torch.nn.Module):
    """A block whose output is doubled: the block's steps, then one more."""

    def __init__(self, block: torch.nn.Module):
        super().__init__()
        self.block = block

    def forward(self, x):
        return self.block(x) * 2


def _tp_plan():
    col, row = gtp.ColwiseParallel, gtp.RowwiseParallel
    return graphshard.Plan(mesh1d("tp"), {"layers.*.attn.wq": col(), "layers.*.attn.wk": col(), "layers.*.attn.wv": col(),
                                          "layers.*.attn.wo": row(), "layers.*.ffn.w1": col(), "layers.*.ffn.w2": row()})


_KEPT = re.compile(r"# Annotation|_c10d_functional|graphshard\.|aten\.(mm|addmm|bmm)\.")


def _collectives(text: str) -> list[str]:
    """A graph's collectives in order, without node names."""
    return [line for line in _skeleton(text) if "_c10d_functional" in line]


def _skeleton(text: str) -> list[str]:
    """A graph's annotations, collectives, graphshard ops and matmuls in order, without node names."""
    return [re.sub(r"(?<![.\w'])[a-z_]+(?:_\d+)?\b(?!['(.])", "v", line).strip()
            for line in text.splitlines() if _KEPT.search(line)]


class _Block(torch.nn.Module):
    def __init__(self, writes_input: bool):
        super().__init__()
        self.lin, self.writes_input = torch.nn.Linear(8, 8), writes_input

    def forward(self, x, total):
        y = self.lin(x)
        y.relu_()  # in place on the block's own value: functionalized inside a body like anywhere
        if self.writes_input:
            total.add_(y)  # writes a value made before the block: an input of its segment
        return y


class _Blocks(torch.nn.Module):
    def __init__(self, writes_input: bool):
        super().__init__()
        self.inp = torch.nn.Linear(8, 8)
        self.layers = torch.nn.ModuleList(_Block(writes_input) for _ in range(4))

    def forward(self, x):
        x = self.inp(x)
        total = torch.zeros_like(x)
        for layer in self.layers:
            x = layer(x, total)
        return x.sum() + total.sum()


class TestOutlineRefusals(TestCase):
    def test_in_place_on_own_values_is_outlined(self):
        _, outlined = outlined_graph(seeded(_Blocks, False), fsdp_plan(), (torch.randn(4, 8),))
        self.assertEqual(outlined.describe(), "4 units traced as 1 body (layers.0 x4), 1 on their own")

    def test_a_block_that_writes_its_input_is_traced_in_line(self):
        # invoke_subgraph refuses a body that mutates an input: such segments keep the flat trace
        _, outlined = outlined_graph(seeded(_Blocks, True), fsdp_plan(), (torch.randn(4, 8),))
        self.assertEqual(outlined.describe(), "no repeated units: 5 unit(s) traced on their own")


def _ac_plan(mode: str = "full"):
    return graphshard.Plan(fsdp_plan().mesh, fsdp_plan().rules,
                           checkpoint={"layers.*": graphshard.Checkpoint(mode=mode)})


# the last block stays in line: the tail would keep its output, which the flat partition recomputes
_AC_OUTLINED = ("trace once: 3 units traced as 1 body (layers.0 x3), 2 on their own; "
                "1 in line: the last checkpointed block, whose output the code after it would keep")


class TestCheckpointedBodies(TestCase):
    """Activation checkpointing in a shared body: the body's partition recomputes what the tags say,
    and what aot_autograd hands on matches the flat program's (the reference: ``trace_once=False``)."""

    def _both(self, mode: str):
        x, _ = token_batch(0, 2, 8, 32)
        flat_model, once_model = seeded(Transformer, DEEP), seeded(Transformer, DEEP)
        flat = compiled_stages(flat_model, _ac_plan(mode), (x,), trace_once=False)
        once = compiled_stages(once_model, _ac_plan(mode), (x,), trace_once=True)
        return (flat, flat_model._graphshard.explain[0]), (once, once_model._graphshard.explain[0])

    def test_full_checkpointing_is_outlined_and_recomputes_as_the_flat_program(self):
        (flat, flat_report), (once, once_report) = self._both("full")
        self.assertIn(_AC_OUTLINED, once_report.notes)
        for stage in ("forward", "backward"):
            # the collectives in the flat program's order, and as many matmuls (the recomputed ones too);
            # where a body's partition puts a recomputed op between them may differ from the flat one's
            self.assertEqual(_collectives(once[stage]), _collectives(flat[stage]), stage)
            self.assertEqual(once[stage].count("aten.mm.default("), flat[stage].count("aten.mm.default("), stage)
        self.assertEqual(once["backward"].count("all_gather_into_tensor.default("), 4)  # re-gathered, not saved
        self._same_account(flat_report.recompute, once_report.recompute)

    def test_selective_checkpointing_is_outlined_and_saves_as_the_flat_program(self):
        (flat, flat_report), (once, once_report) = self._both("selective")
        self.assertIn(_AC_OUTLINED, once_report.notes)
        for stage in ("forward", "backward"):
            self.assertEqual(_skeleton(once[stage]), _skeleton(flat[stage]), stage)
        self._same_account(flat_report.recompute, once_report.recompute)

    def _same_account(self, flat: dict, once: dict):
        # explain's account: every block's region named by its own module, the saved bytes with and
        # without checkpointing, and recomputation in every region
        self.assertEqual(list(once["per_region"]), [f"layers.{i}" for i in range(4)])
        self.assertEqual(list(once["per_region"]), list(flat["per_region"]))
        self.assertTrue(all(sum(ops.values()) > 0 for ops in once["per_region"].values()), once)
        self.assertEqual(once["regions"], 4)
        # the flat trace computes the causal mask (f32[8, 8]) once for every block and may save it; a
        # body computes its own, so the two accounts may differ by that mask and nothing else
        mask = 8 * 8 * 4
        self.assertLessEqual(abs(once["saved_bytes"] - flat["saved_bytes"]), mask)
        self.assertLessEqual(abs(once["saved_bytes_without_ac"] - flat["saved_bytes_without_ac"]), mask)

    def test_hf_gradient_checkpointing_saves_as_the_flat_program(self):
        # HF's own switch on a 4-layer Llama: each layer's checkpoint body calls the one region body
        # dynamo traced in layers.0, whose nodes name layers.0's modules; they are pointed at their own
        # layer (`regions.traced_at`), so each layer's region and unit segment is its own. A segment
        # begins with its layer's first node, the norm's steps before its weight included
        # (`outline._begin_at_blocks`): cut at the gather, every call kept the next layer's normalized
        # input, one activation a layer more than the flat program (2 KiB each here)
        pytest.importorskip("transformers")
        import workers.hf_archs as hf_archs

        def compiled(trace_once: bool):
            torch._dynamo.reset()
            model = hf_archs.build("llama", layers=4)
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            model.config.use_cache = False
            units = {fqn: graphshard.FullyShard() for fqn in ["", *hf_archs.unit_fqns(model)]}
            graphshard.compile(model, graphshard.Plan(mesh1d("dp"), units), lower="eager", trace_once=trace_once)
            hf_archs.loss_of(model(**hf_archs.batch("llama", 0, 2))).backward()
            return model._graphshard.explain[0]

        flat, once = compiled(False), compiled(True)
        self.assertIn("trace once: 3 units traced as 1 body (model.layers.0 x3), 2 on their own; 1 in line: "
                      "the last checkpointed block, whose output the code after it would keep", once.notes)
        layers = [f"model.layers.{i}" for i in range(4)]
        self.assertEqual(list(flat.recompute["per_region"]), layers)
        self.assertEqual(list(once.recompute["per_region"]), layers)
        activation = 2 * 8 * 32 * 4  # f32[2, 8, 32]: what the layers hand on
        # the masks differ (a body makes its own from the boolean one), never by an activation
        self.assertLess(abs(once.recompute["saved_bytes"] - flat.recompute["saved_bytes"]), activation)

    def test_a_saved_generator_state_has_its_size(self):
        # attention is tagged random whatever its dropout, so the partitioner saves the CPU generator's
        # state around its recomputation; in a body that state came out with a symbolic size, which
        # sent the backward to Inductor whole, as a dynamic-shape graph (`outline.concrete_rng_states`)
        model, flat_model = seeded(_AttentionBlocks), seeded(_AttentionBlocks)
        g = compiled_stages(model, _ac_plan(), (torch.randn(2, 8, 16),), trace_once=True)
        compiled_stages(flat_model, _ac_plan(), (torch.randn(2, 8, 16),), trace_once=False)
        # layers.0's segment also holds the head's gather (the root's unit), so it is traced on its own;
        # the head (the root's segment, in line) reads layers.3's output, so layers.3 stays in line too
        self.assertIn("trace once: 2 units traced as 1 body (layers.1 x2), 3 on their own; 1 in line: "
                      "the last checkpointed block, whose output the code after it would keep",
                      model._graphshard.explain[0].notes)
        # and the forward saves what the flat one saves, to the byte (no mask here: the attention is causal)
        self.assertEqual(model._graphshard.explain[0].recompute["saved_bytes"],
                         flat_model._graphshard.explain[0].recompute["saved_bytes"])
        self.assertEqual(g["backward"].count("run_with_rng_state("), 4)
        self.assertNotRegex(g["backward"], r'"u8\[s\d+\]"')
        self.assertEqual(len(re.findall(r': "u8\[\d+\]"', g["backward"].split("\n")[1])), 4)  # the inputs


class _Attention(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv, self.out = torch.nn.Linear(16, 48, bias=False), torch.nn.Linear(16, 16, bias=False)

    def forward(self, x):
        q, k, v = (t.unflatten(-1, (2, 8)).transpose(1, 2) for t in self.qkv(x).chunk(3, dim=-1))
        a = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.out(a.transpose(1, 2).flatten(2))


class _AttentionBlocks(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(_Attention() for _ in range(4))
        self.head = torch.nn.Linear(16, 16)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.head(x)
