"""Tensor-parallel layouts: every layout argument of every style, as torch's ``parallelize_module`` reads it.

Torch reads a plain tensor that reaches a module input declared ``Shard(d)`` as this rank's piece
of a larger tensor (``DTensor.from_local``): each rank passes its own rows, positions or features.
graphshard's programs are logical, so such a graph input enters them as the logical value, sharded
(``graphshard::from_local``); what graphshard cannot read that way is refused with the module, the
argument and what to do instead.

- The golden graphs (fake process group, world 4) show a graph input declared ``Shard(0)``: no
  slice of it, the all-gather torch's sequence-parallel MLP does, and the local shapes.
- The sweep (2 ranks, gloo, one torchrun launch: tests/workers/tp_layouts.py) runs every style x
  every layout argument value against torch's ``parallelize_module`` and the single process on the
  whole batch (1e-5 on the outputs, the losses of two SGD steps, every gradient and parameter).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
from expecttest import TestCase
from torch.distributed.tensor import Replicate, Shard

import graphshard
from _golden import graph_after
from _launch import run_cases
from _models import mesh1d, seeded
from graphshard.tensor_parallel import ColwiseParallel, PrepareModuleOutput, RowwiseParallel
from graphshard.testing.models import MLP

TOL = 1e-5


class TestGoldenGraphs(TestCase):
    def test_sharded_graph_input_is_the_local_piece(self):
        # torch's sequence-parallel MLP: each of the 4 ranks passes its 2 rows of the 8. The input
        # enters as an alias carrying the logical [8, 16] value (Shard(0)), is all-gathered for the
        # column-parallel layer and the row-parallel sum is reduce-scattered back to rows: no slice.
        plan = graphshard.Plan(mesh1d("tp"), {"fc1": ColwiseParallel(input_layouts=Shard(0)),
                                              "fc2": RowwiseParallel(output_layouts=Shard(0))})
        text = graph_after(seeded(MLP, 16, 32, 8), plan, (torch.randn(2, 16),), "annotate_placements", placements=True)
        head = "\n".join(l for l in text.splitlines() if "from_local" in l or l.startswith(("from_local:", "layout:")))
        self.assertExpectedInline(head, """\
        from_local: "f32[8, 16]" = torch.ops.graphshard.from_local.default(arg0_1, 'fc1:in0', 'tp', 'S(0)', 4);  arg0_1 = None
        layout: "f32[8, 16]" = torch.ops.graphshard.layout.default(from_local, 'fc1:in0', 'tp', 'S(0)', True);  from_local = None
from_local: {tp: S(0)}
layout: {tp: S(0)}""")
        text = graph_after(seeded(MLP, 16, 32, 8), plan, (torch.randn(2, 16),), "localize_shapes")
        self.assertExpectedInline(text, """\
class <lambda>(torch.nn.Module):
    def forward(self, arg0_1: "f32[2, 16]", arg1_1: "f32[8, 16]", arg2_1: "f32[8]", arg3_1: "f32[8, 8]", arg4_1: "f32[8]"):
        to_partial_default: "f32[8]" = torch.ops.graphshard.to_partial.default(arg4_1, 0);  arg4_1 = None
        alias_default: "f32[2, 16]" = torch.ops.aten.alias.default(arg0_1);  arg0_1 = None
        all_gather_default: "f32[8, 16]" = torch.ops.graphshard.all_gather.default(alias_default, 0, 8, 'tp', 4, 0);  alias_default = None
        alias_default_1: "f32[8, 16]" = torch.ops.aten.alias.default(arg1_1);  arg1_1 = None
        alias_default_2: "f32[8]" = torch.ops.aten.alias.default(arg2_1);  arg2_1 = None
        t: "f32[16, 8]" = torch.ops.aten.t.default(alias_default_1);  alias_default_1 = None
        addmm: "f32[8, 8]" = torch.ops.aten.addmm.default(alias_default_2, all_gather_default, t);  alias_default_2 = all_gather_default = t = None
        gelu: "f32[8, 8]" = torch.ops.aten.gelu.default(addmm);  addmm = None
        alias_default_3: "f32[8, 8]" = torch.ops.aten.alias.default(arg3_1);  arg3_1 = None
        t_1: "f32[8, 8]" = torch.ops.aten.t.default(alias_default_3);  alias_default_3 = None
        addmm_1: "f32[8, 8]" = torch.ops.aten.addmm.default(to_partial_default, gelu, t_1);  to_partial_default = gelu = t_1 = None
        reduce_scatter_default: "f32[2, 8]" = torch.ops.graphshard.reduce_scatter.default(addmm_1, 0, 'tp', 4, 0);  addmm_1 = None
        return (reduce_scatter_default,)
""")

    def test_row_parallel_default_reads_its_feature_piece(self):
        # RowwiseParallel() declares its input Shard(-1), as torch: each rank passes its 4 of the 16
        # features, which go straight into the matmul (no slice, no gather).
        plan = graphshard.Plan(mesh1d("tp"), {"fc1": RowwiseParallel()})
        model = seeded(MLP, 16, 32, 8)
        text = graph_after(model, plan, (torch.randn(2, 4),), "localize_shapes")
        self.assertIn('arg0_1: "f32[2, 4]"', text)
        self.assertNotIn("graphshard.shard.default", text)
        self.assertNotIn("all_gather", text)
        self.assertIn("graphshard.all_reduce.default", text)


class Scaled(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 8)

    def forward(self, x):
        return self.fc(x * 2)


class Tanh(nn.Module):
    def forward(self, x):
        return torch.tanh(x)


class TanhLinear(nn.Module):
    def __init__(self):
        super().__init__()
        self.act, self.fc = Tanh(), nn.Linear(16, 8)

    def forward(self, x):
        return self.fc(self.act(x))


class TestRefusals(TestCase):
    """Single-process checks of the messages (the sweep checks them on 2 ranks, next to torch)."""

    def test_sharded_layout_on_a_computed_value(self):
        plan = graphshard.Plan(mesh1d("tp"), {"fc": ColwiseParallel(input_layouts=Shard(0))})
        with self.assertRaisesRegex(NotImplementedError, r"module 'fc' input 0 \(input_layouts\) is declared Shard\(0\).*"
                                                         r"computed from the graph inputs alone.*Replicate\(\)"):
            graph_after(seeded(Scaled), plan, (torch.randn(2, 16),), "annotate_placements")

    def test_sharded_output_layout_of_a_parameterless_module(self):
        plan = graphshard.Plan(mesh1d("tp"), {
            "act": PrepareModuleOutput(output_layouts=(Shard(0),), desired_output_layouts=(Replicate(),)),
            "fc": ColwiseParallel(output_layouts=Replicate())})
        with self.assertRaisesRegex(NotImplementedError, r"module 'act' output 0 \(output_layouts\) is declared Shard\(0\)"):
            graph_after(seeded(TanhLinear), plan, (torch.randn(2, 16),), "annotate_placements")

    def test_replicated_dtensor_output(self):
        plan = graphshard.Plan(mesh1d("tp"), {"fc": ColwiseParallel(output_layouts=Replicate(), use_local_output=False)})
        model = nn.Sequential()
        model.fc = nn.Linear(16, 8)
        with self.assertRaisesRegex(NotImplementedError, r"module 'fc' output 0 \(output_layouts\) is declared Replicate\(\) "
                                                         r"with use_local_output=False.*use_local_output=True"):
            graph_after(model, plan, (torch.randn(2, 16),), "annotate_placements")


# ------------------------------------------------------------------------------------------------
# The sweep: tests/workers/tp_layouts.py names each case's model, plan and how the ranks hold
# the inputs. Every case below matches torch's parallelize_module AND the single process.
# ------------------------------------------------------------------------------------------------
MATCHED = [
    # torch's sequence-parallel MLP test plan (Inductor, graphshard.tensor_parallel.parallelize_module)
    "mlp_sp", "mlp_sp_eager", "mlp_tp",
    # ColwiseParallel: input_layouts None / Replicate (whole input) / Shard(0) rows / Shard(1), Shard(-1) features
    "col_in_none", "col_in_r", "col_in_s0", "col_in_s1", "col_in_sm1",
    # ColwiseParallel: output_layouts x use_local_output (False: the caller gets a DTensor)
    "col_out_none_local", "col_out_none_dt", "col_out_sm1_local", "col_out_sm1_dt", "col_out_s0_local", "col_out_s0_dt",
    "col_out_r_local", "col_r_row_r", "col_dt_row",
    # RowwiseParallel: input_layouts None (Shard(-1): each rank its features) / Replicate / Shard(-1) / Shard(1) / Shard(0)
    "row_in_none", "row_in_r", "row_in_sm1", "row_in_s1", "row_in_s0",
    # RowwiseParallel: output_layouts x use_local_output
    "row_out_none_local", "row_out_r_local", "row_out_s0_local", "row_out_s0_dt", "row_out_s1_local", "row_out_s1_dt",
    # nn.Embedding under both styles; ids whole, batch-sharded, or (RowwiseParallel's default) position-sharded
    "emb_col", "emb_col_out_r", "emb_col_in_s0", "emb_row", "emb_row_default", "emb_row_out_s1", "emb_row_in_s0",
    # SequenceParallel: sequence_dim 1 and 0, use_local_output False (DTensor) and True
    "sp_dt", "sp_local", "sp_dim0_local",
    # PrepareModuleInput: input_layouts -> desired_input_layouts, use_local_output, input_kwarg_layouts
    "pmi_s0_r_dt", "pmi_s0_r_local", "pmi_r_r", "pmi_s0_s0_local", "pmi_r_s0_dt", "pmi_s1_r_local", "pmi_none_entry", "pmi_kwarg",
    "pmi_s0_r_dt_inductor",
    # PrepareModuleOutput: output_layouts -> desired_output_layouts, use_local_output
    "pmo_r_s0_local", "pmo_r_s0_dt", "pmo_s0_r_local", "pmo_s0_s1_local",
]

REFUSED = {
    # A replicated model output with use_local_output=False: torch runs these and returns a
    # DTensor(Replicate()); graphshard's compiled call wraps only sharded outputs.
    "col_out_r_dt": ("NotImplementedError", "module 'lin' output 0 (output_layouts) is declared Replicate() with "
                                            "use_local_output=False"),
    "row_out_none_dt": ("NotImplementedError", "module 'net2' output 0 (output_layouts) is declared Replicate() with "
                                               "use_local_output=False"),
    "row_out_r_dt": ("NotImplementedError", "module 'net2' output 0 (output_layouts) is declared Replicate() with "
                                            "use_local_output=False"),
    # PrepareModuleOutput(output_layouts=Shard(0)) on a module without parameters whose output is
    # computed from the input alone: torch runs it and matches the single process (the tanh of each
    # rank's rows); graphshard reads that value as whole on every rank and refuses.
    "refuse_pmo_data": ("NotImplementedError", "module 'act' output 0 (output_layouts) is declared Shard(0)"),
    # ColwiseParallel(input_layouts=Shard(0)) on x * 2: torch runs it and matches the single process.
    "refuse_computed_input": ("NotImplementedError", "module 'net1' input 0 (input_layouts) is declared Shard(0)"),
    # The rows also read outside the layer (+ x.mean()): torch runs it and differs from the single
    # process (its mean is of each rank's rows); graphshard refuses.
    "refuse_input_read_outside": ("NotImplementedError", "is declared Shard(0) at module 'net1' input 0 "
                                                         "(input_layouts), so each rank passes its own piece"),
    # The rows also added outside the layer (+ x): torch runs it and matches the single process;
    # under graphshard the logical [16, 10] output meets the [8, 10] piece while dynamo traces.
    "refuse_input_used_outside": ("TorchRuntimeError", "RuntimeError when making fake tensor call"),
    # The rows' count changes at step 2 (16 -> 12): torch runs it and matches the single process;
    # dynamo recompiles with a symbolic row count, which graphshard refuses for a sharded dim.
    "refuse_dynamic_rows": ("NotImplementedError", "is declared Shard(0) at module 'net1' input 0 (input_layouts), "
                                                   "and its dim 0 has a dynamic size"),
    # 9 rows, passed as 5 and 4: the collective check's per-call comparison of the tp group's inputs
    # stops every rank before the first collective. Torch's TP is not run: gloo aborts its process on
    # the size mismatch of its all-gather (torch's from_local takes pieces as even).
    "refuse_uneven_rows": ("CollectiveMismatch", ("float32[5,10]", "float32[4,10]", "Nothing was issued")),
}
TORCH_NOT_RUN = {"refuse_uneven_rows"}


@pytest.fixture(scope="module")
def sweep():
    return run_cases("tp_layouts.py", MATCHED + list(REFUSED), timeout=900)


@pytest.mark.parametrize("case", MATCHED)
def test_matches_torch_and_single_process(sweep, case):
    r = sweep[case]
    assert "refused" not in r, f"{r['refused']}\n{r.get('traceback', '')}"
    assert "torch_error" not in r, r["torch_error"]
    for who in ("ours", "torch", "ours_vs_torch"):
        errs = {k: v for k, v in r[who].items() if k != "shapes"}
        assert all(v <= TOL for v in errs.values()), (who, r)
        assert all(math.isfinite(v) for v in errs.values()), (who, r)
    assert r["fallbacks"] == [], r["fallbacks"]


@pytest.mark.parametrize("case", list(REFUSED))
def test_refused_with_its_reason(sweep, case):
    kind, message = REFUSED[case]
    r = sweep[case]
    assert "refused" in r, f"{case} ran: {r}"
    messages = (message,) if isinstance(message, str) else message
    assert kind in r["refused"] and all(m in r["refused"] for m in messages), r["refused"]
    if case not in TORCH_NOT_RUN:
        assert "torch_error" not in r, f"torch runs {case}: {r['torch_error']}"
