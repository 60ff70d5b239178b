"""Does aot_autograd's min-cut re-gather, in the backward, a parameter that the outer graph gathers
and passes into an ``invoke_subgraph`` body? (The question the structural step of issue 31 has to
answer first: docs/notes/2026-12-03-ac-figures-and-the-outer-regather.md.)

    python docs/notes/2026-12-03-outer-regather.py              # torch's partition alone
    python docs/notes/2026-12-03-outer-regather.py --tag-body   # the body's ops tagged for recomputation too
    python docs/notes/2026-12-03-outer-regather.py --rewrite    # with a post-partition re-gather

The outer forward is ``h = block(gather(shard_i), h)`` for three shards, ``block`` a
``nested_compile_region``; ``scratch::gather`` stands for ``graphshard::unshard`` (it concatenates
two copies of the shard) and is tagged MUST_RECOMPUTE, as graphshard tags a FULL_SHARD unit's
gather. Prints how many gathers each partitioned graph holds and the shapes the forward saves.
"""
import argparse
import operator

import torch
import torch.fx as fx
import torch.nn as nn
from torch._functorch.aot_autograd import aot_module_simplified
from torch._functorch.partitioners import min_cut_rematerialization_partition
from torch.utils.checkpoint import CheckpointPolicy

lib = torch.library.Library("scratch", "DEF")
lib.define("gather(Tensor x) -> Tensor")
torch.library.impl(lib, "gather", "CompositeExplicitAutograd")(lambda x: torch.cat([x, x]))
torch.library.register_fake("scratch::gather")(lambda x: x.new_empty((2 * x.shape[0], *x.shape[1:])))
torch.library.register_autograd("scratch::gather", lambda ctx, g: g[: g.shape[0] // 2] + g[g.shape[0] // 2:])
GATHER = torch.ops.scratch.gather.default
VIEWS = {torch.ops.aten.t.default, torch.ops.aten.view.default, torch.ops.aten.permute.default,
         torch.ops.aten.transpose.int, torch.ops.aten.slice.Tensor, torch.ops.aten.expand.default}


@torch.compiler.nested_compile_region
def block(w, h):
    return torch.relu(h @ w).sin()[:, :16] * h


class M(nn.Module):
    def __init__(self, n):
        super().__init__()
        self.shards = nn.ParameterList([nn.Parameter(torch.randn(8, 32) * 0.1) for _ in range(n)])

    def forward(self, h):
        for p in self.shards:
            h = block(torch.ops.scratch.gather(p), h)
        return h.sum()


def aliased_operand(call: fx.Node, k: int):
    """(operand of ``call``, view ops) when output ``k`` of its body is that operand or views of it."""
    body = getattr(call.graph.owning_module, call.args[0].target)
    out, chain = body.graph.output_node().args[0][k], []
    while out.op == "call_function" and out.target in VIEWS:
        chain.append((out.target, out.args[1:]))
        out = out.args[0]
    if out.op != "placeholder":
        return None, None
    return call.args[2 + list(body.graph.find_nodes(op="placeholder")).index(out)], chain[::-1]


def regather(fw: fx.GraphModule, bw: fx.GraphModule) -> list[str]:
    """Saves the shard instead of a body output that aliases a gathered operand; the backward gathers
    it again and replays the views. Returns the backward inputs it rewrote."""
    outs = list(fw.graph.output_node().args[0])
    placeholders = list(bw.graph.find_nodes(op="placeholder"))
    n_user = len(outs) - (len(placeholders) - 1)  # the backward takes the saved values and one tangent
    done = []
    for i in range(n_user, len(outs)):
        v = outs[i]
        if not (v.op == "call_function" and v.target is operator.getitem
                and v.args[0].target is torch.ops.higher_order.invoke_subgraph):
            continue
        src, chain = aliased_operand(v.args[0], v.args[1])
        if src is None or src.target is not GATHER or src.args[0].op != "placeholder":
            continue
        outs[i] = src.args[0]
        ph = placeholders[i - n_user]
        with bw.graph.inserting_after(ph):
            gathered = again = bw.graph.call_function(GATHER, (ph,))
        for op, rest in chain:
            with bw.graph.inserting_after(again):
                again = bw.graph.call_function(op, (again, *rest))
        ph.replace_all_uses_with(again, delete_user_cb=lambda u: u is not gathered)
        ph.meta["val"] = src.args[0].meta["val"]
        done.append(ph.name)
    fw.graph.output_node().args = (tuple(outs),)
    fw.graph.eliminate_dead_code()
    fw.recompile()
    bw.recompile()
    return done


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tag-body", action="store_true")
    ap.add_argument("--rewrite", action="store_true")
    args = ap.parse_args()
    graphs, rewritten = {}, []

    def partition(joint, inputs, **kw):
        fw, bw = min_cut_rematerialization_partition(joint, inputs, **kw)
        if args.rewrite:
            rewritten.extend(regather(fw, bw))
        return fw, bw

    def backend(gm, inputs):
        for n in gm.graph.find_nodes(op="call_function", target=GATHER):
            n.meta.update(recompute=CheckpointPolicy.MUST_RECOMPUTE, ac_graph_id=1)
        if args.tag_body:
            for _, sub in gm.named_children():
                for n in sub.graph.nodes:
                    if n.op == "call_function":
                        n.meta.update(recompute=CheckpointPolicy.MUST_RECOMPUTE, ac_graph_id=2)

        def keep(name):
            def compiler(g, _):
                graphs[name] = g
                return g
            return compiler
        return aot_module_simplified(gm, inputs, fw_compiler=keep("fw"), bw_compiler=keep("bw"),
                                     partition_fn=partition)

    torch.manual_seed(0)
    m, ref = M(3), M(3)
    ref.load_state_dict(m.state_dict())
    x = torch.randn(4, 16)
    torch.compile(m, backend=backend, fullgraph=True)(x).backward()
    ref(x).backward()
    print("rewritten backward inputs:", rewritten)
    print("grads equal the eager model's:",
          all(torch.allclose(a.grad, b.grad, atol=1e-6) for a, b in zip(m.shards, ref.shards)))
    fw_saved = [tuple(n.meta["val"].shape) for n in graphs["fw"].graph.output_node().args[0][1:]]
    print("forward: gathers", sum(n.target is GATHER for n in graphs["fw"].graph.nodes), "saves", fw_saved)
    print("backward: gathers", sum(n.target is GATHER for n in graphs["bw"].graph.nodes))


if __name__ == "__main__":
    main()
