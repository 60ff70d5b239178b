"""``graphshard.no_sync``'s two derived backward programs, built from the partitioned backward.

The compiled backward is one graph; gradient accumulation without communication needs two more
programs derived from it (`graphshard.compiler.grad_sync.GradSync` selects among the three per
call and lowers each derived one on its first use):

* ``accumulate`` (`accumulate_variant`): the root data-parallel reductions (`root_reductions`) and
  everything downstream of them removed; what each would have sent (`sent`) becomes an extra
  output (the pending buffers), the parameter gradients they produced are ``None``.
* ``flush`` (`flush_variant`): each root reduction's input is ``input + pending`` (a graph input per
  value it sends).

Both are derived after the post-partition passes (the scheduled backward), so they keep its order.
With ``dump_graphs`` each is written as ``g<i>_backward_no_sync_<name>.txt`` when it is built; the
golden graphs are in ``tests/test_grad_sync.py``.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from graphshard._compat import c10d

_REDUCTIONS = frozenset({c10d.reduce_scatter_tensor.default, c10d.all_reduce.default,
                         c10d.all_to_all_single.default})


def root_reductions(gm: fx.GraphModule, model_parallel_groups: set[str], param_outputs: set[int]) -> list[fx.Node]:
    """The data-parallel gradient reductions of a backward graph that no other one feeds (a
    hybrid unit's all-reduce over the replicate axis follows its reduce-scatter: only the
    reduce-scatter is a root). A reduction whose results reach anything but the outputs at
    ``param_outputs`` (gradients of parameter shards) is not a gradient reduction to skip."""
    out_node = gm.graph.find_nodes(op="output")[0]
    outputs = out_node.args[0]
    candidates = [n for n in gm.graph.nodes if n.target in _REDUCTIONS and n.args[-1] not in model_parallel_groups]
    below = {r: _descendants(r) for r in candidates}
    roots = []
    for r in candidates:
        if any(r in below[c] for c in candidates if c is not r):
            continue
        reached = [i for i, o in enumerate(outputs) if isinstance(o, fx.Node) and o in below[r]]
        if reached and set(reached) <= param_outputs:
            roots.append(r)
    return roots


def _descendants(node: fx.Node) -> set[fx.Node]:
    seen, stack = set(), [node]
    while stack:
        for u in stack.pop().users:
            if u not in seen and u.op != "output":
                seen.add(u)
                stack.append(u)
    return seen


def sent(root: fx.Node) -> list[fx.Node]:
    """What a root reduction reduces of this rank's gradients: its input, and on gloo's all-to-all
    form (`ops._reduce_scatter_flat`) the row this rank kept for itself, which ``unpack_reduced``
    adds in after the collective. Deferring a reduction defers every one of them."""
    x = root.args[0]
    if x.target is operator.getitem and x.args[0].target == torch.ops.graphshard.pack_grads_peers.default:
        kept = [u for u in x.args[0].users if u.target is operator.getitem and u.args[1] == 1]
        return [x, *kept]
    return [x]


def _copy(gm: fx.GraphModule) -> tuple[fx.Graph, dict[fx.Node, fx.Node], list]:
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    out = graph.graph_copy(gm.graph, env)
    return graph, env, list(out) if isinstance(out, (list, tuple)) else [out]


def accumulate_variant(gm: fx.GraphModule, roots: list[fx.Node]) -> fx.GraphModule:
    """``gm`` without ``roots`` and what follows them; their inputs appended to the outputs."""
    graph, env, outs = _copy(gm)
    removed = set().union(*(_descendants(env[r]) | {env[r]} for r in roots))
    for n in removed:
        extern = [u for u in n.users if u not in removed and u.op != "output"]
        assert not extern, f"no_sync: {n.name} feeds {extern[0].name}, which is not part of a gradient reduction"
    outs = [None if isinstance(o, fx.Node) and o in removed else o for o in outs]
    graph.output(tuple(outs + [env[x] for r in roots for x in sent(r)]))
    for n in reversed(list(graph.nodes)):
        if n in removed:
            graph.erase_node(n)
    return fx.GraphModule(gm, graph)


def flush_variant(gm: fx.GraphModule, roots: list[fx.Node]) -> fx.GraphModule:
    """``gm`` with one more input per value a root reduction reduces (`sent`), added to it."""
    graph, env, outs = _copy(gm)
    last = list(graph.find_nodes(op="placeholder"))[-1]
    i = 0
    for r in roots:
        r2 = env[r]
        for x in map(env.__getitem__, sent(r)):
            with graph.inserting_after(last):
                last = graph.placeholder(f"pending_grads_{i}")
            last.meta["val"] = x.meta["val"]
            i += 1
            with graph.inserting_before(r2):
                total = graph.call_function(torch.ops.aten.add.Tensor, (x, last))
            total.meta.update(x.meta)
            x.replace_all_uses_with(total, delete_user_cb=lambda u, total=total: u is not total)
    graph.output(tuple(outs))
    return fx.GraphModule(gm, graph)
