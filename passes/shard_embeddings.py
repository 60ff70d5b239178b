"""shard_embeddings: each logical embedding-collection lookup -> its per-rank sharded program.

``graphshard::embedding_bags`` (one node: the KJT's values, lengths and weights in, the
pooled ``[batch, total_dim]`` out; ``graphshard::embedding_seqs`` for a sequence collection,
each feature's rows out) is replaced by the collection's sharded program
(``graphshard.sparse.program``): the ids' input distribution (permutes and bucketizes,
fbgemm's or graphshard's ``kjt_*`` ops; ``graphshard::all_to_all`` of lengths, then of ids with
data-dependent sizes), the fused TBE lookup (``graphshard::tbe_lookup`` or
``graphshard::triton_tbe_lookup``), and the pooled output's distribution
(``all_to_all`` or ``reduce_scatter``), as graph nodes. ``graphshard::embedding_bags_received``
(the ids exchanged a batch ahead by a training pipeline, `graphshard.sparse.input_dist`) expands
to the same program from the lookup on, reading what arrived. The program is traced in the graph's
own fake mode, so data-dependent sizes become the graph's unbacked sizes; the TBE's layout
tensors become constants of the graph module. Backward comes from autograd of the emitted
ops; the TBE's backward applies the fused optimizer.

The lookup's output is per-rank (data-parallel) like its input, so it runs after the
model-parallel passes (the program is already per-rank) and before bucketing.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from graphshard import _compat
from graphshard.passes.context import PassContext, log
from graphshard.ops.sparse import lookup_args, ops as sparse_ops, received_args


def shard_embeddings(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    groups: dict[str, list[fx.Node]] = {}
    for n in gm.graph.nodes:
        if (args := lookup_args(n)) is not None:
            groups.setdefault(args[4], []).append(n)
    for key, nodes in groups.items():
        _expand(gm, nodes, ctx)
    if groups:
        gm.graph.eliminate_dead_code()
    return gm


def _expand(gm: fx.GraphModule, nodes: list[fx.Node], ctx: PassContext) -> None:
    """Replaces the lookups of one collection (one, or one per FQN of a shared module) by one program."""
    key = lookup_args(nodes[0])[4]
    coll = ctx.sparse[key]
    last = nodes[-1]
    if len(nodes) > 1:
        _defer_users(nodes, coll)
    consts = [(tbe, name, t) for tbe, m in coll.tbes.items() for name, t in m.constants().items()]
    state = lookup_args(last)[3]
    n_state, n_uses = len(state), len(nodes)
    keys = [list(lookup_args(n)[5]) for n in nodes]
    received, groups = _received(nodes, coll, ctx)

    def program(*args):
        uses = [(args[3 * i], args[3 * i + 1], args[3 * i + 2], keys[i]) for i in range(n_uses)]
        rest = args[3 * n_uses:]
        st, cs, rcv = rest[:n_state], rest[n_state:n_state + len(consts)], rest[n_state + len(consts):]
        constants: dict = {}
        for (tbe, name, _), c in zip(consts, cs):
            constants.setdefault(tbe, {})[name] = c
        if received:
            values, lengths, weights, use_keys = uses[0]
            outs = [coll.run(values, lengths, weights, list(st), use_keys, constants, received=(groups, list(rcv)))]
        else:
            outs = coll.run_uses(uses, list(st), constants)
        return tuple(t for out in outs for t in (out if isinstance(out, (list, tuple)) else [out]))

    # traced with the grad facts of the real call (the TBE tokens and data-parallel tables need
    # gradients): embedding_bag picks a forward-only kernel for a weight that needs none
    grads = coll.state_requires_grad()
    use_inputs = [a for n in nodes for a in lookup_args(n)[:3]]
    with ctx.fake_mode:
        fake_state = [_val(a).detach().requires_grad_(g) for a, g in zip(state, grads)]
        fake = [*map(_val, use_inputs), *fake_state,
                *(ctx.fake_mode.from_tensor(t, static_shapes=True) for _, _, t in consts), *map(_val, received)]
        with torch.enable_grad():
            sub = _compat.make_fx(program, tracing_mode="real")(*fake)

    g = gm.graph
    env: dict[fx.Node, object] = {}
    with g.inserting_before(last):
        const_nodes = []
        for tbe, name, t in consts:
            attr = _fresh_attr(gm, f"_sparse_{tbe}_{name}", t)
            n = g.get_attr(attr)
            n.meta["val"] = ctx.fake_mode.from_tensor(t, static_shapes=True)
            const_nodes.append(n)
        placeholders = [n for n in sub.graph.nodes if n.op == "placeholder"]
        for ph, a in zip(placeholders, [*use_inputs, *state, *const_nodes, *received]):
            env[ph] = a
        outs = None
        for n in sub.graph.nodes:
            if n.op == "placeholder":
                continue
            if n.op == "output":
                outs = [env[o] for o in n.args[0]]
                continue
            if n.op == "get_attr":
                attr = _fresh_attr(gm, "_sparse_const", getattr(sub, n.target))
                new = g.get_attr(attr)
                new.meta.update(n.meta)
            else:
                new = g.node_copy(n, lambda a: env[a])
            new.meta["expanded_from"] = last.name
            env[n] = new
    at = 0
    for node in nodes:
        if node.target in (sparse_ops.embedding_bags.default, sparse_ops.embedding_bags_received.default):
            node.replace_all_uses_with(outs[at])
            at += 1
        else:  # a list of tensors: its users are getitem nodes
            count = len(node.meta["val"])
            for user in list(node.users):
                if user.target is not operator.getitem:
                    raise AssertionError(f"{user}: a sequence lookup's output read other than by index")
                user.replace_all_uses_with(outs[at + user.args[1]])
                g.erase_node(user)
            at += count
        g.erase_node(node)
    ctx.report.sparse.append(_describe(coll, n_uses) + (f", ids exchanged a batch ahead ({', '.join(groups)})"
                                                        if received else ""))
    if coll.layout.kernel_note:  # a kernel other than the plan's: listed with the fallbacks
        ctx.report.fallbacks.append(coll.layout.kernel_note)
    log.info("shard_embeddings: %s", ctx.report.sparse[-1])


def _received(nodes: list[fx.Node], coll, ctx: PassContext) -> tuple[list, list[str]]:
    """The ids a pipeline exchanged a batch ahead for this lookup (their nodes and groups), or none.
    A module looked up several times a step merges its uses into one exchange in the step, and
    leaves what was exchanged ahead unused: a fallback, logged and listed."""
    ahead = [r for r in map(received_args, nodes) if r is not None]
    if not ahead:
        return [], []
    if len(nodes) == 1:
        return ahead[0]
    note = (f"{coll.layout.fqns[0]}: looked up {len(nodes)} times a step, so its ids are exchanged in the step "
            "(one exchange for the merged uses); the ids the pipeline exchanged a batch ahead go unused")
    ctx.report.fallbacks.append(note)
    log.warning("shard_embeddings: %s", note)
    return [], []


def _defer_users(nodes: list[fx.Node], coll) -> None:
    """Moves what the earlier lookups' outputs feed to after the last lookup, where the merged
    program will be; refuses when the last lookup's input needs an earlier one's output."""
    last = nodes[-1]
    order = {n: i for i, n in enumerate(last.graph.nodes)}
    dependents: set[fx.Node] = set()
    stack = [u for n in nodes[:-1] for u in n.users]
    while stack:
        n = stack.pop()
        if n in dependents or order[n] > order[last]:
            continue
        dependents.add(n)
        stack.extend(n.users)
    ancestors: set[fx.Node] = set()
    stack = list(last.all_input_nodes)
    while stack:
        n = stack.pop()
        if n not in ancestors:
            ancestors.add(n)
            stack.extend(n.all_input_nodes)
    if dependents & ancestors or last in dependents:
        raise NotImplementedError(
            f"{coll.layout.fqns}: one embedding module used twice in a step, the second lookup's input computed "
            "from the first's output; graphshard merges the uses of a shared module into one lookup, which needs "
            "their inputs to be independent"
        )
    for n in sorted(dependents, key=order.__getitem__, reverse=True):
        last.append(n)


def _val(a):
    return a.meta["val"] if isinstance(a, fx.Node) else a


def _fresh_attr(gm: fx.GraphModule, base: str, value: torch.Tensor) -> str:
    name, i = base, 0
    while hasattr(gm, name):
        i += 1
        name = f"{base}_{i}"
    gm.register_buffer(name, value)  # aot_autograd lifts buffers and gives the trace their fake values
    return name


def _describe(coll, uses: int) -> str:
    lay = coll.layout
    kinds = {}
    for t in lay.tables:
        where = ",".join(str(s.rank) for s in t.shards) if t.sharding_type != "data_parallel" else "all"
        kinds.setdefault(t.sharding_type, []).append(f"{t.name}@{where}")
    tbes = ", ".join(f"{name}: {len(m.shapes)} table shard(s), {m.optimizer}"
                     + (f", {m.kernel} kernel" if m.kernel != "fbgemm" else "") for name, m in coll.tbes.items()
                     if hasattr(m, "shapes"))
    return (f"{lay.fqns[0]}: " + "; ".join(f"{k} {' '.join(v)}" for k, v in kinds.items())
            + f" | rank {lay.rank} fused TBEs: {tbes or 'none'}"
            + (f" | {uses} uses ({', '.join(lay.fqns)}) merged into one lookup" if uses > 1 else ""))
