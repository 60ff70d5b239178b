import glob
import os
import tempfile

import torch
from expecttest import TestCase

import graphshard
from _models import fsdp_plan, seeded, stack
from graphshard.lowering import split_work, whole_graph_reason


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
unpack
getitem 0
region r2(4 in, 1 out): full, mm, le, where, mm
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
        self.assertEqual(regions["forward"]["regions"], 6)
        # Every region remakes the shared constant instead of the first layer handing it on,
        # so the first five layers share one key; the last also returns what backward saves.
        self.assertEqual(regions["forward"]["compiled"], 2)
        self.assertLess(regions["backward"]["compiled"], regions["backward"]["regions"])

    def test_split_work(self):
        # Largest first, each to the least loaded rank; every rank gets work while there is some.
        self.assertEqual(split_work([1, 110, 88, 18], 2), [[1], [2, 3, 0]])
        self.assertEqual(split_work([5, 5, 5], 4), [[0], [1], [2], []])
        self.assertEqual(split_work([], 2), [[], []])

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
