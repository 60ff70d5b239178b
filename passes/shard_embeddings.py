"""shard_embeddings: each logical embedding-collection lookup -> its per-rank sharded program.

``graphshard::embedding_bags`` (one node: the KJT's values, lengths and weights in, the
pooled ``[batch, total_dim]`` out) is replaced by the collection's sharded program
(``graphshard.sparse.program``): the ids' input distribution (``fbgemm`` permutes and
bucketizes, ``graphshard::all_to_all`` of lengths, then of ids with data-dependent sizes),
the fused TBE lookup (``graphshard::tbe_lookup``), and the pooled output's distribution
(``all_to_all`` or ``reduce_scatter``), as graph nodes. The program is traced in the graph's
own fake mode, so data-dependent sizes become the graph's unbacked sizes; the TBE's layout
tensors become constants of the graph module. Backward comes from autograd of the emitted
ops; the TBE's backward applies the fused optimizer.

The lookup's output is per-rank (data-parallel) like its input, so it runs after the
model-parallel passes (the program is already per-rank) and before bucketing.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from graphshard import _compat
from graphshard.passes.pipeline import PassContext, log
from graphshard.sparse.ops import ops as sparse_ops


def shard_embeddings(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    nodes = [n for n in gm.graph.nodes if n.op == "call_function" and n.target == sparse_ops.embedding_bags.default]
    for node in nodes:
        _expand(gm, node, ctx)
    if nodes:
        gm.graph.eliminate_dead_code()
    return gm


def _expand(gm: fx.GraphModule, node: fx.Node, ctx: PassContext) -> None:
    values, lengths, weights, state, key, keys, _total = node.args
    coll = ctx.sparse[key]
    consts = [(tbe, name, t) for tbe, m in coll.tbes.items() for name, t in m.constants().items()]
    n_state = len(state)

    def program(values, lengths, weights, *rest):
        st, cs = rest[:n_state], rest[n_state:]
        constants: dict = {}
        for (tbe, name, _), c in zip(consts, cs):
            constants.setdefault(tbe, {})[name] = c
        return coll.run(values, lengths, weights, list(st), keys, constants)

    # traced with the grad facts of the real call (the TBE tokens and data-parallel tables need
    # gradients): embedding_bag picks a forward-only kernel for a weight that needs none
    grads = coll.state_requires_grad()
    with ctx.fake_mode:
        fake_state = [_val(a).detach().requires_grad_(g) for a, g in zip(state, grads)]
        fake = [_val(values), _val(lengths), _val(weights), *fake_state,
                *(ctx.fake_mode.from_tensor(t, static_shapes=True) for _, _, t in consts)]
        with torch.enable_grad():
            sub = _compat.make_fx(program, tracing_mode="real")(*fake)

    g = gm.graph
    env: dict[fx.Node, object] = {}
    inputs = [values, lengths, weights, *state]
    with g.inserting_before(node):
        const_nodes = []
        for tbe, name, t in consts:
            attr = _fresh_attr(gm, f"_sparse_{key.split('/', 1)[0]}_{tbe}_{name}", t)
            n = g.get_attr(attr)
            n.meta["val"] = ctx.fake_mode.from_tensor(t, static_shapes=True)
            const_nodes.append(n)
        placeholders = [n for n in sub.graph.nodes if n.op == "placeholder"]
        for ph, a in zip(placeholders, inputs + const_nodes):
            env[ph] = a
        out = None
        for n in sub.graph.nodes:
            if n.op == "placeholder":
                continue
            if n.op == "output":
                out = env[n.args[0]] if not isinstance(n.args[0], (list, tuple)) else env[n.args[0][0]]
                continue
            if n.op == "get_attr":
                attr = _fresh_attr(gm, f"_sparse_const", getattr(sub, n.target))
                new = g.get_attr(attr)
                new.meta.update(n.meta)
            else:
                new = g.node_copy(n, lambda a: env[a])
            new.meta["expanded_from"] = node.name
            env[n] = new
    node.replace_all_uses_with(out)
    g.erase_node(node)
    ctx.report.sparse.append(_describe(coll))
    log.info("shard_embeddings: %s", ctx.report.sparse[-1])


def _val(a):
    return a.meta["val"] if isinstance(a, fx.Node) else a


def _fresh_attr(gm: fx.GraphModule, base: str, value: torch.Tensor) -> str:
    name, i = base, 0
    while hasattr(gm, name):
        i += 1
        name = f"{base}_{i}"
    gm.register_buffer(name, value)  # aot_autograd lifts buffers and gives the trace their fake values
    return name


def _describe(coll) -> str:
    lay = coll.layout
    kinds = {}
    for t in lay.tables:
        where = ",".join(str(s.rank) for s in t.shards) if t.sharding_type != "data_parallel" else "all"
        kinds.setdefault(t.sharding_type, []).append(f"{t.name}@{where}")
    tbes = ", ".join(f"{name}: {len(m.shapes)} table shard(s), {m.optimizer}" for name, m in coll.tbes.items())
    return (f"{lay.fqns[0]}: " + "; ".join(f"{k} {' '.join(v)}" for k, v in kinds.items())
            + f" | rank {lay.rank} fused TBEs: {tbes or 'none'}")
