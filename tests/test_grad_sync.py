"""``graphshard.no_sync``'s two derived backward programs (`graphshard.passes.no_sync_programs`), as
golden graphs on a fake process group: ``accumulate`` (the root gradient reductions and what
follows them removed, what they reduce returned) and ``flush`` (the pending buffers added to
what they reduce). Parity with torch's FSDP under ``no_sync`` on gloo ranks is
``tests/test_fsdp1.py``'s."""

from __future__ import annotations

from unittest import mock

import torch
from expecttest import TestCase

from _golden import compiled_stages
from _models import fsdp_plan, stack
from graphshard.compiler import aot
from graphshard.passes import no_sync_programs
from graphshard.params import AxisGroup


def _backward_and_roots(gloo_forms: bool):
    """The partitioned backward of the three-layer stack (FULL_SHARD units) and its root reductions."""
    seen = []

    def spy(gm, *args):
        roots = real(gm, *args)
        seen.append((gm, roots))
        return roots

    real = no_sync_programs.root_reductions
    with mock.patch.object(aot, "root_reductions", spy), \
            mock.patch.object(AxisGroup, "scatter_by_all_to_all", new_callable=mock.PropertyMock,
                              return_value=gloo_forms):
        plan = fsdp_plan()
        compiled_stages(stack(), plan, (torch.randn(4, 8),))
    assert len(seen) == 1, seen
    return (*seen[0], plan.mesh.get_group("dp").group_name)


def _lines(gm, group: str, *words) -> str:
    gm.recompile()
    return "\n".join(line.strip().replace(f"'{group}'", "'dp'") for line in gm.code.splitlines()
                     if any(w in line for w in words) and not line.strip().startswith("#"))


class TestGradSync(TestCase):
    def test_flush_adds_the_pending_row_a_rank_keeps_on_gloo(self):
        # gloo's all-to-all form reduces two values per unit: the rows the rank sends and the
        # row it keeps (`ops._reduce_scatter_flat`). Deferring the reduction must defer both:
        # accumulate returns both, flush adds a pending buffer to each (the kept one reaches
        # unpack_reduced, not the collective). A kept row left out would drop 1/world of every
        # accumulated micro-batch's gradient.
        bw, roots, group = _backward_and_roots(gloo_forms=True)
        self.assertEqual(len(roots), 3)
        self.assertEqual([len(no_sync_programs.sent(r)) for r in roots], [2, 2, 2])
        acc = no_sync_programs.accumulate_variant(bw, roots)
        self.assertExpectedInline(_lines(acc, group, "return"), """return (None, None, None, None, getitem_3, getitem_4, getitem_6, getitem_7, getitem_9, getitem_10)""")
        flush = no_sync_programs.flush_variant(bw, roots)
        self.assertExpectedInline(_lines(flush, group, "pending_grads", "all_to_all_single.default", "unpack_reduced.default"), """\
def forward(self, primals_1, primals_2, primals_3, primals_4, relu, relu_1, detach_3, tangents_1, pending_grads_0, pending_grads_1, pending_grads_2, pending_grads_3, pending_grads_4, pending_grads_5):
add_tensor = torch.ops.aten.add.Tensor(getitem_3, pending_grads_0);  getitem_3 = pending_grads_0 = None
add_tensor_1 = torch.ops.aten.add.Tensor(getitem_4, pending_grads_1);  getitem_4 = pending_grads_1 = None
all_to_all_single = torch.ops._c10d_functional.all_to_all_single.default(add_tensor, [0, 16, 16, 16], [0, 16, 16, 16], 'dp');  add_tensor = None
add_tensor_2 = torch.ops.aten.add.Tensor(getitem_6, pending_grads_2);  getitem_6 = pending_grads_2 = None
add_tensor_3 = torch.ops.aten.add.Tensor(getitem_7, pending_grads_3);  getitem_7 = pending_grads_3 = None
all_to_all_single_1 = torch.ops._c10d_functional.all_to_all_single.default(add_tensor_2, [0, 16, 16, 16], [0, 16, 16, 16], 'dp');  add_tensor_2 = None
unpack_reduced = torch.ops.graphshard.unpack_reduced.default(wait_tensor_3, 3, [16], [16], add_tensor_1);  wait_tensor_3 = add_tensor_1 = None
add_tensor_4 = torch.ops.aten.add.Tensor(getitem_9, pending_grads_4);  getitem_9 = pending_grads_4 = None
add_tensor_5 = torch.ops.aten.add.Tensor(getitem_10, pending_grads_5);  getitem_10 = pending_grads_5 = None
all_to_all_single_2 = torch.ops._c10d_functional.all_to_all_single.default(add_tensor_4, [0, 16, 16, 16], [0, 16, 16, 16], 'dp');  add_tensor_4 = None
unpack_reduced_1 = torch.ops.graphshard.unpack_reduced.default(wait_tensor_4, 3, [16], [16], add_tensor_3);  wait_tensor_4 = add_tensor_3 = None
unpack_reduced_2 = torch.ops.graphshard.unpack_reduced.default(wait_tensor_5, 3, [16], [16], add_tensor_5);  wait_tensor_5 = add_tensor_5 = None""")

    def test_flush_adds_the_pending_bucket_before_a_reduce_scatter(self):
        bw, roots, group = _backward_and_roots(gloo_forms=False)
        self.assertEqual([len(no_sync_programs.sent(r)) for r in roots], [1, 1, 1])
        flush = no_sync_programs.flush_variant(bw, roots)
        self.assertExpectedInline(_lines(flush, group, "pending_grads", "reduce_scatter_tensor.default"), """\
def forward(self, primals_1, primals_2, primals_3, primals_4, relu, relu_1, detach_3, tangents_1, pending_grads_0, pending_grads_1, pending_grads_2):
add_tensor = torch.ops.aten.add.Tensor(pack_grads, pending_grads_0);  pack_grads = pending_grads_0 = None
reduce_scatter_tensor = torch.ops._c10d_functional.reduce_scatter_tensor.default(add_tensor, 'avg', 4, 'dp');  add_tensor = None
add_tensor_1 = torch.ops.aten.add.Tensor(pack_grads_1, pending_grads_1);  pack_grads_1 = pending_grads_1 = None
reduce_scatter_tensor_1 = torch.ops._c10d_functional.reduce_scatter_tensor.default(add_tensor_1, 'avg', 4, 'dp');  add_tensor_1 = None
add_tensor_2 = torch.ops.aten.add.Tensor(pack_grads_2, pending_grads_2);  pack_grads_2 = pending_grads_2 = None
reduce_scatter_tensor_2 = torch.ops._c10d_functional.reduce_scatter_tensor.default(add_tensor_2, 'avg', 4, 'dp');  add_tensor_2 = None""")

    def test_dump_graphs_writes_each_derived_program_when_it_is_built(self):
        import glob
        import os
        import tempfile

        import graphshard

        model, plan = stack(), fsdp_plan()
        with tempfile.TemporaryDirectory() as d:
            graphshard.compile(model, plan, lower="eager", dump_graphs=d, trace_once=False)
            with graphshard.no_sync(model):
                model(torch.randn(4, 8)).sum().backward()
            dumped = sorted(os.path.basename(f) for f in glob.glob(os.path.join(d, "*no_sync*")))
            self.assertEqual(dumped, ["g0_backward_no_sync_accumulate.txt"])  # flush: not used yet
            model(torch.randn(4, 8)).sum().backward()
            dumped = sorted(os.path.basename(f) for f in glob.glob(os.path.join(d, "*no_sync*")))
            self.assertEqual(dumped, ["g0_backward_no_sync_accumulate.txt", "g0_backward_no_sync_flush.txt"])
            with open(os.path.join(d, "g0_backward_no_sync_flush.txt")) as f:
                flush = f.read()
            with open(os.path.join(d, "g0_backward_no_sync_accumulate.txt")) as f:
                accumulate = f.read()
        self.assertIn("pending_grads_0", flush)
        self.assertNotIn("reduce_scatter_tensor", accumulate)
        self.assertNotIn("all_to_all_single", accumulate)
