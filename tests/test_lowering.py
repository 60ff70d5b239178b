import glob
import os
import tempfile

import torch
from expecttest import TestCase

import graphshard
from _models import fsdp_plan, seeded, stack
from graphshard import _compat
from graphshard.compiler.lowering import InPlaceGather, is_communication, lower_regions, split_regions, whole_graph_reason
from graphshard.testing.models import Transformer, TransformerConfig, lm_loss, token_batch


FLAT = dict(trace_once=False)
"""The listings here are the flat trace's: a body partitioned on its own saves other values than
the flat partition of the same layer (a relu's mask in its forward), so its regions cut
differently. What trace once must keep, compiles that do not grow with depth, is checked with it."""


def _lowered(model, **kwargs) -> dict[str, str]:
    """Compiles with Inductor (regional lowering), runs a step, returns the program listings."""
    with tempfile.TemporaryDirectory() as d:
        graphshard.compile(model, fsdp_plan(), lower="inductor", dump_graphs=d, **{**FLAT, **kwargs})
        model(torch.randn(4, 8)).sum().backward()
        out = {}
        for stage in ("forward", "backward"):
            (path,) = glob.glob(os.path.join(d, f"g*_{stage}_regions.txt"))
            with open(path) as f:
                out[stage] = f.read()
        return out


class DeepStack(torch.nn.Module):
    """``depth`` identical layers, each its own unit, scaled by a constant that every layer reads
    (as attention layers read one mask)."""

    def __init__(self, depth: int = 6):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(8, 8, bias=False) for _ in range(depth))

    def forward(self, x):
        scale = torch.full((8,), 0.5)
        for layer in self.layers:
            x = torch.relu(layer(x)) * scale
        return x


class TailStack(torch.nn.Module):
    """Four identical pre-norm residual layers, each region ending in the next layer's norm;
    after the last, a tail that follows with no communication between (as a transformer's
    output head follows its final norm), then a root-owned gain (whose all-gather's wait
    comes at its first use)."""

    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(8, 8, bias=False) for _ in range(4))
        self.gain = torch.nn.Parameter(torch.linspace(0.5, 1.5, 8))

    def forward(self, x):
        h = torch.nn.functional.layer_norm(x, (8,))
        for layer in self.layers:
            x = x + torch.relu(layer(h))
            h = torch.nn.functional.layer_norm(x, (8,))
        y = torch.tanh(h) - 0.5 * h
        return (y * self.gain).sum(-1)


class TestRegionalLowering(TestCase):
    def test_programs(self):
        # Communication runs between regions in the scheduled order. A region with one op
        # Inductor would generate (mm + relu) runs as ATen calls; the backward regions remake
        # the constant they read. One compile serves both listings.
        listing = _lowered(stack())
        self.assertExpectedInline(listing["forward"], """\
pack (in place)
all_gather_into_tensor (in place)
wait_tensor
pack (in place)
all_gather_into_tensor (in place)
unpack
getitem 0
eager(2 in, 1 out): mm, relu
wait_tensor
pack (in place)
all_gather_into_tensor (in place)
unpack
getitem 0
eager(2 in, 1 out): mm, relu
wait_tensor
unpack
getitem 0
region r0(2 in, 2 out): mm, relu, le
""")
        self.assertExpectedInline(listing["backward"], """\
pack (in place)
all_gather_into_tensor (in place)
region r0(3 in, 2 out): full, where, mm
wait_tensor
pack (in place)
all_gather_into_tensor (in place)
pack_grads
reduce_scatter_tensor
unpack
getitem 0
region r1(4 in, 2 out): full, mm, le, where, mm
pack_grads
reduce_scatter_tensor
wait_tensor
unpack_reduced
getitem 0
eager(1 in, 1 out): views
wait_tensor
unpack
getitem 0
region r1(4 in, 2 out, 1 unread): full, mm, le, where, mm
pack_grads
reduce_scatter_tensor
wait_tensor
unpack_reduced
getitem 0
eager(1 in, 1 out): views
wait_tensor
unpack_reduced
getitem 0
eager(1 in, 1 out): views
""")

    def test_in_place_gather_packs_into_this_ranks_slot(self):
        # NCCL gathers in place only when the input is this rank's slot of the output; elsewhere
        # the other ranks' data overwrite the input while it is read. gloo copies through a
        # temporary either way, so the launch tests' parity cannot see a wrong slot: this can.
        group = torch.distributed.group.WORLD.group_name
        world = torch.distributed.get_world_size()
        self.assertEqual(InPlaceGather(world, group).rank(), torch.distributed.get_rank())
        xs, numels = [torch.arange(3.0), torch.arange(5.0) + 10], [4, 5]
        packed = torch.ops.graphshard.pack.default(xs, numels, torch.float32)
        for rank in range(world):
            run = InPlaceGather(world, group, rank)
            buf = run.pack(xs, numels, torch.float32)
            self.assertEqual(buf.shape, (world * 9,))
            torch.testing.assert_close(buf.narrow(0, rank * 9, 9), packed, rtol=0, atol=0)
            out = _compat.c10d.wait_tensor(run.gather(buf, world, group))
            self.assertEqual(out.data_ptr(), buf.data_ptr())  # gathered into the buffer itself

    def test_identical_layers_compile_once(self):
        # Every region remakes the shared constant instead of the first layer handing it on,
        # so the layers share one key. The relu masks that backward saves, which the
        # partitioner computes at the end of the graph, would make the last layer's region
        # differ; it is cut after the layer's own computation, and the masks are a region.
        # So: one region per layer plus the masks', and two compiled whatever the depth.
        counts, once = {}, {}
        for depth in (3, 6):
            for trace_once, out in ((False, counts), (True, once)):
                torch._dynamo.reset()
                model = seeded(DeepStack, depth)
                graphshard.compile(model, fsdp_plan(), lower="inductor", trace_once=trace_once)
                model(torch.randn(4, 8)).sum().backward()
                out[depth] = model._graphshard.explain[0].regions
        # traced once, the layers' bodies share regions as the flat trace's layers do
        for stage in ("forward", "backward"):
            self.assertEqual(once[3][stage]["compiled"], once[6][stage]["compiled"], stage)
        for depth, regions in counts.items():
            self.assertEqual(regions["forward"]["regions"], depth + 1)
            self.assertEqual(regions["forward"]["compiled"], 2)
            self.assertLess(regions["backward"]["compiled"], regions["backward"]["regions"])
        # the backward compiles as many regions at depth 6 as at 3, and each added layer adds
        # the same whole number of regions (its gradient's communication splits it)
        self.assertEqual(counts[3]["backward"]["compiled"], counts[6]["backward"]["compiled"])
        added = counts[6]["backward"]["regions"] - counts[3]["backward"]["regions"]
        self.assertTrue(added > 0 and added % 3 == 0, added)

    def test_last_layer_reuses_layer_region(self):
        # The last layer's region would run on into the tail; it is cut after the layer, so
        # all four layers share r1 and only the tail (r2) is new. The last layer's x, which
        # the layers hand on for the next residual add, has no reader there: the shared
        # region still returns it ("1 unread"), and the runner drops it at once.
        model = seeded(TailStack)
        with tempfile.TemporaryDirectory() as d:
            graphshard.compile(model, fsdp_plan(), lower="inductor", dump_graphs=d, **FLAT)
            model(torch.randn(4, 8)).sum().backward()
            (path,) = glob.glob(os.path.join(d, "g*_forward_regions.txt"))
            with open(path) as f:
                listing = f.read()
        regions = model._graphshard.explain[0].regions["forward"]
        self.assertEqual((regions["regions"], regions["compiled"]), (7, 4))
        self.assertExpectedInline("\n".join(line for line in listing.splitlines() if line.startswith("region")), """\
region r0(1 in, 1 out): var_mean, add, rsqrt, sub, mul
region r1(3 in, 4 out): mm, relu, add, var_mean, add, rsqrt, sub, mul
region r1(3 in, 4 out): mm, relu, add, var_mean, add, rsqrt, sub, mul
region r1(3 in, 4 out): mm, relu, add, var_mean, add, rsqrt, sub, mul
region r1(3 in, 4 out, 1 unread): mm, relu, add, var_mean, add, rsqrt, sub, mul
region r2(1 in, 1 out): tanh, mul, sub
region r3(10 in, 9 out): mul, sum, div, le, div, le, div, le, div, le""")

    def test_first_layer_shares_the_layers_backward_region(self):
        # The partitioner saves other values for the first layer's first norm (the two
        # embeddings, from which it recomputes the normalised input, where the other layers
        # save the normalised input itself), so the first layer's backward region differs
        # from the others' only in its last nodes. Both are cut after their common part,
        # which all layers share (r1); only the two short tails are compiled apart.
        model = seeded(Transformer, TransformerConfig(vocab_size=32, dim=16, n_layers=3, n_heads=4, max_seq_len=8))
        x, y = token_batch(0, 8, 8, 32)
        with tempfile.TemporaryDirectory() as d:
            graphshard.compile(model, fsdp_plan(), lower="inductor", dump_graphs=d, **FLAT)
            lm_loss(model(x), y).backward()
            (path,) = glob.glob(os.path.join(d, "g*_backward_regions.txt"))
            with open(path) as f:
                listing = f.read()
        self.assertExpectedInline("\n".join(line.split(":")[0] for line in listing.splitlines()
                                            if line.startswith("region")), """\
region r0(6 in, 5 out)
region r1(23 in, 15 out)
region r2(6 in, 3 out)
region r1(23 in, 15 out)
region r2(6 in, 3 out)
region r1(23 in, 15 out)
region r3(8 in, 3 out)
region r4(11 in, 8 out)""")

    def test_chain_of_views_into_a_collective_is_communication(self):
        # A shard reshaped twice before its all-gather: each view's test looked at the other
        # (the first at its users, the second at its inputs) and recursed without end.
        aten, c10d = torch.ops.aten, torch.ops._c10d_functional
        g = torch.fx.Graph()
        x = g.placeholder("x")
        flat = g.call_function(aten.view.default, (x, [-1]))
        rows = g.call_function(aten.view.default, (flat, [2, -1]))
        gathered = g.call_function(c10d.wait_tensor.default, (g.call_function(c10d.all_gather_into_tensor.default,
                                                                              (rows, 4, "0")),))
        y = g.call_function(aten.relu.default, (gathered,))
        g.output((y,))
        self.assertEqual([is_communication(n) for n in (flat, rows, y)], [True, True, False])
        steps = split_regions(g)
        self.assertEqual([s.nodes if not isinstance(s, torch.fx.Node) else s for s in steps][:4],
                         [flat, rows, gathered.args[0], gathered])
        self.assertEqual(steps[4].nodes, [y])

    def test_symbolic_shapes_lower_whole(self):
        # A region could use a size symbol that only another region's inputs bind.
        from torch.fx.experimental.symbolic_shapes import ShapeEnv

        g = torch.fx.Graph()
        x = g.placeholder("x")
        y = g.call_function(torch.ops.aten.relu.default, (x,))
        g.output((y,))
        x.meta["val"] = y.meta["val"] = torch.randn(3, 2)
        gm = torch.fx.GraphModule(torch.nn.Module(), g)
        self.assertIsNone(whole_graph_reason(gm))
        x.meta["val"] = ShapeEnv().create_unbacked_symint()
        self.assertEqual(whole_graph_reason(gm), "input x has symbolic sizes")


class _Step(torch.autograd.Function):
    """Identity forward; the backward passes the gradient through ``graphshard::pack`` (a
    local copy that regional lowering treats as a communication step, as it does the
    pack before a reduce-scatter), so the backward is several regions."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        return torch.ops.graphshard.pack([g], [g.numel()], g.dtype).view(g.shape)


def _three_regions(x, w):
    h = torch.tanh(x * w)
    a = _Step.apply(h)
    b = torch.sigmoid(a) * a
    c = _Step.apply(b)
    return (_Step.apply(torch.exp(c) * h).sum(),)


class TestRegionFacts(TestCase):
    def test_backward_regions_do_not_overwrite_their_inputs(self):
        # aot_autograd compiles the backward inside a context that lists the whole graph's
        # donated buffers (the saved activations: placeholders 2.. here). A region compiled
        # in that context took those positions for its own inputs, and Inductor wrote its
        # outputs into four of them; among them the saved tanh, which the last region reads
        # again (through the alias saved for tanh's own backward). Gradients were off by ~20.
        # Each region is compiled with its own facts: no input of a region is written, and
        # the gradients are eager's.
        writes = []

        def backward_compiler(gm, inputs):
            program, _, counts = lower_regions(gm, is_backward=True)
            assert counts["compiled"] == 3, counts
            steps = []
            for i, step in enumerate(program.program):
                if step[0] == "region":
                    kind, fn, ins, outs, dying = step

                    def checked(boxed, fn=fn, i=i):
                        before = [(t, t.clone()) for t in boxed]
                        out = fn(boxed)
                        writes.extend((i, j) for j, (t, c) in enumerate(before) if not torch.equal(t, c))
                        return out

                    step = (kind, checked, ins, outs, dying)
                steps.append(step)
            program.program = steps
            return program

        def backend(gm, inputs):
            return _compat.aot_module_simplified(gm, inputs, fw_compiler=_compat.boxed_nop, bw_compiler=backward_compiler,
                                                 decompositions=_compat.inductor_decompositions())

        torch.manual_seed(0)
        x, w = torch.randn(64, requires_grad=True), torch.randn(64, requires_grad=True)
        torch.compile(_three_regions, backend=backend)(x, w)[0].backward()
        got = x.grad, w.grad
        x.grad = w.grad = None
        _three_regions(x, w)[0].backward()
        self.assertEqual(writes, [])
        torch.testing.assert_close(got, (x.grad, w.grad))


def _all_reduced(fn, *inputs) -> tuple[str, set]:
    """``fn`` traced to ATen (its collectives on this process's fake group), cut into the regional
    program's steps: the program's listing and the all-reduces it runs in place."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from graphshard.compiler.lowering import RegionalProgram, in_place_all_reduces

    gm = make_fx(fn)(*inputs)
    steps = split_regions(gm.graph)
    reduced = in_place_all_reduces(gm.graph, steps)
    program = RegionalProgram(gm.graph, steps, {})
    return program.describe(), {n.args[0].name for n in reduced}


def _reduce(x):
    group = torch.distributed.group.WORLD.group_name
    return _compat.c10d.wait_tensor(_compat.c10d.all_reduce(x, "sum", group))


class TestInPlaceAllReduce(TestCase):
    # Tensor parallelism's reductions of partial sums: the functional all-reduce copies its input
    # into a new buffer, and Inductor's reinplacing, which would run it in place, sees no
    # collective inside a region. The regional program runs it in place where nothing reads the
    # input's buffer afterwards; the graph, the goldens and the collective check keep the
    # functional op.
    x, w = torch.randn(4, 8), torch.randn(8, 8)

    def test_a_partial_sum_nothing_reads_again_is_reduced_in_place(self):
        listing, reduced = _all_reduced(lambda x, w: _reduce(x @ w) + 1, self.x, self.w)
        self.assertEqual(reduced, {"mm"})
        self.assertExpectedInline(listing, """\
eager(2 in, 1 out): mm
all_reduce (in place)
wait_tensor
eager(1 in, 1 out): add""")

    def test_a_view_of_the_sum_reduced_in_place(self):
        # the reshape before the reduction is the same buffer: its base, the mm, is not read again
        _, reduced = _all_reduced(lambda x, w: _reduce((x @ w).view(2, 16)) + 1, self.x, self.w)
        self.assertEqual(reduced, {"view"})

    def test_an_input_read_after_the_reduction_is_copied(self):
        _, reduced = _all_reduced(lambda x, w: (lambda y: _reduce(y) + y)(x @ w), self.x, self.w)
        self.assertEqual(reduced, set())

    def test_a_view_of_the_same_buffer_read_after_is_copied(self):
        # the reduction reads a reshape; the mm it views is read afterwards
        _, reduced = _all_reduced(lambda x, w: (lambda y: _reduce(y.view(2, 16)).sum() + y)(x @ w), self.x, self.w)
        self.assertEqual(reduced, set())

    def test_an_unsafe_view_counts_as_the_buffer(self):
        # matmul's decomposition reshapes its result with _unsafe_view, whose schema claims no alias
        def fn(x, w):
            y = x @ w
            return _reduce(torch.ops.aten._unsafe_view.default(y, [2, 16])).sum() + y

        _, reduced = _all_reduced(fn, self.x, self.w)
        self.assertEqual(reduced, set())

    def test_a_split_piece_whose_sibling_is_read_after_is_copied(self):
        def fn(x, w):
            a, b = (x @ w).split(4, dim=1)
            return _reduce(a).sum() + b

        _, reduced = _all_reduced(fn, self.x, self.w)
        self.assertEqual(reduced, set())

    def test_graph_inputs_and_returned_values_are_copied(self):
        _, from_input = _all_reduced(lambda x: _reduce(x) + 1, self.x)
        _, returned = _all_reduced(lambda x, w: (lambda y: (_reduce(y), y))(x @ w), self.x, self.w)
        self.assertEqual((from_input, returned), (set(), set()))

    def test_tensor_parallel_block_reduces_in_place(self):
        # the block's two row-parallel outputs in the forward, the column-parallel inputs'
        # gradients in the backward: every all-reduce of the block runs in place
        from graphshard.tensor_parallel import ColwiseParallel, RowwiseParallel

        from _models import mesh1d
        from graphshard.testing.models import Block

        cfg = TransformerConfig(vocab_size=32, dim=16, n_layers=1, n_heads=4, max_seq_len=8)
        block = seeded(Block, cfg)
        plan = graphshard.Plan(mesh1d("tp"), {"attn.w[qkv]": ColwiseParallel(), "attn.wo": RowwiseParallel(),
                                              "ffn.w1": ColwiseParallel(), "ffn.w2": RowwiseParallel()})
        with tempfile.TemporaryDirectory() as d:
            graphshard.compile(block, plan, lower="inductor", dump_graphs=d)
            block(torch.randn(2, 8, 16, requires_grad=True)).sum().backward()
            listings = {}
            for stage in ("forward", "backward"):
                (path,) = glob.glob(os.path.join(d, f"g*_{stage}_regions.txt"))
                with open(path) as f:
                    listings[stage] = [l for l in f.read().splitlines() if l.startswith("all_reduce")]
        self.assertEqual(listings["forward"], ["all_reduce (in place)"] * 2)
        self.assertEqual(listings["backward"], ["all_reduce (in place)"] * 2)


class TestFusePackedGathers(TestCase):
    def test_each_packed_gather_becomes_one_in_place_gather(self):
        # a graph Inductor lowers whole: each unit's pack + all-gather (bucket_collectives) becomes one
        # graphshard::pack_gather whose output the same wait_tensor waits on; nothing else changes
        from unittest import mock

        from _golden import compiled_stages
        from graphshard.compiler import aot
        from graphshard.compiler.lowering import fuse_packed_gathers

        seen = {}
        real = aot.Compilation.post_partition

        def spy(self, g, stage):
            seen[stage] = real(self, g, stage)
            return seen[stage]

        plan = fsdp_plan()
        with mock.patch.object(aot.Compilation, "post_partition", spy):
            compiled_stages(stack(), plan, (torch.randn(4, 8),))
        group = plan.mesh.get_group("dp").group_name
        fw = seen["forward"]
        before = {str(n.target) for n in fw.graph.nodes if n.op == "call_function"}
        fused = fuse_packed_gathers(fw)
        after = {str(n.target) for n in fused.graph.nodes if n.op == "call_function"}
        self.assertEqual(sorted(before ^ after), ["_c10d_functional.all_gather_into_tensor.default",
                                                  "graphshard.pack.default", "graphshard.pack_gather.default"])
        lines = [line.strip().replace(f"'{group}'", "'dp'") for line in fused.code.splitlines()
                 if "pack_gather" in line or "wait_tensor" in line]
        self.assertExpectedInline("\n".join(lines), """\
pack_gather_default = torch.ops.graphshard.pack_gather.default([primals_1], [16], torch.float32, 4, 'dp')
wait_tensor = torch.ops._c10d_functional.wait_tensor.default(pack_gather_default);  pack_gather_default = None
pack_gather_default_1 = torch.ops.graphshard.pack_gather.default([primals_3], [16], torch.float32, 4, 'dp')
unpack = torch.ops.graphshard.unpack.default(wait_tensor, 4, [16]);  wait_tensor = None
wait_tensor_1 = torch.ops._c10d_functional.wait_tensor.default(pack_gather_default_1);  pack_gather_default_1 = None
pack_gather_default_2 = torch.ops.graphshard.pack_gather.default([primals_4], [16], torch.float32, 4, 'dp')
unpack_1 = torch.ops.graphshard.unpack.default(wait_tensor_1, 4, [16]);  wait_tensor_1 = None
wait_tensor_2 = torch.ops._c10d_functional.wait_tensor.default(pack_gather_default_2);  pack_gather_default_2 = None
unpack_2 = torch.ops.graphshard.unpack.default(wait_tensor_2, 4, [16]);  wait_tensor_2 = None""")
