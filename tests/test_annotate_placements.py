import operator

import torch
import torch.fx as fx
import torch.nn.functional as F
from expecttest import TestCase
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.fx.experimental.proxy_tensor import make_fx

from _golden import graph_after
from _models import attention, mlp, rotary_attention, tp_attention_plan, tp_mlp_plan
from conftest import WORLD
from graphshard.passes import _rules
from graphshard.passes._graph import fmt_placement, tensor_args
from graphshard.passes._rules import StridedShard

aten = torch.ops.aten
R, P, PMAX = Replicate(), Partial(), Partial("max")


# ------------------------------------------------------------------ rule-level helpers
def T(*shape, dtype=torch.float32) -> torch.Tensor:
    """A tensor argument of ``shape`` (meta: rules only read shapes)."""
    return torch.empty(shape, dtype=dtype, device="meta")


def fmt(p) -> str:
    if isinstance(p, (list, tuple)):
        return "(" + ", ".join(fmt(q) for q in p) + ")"
    return fmt_placement(p)


def op_node(op, *args, **kwargs) -> fx.Node:
    """One node calling ``op``, its tensor arguments placeholders with ``meta["val"]``."""
    g = fx.Graph()

    def placeholder(a):
        if not isinstance(a, torch.Tensor):
            return a
        n = g.placeholder(f"x{len(g.nodes)}")
        n.meta["val"] = a
        return n

    node = g.call_function(op, fx.node.map_aggregate(args, placeholder), fx.node.map_aggregate(kwargs, placeholder))
    node.meta["val"] = op(*args, **kwargs)
    return node


def apply(op, ins, *args, **kwargs) -> str:
    """``required -> output`` of ``op``'s rule for input placements ``ins``."""
    rule = _rules.lookup(op)
    extra = {"world": WORLD} if getattr(rule, "takes_world", False) else {}
    req, out = rule(op_node(op, *args, **kwargs), list(ins), **extra)
    return f"{fmt(req)} -> {fmt(out)}"


def cases(rows) -> str:
    """One line per ``(label, op, input placements, *args[, kwargs dict])``."""
    lines = []
    for label, *row in rows:
        kwargs = row.pop() if isinstance(row[-1], dict) else {}
        lines.append(f"{label}: {apply(*row, **kwargs)}")
    return "\n".join(lines) + "\n"


def propagate(fn, inputs, placements) -> str:
    """Traces ``fn`` as the backend does (make_fx under no_grad), gives its inputs
    ``placements`` and applies the rules node by node (every op must have one):
    ``name = op(arg: placement[->required], ...) -> output placement``."""
    with torch.no_grad():
        gm = make_fx(fn, tracing_mode="fake")(*inputs)
    pl, given, lines = {}, iter(placements), []
    for n in gm.graph.nodes:
        if n.op == "placeholder":
            pl[n] = next(given)
            lines.append(f"{n.name}: {fmt(pl[n])}")
        elif n.op == "call_function" and n.target == operator.getitem:
            parent = pl[n.args[0]]
            pl[n] = parent[n.args[1]] if isinstance(parent, list) else parent
        elif n.op == "call_function":
            args = [a for _, a in tensor_args(n)]
            cur = [pl[a] for a in args]
            if all(p == R for p in cur):
                req, out = cur, R
            else:
                rule = _rules.lookup(n.target)
                assert rule is not None, f"no placement rule for {n.target}"
                req, out = rule(n, cur)
            if isinstance(n.meta["val"], (list, tuple)) and not isinstance(out, list):
                out = [out] * len(n.meta["val"])
            pl[n] = out
            shown = [f"{a.name}: {fmt(c)}" + (f"->{fmt(r)}" if r != c else "") for a, c, r in zip(args, cur, req)]
            lines.append(f"{n.name} = {str(n.target).removeprefix('aten.')}({', '.join(shown)}) -> {fmt(out)}")
    return "\n".join(lines) + "\n"


class TestAnnotatePlacements(TestCase):
    def test_colwise_rowwise_mlp(self):
        # fc1 column-sharded, fc2 row-sharded: the activation between them is S(1),
        # fc2's output is Partial, and only the graph output needs Replicate.
        text = graph_after(mlp(), tp_mlp_plan(), (torch.randn(4, 16),), "annotate_placements", placements=True)
        self.assertExpectedInline(text, """\
class <lambda>(torch.nn.Module):
    def forward(self, arg0_1: "f32[8, 16]", arg1_1: "f32[8]", arg2_1: "f32[4, 16]", arg3_1: "f32[8, 8]", arg4_1: "f32[8]"):
        param: "f32[32, 16]" = torch.ops.graphshard.param.default(arg0_1, 'fc1.weight', [32, 16], torch.float32);  arg0_1 = None
        param_1: "f32[32]" = torch.ops.graphshard.param.default(arg1_1, 'fc1.bias', [32], torch.float32);  arg1_1 = None
        t: "f32[16, 32]" = torch.ops.aten.t.default(param);  param = None
        addmm: "f32[4, 32]" = torch.ops.aten.addmm.default(param_1, arg2_1, t);  param_1 = arg2_1 = t = None
        gelu: "f32[4, 32]" = torch.ops.aten.gelu.default(addmm);  addmm = None
        param_2: "f32[8, 32]" = torch.ops.graphshard.param.default(arg3_1, 'fc2.weight', [8, 32], torch.float32);  arg3_1 = None
        param_3: "f32[8]" = torch.ops.graphshard.param.default(arg4_1, 'fc2.bias', [8], torch.float32);  arg4_1 = None
        t_1: "f32[32, 8]" = torch.ops.aten.t.default(param_2);  param_2 = None
        addmm_1: "f32[4, 8]" = torch.ops.aten.addmm.default(param_3, gelu, t_1);  param_3 = gelu = t_1 = None
        return (addmm_1,)
arg0_1: {tp: R}
arg1_1: {tp: R}
arg2_1: {tp: R}
arg3_1: {tp: R}
arg4_1: {tp: R}
param: {tp: S(0)}
param_1: {tp: S(0)}
t: {tp: S(1)}
addmm: {tp: S(1)}
gelu: {tp: S(1)}
param_2: {tp: S(1)}
param_3: {tp: R}
t_1: {tp: S(0)}
addmm_1: {tp: P}
""")

    def test_attention_with_hard_coded_heads(self):
        text = graph_after(attention(), tp_attention_plan(), (torch.randn(2, 8, 16),), "annotate_placements",
                           placements=True)
        self.assertExpectedInline(text, """\
class <lambda>(torch.nn.Module):
    def forward(self, arg0_1: "f32[2, 8, 16]", arg1_1: "f32[4, 16]", arg2_1: "f32[4, 16]", arg3_1: "f32[4, 16]", arg4_1: "f32[16, 4]"):
        param: "f32[16, 16]" = torch.ops.graphshard.param.default(arg1_1, 'wq.weight', [16, 16], torch.float32);  arg1_1 = None
        t: "f32[16, 16]" = torch.ops.aten.t.default(param);  param = None
        view: "f32[16, 16]" = torch.ops.aten.reshape.default(arg0_1, [16, 16])
        mm: "f32[16, 16]" = torch.ops.aten.mm.default(view, t);  view = t = None
        _unsafe_view: "f32[2, 8, 16]" = torch.ops.aten._unsafe_view.default(mm, [2, 8, 16]);  mm = None
        view_1: "f32[2, 8, 4, 4]" = torch.ops.aten.reshape.default(_unsafe_view, [2, 8, 4, 4]);  _unsafe_view = None
        transpose: "f32[2, 4, 8, 4]" = torch.ops.aten.transpose.int(view_1, 1, 2);  view_1 = None
        param_1: "f32[16, 16]" = torch.ops.graphshard.param.default(arg2_1, 'wk.weight', [16, 16], torch.float32);  arg2_1 = None
        t_1: "f32[16, 16]" = torch.ops.aten.t.default(param_1);  param_1 = None
        view_2: "f32[16, 16]" = torch.ops.aten.reshape.default(arg0_1, [16, 16])
        mm_1: "f32[16, 16]" = torch.ops.aten.mm.default(view_2, t_1);  view_2 = t_1 = None
        _unsafe_view_1: "f32[2, 8, 16]" = torch.ops.aten._unsafe_view.default(mm_1, [2, 8, 16]);  mm_1 = None
        view_3: "f32[2, 8, 4, 4]" = torch.ops.aten.reshape.default(_unsafe_view_1, [2, 8, 4, 4]);  _unsafe_view_1 = None
        transpose_1: "f32[2, 4, 8, 4]" = torch.ops.aten.transpose.int(view_3, 1, 2);  view_3 = None
        param_2: "f32[16, 16]" = torch.ops.graphshard.param.default(arg3_1, 'wv.weight', [16, 16], torch.float32);  arg3_1 = None
        t_2: "f32[16, 16]" = torch.ops.aten.t.default(param_2);  param_2 = None
        view_4: "f32[16, 16]" = torch.ops.aten.reshape.default(arg0_1, [16, 16]);  arg0_1 = None
        mm_2: "f32[16, 16]" = torch.ops.aten.mm.default(view_4, t_2);  view_4 = t_2 = None
        _unsafe_view_2: "f32[2, 8, 16]" = torch.ops.aten._unsafe_view.default(mm_2, [2, 8, 16]);  mm_2 = None
        view_5: "f32[2, 8, 4, 4]" = torch.ops.aten.reshape.default(_unsafe_view_2, [2, 8, 4, 4]);  _unsafe_view_2 = None
        transpose_2: "f32[2, 4, 8, 4]" = torch.ops.aten.transpose.int(view_5, 1, 2);  view_5 = None
        transpose_3: "f32[2, 4, 4, 8]" = torch.ops.aten.transpose.int(transpose_1, -2, -1);  transpose_1 = None
        expand: "f32[2, 4, 8, 4]" = torch.ops.aten.expand.default(transpose, [2, 4, 8, 4]);  transpose = None
        clone: "f32[2, 4, 8, 4]" = torch.ops.aten.clone.default(expand, memory_format = torch.contiguous_format);  expand = None
        _unsafe_view_3: "f32[8, 8, 4]" = torch.ops.aten._unsafe_view.default(clone, [8, 8, 4]);  clone = None
        expand_1: "f32[2, 4, 4, 8]" = torch.ops.aten.expand.default(transpose_3, [2, 4, 4, 8]);  transpose_3 = None
        clone_1: "f32[2, 4, 4, 8]" = torch.ops.aten.clone.default(expand_1, memory_format = torch.contiguous_format);  expand_1 = None
        _unsafe_view_4: "f32[8, 4, 8]" = torch.ops.aten._unsafe_view.default(clone_1, [8, 4, 8]);  clone_1 = None
        bmm: "f32[8, 8, 8]" = torch.ops.aten.bmm.default(_unsafe_view_3, _unsafe_view_4);  _unsafe_view_3 = _unsafe_view_4 = None
        _unsafe_view_5: "f32[2, 4, 8, 8]" = torch.ops.aten._unsafe_view.default(bmm, [2, 4, 8, 8]);  bmm = None
        div: "f32[2, 4, 8, 8]" = torch.ops.aten.div.Tensor(_unsafe_view_5, 2.0);  _unsafe_view_5 = None
        full: "f32[8, 8]" = torch.ops.aten.full.default([8, 8], -inf, device = device(type='cpu'), pin_memory = False)
        triu: "f32[8, 8]" = torch.ops.aten.triu.default(full, 1);  full = None
        add: "f32[2, 4, 8, 8]" = torch.ops.aten.add.Tensor(div, triu);  div = triu = None
        _softmax: "f32[2, 4, 8, 8]" = torch.ops.aten._softmax.default(add, -1, False);  add = None
        expand_2: "f32[2, 4, 8, 8]" = torch.ops.aten.expand.default(_softmax, [2, 4, 8, 8]);  _softmax = None
        view_6: "f32[8, 8, 8]" = torch.ops.aten.reshape.default(expand_2, [8, 8, 8]);  expand_2 = None
        expand_3: "f32[2, 4, 8, 4]" = torch.ops.aten.expand.default(transpose_2, [2, 4, 8, 4]);  transpose_2 = None
        clone_2: "f32[2, 4, 8, 4]" = torch.ops.aten.clone.default(expand_3, memory_format = torch.contiguous_format);  expand_3 = None
        _unsafe_view_6: "f32[8, 8, 4]" = torch.ops.aten._unsafe_view.default(clone_2, [8, 8, 4]);  clone_2 = None
        bmm_1: "f32[8, 8, 4]" = torch.ops.aten.bmm.default(view_6, _unsafe_view_6);  view_6 = _unsafe_view_6 = None
        _unsafe_view_7: "f32[2, 4, 8, 4]" = torch.ops.aten._unsafe_view.default(bmm_1, [2, 4, 8, 4]);  bmm_1 = None
        transpose_4: "f32[2, 8, 4, 4]" = torch.ops.aten.transpose.int(_unsafe_view_7, 1, 2);  _unsafe_view_7 = None
        clone_3: "f32[2, 8, 4, 4]" = torch.ops.aten.clone.default(transpose_4, memory_format = torch.contiguous_format);  transpose_4 = None
        _unsafe_view_8: "f32[2, 8, 16]" = torch.ops.aten._unsafe_view.default(clone_3, [2, 8, 16]);  clone_3 = None
        param_3: "f32[16, 16]" = torch.ops.graphshard.param.default(arg4_1, 'wo.weight', [16, 16], torch.float32);  arg4_1 = None
        t_3: "f32[16, 16]" = torch.ops.aten.t.default(param_3);  param_3 = None
        view_7: "f32[16, 16]" = torch.ops.aten.reshape.default(_unsafe_view_8, [16, 16]);  _unsafe_view_8 = None
        mm_3: "f32[16, 16]" = torch.ops.aten.mm.default(view_7, t_3);  view_7 = t_3 = None
        _unsafe_view_9: "f32[2, 8, 16]" = torch.ops.aten._unsafe_view.default(mm_3, [2, 8, 16]);  mm_3 = None
        return (_unsafe_view_9,)
arg0_1: {tp: R}
arg1_1: {tp: R}
arg2_1: {tp: R}
arg3_1: {tp: R}
arg4_1: {tp: R}
param: {tp: S(0)}
t: {tp: S(1)}
view: {tp: R}
mm: {tp: S(1)}
_unsafe_view: {tp: S(2)}
view_1: {tp: S(2)}
transpose: {tp: S(1)}
param_1: {tp: S(0)}
t_1: {tp: S(1)}
view_2: {tp: R}
mm_1: {tp: S(1)}
_unsafe_view_1: {tp: S(2)}
view_3: {tp: S(2)}
transpose_1: {tp: S(1)}
param_2: {tp: S(0)}
t_2: {tp: S(1)}
view_4: {tp: R}
mm_2: {tp: S(1)}
_unsafe_view_2: {tp: S(2)}
view_5: {tp: S(2)}
transpose_2: {tp: S(1)}
transpose_3: {tp: S(1)}
expand: {tp: S(1)}
clone: {tp: S(1)}
_unsafe_view_3: {tp: S(0/2)}
expand_1: {tp: S(1)}
clone_1: {tp: S(1)}
_unsafe_view_4: {tp: S(0/2)}
bmm: {tp: S(0/2)}
_unsafe_view_5: {tp: S(1)}
div: {tp: S(1)}
full: {tp: R}
triu: {tp: R}
add: {tp: S(1)}
_softmax: {tp: S(1)}
expand_2: {tp: S(1)}
view_6: {tp: S(0/2)}
expand_3: {tp: S(1)}
clone_2: {tp: S(1)}
_unsafe_view_6: {tp: S(0/2)}
bmm_1: {tp: S(0/2)}
_unsafe_view_7: {tp: S(1)}
transpose_4: {tp: S(2)}
clone_3: {tp: S(2)}
_unsafe_view_8: {tp: S(2)}
param_3: {tp: S(1)}
t_3: {tp: S(0)}
view_7: {tp: S(1)}
mm_3: {tp: P}
_unsafe_view_9: {tp: P}
""")

    def test_data_parallel_only_graph_is_untouched(self):
        from _models import fsdp_plan, tiny_transformer
        from graphshard.testing.models import token_batch

        x, _ = token_batch(0, 2, 8, 32)
        text = graph_after(tiny_transformer(), fsdp_plan(), (x,), "annotate_placements", placements=True)
        self.assertNotIn("placement", text)
        self.assertIn("graphshard.param.default", text)

    # ------------------------------------------------------------------ transformer blocks
    def test_sdpa_attention_with_real_rotary(self):
        # wq/wk/wv column-sharded, wo row-sharded: q/k/v are sharded on heads (S(2) on
        # [b, s, h, hd], S(1) after the transpose) through rotary (chunk/cat on the last dim,
        # cos/sin indexed by position and replicated) and SDPA (output and logsumexp) up to wo,
        # whose output is the only Partial.
        text = graph_after(rotary_attention(), tp_attention_plan(), (torch.randn(2, 8, 16),), "annotate_placements",
                           placements=True)
        self.assertExpectedInline(text, """\
class <lambda>(torch.nn.Module):
    def forward(self, arg0_1: "f32[2, 8, 16]", arg1_1: "f32[4, 16]", arg2_1: "f32[4, 16]", arg3_1: "f32[4, 16]", arg4_1: "f32[8, 4]", arg5_1: "f32[8, 4]", arg6_1: "f32[16, 4]"):
        param: "f32[16, 16]" = torch.ops.graphshard.param.default(arg1_1, 'wq.weight', [16, 16], torch.float32);  arg1_1 = None
        t: "f32[16, 16]" = torch.ops.aten.t.default(param);  param = None
        view: "f32[16, 16]" = torch.ops.aten.reshape.default(arg0_1, [16, 16])
        mm: "f32[16, 16]" = torch.ops.aten.mm.default(view, t);  view = t = None
        _unsafe_view: "f32[2, 8, 16]" = torch.ops.aten._unsafe_view.default(mm, [2, 8, 16]);  mm = None
        view_1: "f32[2, 8, 4, 4]" = torch.ops.aten.reshape.default(_unsafe_view, [2, 8, 4, 4]);  _unsafe_view = None
        param_1: "f32[16, 16]" = torch.ops.graphshard.param.default(arg2_1, 'wk.weight', [16, 16], torch.float32);  arg2_1 = None
        t_1: "f32[16, 16]" = torch.ops.aten.t.default(param_1);  param_1 = None
        view_2: "f32[16, 16]" = torch.ops.aten.reshape.default(arg0_1, [16, 16])
        mm_1: "f32[16, 16]" = torch.ops.aten.mm.default(view_2, t_1);  view_2 = t_1 = None
        _unsafe_view_1: "f32[2, 8, 16]" = torch.ops.aten._unsafe_view.default(mm_1, [2, 8, 16]);  mm_1 = None
        view_3: "f32[2, 8, 4, 4]" = torch.ops.aten.reshape.default(_unsafe_view_1, [2, 8, 4, 4]);  _unsafe_view_1 = None
        param_2: "f32[16, 16]" = torch.ops.graphshard.param.default(arg3_1, 'wv.weight', [16, 16], torch.float32);  arg3_1 = None
        t_2: "f32[16, 16]" = torch.ops.aten.t.default(param_2);  param_2 = None
        view_4: "f32[16, 16]" = torch.ops.aten.reshape.default(arg0_1, [16, 16]);  arg0_1 = None
        mm_2: "f32[16, 16]" = torch.ops.aten.mm.default(view_4, t_2);  view_4 = t_2 = None
        _unsafe_view_2: "f32[2, 8, 16]" = torch.ops.aten._unsafe_view.default(mm_2, [2, 8, 16]);  mm_2 = None
        view_5: "f32[2, 8, 4, 4]" = torch.ops.aten.reshape.default(_unsafe_view_2, [2, 8, 4, 4]);  _unsafe_view_2 = None
        transpose: "f32[2, 4, 8, 4]" = torch.ops.aten.transpose.int(view_5, 1, 2);  view_5 = None
        arange: "i64[8]" = torch.ops.aten.arange.default(8, device = device(type='cpu'), pin_memory = False)
        transpose_1: "f32[2, 4, 8, 4]" = torch.ops.aten.transpose.int(view_1, 1, 2);  view_1 = None
        transpose_2: "f32[2, 4, 8, 4]" = torch.ops.aten.transpose.int(view_3, 1, 2);  view_3 = None
        index: "f32[8, 4]" = torch.ops.aten.index.Tensor(arg4_1, [arange]);  arg4_1 = None
        index_1: "f32[8, 4]" = torch.ops.aten.index.Tensor(arg5_1, [arange]);  arg5_1 = arange = None
        mul: "f32[2, 4, 8, 4]" = torch.ops.aten.mul.Tensor(transpose_1, index)
        split = torch.ops.aten.split.Tensor(transpose_1, 2, -1);  transpose_1 = None
        getitem: "f32[2, 4, 8, 2]" = split[0]
        getitem_1: "f32[2, 4, 8, 2]" = split[1];  split = None
        neg: "f32[2, 4, 8, 2]" = torch.ops.aten.neg.default(getitem_1);  getitem_1 = None
        cat: "f32[2, 4, 8, 4]" = torch.ops.aten.cat.default([neg, getitem], -1);  neg = getitem = None
        mul_1: "f32[2, 4, 8, 4]" = torch.ops.aten.mul.Tensor(cat, index_1);  cat = None
        add: "f32[2, 4, 8, 4]" = torch.ops.aten.add.Tensor(mul, mul_1);  mul = mul_1 = None
        mul_2: "f32[2, 4, 8, 4]" = torch.ops.aten.mul.Tensor(transpose_2, index);  index = None
        split_1 = torch.ops.aten.split.Tensor(transpose_2, 2, -1);  transpose_2 = None
        getitem_2: "f32[2, 4, 8, 2]" = split_1[0]
        getitem_3: "f32[2, 4, 8, 2]" = split_1[1];  split_1 = None
        neg_1: "f32[2, 4, 8, 2]" = torch.ops.aten.neg.default(getitem_3);  getitem_3 = None
        cat_1: "f32[2, 4, 8, 4]" = torch.ops.aten.cat.default([neg_1, getitem_2], -1);  neg_1 = getitem_2 = None
        mul_3: "f32[2, 4, 8, 4]" = torch.ops.aten.mul.Tensor(cat_1, index_1);  cat_1 = index_1 = None
        add_1: "f32[2, 4, 8, 4]" = torch.ops.aten.add.Tensor(mul_2, mul_3);  mul_2 = mul_3 = None
        _scaled_dot_product_flash_attention_for_cpu = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default(add, add_1, transpose, 0.0, True);  add = add_1 = transpose = None
        getitem_4: "f32[2, 4, 8, 4]" = _scaled_dot_product_flash_attention_for_cpu[0]
        getitem_5: "f32[2, 4, 8]" = _scaled_dot_product_flash_attention_for_cpu[1];  _scaled_dot_product_flash_attention_for_cpu = getitem_5 = None
        transpose_3: "f32[2, 8, 4, 4]" = torch.ops.aten.transpose.int(getitem_4, 1, 2);  getitem_4 = None
        view_6: "f32[2, 8, 16]" = torch.ops.aten.reshape.default(transpose_3, [2, 8, 16]);  transpose_3 = None
        param_3: "f32[16, 16]" = torch.ops.graphshard.param.default(arg6_1, 'wo.weight', [16, 16], torch.float32);  arg6_1 = None
        t_3: "f32[16, 16]" = torch.ops.aten.t.default(param_3);  param_3 = None
        view_7: "f32[16, 16]" = torch.ops.aten.reshape.default(view_6, [16, 16]);  view_6 = None
        mm_3: "f32[16, 16]" = torch.ops.aten.mm.default(view_7, t_3);  view_7 = t_3 = None
        _unsafe_view_3: "f32[2, 8, 16]" = torch.ops.aten._unsafe_view.default(mm_3, [2, 8, 16]);  mm_3 = None
        return (_unsafe_view_3,)
arg0_1: {tp: R}
arg1_1: {tp: R}
arg2_1: {tp: R}
arg3_1: {tp: R}
arg4_1: {tp: R}
arg5_1: {tp: R}
arg6_1: {tp: R}
param: {tp: S(0)}
t: {tp: S(1)}
view: {tp: R}
mm: {tp: S(1)}
_unsafe_view: {tp: S(2)}
view_1: {tp: S(2)}
param_1: {tp: S(0)}
t_1: {tp: S(1)}
view_2: {tp: R}
mm_1: {tp: S(1)}
_unsafe_view_1: {tp: S(2)}
view_3: {tp: S(2)}
param_2: {tp: S(0)}
t_2: {tp: S(1)}
view_4: {tp: R}
mm_2: {tp: S(1)}
_unsafe_view_2: {tp: S(2)}
view_5: {tp: S(2)}
transpose: {tp: S(1)}
arange: {tp: R}
transpose_1: {tp: S(1)}
transpose_2: {tp: S(1)}
index: {tp: R}
index_1: {tp: R}
mul: {tp: S(1)}
split: [{tp: S(1)}, {tp: S(1)}]
getitem: {tp: S(1)}
getitem_1: {tp: S(1)}
neg: {tp: S(1)}
cat: {tp: S(1)}
mul_1: {tp: S(1)}
add: {tp: S(1)}
mul_2: {tp: S(1)}
split_1: [{tp: S(1)}, {tp: S(1)}]
getitem_2: {tp: S(1)}
getitem_3: {tp: S(1)}
neg_1: {tp: S(1)}
cat_1: {tp: S(1)}
mul_3: {tp: S(1)}
add_1: {tp: S(1)}
_scaled_dot_product_flash_attention_for_cpu: [{tp: S(1)}, {tp: S(1)}]
getitem_4: {tp: S(1)}
getitem_5: {tp: S(1)}
transpose_3: {tp: S(2)}
view_6: {tp: S(2)}
param_3: {tp: S(1)}
t_3: {tp: S(0)}
view_7: {tp: S(1)}
mm_3: {tp: P}
_unsafe_view_3: {tp: P}
""")

    def test_complex_rotary_attention(self):
        # llama's rotary: view_as_complex of [b, s, h, hd/2, 2], times freqs_cis [1, s, 1, hd/2]
        # (replicated, broadcast over heads), view_as_real, flatten: heads stay sharded (S(2)).
        text = graph_after(rotary_attention(complex_form=True), tp_attention_plan(), (torch.randn(2, 8, 16),),
                           "annotate_placements", placements=True)
        self.assertExpectedInline(text, """\
class <lambda>(torch.nn.Module):
    def forward(self, arg0_1: "f32[2, 8, 16]", arg1_1: "f32[4, 16]", arg2_1: "f32[4, 16]", arg3_1: "f32[4, 16]", arg4_1: "c64[8, 2]", arg5_1: "f32[16, 4]"):
        param: "f32[16, 16]" = torch.ops.graphshard.param.default(arg1_1, 'wq.weight', [16, 16], torch.float32);  arg1_1 = None
        t: "f32[16, 16]" = torch.ops.aten.t.default(param);  param = None
        view: "f32[16, 16]" = torch.ops.aten.reshape.default(arg0_1, [16, 16])
        mm: "f32[16, 16]" = torch.ops.aten.mm.default(view, t);  view = t = None
        _unsafe_view: "f32[2, 8, 16]" = torch.ops.aten._unsafe_view.default(mm, [2, 8, 16]);  mm = None
        view_1: "f32[2, 8, 4, 4]" = torch.ops.aten.reshape.default(_unsafe_view, [2, 8, 4, 4]);  _unsafe_view = None
        param_1: "f32[16, 16]" = torch.ops.graphshard.param.default(arg2_1, 'wk.weight', [16, 16], torch.float32);  arg2_1 = None
        t_1: "f32[16, 16]" = torch.ops.aten.t.default(param_1);  param_1 = None
        view_2: "f32[16, 16]" = torch.ops.aten.reshape.default(arg0_1, [16, 16])
        mm_1: "f32[16, 16]" = torch.ops.aten.mm.default(view_2, t_1);  view_2 = t_1 = None
        _unsafe_view_1: "f32[2, 8, 16]" = torch.ops.aten._unsafe_view.default(mm_1, [2, 8, 16]);  mm_1 = None
        view_3: "f32[2, 8, 4, 4]" = torch.ops.aten.reshape.default(_unsafe_view_1, [2, 8, 4, 4]);  _unsafe_view_1 = None
        param_2: "f32[16, 16]" = torch.ops.graphshard.param.default(arg3_1, 'wv.weight', [16, 16], torch.float32);  arg3_1 = None
        t_2: "f32[16, 16]" = torch.ops.aten.t.default(param_2);  param_2 = None
        view_4: "f32[16, 16]" = torch.ops.aten.reshape.default(arg0_1, [16, 16]);  arg0_1 = None
        mm_2: "f32[16, 16]" = torch.ops.aten.mm.default(view_4, t_2);  view_4 = t_2 = None
        _unsafe_view_2: "f32[2, 8, 16]" = torch.ops.aten._unsafe_view.default(mm_2, [2, 8, 16]);  mm_2 = None
        view_5: "f32[2, 8, 4, 4]" = torch.ops.aten.reshape.default(_unsafe_view_2, [2, 8, 4, 4]);  _unsafe_view_2 = None
        transpose: "f32[2, 4, 8, 4]" = torch.ops.aten.transpose.int(view_5, 1, 2);  view_5 = None
        arange: "i64[8]" = torch.ops.aten.arange.default(8, device = device(type='cpu'), pin_memory = False)
        index: "c64[8, 2]" = torch.ops.aten.index.Tensor(arg4_1, [arange]);  arg4_1 = arange = None
        view_6: "c64[1, 8, 1, 2]" = torch.ops.aten.reshape.default(index, [1, 8, 1, 2]);  index = None
        view_7: "f32[2, 8, 4, 2, 2]" = torch.ops.aten.reshape.default(view_1, [2, 8, 4, -1, 2]);  view_1 = None
        view_as_complex: "c64[2, 8, 4, 2]" = torch.ops.aten.view_as_complex.default(view_7);  view_7 = None
        mul: "c64[2, 8, 4, 2]" = torch.ops.aten.mul.Tensor(view_as_complex, view_6);  view_as_complex = None
        view_as_real: "f32[2, 8, 4, 2, 2]" = torch.ops.aten.view_as_real.default(mul);  mul = None
        view_8: "f32[2, 8, 4, 4]" = torch.ops.aten.reshape.default(view_as_real, [2, 8, 4, 4]);  view_as_real = None
        transpose_1: "f32[2, 4, 8, 4]" = torch.ops.aten.transpose.int(view_8, 1, 2);  view_8 = None
        view_9: "f32[2, 8, 4, 2, 2]" = torch.ops.aten.reshape.default(view_3, [2, 8, 4, -1, 2]);  view_3 = None
        view_as_complex_1: "c64[2, 8, 4, 2]" = torch.ops.aten.view_as_complex.default(view_9);  view_9 = None
        mul_1: "c64[2, 8, 4, 2]" = torch.ops.aten.mul.Tensor(view_as_complex_1, view_6);  view_as_complex_1 = view_6 = None
        view_as_real_1: "f32[2, 8, 4, 2, 2]" = torch.ops.aten.view_as_real.default(mul_1);  mul_1 = None
        view_10: "f32[2, 8, 4, 4]" = torch.ops.aten.reshape.default(view_as_real_1, [2, 8, 4, 4]);  view_as_real_1 = None
        transpose_2: "f32[2, 4, 8, 4]" = torch.ops.aten.transpose.int(view_10, 1, 2);  view_10 = None
        _scaled_dot_product_flash_attention_for_cpu = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default(transpose_1, transpose_2, transpose, 0.0, True);  transpose_1 = transpose_2 = transpose = None
        getitem: "f32[2, 4, 8, 4]" = _scaled_dot_product_flash_attention_for_cpu[0]
        getitem_1: "f32[2, 4, 8]" = _scaled_dot_product_flash_attention_for_cpu[1];  _scaled_dot_product_flash_attention_for_cpu = getitem_1 = None
        transpose_3: "f32[2, 8, 4, 4]" = torch.ops.aten.transpose.int(getitem, 1, 2);  getitem = None
        view_11: "f32[2, 8, 16]" = torch.ops.aten.reshape.default(transpose_3, [2, 8, 16]);  transpose_3 = None
        param_3: "f32[16, 16]" = torch.ops.graphshard.param.default(arg5_1, 'wo.weight', [16, 16], torch.float32);  arg5_1 = None
        t_3: "f32[16, 16]" = torch.ops.aten.t.default(param_3);  param_3 = None
        view_12: "f32[16, 16]" = torch.ops.aten.reshape.default(view_11, [16, 16]);  view_11 = None
        mm_3: "f32[16, 16]" = torch.ops.aten.mm.default(view_12, t_3);  view_12 = t_3 = None
        _unsafe_view_3: "f32[2, 8, 16]" = torch.ops.aten._unsafe_view.default(mm_3, [2, 8, 16]);  mm_3 = None
        return (_unsafe_view_3,)
arg0_1: {tp: R}
arg1_1: {tp: R}
arg2_1: {tp: R}
arg3_1: {tp: R}
arg4_1: {tp: R}
arg5_1: {tp: R}
param: {tp: S(0)}
t: {tp: S(1)}
view: {tp: R}
mm: {tp: S(1)}
_unsafe_view: {tp: S(2)}
view_1: {tp: S(2)}
param_1: {tp: S(0)}
t_1: {tp: S(1)}
view_2: {tp: R}
mm_1: {tp: S(1)}
_unsafe_view_1: {tp: S(2)}
view_3: {tp: S(2)}
param_2: {tp: S(0)}
t_2: {tp: S(1)}
view_4: {tp: R}
mm_2: {tp: S(1)}
_unsafe_view_2: {tp: S(2)}
view_5: {tp: S(2)}
transpose: {tp: S(1)}
arange: {tp: R}
index: {tp: R}
view_6: {tp: R}
view_7: {tp: S(2)}
view_as_complex: {tp: S(2)}
mul: {tp: S(2)}
view_as_real: {tp: S(2)}
view_8: {tp: S(2)}
transpose_1: {tp: S(1)}
view_9: {tp: S(2)}
view_as_complex_1: {tp: S(2)}
mul_1: {tp: S(2)}
view_as_real_1: {tp: S(2)}
view_10: {tp: S(2)}
transpose_2: {tp: S(1)}
_scaled_dot_product_flash_attention_for_cpu: [{tp: S(1)}, {tp: S(1)}]
getitem: {tp: S(1)}
getitem_1: {tp: S(1)}
transpose_3: {tp: S(2)}
view_11: {tp: S(2)}
param_3: {tp: S(1)}
t_3: {tp: S(0)}
view_12: {tp: S(1)}
mm_3: {tp: P}
_unsafe_view_3: {tp: P}
""")

    # ------------------------------------------------------------------ traced pieces, placements given
    def test_sequence_parallel_layer_norm(self):
        # [b, s, d] sharded on the sequence: layer norm over d is local (mean/rstd too).
        def ln(x, w, b):
            return F.layer_norm(x, (16,), w, b)

        x, w, b = torch.randn(2, 8, 16), torch.randn(16), torch.randn(16)  # distinct: make_fx keys inputs by identity
        self.assertExpectedInline(propagate(ln, (x, w, b), [Shard(1), R, R]), """\
x_1: S(1)
w_1: R
b_1: R
native_layer_norm = native_layer_norm.default(x_1: S(1), w_1: R, b_1: R) -> (S(1), S(1), S(1))
""")
        # Sharded on the normalized dim: replicated first.
        self.assertExpectedInline(propagate(ln, (x, w, b), [Shard(2), R, R]), """\
x_1: S(2)
w_1: R
b_1: R
native_layer_norm = native_layer_norm.default(x_1: S(2)->R, w_1: R, b_1: R) -> (R, R, R)
""")

    def test_sequence_parallel_rms_norm(self):
        # On CPU F.rms_norm (and nn.RMSNorm) decompose to pow/mean/rsqrt/mul under make_fx;
        # with the sequence sharded every step stays sharded and the weight broadcasts.
        def rms(x, w):
            return F.rms_norm(x, (16,), w, 1e-6)

        x, w = torch.randn(2, 8, 16), torch.randn(16)
        self.assertExpectedInline(propagate(rms, (x, w), [Shard(1), R]), """\
x_1: S(1)
w_1: R
pow_1 = pow.Tensor_Scalar(x_1: S(1)) -> S(1)
mean = mean.dim(pow_1: S(1)) -> S(1)
add_ = add_.Scalar(mean: S(1)) -> S(1)
rsqrt = rsqrt.default(add_: S(1)) -> S(1)
mul = mul.Tensor(x_1: S(1), rsqrt: S(1)) -> S(1)
mul_1 = mul.Tensor(mul: S(1), w_1: R) -> S(1)
""")
        # Sharded on the normalized dim: the mean needs the whole row (the squares are gathered).
        self.assertExpectedInline(propagate(rms, (x, w), [Shard(2), R]), """\
x_1: S(2)
w_1: R
pow_1 = pow.Tensor_Scalar(x_1: S(2)) -> S(2)
mean = mean.dim(pow_1: S(2)->R) -> R
add_ = add_.Scalar(mean: R) -> R
rsqrt = rsqrt.default(add_: R) -> R
mul = mul.Tensor(x_1: S(2), rsqrt: R) -> S(2)
mul_1 = mul.Tensor(mul: S(2), w_1: R->S(0)) -> S(2)
""")

    def test_real_rotary_on_bshd_layout(self):
        # q/k as [b, s, h, hd] sharded on heads; cos/sin [max_s, hd] indexed by position,
        # unsqueezed to broadcast over heads; rotate_half written with slices this time,
        # and q/k stacked and unbound again.
        def rotary(q, k, cos_t, sin_t):
            pos = torch.arange(8)
            cos, sin = cos_t[pos][:, None, :], sin_t[pos][:, None, :]

            def rot(x):
                x1, x2 = x[..., :2], x[..., 2:]
                return torch.cat((-x2, x1), dim=-1)

            qk = torch.stack((q * cos + rot(q) * sin, k * cos + rot(k) * sin))
            q2, k2 = qk.unbind(0)
            return q2, k2

        q, k, cos, sin = torch.randn(2, 8, 4, 4), torch.randn(2, 8, 4, 4), torch.randn(16, 4), torch.randn(16, 4)
        self.assertExpectedInline(propagate(rotary, (q, k, cos, sin), [Shard(2), Shard(2), R, R]), """\
q_1: S(2)
k_1: S(2)
cos_t_1: R
sin_t_1: R
arange = arange.default() -> R
index = index.Tensor(cos_t_1: R, arange: R) -> R
unsqueeze = unsqueeze.default(index: R) -> R
index_1 = index.Tensor(sin_t_1: R, arange: R) -> R
unsqueeze_1 = unsqueeze.default(index_1: R) -> R
mul = mul.Tensor(q_1: S(2), unsqueeze: R) -> S(2)
slice_1 = slice.Tensor(q_1: S(2)) -> S(2)
slice_2 = slice.Tensor(q_1: S(2)) -> S(2)
neg = neg.default(slice_2: S(2)) -> S(2)
cat = cat.default(neg: S(2), slice_1: S(2)) -> S(2)
mul_1 = mul.Tensor(cat: S(2), unsqueeze_1: R) -> S(2)
add = add.Tensor(mul: S(2), mul_1: S(2)) -> S(2)
mul_2 = mul.Tensor(k_1: S(2), unsqueeze: R) -> S(2)
slice_3 = slice.Tensor(k_1: S(2)) -> S(2)
slice_4 = slice.Tensor(k_1: S(2)) -> S(2)
neg_1 = neg.default(slice_4: S(2)) -> S(2)
cat_1 = cat.default(neg_1: S(2), slice_3: S(2)) -> S(2)
mul_3 = mul.Tensor(cat_1: S(2), unsqueeze_1: R) -> S(2)
add_1 = add.Tensor(mul_2: S(2), mul_3: S(2)) -> S(2)
stack = stack.default(add: S(2), add_1: S(2)) -> S(3)
unbind = unbind.int(stack: S(3)) -> (S(2), S(2))
""")

    def test_amax_is_partial_max_only_where_no_gradient_flows(self):
        # A softmax written by hand over a sharded dim, with the max detached (what the
        # forward-only all_reduce_max supports): amax gives Partial(max), replicated for sub.
        def stable_softmax(x):
            m = x.detach().amax(-1, keepdim=True)
            e = (x - m).exp()
            return e / e.sum(-1, keepdim=True)

        def amax_with_grad(x):
            return x.amax(-1)

        x = torch.randn(2, 8)
        self.assertExpectedInline(propagate(stable_softmax, (x,), [Shard(1)]), """\
x_1: S(1)
detach = detach.default(x_1: S(1)) -> S(1)
amax = amax.default(detach: S(1)) -> P(max)
sub = sub.Tensor(x_1: S(1), amax: P(max)->R) -> S(1)
exp = exp.default(sub: S(1)) -> S(1)
sum_1 = sum.dim_IntList(exp: S(1)) -> P
div = div.Tensor(exp: S(1), sum_1: P->R) -> S(1)
""")
        self.assertExpectedInline(propagate(amax_with_grad, (x,), [Shard(1)]), """\
x_1: S(1)
amax = amax.default(x_1: S(1)->R) -> R
""")

    # ------------------------------------------------------------------ rule by rule
    def test_view_family_rules(self):
        x = T(2, 8, 4, 4)
        idx = T(3, dtype=torch.long)
        self.assertExpectedInline(cases([
            ("split last dim, shard on heads", aten.split.Tensor, [Shard(1)], x, 2, -1),
            ("split the sharded dim", aten.split.Tensor, [Shard(1)], x, 2, 1),
            ("split a fused q|k|v into its blocks", aten.split.Tensor, [StridedShard(2, 3)], T(2, 8, 12), 4, 2),
            ("split fused blocks 1 | 2", aten.split_with_sizes.default, [StridedShard(2, 3)], T(2, 8, 12), [4, 8], 2),
            ("split inside a fused block", aten.split.Tensor, [StridedShard(2, 3)], T(2, 8, 12), 6, 2),
            ("split_with_sizes, partial", aten.split_with_sizes.default, [P], x, [1, 3], -1),
            ("unbind before the shard", aten.unbind.int, [Shard(1)], x, 0),
            ("unbind the sharded dim", aten.unbind.int, [Shard(1)], x, 1),
            ("cat last dim, both sharded", aten.cat.default, [Shard(1), Shard(1)], [x, x], -1),
            ("cat last dim, one replicated", aten.cat.default, [Shard(1), R], [x, x], -1),
            ("cat along the shard", aten.cat.default, [Shard(1), Shard(1)], [x, x], 1),
            ("cat partials", aten.cat.default, [P, P], [x, x], 1),
            ("cat partial and replicated", aten.cat.default, [P, R], [x, x], 1),
            ("cat partial and shard", aten.cat.default, [P, Shard(1)], [x, x], -1),
            ("cat P(max) and replicated", aten.cat.default, [PMAX, R], [x, x], -1),
            ("cat legacy empty and sharded (a KV cache)", aten.cat.default, [R, Shard(1)], [T(0), x], -1),
            ("cat legacy empty and sharded, along the shard", aten.cat.default, [R, Shard(1)], [T(0), x], 1),
            ("stack at 0", aten.stack.default, [Shard(1), Shard(1)], [x, x]),
            ("stack at the shard", aten.stack.default, [Shard(1), R], [x, x], 1),
            ("stack strided", aten.stack.default, [StridedShard(0, 2), StridedShard(0, 2)], [x, x], -1),
            ("slice another dim", aten.slice.Tensor, [Shard(1)], x, 3, 0, 2),
            ("slice whole sharded dim", aten.slice.Tensor, [Shard(1)], x, 1, 0, 9223372036854775807),
            ("slice part of sharded dim", aten.slice.Tensor, [Shard(1)], x, 1, 2, 6),
            ("narrow whole", aten.narrow.default, [Shard(1)], x, 1, 0, 8),
            ("narrow part", aten.narrow.default, [Shard(1)], x, 1, 1, 4),
            ("select before the shard", aten.select.int, [Shard(1)], x, 0, 1),
            ("select after the shard", aten.select.int, [Shard(1)], x, 2, 1),
            ("select the sharded dim", aten.select.int, [Shard(1)], x, 1, 1),
            ("squeeze.dim before the shard", aten.squeeze.dim, [Shard(2)], T(2, 1, 8), 1),
            ("squeeze.dim the shard", aten.squeeze.dim, [Shard(1)], T(2, 8, 1), 1),
            ("squeeze.dims", aten.squeeze.dims, [Shard(3)], T(1, 2, 1, 8), [0, 2]),
            ("squeeze() sharded", aten.squeeze.default, [Shard(1)], T(1, 8)),
            ("unsqueeze strided", aten.unsqueeze.default, [StridedShard(0, 2)], T(8, 4), 0),
            ("transpose strided", aten.transpose.int, [StridedShard(0, 2)], T(8, 4), 0, 1),
            ("index x[pos], x sharded on dim 1", aten.index.Tensor, [Shard(1), R], T(16, 4), [idx]),
            ("index x[pos], x sharded on dim 0", aten.index.Tensor, [Shard(0), R], T(16, 4), [idx]),
            ("index x[pos], pos sharded", aten.index.Tensor, [R, Shard(0)], T(16, 4), [idx]),
            ("index x[:, i], x sharded on 2", aten.index.Tensor, [Shard(2), R], T(8, 6, 5), [None, idx]),
            ("index x[i, :, j], x sharded on 1", aten.index.Tensor, [Shard(1), R, R], T(8, 6, 5), [idx, None, idx]),
            ("index x[i, :, j], i sharded", aten.index.Tensor, [R, Shard(0), R], T(8, 6, 5), [idx, None, idx]),
            ("index x[pos], x partial", aten.index.Tensor, [P, R], T(16, 4), [idx]),
            ("view_as_complex, shard kept", aten.view_as_complex.default, [Shard(2)], T(2, 8, 4, 2, 2)),
            ("view_as_complex, trailing pair", aten.view_as_complex.default, [Shard(4)], T(2, 8, 4, 2, 2)),
            ("view_as_complex, partial max", aten.view_as_complex.default, [PMAX], T(2, 8, 4, 2, 2)),
            ("view_as_real", aten.view_as_real.default, [Shard(2)], T(2, 8, 4, 2, dtype=torch.complex64)),
            ("flatten (view) of [b, s, h, hd/2, 2]", aten.view.default, [Shard(2)], T(2, 8, 4, 2, 2), [2, 8, 4, 4]),
        ]), """\
split last dim, shard on heads: (S(1)) -> (S(1), S(1))
split the sharded dim: (R) -> (R, R, R, R)
split a fused q|k|v into its blocks: (S(2/3)) -> (S(2), S(2), S(2))
split fused blocks 1 | 2: (S(2/3)) -> (S(2), S(2/2))
split inside a fused block: (R) -> (R, R)
split_with_sizes, partial: (P) -> (P, P)
unbind before the shard: (S(1)) -> (S(0), S(0))
unbind the sharded dim: (R) -> (R, R, R, R, R, R, R, R)
cat last dim, both sharded: (S(1), S(1)) -> S(1)
cat last dim, one replicated: (S(1), S(1)) -> S(1)
cat along the shard: (R, R) -> R
cat partials: (P, P) -> P
cat partial and replicated: (R, R) -> R
cat partial and shard: (S(1), S(1)) -> S(1)
cat P(max) and replicated: (R, R) -> R
cat legacy empty and sharded (a KV cache): (R, S(1)) -> S(1)
cat legacy empty and sharded, along the shard: (R, R) -> R
stack at 0: (S(1), S(1)) -> S(2)
stack at the shard: (S(1), S(1)) -> S(2)
stack strided: (S(0/2), S(0/2)) -> S(0/2)
slice another dim: (S(1)) -> S(1)
slice whole sharded dim: (S(1)) -> S(1)
slice part of sharded dim: (R) -> R
narrow whole: (S(1)) -> S(1)
narrow part: (R) -> R
select before the shard: (S(1)) -> S(0)
select after the shard: (S(1)) -> S(1)
select the sharded dim: (R) -> R
squeeze.dim before the shard: (S(2)) -> S(1)
squeeze.dim the shard: (R) -> R
squeeze.dims: (S(3)) -> S(1)
squeeze() sharded: (R) -> R
unsqueeze strided: (S(0/2)) -> S(1/2)
transpose strided: (S(0/2)) -> S(1/2)
index x[pos], x sharded on dim 1: (S(1), R) -> S(1)
index x[pos], x sharded on dim 0: (R, R) -> R
index x[pos], pos sharded: (R, S(0)) -> S(0)
index x[:, i], x sharded on 2: (S(2), R) -> S(2)
index x[i, :, j], x sharded on 1: (S(1), R, R) -> S(1)
index x[i, :, j], i sharded: (R, S(0), S(0)) -> S(0)
index x[pos], x partial: (P, R) -> P
view_as_complex, shard kept: (S(2)) -> S(2)
view_as_complex, trailing pair: (R) -> R
view_as_complex, partial max: (R) -> R
view_as_real: (S(2)) -> S(2)
flatten (view) of [b, s, h, hd/2, 2]: (S(2)) -> S(2)
""")

    def test_pointwise_rules(self):
        x, mask = T(2, 4, 8, 8), T(8, 8, dtype=torch.bool)
        self.assertExpectedInline(cases([
            ("masked_fill.Scalar, mask broadcast", aten.masked_fill.Scalar, [Shard(1), R], x, mask, 0.0),
            ("masked_fill.Scalar, shard on masked dim", aten.masked_fill.Scalar, [Shard(2), R], x, mask, 0.0),
            ("masked_fill.Tensor", aten.masked_fill.Tensor, [Shard(1), R, R], x, mask, T()),
            ("where.self", aten.where.self, [R, Shard(1), R], mask, x, T()),
            ("tril on batch dims", aten.tril.default, [Shard(1)], x),
            ("triu on a masked dim", aten.triu.default, [Shard(3)], x, 1),
            ("tril partial", aten.tril.default, [P], x),
            ("complex mul, table broadcast", aten.mul.Tensor, [Shard(2), R], T(2, 8, 4, 2, dtype=torch.complex64),
             T(1, 8, 1, 2, dtype=torch.complex64)),
            ("add P + P", aten.add.Tensor, [P, P], x, x),
            ("add P(max) + P(max)", aten.add.Tensor, [PMAX, PMAX], x, x),
            ("add P + P(max)", aten.add.Tensor, [P, PMAX], x, x),
            ("mul P * scalar", aten.mul.Tensor, [P, R], x, T()),
            ("mul P(max) * scalar", aten.mul.Tensor, [PMAX, R], x, T()),
            ("div P / scalar", aten.div.Tensor, [P, R], x, T()),
            ("div scalar / P", aten.div.Tensor, [R, P], T(), x),
            ("exp P(max)", aten.exp.default, [PMAX], x),
            ("clone P(max)", aten.clone.default, [PMAX], x),
            ("_to_copy P to float64", aten._to_copy.default, [P], x, {"dtype": torch.float64}),
            ("_to_copy P to bfloat16", aten._to_copy.default, [P], x, {"dtype": torch.bfloat16}),
            ("empty_like of a shard", aten.empty_like.default, [Shard(1)], x),
            ("zeros_like of a partial", aten.zeros_like.default, [P], x),
            ("native_dropout of a partial", aten.native_dropout.default, [P], x, 0.1, True),
        ]), """\
masked_fill.Scalar, mask broadcast: (S(1), R) -> S(1)
masked_fill.Scalar, shard on masked dim: (S(2), S(0)) -> S(2)
masked_fill.Tensor: (S(1), R, R) -> S(1)
where.self: (R, S(1), R) -> S(1)
tril on batch dims: (S(1)) -> S(1)
triu on a masked dim: (R) -> R
tril partial: (P) -> P
complex mul, table broadcast: (S(2), R) -> S(2)
add P + P: (P, P) -> P
add P(max) + P(max): (R, R) -> R
add P + P(max): (R, R) -> R
mul P * scalar: (P, R) -> P
mul P(max) * scalar: (R, R) -> R
div P / scalar: (P, R) -> P
div scalar / P: (R, R) -> R
exp P(max): (R) -> R
clone P(max): (P(max)) -> P(max)
_to_copy P to float64: (P) -> P
_to_copy P to bfloat16: (R) -> R
empty_like of a shard: (S(1)) -> S(1)
zeros_like of a partial: (P) -> R
native_dropout of a partial: (R) -> (R, R)
""")

    def test_reduction_rules(self):
        x, xi = T(2, 8, 16), T(2, 8, 16, dtype=torch.long)
        self.assertExpectedInline(cases([
            ("amax kept dim", aten.amax.default, [Shard(1)], x, [-1]),
            ("amax reduced dim (may need a gradient)", aten.amax.default, [Shard(2)], x, [-1]),
            ("amax reduced dim of integers", aten.amax.default, [Shard(2)], xi, [-1], True),
            ("amax of P(max)", aten.amax.default, [PMAX], x, [0]),
            ("amin reduced dim of integers", aten.amin.default, [Shard(2)], xi, [-1]),
            ("max() of integers", aten.max.default, [Shard(0)], xi),
            ("max.dim kept dim", aten.max.dim, [Shard(0)], x, 1),
            ("max.dim reduced dim", aten.max.dim, [Shard(1)], x, 1),
            ("min.dim keepdim", aten.min.dim, [Shard(2)], x, 1, True),
            ("sum reduced dim", aten.sum.dim_IntList, [Shard(1)], x, [1]),
            ("sum of P(max)", aten.sum.dim_IntList, [PMAX], x, [1]),
            ("sum strided, reduced", aten.sum.dim_IntList, [StridedShard(0, 2)], x, [0]),
            ("sum strided, kept", aten.sum.dim_IntList, [StridedShard(1, 2)], x, [0]),
            ("mean reduced dim", aten.mean.dim, [Shard(1)], x, [1]),
            ("mean kept dim", aten.mean.dim, [Shard(1)], x, [2], True),
            ("mean of P", aten.mean.dim, [P], x, [2]),
            ("var kept dim", aten.var.correction, [Shard(0)], x, [-1]),
            ("var reduced dim", aten.var.correction, [Shard(2)], x, [-1]),
            ("var_mean kept dim, keepdim", aten.var_mean.correction, [Shard(1)], x, [-1], {"keepdim": True}),
            ("var of P", aten.var.correction, [P], x, [-1]),
            ("any()", aten.any.default, [Shard(1)], x),
            ("all.dim kept", aten.all.dim, [Shard(1)], x, -1),
            ("argmax kept", aten.argmax.default, [Shard(0)], x, -1),
            ("argmax reduced", aten.argmax.default, [Shard(2)], x, -1),
            ("argmax flattened", aten.argmax.default, [Shard(0)], x),
        ]), """\
amax kept dim: (S(1)) -> S(1)
amax reduced dim (may need a gradient): (R) -> R
amax reduced dim of integers: (S(2)) -> P(max)
amax of P(max): (P(max)) -> P(max)
amin reduced dim of integers: (R) -> R
max() of integers: (S(0)) -> P(max)
max.dim kept dim: (S(0)) -> (S(0), S(0))
max.dim reduced dim: (R) -> (R, R)
min.dim keepdim: (S(2)) -> (S(2), S(2))
sum reduced dim: (S(1)) -> P
sum of P(max): (R) -> R
sum strided, reduced: (S(0/2)) -> P
sum strided, kept: (S(1/2)) -> S(0/2)
mean reduced dim: (R) -> R
mean kept dim: (S(1)) -> S(1)
mean of P: (P) -> P
var kept dim: (S(0)) -> S(0)
var reduced dim: (R) -> R
var_mean kept dim, keepdim: (S(1)) -> (S(1), S(1))
var of P: (R) -> R
any(): (R) -> R
all.dim kept: (S(1)) -> S(1)
argmax kept: (S(0)) -> S(0)
argmax reduced: (R) -> R
argmax flattened: (R) -> R
""")

    def test_norm_and_softmax_rules(self):
        x, w = T(2, 8, 16), T(16)
        self.assertExpectedInline(cases([
            ("layer_norm, sequence sharded", aten.native_layer_norm.default, [Shard(1), R, R], x, [16], w, w, 1e-5),
            ("layer_norm, normalized dim sharded", aten.native_layer_norm.default, [Shard(2), R, R], x, [16], w, w,
             1e-5),
            ("_fused_rms_norm, sequence sharded", aten._fused_rms_norm.default, [Shard(1), R], x, [16], w, 1e-6),
            ("_fused_rms_norm, normalized dim sharded", aten._fused_rms_norm.default, [Shard(2), R], x, [16], w,
             1e-6),
            ("_fused_rms_norm, partial", aten._fused_rms_norm.default, [P, R], x, [16], w, 1e-6),
            ("_safe_softmax, other dim", aten._safe_softmax.default, [Shard(1)], x, -1),
            ("_safe_softmax, softmax dim", aten._safe_softmax.default, [Shard(2)], x, -1),
        ]), """\
layer_norm, sequence sharded: (S(1), R, R) -> (S(1), S(1), S(1))
layer_norm, normalized dim sharded: (R, R, R) -> (R, R, R)
_fused_rms_norm, sequence sharded: (S(1), R) -> (S(1), S(1))
_fused_rms_norm, normalized dim sharded: (R, R) -> (R, R)
_fused_rms_norm, partial: (R, R) -> (R, R)
_safe_softmax, other dim: (S(1)) -> S(1)
_safe_softmax, softmax dim: (R) -> R
""")

    def test_attention_rules(self):
        q, gqa_kv = T(2, 4, 8, 4), T(2, 2, 8, 4)
        cpu = aten._scaled_dot_product_flash_attention_for_cpu.default
        self.assertExpectedInline(cases([
            ("causal, heads sharded", cpu, [Shard(1)] * 3, q, q, q, 0.0, True),
            ("causal, batch sharded", cpu, [Shard(0)] * 3, q, q, q, 0.0, True),
            ("causal, v replicated", cpu, [Shard(1), Shard(1), R], q, q, q, 0.0, True),
            ("sequence sharded", cpu, [Shard(2)] * 3, q, q, q),
            ("head_dim sharded", cpu, [Shard(3)] * 3, q, q, q),
            ("heads, mask [s, s]", cpu, [Shard(1)] * 3 + [R], q, q, q, {"attn_mask": T(8, 8)}),
            ("heads, mask [b, h, s, s]", cpu, [Shard(1)] * 3 + [R], q, q, q, {"attn_mask": T(2, 4, 8, 8)}),
            ("batch, mask [b, 1, s, s]", cpu, [Shard(0)] * 3 + [R], q, q, q, {"attn_mask": T(2, 1, 8, 8)}),
            ("heads, GQA (4 q heads, 2 kv heads over 4 ranks)", cpu, [Shard(1)] * 3, q, gqa_kv, gqa_kv),
            ("heads, GQA (8 q heads, 4 kv heads over 4 ranks)", cpu, [Shard(1)] * 3, T(2, 8, 8, 4), q, q),
            ("partial q", cpu, [P, R, R], q, q, q),
            ("flash (GPU), heads", aten._scaled_dot_product_flash_attention.default, [Shard(1)] * 3, q, q, q),
            ("efficient (GPU), heads, bias [h, s, s]", aten._scaled_dot_product_efficient_attention.default,
             [Shard(1)] * 3 + [R], q, q, q, T(4, 8, 8), True),
            ("cudnn (GPU), batch", aten._scaled_dot_product_cudnn_attention.default, [Shard(0)] * 3, q, q, q, None,
             True),
        ]), """\
causal, heads sharded: (S(1), S(1), S(1)) -> (S(1), S(1))
causal, batch sharded: (S(0), S(0), S(0)) -> (S(0), S(0))
causal, v replicated: (S(1), S(1), S(1)) -> (S(1), S(1))
sequence sharded: (R, R, R) -> (R, R)
head_dim sharded: (R, R, R) -> (R, R)
heads, mask [s, s]: (S(1), S(1), S(1), R) -> (S(1), S(1))
heads, mask [b, h, s, s]: (S(1), S(1), S(1), S(1)) -> (S(1), S(1))
batch, mask [b, 1, s, s]: (S(0), S(0), S(0), S(0)) -> (S(0), S(0))
heads, GQA (4 q heads, 2 kv heads over 4 ranks): (R, R, R) -> (R, R)
heads, GQA (8 q heads, 4 kv heads over 4 ranks): (S(1), S(1), S(1)) -> (S(1), S(1))
partial q: (R, R, R) -> (R, R)
flash (GPU), heads: (S(1), S(1), S(1)) -> (S(1), S(1), R, R, R, R, R, R, R)
efficient (GPU), heads, bias [h, s, s]: (S(1), S(1), S(1), S(0)) -> (S(1), S(1), R, R)
cudnn (GPU), batch: (S(0), S(0), S(0)) -> (S(0), S(0), R, R, R, R, R, R, R)
""")

    def test_matmul_rules(self):
        a, b, inp = T(4, 8, 16), T(4, 16, 8), T(8)
        bf, offs = (lambda *shape: T(*shape, dtype=torch.bfloat16)), T(3, dtype=torch.int32)
        self.assertExpectedInline(cases([
            ("baddbmm, batch sharded", aten.baddbmm.default, [R, Shard(0), Shard(0)], T(4, 8, 8), a, b),
            ("baddbmm, rows sharded, input broadcast", aten.baddbmm.default, [R, Shard(1), R], inp, a, b),
            ("baddbmm, cols sharded, input broadcast", aten.baddbmm.default, [R, R, Shard(2)], inp, a, b),
            ("baddbmm, contraction sharded", aten.baddbmm.default, [R, Shard(2), Shard(1)], inp, a, b),
            ("mm, fused weight's columns", aten.mm.default, [R, StridedShard(1, 3)], T(4, 16), T(16, 12)),
            ("addmm, fused weight and bias", aten.addmm.default, [StridedShard(0, 3), R, StridedShard(1, 3)], T(12),
             T(4, 16), T(16, 12)),
            ("grouped_mm, experts' output dim", aten._grouped_mm.default, [R, StridedShard(2, 2), R], bf(6, 16),
             bf(3, 16, 8), offs),
            ("grouped_mm, contraction", aten._grouped_mm.default, [Shard(1), Shard(1), R], bf(6, 16), bf(3, 16, 8),
             offs),
            ("baddbmm, strided batch, input broadcast", aten.baddbmm.default,
             [R, StridedShard(0, 2), StridedShard(0, 2)], T(8, 8), a, b),
            ("baddbmm, strided batch, input strided", aten.baddbmm.default,
             [StridedShard(0, 2)] * 3, T(4, 8, 8), a, b),
            ("baddbmm, strided batch, input replicated", aten.baddbmm.default,
             [R, StridedShard(0, 2), StridedShard(0, 2)], T(4, 8, 8), a, b),
            ("linear, column-parallel", aten.linear.default, [R, Shard(0), Shard(0)], a, T(12, 16), T(12)),
            ("linear, row-parallel", aten.linear.default, [Shard(2), Shard(1)], a, T(12, 16)),
            ("linear, batch-sharded input", aten.linear.default, [Shard(0), R], a, T(12, 16)),
        ]), """\
baddbmm, batch sharded: (S(0), S(0), S(0)) -> S(0)
baddbmm, rows sharded, input broadcast: (R, S(1), R) -> S(1)
baddbmm, cols sharded, input broadcast: (S(0), R, S(2)) -> S(2)
baddbmm, contraction sharded: (P, S(2), S(1)) -> P
mm, fused weight's columns: (R, S(1/3)) -> S(1/3)
addmm, fused weight and bias: (S(0/3), R, S(1/3)) -> S(1/3)
grouped_mm, experts' output dim: (R, S(2/2), R) -> S(1/2)
grouped_mm, contraction: (S(1), S(1), R) -> P
baddbmm, strided batch, input broadcast: (R, S(0/2), S(0/2)) -> S(0/2)
baddbmm, strided batch, input strided: (S(0/2), S(0/2), S(0/2)) -> S(0/2)
baddbmm, strided batch, input replicated: (S(0/2), S(0/2), S(0/2)) -> S(0/2)
linear, column-parallel: (R, S(0), S(0)) -> S(2)
linear, row-parallel: (S(2), S(1)) -> P
linear, batch-sharded input: (S(0), R) -> S(0)
""")
