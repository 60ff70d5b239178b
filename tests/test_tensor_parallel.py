"""graphshard.tensor_parallel: torch's documented API, compiled by graphshard (fake process group, world 4).

Golden graphs after ``localize_shapes`` show the per-rank program each plan
compiles to; API tests follow the documentation of
``torch.distributed.tensor.parallel``.
"""

from __future__ import annotations

import re
import warnings

import pytest
import torch
import torch.nn as nn
from expecttest import TestCase
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

import graphshard
from _golden import compiled_stages, graph_after
from _models import mesh1d, seeded
from graphshard.tensor_parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)
from graphshard.testing.models import MLP, Block, Transformer, TransformerConfig, lm_loss

TINY = TransformerConfig(vocab_size=32, dim=16, n_layers=1, n_heads=4, max_seq_len=8)
SEQ_IN = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))


def collectives(text: str) -> str:
    """The signature line and the lines that hold graphshard ops: the communication of a graph."""
    lines = text.splitlines()
    return "\n".join([lines[1]] + [l for l in lines[2:] if "graphshard." in l or "return" in l]) + "\n"


def data_movement(text: str) -> str:
    """The collectives, their waits, and every permute with the copy that makes it contiguous:
    where a graph moves data around its collectives."""
    out, permutes = [], set()
    for line in text.splitlines():
        m = re.match(r'\s*(\w+)(?:: "[^"]*")? = torch\.ops\.[\w.]+?\.(\w+)\.\w+\((\w+)', line)
        if not m:
            continue
        name, op, first = m.groups()
        if op == "permute":
            permutes.add(name)
        if op in ("all_gather_into_tensor", "reduce_scatter_tensor", "wait_tensor", "permute") or (
                op == "clone" and first in permutes):
            out.append(line.strip().split(";")[0] + "\n")
    return "".join(out)


def sp_block_plan(mesh):
    return graphshard.Plan(mesh, {
        "attn_norm": SequenceParallel(), "ffn_norm": SequenceParallel(),
        "attn": SEQ_IN, "ffn": SEQ_IN,
        "attn.w[qkv]": ColwiseParallel(), "attn.wo": RowwiseParallel(output_layouts=Shard(1)),
        "ffn.w1": ColwiseParallel(), "ffn.w2": RowwiseParallel(output_layouts=Shard(1)),
        "": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Shard(1),)),
    })


class WithLoss(nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, tokens, targets):
        return lm_loss(self.model(tokens), targets)


class TestGoldenGraphs(TestCase):
    def test_colwise_rowwise_mlp(self):
        plan = graphshard.Plan(mesh1d("tp"), {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
        text = graph_after(seeded(MLP, 16, 32, 8), plan, (torch.randn(4, 16),), "localize_shapes")
        self.assertExpectedInline(text, """\
class <lambda>(torch.nn.Module):
    def forward(self, arg0_1: "f32[4, 16]", arg1_1: "f32[8, 16]", arg2_1: "f32[8]", arg3_1: "f32[8, 8]", arg4_1: "f32[8]"):
        to_partial_default: "f32[8]" = torch.ops.graphshard.to_partial.default(arg4_1, 0);  arg4_1 = None
        alias_default: "f32[8, 16]" = torch.ops.aten.alias.default(arg1_1);  arg1_1 = None
        alias_default_1: "f32[8]" = torch.ops.aten.alias.default(arg2_1);  arg2_1 = None
        t: "f32[16, 8]" = torch.ops.aten.t.default(alias_default);  alias_default = None
        addmm: "f32[4, 8]" = torch.ops.aten.addmm.default(alias_default_1, arg0_1, t);  alias_default_1 = arg0_1 = t = None
        gelu: "f32[4, 8]" = torch.ops.aten.gelu.default(addmm);  addmm = None
        alias_default_2: "f32[8, 8]" = torch.ops.aten.alias.default(arg3_1);  arg3_1 = None
        t_1: "f32[8, 8]" = torch.ops.aten.t.default(alias_default_2);  alias_default_2 = None
        addmm_1: "f32[4, 8]" = torch.ops.aten.addmm.default(to_partial_default, gelu, t_1);  to_partial_default = gelu = t_1 = None
        all_reduce_default: "f32[4, 8]" = torch.ops.graphshard.all_reduce.default(addmm_1, 'tp', 4);  addmm_1 = None
        return (all_reduce_default,)
""")

    def test_attention_block_keeps_heads_sharded(self):
        # Hard-coded view(b, s, n_heads, head_dim): 4 heads become 1 local head; one all-reduce, after wo,
        # and one gradient all-reduce of the block input (shared by wq, wk, wv).
        plan = graphshard.Plan(mesh1d("tp"), {"attn.w[qkv]": ColwiseParallel(), "attn.wo": RowwiseParallel()})
        block = seeded(Block, TINY)
        text = graph_after(block, plan, (torch.randn(2, 8, 16),), "localize_shapes")
        self.assertExpectedInline(collectives(text), """\
    def forward(self, arg0_1: "f32[16]", arg1_1: "f32[16]", arg2_1: "f32[2, 8, 16]", arg3_1: "f32[4, 16]", arg4_1: "f32[4, 16]", arg5_1: "f32[4, 16]", arg6_1: "f32[16, 4]", arg7_1: "f32[16]", arg8_1: "f32[16]", arg9_1: "f32[64, 16]", arg10_1: "f32[64]", arg11_1: "f32[16, 64]", arg12_1: "f32[16]"):
        grad_all_reduce_default_3: "f32[2, 8, 16]" = torch.ops.graphshard.grad_all_reduce.default(getitem, 'tp', 4);  getitem = None
        all_reduce_default: "f32[2, 8, 16]" = torch.ops.graphshard.all_reduce.default(_unsafe_view_9, 'tp', 4);  _unsafe_view_9 = None
        return (add_2,)
""")
        # the views themselves: q, k and v as (batch 2, seq 8, 1 local head of 4, head_dim 4), by hand
        self.assertIn('"f32[2, 8, 1, 4]"', text)
        self.assertNotIn('"f32[2, 8, 4, 4]"', text)  # no view left with the 4 global heads

    def test_sequence_parallel_block(self):
        # Norms run on sequence shards; the row-parallel all-reduce becomes a reduce-scatter and the
        # column-parallel input an all-gather whose backward is a reduce-scatter.
        # the root's input is declared Shard(1): each of the 4 ranks passes its 2 positions of the 8
        text = graph_after(seeded(Block, TINY), sp_block_plan(mesh1d("tp")), (torch.randn(2, 2, 16),),
                           "localize_shapes")
        self.assertExpectedInline(collectives(text), """\
    def forward(self, arg0_1: "f32[2, 2, 16]", arg1_1: "f32[16]", arg2_1: "f32[16]", arg3_1: "f32[4, 16]", arg4_1: "f32[4, 16]", arg5_1: "f32[4, 16]", arg6_1: "f32[16, 4]", arg7_1: "f32[16]", arg8_1: "f32[16]", arg9_1: "f32[16, 16]", arg10_1: "f32[16]", arg11_1: "f32[16, 16]", arg12_1: "f32[16]"):
        grad_all_reduce_default: "f32[16]" = torch.ops.graphshard.grad_all_reduce.default(arg1_1, 'tp', 4);  arg1_1 = None
        grad_all_reduce_default_1: "f32[16]" = torch.ops.graphshard.grad_all_reduce.default(arg2_1, 'tp', 4);  arg2_1 = None
        grad_all_reduce_default_5: "f32[16]" = torch.ops.graphshard.grad_all_reduce.default(arg7_1, 'tp', 4);  arg7_1 = None
        grad_all_reduce_default_6: "f32[16]" = torch.ops.graphshard.grad_all_reduce.default(arg8_1, 'tp', 4);  arg8_1 = None
        to_partial_default: "f32[16]" = torch.ops.graphshard.to_partial.default(arg12_1, 0);  arg12_1 = None
        all_gather_default: "f32[2, 8, 16]" = torch.ops.graphshard.all_gather_partial_grad.default(getitem, 1, 8, 'tp', 4, 0);  getitem = None
        reduce_scatter_default: "f32[2, 2, 16]" = torch.ops.graphshard.reduce_scatter.default(_unsafe_view_9, 1, 'tp', 4, 0);  _unsafe_view_9 = None
        all_gather_default_1: "f32[2, 8, 16]" = torch.ops.graphshard.all_gather_partial_grad.default(getitem_3, 1, 8, 'tp', 4, 0);  getitem_3 = None
        reduce_scatter_default_1: "f32[2, 2, 16]" = torch.ops.graphshard.reduce_scatter.default(view_11, 1, 'tp', 4, 0);  view_11 = None
        all_gather_default_2: "f32[2, 8, 16]" = torch.ops.graphshard.all_gather.default(add_2, 1, 8, 'tp', 4, 0);  add_2 = None
        return (all_gather_default_2,)
""")

    def test_sequence_parallel_gathers_and_scatters_whole_rows(self):
        # A collective along dim 1 moves the ranks' axis beside dim 1 with one copy of whole rows:
        # after the gather, before the reduce-scatter. The piece itself goes in as it is: no
        # transposing copy of it before the gather, none of the result after the reduce-scatter.
        g = compiled_stages(seeded(Block, TINY), sp_block_plan(mesh1d("tp")), (torch.randn(2, 2, 16),))
        self.assertExpectedInline(data_movement(g["forward"]), """\
all_gather_into_tensor: "f32[8, 2, 16]" = torch.ops._c10d_functional.all_gather_into_tensor.default(getitem, 4, 'tp')
wait_tensor: "f32[8, 2, 16]" = torch.ops._c10d_functional.wait_tensor.default(all_gather_into_tensor)
permute: "f32[2, 4, 2, 16]" = torch.ops.aten.permute.default(view, [1, 0, 2, 3])
clone_5: "f32[2, 4, 2, 16]" = torch.ops.aten.clone.default(permute, memory_format = torch.contiguous_format)
permute_1: "f32[4, 2, 2, 16]" = torch.ops.aten.permute.default(view_9, [1, 0, 2, 3])
clone_10: "f32[4, 2, 2, 16]" = torch.ops.aten.clone.default(permute_1, memory_format = torch.contiguous_format)
reduce_scatter_tensor: "f32[2, 2, 16]" = torch.ops._c10d_functional.reduce_scatter_tensor.default(_unsafe_view_11, 'sum', 4, 'tp')
wait_tensor_1: "f32[2, 2, 16]" = torch.ops._c10d_functional.wait_tensor.default(reduce_scatter_tensor)
all_gather_into_tensor_1: "f32[8, 2, 16]" = torch.ops._c10d_functional.all_gather_into_tensor.default(getitem_3, 4, 'tp')
wait_tensor_2: "f32[8, 2, 16]" = torch.ops._c10d_functional.wait_tensor.default(all_gather_into_tensor_1)
permute_2: "f32[2, 4, 2, 16]" = torch.ops.aten.permute.default(view_10, [1, 0, 2, 3])
clone_11: "f32[2, 4, 2, 16]" = torch.ops.aten.clone.default(permute_2, memory_format = torch.contiguous_format)
permute_3: "f32[4, 2, 2, 16]" = torch.ops.aten.permute.default(view_15, [1, 0, 2, 3])
clone_12: "f32[4, 2, 2, 16]" = torch.ops.aten.clone.default(permute_3, memory_format = torch.contiguous_format)
reduce_scatter_tensor_1: "f32[2, 2, 16]" = torch.ops._c10d_functional.reduce_scatter_tensor.default(_unsafe_view_13, 'sum', 4, 'tp')
wait_tensor_3: "f32[2, 2, 16]" = torch.ops._c10d_functional.wait_tensor.default(reduce_scatter_tensor_1)
all_gather_into_tensor_2: "f32[8, 2, 16]" = torch.ops._c10d_functional.all_gather_into_tensor.default(add_2, 4, 'tp')
wait_tensor_4: "f32[8, 2, 16]" = torch.ops._c10d_functional.wait_tensor.default(all_gather_into_tensor_2)
permute_4: "f32[2, 4, 2, 16]" = torch.ops.aten.permute.default(view_16, [1, 0, 2, 3])
clone_13: "f32[2, 4, 2, 16]" = torch.ops.aten.clone.default(permute_4, memory_format = torch.contiguous_format)
""")

    def test_loss_parallel_never_gathers_the_logits(self):
        # Vocabulary-sharded embedding (Partial, all-reduced) and class-sharded cross-entropy: an all-reduce
        # of the row max, of the row sum of exponentials and of the loss; no all-gather of [16, 32] logits.
        cfg = TransformerConfig(vocab_size=32, dim=16, n_layers=1, n_heads=4, max_seq_len=8, tie_embeddings=False)
        model = WithLoss(seeded(Transformer, cfg))
        plan = graphshard.Plan(mesh1d("tp"), {"model.tok_embeddings": RowwiseParallel(input_layouts=Replicate()),
                                              "model.output": ColwiseParallel()})
        x = torch.randint(0, 32, (2, 8))
        text = graph_after(model, plan, (x, x), "insert_collectives")
        self.assertNotIn("all_gather", text)
        tail = text[text.rindex("\n", 0, text.index("detach")) + 1:]
        self.assertExpectedInline(tail, """\
        detach_default: "f32[16, 32]" = torch.ops.aten.detach.default(view_13)
        amax_default: "f32[16, 1]" = torch.ops.aten.amax.default(detach_default, [1], True);  detach_default = None
        all_reduce_max_default: "f32[16, 1]" = torch.ops.graphshard.all_reduce_max.default(amax_default, 'tp');  amax_default = None
        sub_tensor_1: "f32[16, 32]" = torch.ops.aten.sub.Tensor(view_13, all_reduce_max_default);  view_13 = all_reduce_max_default = None
        exp_default: "f32[16, 32]" = torch.ops.aten.exp.default(sub_tensor_1)
        sum_dim_int_list: "f32[16, 1]" = torch.ops.aten.sum.dim_IntList(exp_default, [1], True);  exp_default = None
        all_reduce_default_1: "f32[16, 1]" = torch.ops.graphshard.all_reduce.default(sum_dim_int_list, 'tp', 4);  sum_dim_int_list = None
        log_default: "f32[16, 1]" = torch.ops.aten.log.default(all_reduce_default_1);  all_reduce_default_1 = None
        grad_all_reduce_default_1: "f32[16, 1]" = torch.ops.graphshard.grad_all_reduce.default(log_default, 'tp', 4);  log_default = None
        sub_tensor_2: "f32[16, 32]" = torch.ops.aten.sub.Tensor(sub_tensor_1, grad_all_reduce_default_1);  sub_tensor_1 = grad_all_reduce_default_1 = None
        sub_tensor_3: "i64[16]" = torch.ops.aten.sub.Tensor(view_14, 0)
        ge_scalar_1: "b8[16]" = torch.ops.aten.ge.Scalar(sub_tensor_3, 0)
        lt_scalar_1: "b8[16]" = torch.ops.aten.lt.Scalar(sub_tensor_3, 8)
        bitwise_and_tensor_1: "b8[16]" = torch.ops.aten.bitwise_and.Tensor(ge_scalar_1, lt_scalar_1);  ge_scalar_1 = lt_scalar_1 = None
        mul_tensor_2: "i64[16]" = torch.ops.aten.mul.Tensor(sub_tensor_3, bitwise_and_tensor_1);  sub_tensor_3 = None
        ne_scalar: "b8[16]" = torch.ops.aten.ne.Scalar(view_14, -100);  view_14 = None
        bitwise_and_tensor_2: "b8[16]" = torch.ops.aten.bitwise_and.Tensor(bitwise_and_tensor_1, ne_scalar);  bitwise_and_tensor_1 = None
        unsqueeze_default_1: "i64[16, 1]" = torch.ops.aten.unsqueeze.default(mul_tensor_2, 1);  mul_tensor_2 = None
        gather_default: "f32[16, 1]" = torch.ops.aten.gather.default(sub_tensor_2, 1, unsqueeze_default_1);  sub_tensor_2 = unsqueeze_default_1 = None
        squeeze_dim: "f32[16]" = torch.ops.aten.squeeze.dim(gather_default, 1);  gather_default = None
        _to_copy_default: "f32[16]" = torch.ops.aten._to_copy.default(bitwise_and_tensor_2, dtype = torch.float32);  bitwise_and_tensor_2 = None
        mul_tensor_3: "f32[16]" = torch.ops.aten.mul.Tensor(squeeze_dim, _to_copy_default);  squeeze_dim = _to_copy_default = None
        neg_default: "f32[16]" = torch.ops.aten.neg.default(mul_tensor_3);  mul_tensor_3 = None
        _to_copy_default_1: "f32[16]" = torch.ops.aten._to_copy.default(ne_scalar, dtype = torch.float32);  ne_scalar = None
        sum_default: "f32[]" = torch.ops.aten.sum.default(_to_copy_default_1);  _to_copy_default_1 = None
        sum_default_1: "f32[]" = torch.ops.aten.sum.default(neg_default);  neg_default = None
        div_tensor: "f32[]" = torch.ops.aten.div.Tensor(sum_default_1, sum_default);  sum_default_1 = sum_default = None
        all_reduce_default_2: "f32[]" = torch.ops.graphshard.all_reduce.default(div_tensor, 'tp', 4);  div_tensor = None
        return (all_reduce_default_2,)
""")

    def test_fsdp_and_tp_block_on_a_2d_mesh(self):
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        plan = graphshard.Plan(mesh, {"attn.w[qkv]": ColwiseParallel(), "attn.wo": RowwiseParallel(),
                                      "ffn.w1": ColwiseParallel(), "ffn.w2": RowwiseParallel(),
                                      "": graphshard.FullyShard()})
        text = graph_after(seeded(Block, TINY), plan, (torch.randn(2, 8, 16),), "bucket_collectives")
        self.assertExpectedInline(collectives(text), """\
    def forward(self, arg0_1: "f32[8]", arg1_1: "f32[8]", arg2_1: "f32[2, 8, 16]", arg3_1: "f32[4, 16]", arg4_1: "f32[4, 16]", arg5_1: "f32[4, 16]", arg6_1: "f32[8, 8]", arg7_1: "f32[8]", arg8_1: "f32[8]", arg9_1: "f32[16, 16]", arg10_1: "f32[16]", arg11_1: "f32[8, 32]", arg12_1: "f32[8]"):
        unshard_default_12 = torch.ops.graphshard.unshard.default([arg0_1, arg1_1, arg3_1, arg4_1, arg5_1, arg6_1, arg7_1, arg8_1, arg9_1, arg10_1, arg11_1, arg12_1], ['attn_norm.weight', 'attn_norm.bias', 'attn.wq.weight', 'attn.wk.weight', 'attn.wv.weight', 'attn.wo.weight', 'ffn_norm.weight', 'ffn_norm.bias', 'ffn.w1.weight', 'ffn.w1.bias', 'ffn.w2.weight', 'ffn.w2.bias']);  arg0_1 = arg1_1 = arg3_1 = arg4_1 = arg5_1 = arg6_1 = arg7_1 = arg8_1 = arg9_1 = arg10_1 = arg11_1 = arg12_1 = None
        grad_all_reduce_default_4: "f32[2, 8, 16]" = torch.ops.graphshard.grad_all_reduce.default(getitem, 'tp', 2);  getitem = None
        all_reduce_default: "f32[2, 8, 16]" = torch.ops.graphshard.all_reduce.default(_unsafe_view_9, 'tp', 2);  _unsafe_view_9 = None
        grad_all_reduce_default_5: "f32[2, 8, 16]" = torch.ops.graphshard.grad_all_reduce.default(getitem_3, 'tp', 2);  getitem_3 = None
        to_partial_default: "f32[16]" = torch.ops.graphshard.to_partial.default(getitem_29, 0);  getitem_29 = None
        all_reduce_default_1: "f32[2, 8, 16]" = torch.ops.graphshard.all_reduce.default(view_11, 'tp', 2);  view_11 = None
        return (add_2,)
""")


# ------------------------------------------------------------------------------------------ API
def test_documented_defaults():
    col, row, seq = ColwiseParallel(), RowwiseParallel(), SequenceParallel()
    assert (col.input_layouts, col.output_layouts, col.use_local_output) == (Replicate(), Shard(-1), True)
    assert (row.input_layouts, row.output_layouts, row.use_local_output) == (None, Replicate(), True)
    assert (seq.sequence_dim, seq.use_local_output) == (1, False)
    assert PrepareModuleInput().use_local_output is False
    assert PrepareModuleOutput(output_layouts=Shard(0), desired_output_layouts=Replicate()).use_local_output is True


def _torch_and_graphshard_styles():
    """The same styles in torch's spelling and graphshard's: every argument away from its default."""
    from torch.distributed.tensor import parallel as tp

    import graphshard.tensor_parallel as gtp

    def both(name, **kw):
        return getattr(tp, name)(**kw), getattr(gtp, name)(**kw)

    s0, s1, r = Shard(0), Shard(1), Replicate()
    return [
        both("ColwiseParallel"), both("ColwiseParallel", input_layouts=s0, output_layouts=r, use_local_output=False),
        both("RowwiseParallel"), both("RowwiseParallel", input_layouts=r, output_layouts=s1, use_local_output=False),
        both("SequenceParallel"), both("SequenceParallel", sequence_dim=0, use_local_output=True),
        both("PrepareModuleInput", input_layouts=(s1, None), desired_input_layouts=(r, None),
             input_kwarg_layouts={"mask": s0}, desired_input_kwarg_layouts={"mask": r}, use_local_output=True),
        both("PrepareModuleOutput", output_layouts=(r, s0), desired_output_layouts=(s1, r), use_local_output=False),
        both("PrepareModuleInputOutput", input_layouts=s1, desired_input_layouts=r, use_local_input=True,
             output_layouts=r, desired_output_layouts=s1, use_local_output=False),
    ]


@pytest.mark.parametrize("module", [nn.Linear(16, 8), nn.Embedding(32, 16)], ids=["linear", "embedding"])
def test_torchs_own_styles_read_as_graphshards(module):
    """A script that switches only ``parallelize_module``'s import keeps torch's styles: each is read as
    graphshard's style of the same arguments (same parameter placements, same declared layouts)."""
    from graphshard.styles import from_torch

    for theirs, ours in _torch_and_graphshard_styles():
        read = from_torch(theirs)
        assert type(read) is type(ours), theirs
        assert read.io("m", module) == ours.io("m", module), theirs
        if type(ours).__name__ in ("ColwiseParallel", "RowwiseParallel"):
            assert read.param_placements("m", module) == ours.param_placements("m", module), theirs


def test_a_plan_of_torchs_styles_compiles_to_graphshards_program():
    from torch.distributed.tensor import parallel as tp

    plan = {"tok_embeddings": RowwiseParallel(input_layouts=Replicate()),
            "layers.*.attn.w[qkv]": ColwiseParallel(), "layers.*.attn.wo": RowwiseParallel(),
            "layers.*.ffn.w1": ColwiseParallel(), "layers.*.ffn.w2": RowwiseParallel(),
            "layers.*.*_norm": SequenceParallel(), "layers.*.attn": SEQ_IN}
    theirs = {k: getattr(tp, type(s).__name__)(**({"input_layouts": Replicate()} if k == "tok_embeddings" else {}))
              for k, s in plan.items() if k != "layers.*.attn"}
    theirs["layers.*.attn"] = tp.PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
    ids = (torch.randint(0, 32, (2, 8)),)
    graphs = [compiled_stages(seeded(Transformer, TINY), graphshard.Plan(mesh1d("tp"), p), ids) for p in (plan, theirs)]
    assert graphs[0]["forward"] == graphs[1]["forward"] and graphs[0]["backward"] == graphs[1]["backward"]
    linear = seeded(nn.Linear, 16, 8)
    parallelize_module(linear, mesh1d("tp"), tp.ColwiseParallel())  # and through parallelize_module
    assert linear.weight.placements == (Shard(0),) and linear.weight.to_local().shape == (2, 16)


def test_parallelize_module_returns_the_module_with_dtensor_parameters():
    model = seeded(Transformer, TINY)
    names = [n for n, _ in model.named_parameters()]
    out = parallelize_module(model, mesh1d("tp"), {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate()),
        "layers.*.attn.w[qkv]": ColwiseParallel(), "layers.*.attn.wo": RowwiseParallel(),
        "layers.*.ffn.w1": ColwiseParallel(), "layers.*.ffn.w2": RowwiseParallel(),
        "layers.*.*_norm": SequenceParallel(),
    })
    assert out is model and [n for n, _ in model.named_parameters()] == names
    wq, wo, w1 = model.layers[0].attn.wq.weight, model.layers[0].attn.wo.weight, model.layers[0].ffn.w1
    assert wq.placements == (Shard(0),) and wq.to_local().shape == (4, 16)
    assert wo.placements == (Shard(1),) and wo.to_local().shape == (16, 4)
    ref = seeded(Transformer, TINY).layers[0]  # rank 0 of 4 holds torch.chunk's first piece
    assert torch.equal(wq.to_local(), ref.attn.wq.weight.chunk(4, 0)[0])
    assert torch.equal(wo.to_local(), ref.attn.wo.weight.chunk(4, 1)[0])
    assert w1.bias.placements == (Shard(0),) and model.layers[0].ffn.w2.bias.placements == (Replicate(),)
    assert model.layers[0].attn_norm.weight.placements == (Replicate(),)
    # the tied output weight is the vocabulary-sharded embedding, under both names
    assert model.tok_embeddings.weight.placements == (Shard(0),) and model.output.weight is model.tok_embeddings.weight
    assert not isinstance(model.pos_embeddings.weight, DTensor)  # not in the plan: left alone, as torch does


def test_mesh_from_context_and_style_for_the_module_itself():
    mesh = mesh1d("tp")
    linear = seeded(nn.Linear, 16, 8)
    with mesh:
        parallelize_module(linear, parallelize_plan=ColwiseParallel())
    assert linear.weight.placements == (Shard(0),) and linear.weight.to_local().shape == (2, 16)


def test_two_dimensional_mesh_must_be_sliced():
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    with pytest.raises(ValueError, match=r"1-D mesh.*mesh\['tp'\]"):
        parallelize_module(seeded(MLP, 16, 32, 8), mesh, {"fc1": ColwiseParallel()})
    parallelize_module(seeded(MLP, 16, 32, 8), mesh["tp"], {"fc1": ColwiseParallel()})


def test_no_plan_returns_the_module_unchanged():
    model = seeded(MLP, 16, 32, 8)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert parallelize_module(model, mesh1d("tp")) is model
    assert "no parallelize_plan" in str(caught[0].message)
    assert not isinstance(model.fc1.weight, DTensor)


@pytest.mark.parametrize("use_local_output", [True, False])
def test_use_local_output_at_the_model_output(use_local_output):
    linear = seeded(nn.Linear, 16, 8)
    plan = graphshard.Plan(mesh1d("tp"), {"": ColwiseParallel(use_local_output=use_local_output)})
    graphshard.compile(linear, plan, lower="eager")
    out = linear(torch.randn(4, 16))
    if use_local_output:
        assert type(out) is torch.Tensor and out.shape == (4, 2)  # this rank's output features
    else:
        assert isinstance(out, DTensor) and out.shape == (4, 8) and out.placements == (Shard(1),)
        assert out.to_local().shape == (4, 2)


def test_style_on_the_wrong_module_names_it():
    with pytest.raises(ValueError, match=r"ColwiseParallel applies to nn.Linear and nn.Embedding, but 'attn_norm' is "
                                         r"LayerNorm"):
        parallelize_module(seeded(Block, TINY), mesh1d("tp"), {"attn_norm": ColwiseParallel()})


def test_bad_layouts_are_rejected():
    with pytest.raises(ValueError, match="not a layout"):
        ColwiseParallel(output_layouts="shard")
    with pytest.raises(ValueError, match="same length"):
        PrepareModuleInput(input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(),))


class _Shared(nn.Module):
    def __init__(self):
        super().__init__()
        block = nn.Linear(16, 16)
        self.first, self.second = block, block

    def forward(self, x):
        return self.second(torch.relu(self.first(x)))


def test_shared_module_is_parallelized_once():
    from torch.distributed.tensor.parallel import ColwiseParallel as TorchColwise
    from torch.distributed.tensor.parallel import parallelize_module as torch_parallelize

    plan = {"first": ColwiseParallel(output_layouts=Replicate()), "second": ColwiseParallel(output_layouts=Replicate())}
    model = seeded(_Shared)
    parallelize_module(model, mesh1d("tp"), plan)
    assert model.first.weight is model.second.weight and model.first.weight.placements == (Shard(0),)
    assert [n for n, _ in model.named_parameters(remove_duplicate=False)] == [
        "first.weight", "first.bias", "second.weight", "second.bias"]
    # torch 2.13 cannot resolve the second name of the shared module and skips that entry with a warning
    with pytest.warns(UserWarning, match="'second' could not be resolved"):
        torch_parallelize(seeded(_Shared), mesh1d("tp"),
                          {"first": TorchColwise(output_layouts=Replicate()),
                           "second": TorchColwise(output_layouts=Replicate())})


def test_parallelizing_a_module_twice_is_an_error():
    model = seeded(MLP, 16, 32, 8)
    parallelize_module(model.fc1, mesh1d("tp"), ColwiseParallel())
    with pytest.raises(ValueError, match=r"^module 'fc1' was parallelized by an earlier parallelize_module call "
                                         r"\('fc1': ColwiseParallel\(.*\)\); a module takes one style .*: drop 'fc1' "
                                         r"from this plan$"):
        parallelize_module(model, mesh1d("tp"), {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})


@pytest.mark.parametrize("order", ["root_first", "block_first"])
def test_several_calls_in_any_order_are_one_plan(order):
    # torch's helpers parallelize the root, then each block in its own call; any order is one plan:
    # the outermost module is compiled once with every call's styles, the blocks are not compiled apart
    model = seeded(MLP, 16, 32, 8)
    calls = [(model, {"fc2": RowwiseParallel()}), (model.fc1, ColwiseParallel())]
    for module, plan in (calls if order == "root_first" else calls[::-1]):
        assert parallelize_module(module, mesh1d("tp"), plan) is module
    assert model.fc1.weight.placements == (Shard(0),) and model.fc2.weight.placements == (Shard(1),)
    assert "_graphshard" in model.__dict__ and "_graphshard" not in model.fc1.__dict__
    assert sorted(model._graphshard_tp_rules) == ["fc1", "fc2"]
    with pytest.raises(ValueError, match="over mesh"):
        parallelize_module(model.fc2, init_device_mesh("cpu", (4,)), RowwiseParallel())


class LocalHeads(nn.Module):
    """Attention-like code sized for each rank's piece, as torch's recipe writes it after
    ``attn.n_heads = n_heads // tp``: one head of 4 features a rank on the 4 ranks."""

    def __init__(self):
        super().__init__()
        self.wq, self.wo = nn.Linear(16, 16, bias=False), nn.Linear(16, 16, bias=False)
        self.n_heads = 1

    def forward(self, x):
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, self.n_heads, 4).transpose(1, 2)
        return self.wo((q * 2).transpose(1, 2).reshape(b, s, self.n_heads * 4))


class TestLocalOutputs(TestCase):
    def test_local_outputs_are_the_ranks_pieces(self):
        # wq's output handed on as the piece (to_local, placement "local": no size rewrite, no collective),
        # read as the logical Shard(-1) value again at wo's declared input (from_local: an alias)
        plan = graphshard.Plan(mesh1d("tp"), {"wq": ColwiseParallel(), "wo": RowwiseParallel()})
        text = graph_after(seeded(LocalHeads), plan, (torch.randn(2, 3, 16),), "localize_shapes",
                           after_shard=graphshard.storage.read_local_outputs, placements=True)
        self.assertExpectedInline(text, """\
class <lambda>(torch.nn.Module):
    def forward(self, arg0_1: "f32[2, 3, 16]", arg1_1: "f32[4, 16]", arg2_1: "f32[16, 4]"):
        alias_default: "f32[4, 16]" = torch.ops.aten.alias.default(arg1_1);  arg1_1 = None
        t: "f32[16, 4]" = torch.ops.aten.t.default(alias_default);  alias_default = None
        view: "f32[6, 16]" = torch.ops.aten.reshape.default(arg0_1, [6, 16]);  arg0_1 = None
        mm: "f32[6, 4]" = torch.ops.aten.mm.default(view, t);  view = t = None
        _unsafe_view: "f32[2, 3, 4]" = torch.ops.aten._unsafe_view.default(mm, [2, 3, 4]);  mm = None
        view_1: "f32[2, 3, 1, 4]" = torch.ops.aten.reshape.default(_unsafe_view, [2, 3, 1, 4]);  _unsafe_view = None
        transpose: "f32[2, 1, 3, 4]" = torch.ops.aten.transpose.int(view_1, 1, 2);  view_1 = None
        mul: "f32[2, 1, 3, 4]" = torch.ops.aten.mul.Tensor(transpose, 2);  transpose = None
        transpose_1: "f32[2, 3, 1, 4]" = torch.ops.aten.transpose.int(mul, 1, 2);  mul = None
        view_2: "f32[2, 3, 4]" = torch.ops.aten.reshape.default(transpose_1, [2, 3, 4]);  transpose_1 = None
        alias_default_1: "f32[2, 3, 4]" = torch.ops.aten.alias.default(view_2);  view_2 = None
        alias_default_2: "f32[16, 4]" = torch.ops.aten.alias.default(arg2_1);  arg2_1 = None
        t_1: "f32[4, 16]" = torch.ops.aten.t.default(alias_default_2);  alias_default_2 = None
        view_3: "f32[6, 4]" = torch.ops.aten.reshape.default(alias_default_1, [6, 4]);  alias_default_1 = None
        mm_1: "f32[6, 16]" = torch.ops.aten.mm.default(view_3, t_1);  view_3 = t_1 = None
        _unsafe_view_1: "f32[2, 3, 16]" = torch.ops.aten._unsafe_view.default(mm_1, [2, 3, 16]);  mm_1 = None
        all_reduce_default: "f32[2, 3, 16]" = torch.ops.graphshard.all_reduce.default(_unsafe_view_1, 'tp', 4);  _unsafe_view_1 = None
        return (all_reduce_default,)
arg0_1: {tp: R}
arg1_1: {tp: R}
arg2_1: {tp: R}
alias_default: {tp: S(0)}
t: {tp: S(1)}
view: {tp: R}
mm: {tp: S(1)}
_unsafe_view: {tp: S(2)}
view_1: {tp: local}
transpose: {tp: local}
mul: {tp: local}
transpose_1: {tp: local}
view_2: {tp: local}
alias_default_1: {tp: S(2)}
alias_default_2: {tp: S(1)}
t_1: {tp: S(0)}
view_3: {tp: S(1)}
mm_1: {tp: P}
_unsafe_view_1: {tp: P}
all_reduce_default: {tp: R}
""")
        head = graph_after(seeded(LocalHeads), plan, (torch.randn(2, 3, 16),), "annotate_placements",
                           after_shard=graphshard.storage.read_local_outputs, placements=True)
        self.assertExpectedInline("\n".join(l for l in head.splitlines() if "local" in l), """\
        to_local: "f32[2, 3, 4]" = torch.ops.graphshard.to_local.default(layout_1, 'wq:out0', 'tp', 'S(-1)', 4);  layout_1 = None
        view_1: "f32[2, 3, 1, 4]" = torch.ops.aten.reshape.default(to_local, [2, 3, 1, 4]);  to_local = None
        from_local: "f32[2, 3, 16]" = torch.ops.graphshard.from_local.default(view_2, 'wo:in0', 'tp', 'S(-1)', 4);  view_2 = None
        layout_2: "f32[2, 3, 16]" = torch.ops.graphshard.layout.default(from_local, 'wo:in0', 'tp', 'S(-1)', True);  from_local = None
to_local: {tp: local}
view_1: {tp: local}
transpose: {tp: local}
mul: {tp: local}
transpose_1: {tp: local}
view_2: {tp: local}
from_local: {tp: S(2)}""")


def test_a_user_style_that_replaces_its_module_is_refused():
    from torch.distributed.tensor.parallel import ParallelStyle as TorchStyle

    class Replacing(TorchStyle):
        def _apply(self, module, device_mesh):
            return nn.Linear(2, 2)

    model = seeded(MLP, 16, 32, 8)
    with pytest.raises(NotImplementedError, match=r"^Replacing on 'fc1': the style's _apply returned another module"):
        parallelize_module(model, mesh1d("tp"), {"fc1": Replacing()})


def test_a_user_style_placement_is_read_from_its_partition_fn():
    from torch.distributed.tensor import distribute_module, distribute_tensor
    from torch.distributed.tensor.parallel import ParallelStyle as TorchStyle

    class RowsOfFc(TorchStyle):  # no hooks: only what partition_fn does to the parameters
        def _apply(self, module, device_mesh):
            def partition(name, mod, mesh):
                if name == "":
                    mod.register_parameter("weight", nn.Parameter(distribute_tensor(mod.weight, mesh, [Shard(0)])))
            return distribute_module(module, device_mesh, partition)

    model = seeded(MLP, 16, 32, 8)
    parallelize_module(model, mesh1d("tp"), {"fc1": RowsOfFc()})
    assert model.fc1.weight.placements == (Shard(0),) and model.fc1.bias.placements == (Replicate(),)


def test_loss_parallel_on_dtensor_logits_is_torchs():
    logits = DTensor.from_local(torch.randn(6, 8), mesh1d("tp"), [Shard(1)], run_check=False)
    with loss_parallel():
        loss = torch.nn.functional.cross_entropy(logits, torch.randint(0, 32, (6,)))
    assert isinstance(loss, DTensor)
