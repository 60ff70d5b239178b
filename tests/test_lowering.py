import glob
import os
import tempfile

import torch
from expecttest import TestCase

import graphshard
from _models import fsdp_plan, seeded, stack
from graphshard.lowering import whole_graph_reason
from graphshard.testing.models import Transformer, TransformerConfig, lm_loss, token_batch


def _lowered(model, **kwargs) -> dict[str, str]:
    """Compiles with Inductor (regional lowering), runs a step, returns the program listings."""
    with tempfile.TemporaryDirectory() as d:
        graphshard.compile(model, fsdp_plan(), lower="inductor", dump_graphs=d, **kwargs)
        model(torch.randn(4, 8)).sum().backward()
        out = {}
        for stage in ("forward", "backward"):
            (path,) = glob.glob(os.path.join(d, f"g*_{stage}_regions.txt"))
            with open(path) as f:
                out[stage] = f.read()
        return out


class DeepStack(torch.nn.Module):
    """Six identical layers, each its own unit, scaled by a constant that every layer reads
    (as attention layers read one mask)."""

    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(8, 8, bias=False) for _ in range(6))

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
pack
all_gather_into_tensor
wait_tensor
pack
all_gather_into_tensor
unpack
getitem 0
eager(2 in, 1 out): mm, relu
wait_tensor
pack
all_gather_into_tensor
unpack
getitem 0
eager(2 in, 1 out): mm, relu
wait_tensor
unpack
getitem 0
region r0(2 in, 2 out): mm, relu, le
""")
        self.assertExpectedInline(listing["backward"], """\
pack
all_gather_into_tensor
region r0(3 in, 2 out): full, where, mm
pack_grads
reduce_scatter_tensor
wait_tensor
pack
all_gather_into_tensor
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

    def test_identical_layers_compile_once(self):
        model = seeded(DeepStack)
        graphshard.compile(model, fsdp_plan(), lower="inductor")
        model(torch.randn(4, 8)).sum().backward()
        regions = model._graphshard.explain[0].regions
        # Every region remakes the shared constant instead of the first layer handing it on,
        # so the layers share one key. The relu masks that backward saves, which the
        # partitioner computes at the end of the graph, would make the last layer's region
        # differ; it is cut after the layer's own computation, and the masks are a region.
        self.assertEqual(regions["forward"]["regions"], 7)
        self.assertEqual(regions["forward"]["compiled"], 2)
        self.assertLess(regions["backward"]["compiled"], regions["backward"]["regions"])

    def test_last_layer_reuses_layer_region(self):
        # The last layer's region would run on into the tail; it is cut after the layer, so
        # all four layers share r1 and only the tail (r2) is new. The last layer's x, which
        # the layers hand on for the next residual add, has no reader there: the shared
        # region still returns it ("1 unread"), and the runner drops it at once.
        model = seeded(TailStack)
        with tempfile.TemporaryDirectory() as d:
            graphshard.compile(model, fsdp_plan(), lower="inductor", dump_graphs=d)
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
            graphshard.compile(model, fsdp_plan(), lower="inductor", dump_graphs=d)
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
