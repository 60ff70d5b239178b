"""schedule_overlap: order collectives to overlap compute, on the partitioned graphs.

Runs on aot_autograd's forward and backward graphs, where every collective is an
explicit ``_c10d_functional`` start plus a ``wait_tensor``:

- unit all-gathers are issued where the prefetch settings say (``CompileConfig``'s
  ``forward_prefetch`` for the forward graph, ``backward_prefetch`` for the backward's
  re-gathers; units in the order of their first use in the graph, so "next" is the next
  unit in program order). With ``limit_all_gathers = L`` (FSDP1's two: L = 2), a
  prefetched all-gather of unit k is anchored on unit k-L+1 (the current unit when L = 2):
  "pre" (and ``forward_prefetch=True``) issues it right after the anchor's all-gather is
  waited, before the anchor's compute that reads its parameters; "post" right after the
  anchor's gradient computation (every use of its gathered parameters and the inputs of
  its gradient reduction). Under both, the anchor's gradient reduction starts after it:
  FSDP1 prefetches in the pre-backward hook (pre) or in the post-backward hook before
  reducing (post), so the next gather never queues behind the current unit's reduction on
  one communicator. The first L-1 units have no anchor and are issued at
  the start of the graph; with L = None none has one. ``None`` / ``False`` / L = 1 issue
  every all-gather at its first use, after the previous unit's compute (a hard edge on
  that unit's uses of its parameters);
- every wait sits right before its first use; the waits of a coalesced
  all-gather (one per parameter, on gloo) sit together before the first use of
  any of them, and every one of its outputs is waited, used or not;
- in the forward, the sparse lookups' input distribution (all-to-alls of ids and lengths and
  the integer work that builds them) is issued first, before the dense compute that precedes
  the lookup in program order; the ids' last wait stays at the lookup;
- reduce-scatters and all-reduces of gradients (and the all-to-alls that stand
  for reduce-scatters on gloo) start as soon as their inputs exist (and, for a prefetch
  anchor, its prefetch has been issued); each one's
  wait comes right after the next of its kind starts (at most two in flight, as
  FSDP2 keeps them), the last one's before the graph's output.

The order is a priority topological sort, so data dependencies always hold. The
all-gather placements are ordering edges to nodes that come before the gathered
unit's first use in the traced program, never to later ones (a module applied twice
is used again after the next unit), and an edge that data reverses is left out.
"""

from __future__ import annotations

import heapq
import itertools
import math
import operator

import torch
import torch.fx as fx

import graphshard.ops  # noqa: F401  (registers torch.ops.graphshard)
from graphshard._compat import c10d
from graphshard.passes.context import PassContext
from graphshard.passes.no_sync_programs import sent
from graphshard.report import CollectiveRecord, add_compute, collective_of_wait

_STARTS = {c10d.all_gather_into_tensor.default: "all_gather", c10d.reduce_scatter_tensor.default: "reduce_scatter",
           c10d.all_reduce.default: "all_reduce", c10d.all_to_all_single.default: "all_to_all",
           c10d.all_gather_into_tensor_coalesced.default: "all_gather"}
_REDUCTIONS = ("reduce_scatter", "all_reduce", "all_to_all")  # in the backward: gradient reductions
_WAIT = c10d.wait_tensor.default
_MATMULS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default,
            torch.ops.aten.baddbmm.default}


def _waits_of(start: fx.Node) -> list[fx.Node]:
    """The waits on ``start``'s result: one, or one per output of a coalesced collective
    (each behind the ``getitem`` that picks it)."""
    direct = [u for u in start.users if u.target == _WAIT]
    return direct or [w for g in start.users if g.target is operator.getitem for w in g.users if w.target == _WAIT]


def _wait_every_output(start: fx.Node) -> None:
    """Gives every output of a coalesced collective a wait. c10d registers the collective's
    work under each output and forgets it only when that output is waited; the work holds
    every output, so one never waited (a parameter the backward's recomputed gather brings
    but no gradient formula reads) would keep the whole gather alive, step after step."""
    picked = {g.args[1]: g for g in start.users if g.target is operator.getitem}
    for i in range(len(start.args[0])):
        g = picked.get(i)
        if g is None:
            with start.graph.inserting_after(start):
                g = start.graph.call_function(operator.getitem, (start, i))
            g.meta.update(start.meta)
            g.meta["val"] = start.meta["val"][i] if "val" in start.meta else None
        if not any(u.target == _WAIT for u in g.users):
            with start.graph.inserting_after(g):
                w = start.graph.call_function(_WAIT, (g,))
            w.meta.update(g.meta)


def _exclusive_prep(start: fx.Node, index: dict[fx.Node, int]) -> list[fx.Node]:
    """The layout ops that exist only to build ``start``'s input (casts, pads, the bucket's cat),
    in graph order (``index``)."""
    prep: set[fx.Node] = set()
    stack = list(start.all_input_nodes)
    while stack:
        n = stack.pop()
        if n.op != "call_function" or n in prep or n.target not in _LAYOUT:
            continue
        if all(u is start or u in prep for u in n.users):
            prep.add(n)
            stack.extend(n.all_input_nodes)
    return sorted(prep, key=index.__getitem__)


def _reduction_prep(start: fx.Node, index: dict[fx.Node, int]) -> list[fx.Node]:
    """`_exclusive_prep` of a gradient reduction. On gloo's all-to-all form the pack has a second
    output, the row this rank keeps (`no_sync_programs.sent`), which only the reduction's own
    ``unpack_reduced`` reads: the pack (and what exists only to build it) moves with the reduction."""
    prep = _exclusive_prep(start, index)
    kept = sent(start)[1:]
    if kept:
        pack = kept[0].args[0]
        prep = list({n: None for n in prep + _exclusive_prep(pack, index) + [pack, *pack.users]})
    return sorted((n for n in prep if n is not start), key=index.__getitem__)


def unit_name(node: fx.Node, fallback: str) -> str:
    unit = (node.meta.get("custom") or {}).get("graphshard_unit")
    return fallback if unit is None else (unit or "<root>")


def schedule_overlap(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    g = gm.graph
    for n in g.find_nodes(op="call_function", target=c10d.all_gather_into_tensor_coalesced.default):
        _wait_every_output(n)
    nodes = list(g.nodes)
    index = {n: i for i, n in enumerate(nodes)}
    starts = [n for n in nodes if n.target in _STARTS]
    if not starts:
        return gm
    key: dict[fx.Node, float] = {n: float(i) for n, i in index.items()}
    extra_deps: dict[fx.Node, list[fx.Node]] = {}

    waits = {s: _waits_of(s) for s in starts}
    gathers = sorted(
        (s for s in starts if _STARTS[s.target] == "all_gather" and waits[s] and _is_unit_gather(s)),
        key=lambda s: min(index[w] for w in waits[s]),
    )
    chains = {s: _gathered(s, waits[s]) for s in gathers}
    uses = {s: [u for n in chain for u in n.users if u not in chain] for s, chain in chains.items()}
    first_use = {s: min((index[u] for u in uses[s]), default=max(index[w] for w in waits[s])) for s in gathers}
    mode = prefetch_mode(ctx.config, ctx.stage)
    _place_gathers(gathers, mode, ctx.config.limit_all_gathers, starts, waits, uses, first_use, index, key,
                   extra_deps)
    for s in starts:
        if not waits[s]:
            continue
        if s in first_use:
            # A coalesced gather's waits (and the getitems before them) move together, to the
            # first use of any of its outputs: the unit's parameters arrive at one point, as a
            # bucket's do, and the compute between is not cut into pieces by waits.
            for n in chains[s]:  # the waits first, then the views of what they return
                key[n] = first_use[s] - (0.75 if n.target is operator.getitem and n.args[0] is s
                                         or n.target == _WAIT else 0.5)
        elif _STARTS[s.target] in _REDUCTIONS and ctx.stage == "backward":
            w = waits[s][0]
            for n in _reduction_prep(s, index) + [s]:
                key[n] = -math.inf
            key[w] = math.inf
    if ctx.stage == "backward":
        _bound_reductions(starts, waits, key, extra_deps)
    else:
        _hoist_sparse_input(starts, key)

    order = _priority_topo(nodes, key, extra_deps)
    _reorder(g, order)
    _record(gm, ctx, gathers)
    ctx.report.schedule[ctx.stage] = describe_settings(ctx.config, ctx.stage, len(gathers))
    return gm


def _is_int_valued(n: fx.Node) -> bool:
    v = n.meta.get("val")
    if isinstance(v, torch.Tensor):
        return not v.is_floating_point()
    if isinstance(v, (list, tuple)):
        return all(x is None or isinstance(x, torch.Tensor) and not x.is_floating_point() for x in v)
    return isinstance(v, (int, torch.SymInt))


def _hoist_sparse_input(starts: list[fx.Node], key: dict) -> None:
    """The sparse lookups' input distribution (all-to-alls of ids and lengths, and the integer
    work that builds them from the graph's inputs) runs first, so the dense compute before the
    lookup in program order (a DLRM's bottom MLP) overlaps the ids' exchange; the last exchange's
    wait stays at its first use (the lookup). An all-to-all whose input needs floating-point
    compute is left where it is."""
    for s in starts:
        if _STARTS[s.target] != "all_to_all" or not _is_int_valued(s):
            continue
        closure, stack = {s}, list(s.all_input_nodes)
        while stack:
            n = stack.pop()
            if n in closure or n.op in ("placeholder", "get_attr"):
                continue
            closure.add(n)
            stack.extend(n.all_input_nodes)
        if all(_is_int_valued(n) for n in closure):
            for n in closure:
                key[n] = -math.inf


def prefetch_mode(config, stage: str) -> str | None:
    """The prefetch setting in force for a graph: 'pre', 'post' or None (at first use)."""
    if stage == "backward":
        return config.backward_prefetch
    return "pre" if config.forward_prefetch else None


def describe_settings(config, stage: str, n_gathers: int) -> str:
    """``explain``'s line on the settings that placed this graph's unit all-gathers."""
    limit = config.limit_all_gathers
    setting = (f"backward_prefetch={config.backward_prefetch!r}" if stage == "backward"
               else f"forward_prefetch={config.forward_prefetch}")
    setting += f", limit_all_gathers={limit}" + (" (unbounded)" if limit is None else "")
    if not n_gathers:
        return f"{setting}: no unit all-gathers in this graph"
    mode = prefetch_mode(config, stage)
    ahead = "the next unit's all-gather" if limit == 2 else f"the all-gather of the unit {(limit or 2) - 1} ahead"
    if mode is None or limit == 1:
        how = "each unit's all-gather is issued at its first use, after the previous unit's compute"
    elif limit is None:
        how = "every unit's all-gather is issued at the start of the graph"
    elif mode == "pre" and stage != "backward":
        how = f"{ahead} is issued right after the current unit's all-gather is waited, before the current unit's compute"
    elif mode == "pre":
        how = (f"{ahead} is issued right after the current unit's all-gather is waited (before the gradient "
               "computation that reads its parameters), before the current unit's gradient reduction")
    else:
        how = (f"{ahead} is issued right after the current unit's gradient computation, "
               "before the current unit's gradient reduction")
    return f"{setting}: {how}"


def _gathered(start: fx.Node, waits: list[fx.Node]) -> list[fx.Node]:
    """The nodes that move with a unit gather's waits: the getitems that pick a coalesced
    gather's outputs, the waits and the views of what they return. Their users outside
    this list are the uses of the unit's gathered parameters."""
    picks = [g for g in start.users if g.target is operator.getitem]
    return picks + [n for w in waits for n in _view_chain(w)]


def _place_gathers(gathers, mode, limit, starts, waits, uses, first_use, index, key, extra_deps) -> None:
    """Where each unit's all-gather (and its copy-in) is issued; see the module docstring.
    A gather is ordered after nodes that come before its own first use in the traced
    program only: an ordering edge never pushes it (and the compute that needs it) later."""
    prefetch = mode is not None and limit != 1
    for k, ag in enumerate(gathers):
        chain = _exclusive_prep(ag, index) + [ag]
        roots = [n for n in chain if not any(a in chain for a in n.all_input_nodes)]

        def earlier(nodes, ag=ag):
            return [n for n in nodes if n.op != "output" and index[n] < first_use[ag]]

        if not prefetch:
            for n in chain:
                key[n] = first_use[ag] - 0.9  # right before its waits (first use - 0.75)
            if k:  # and after the previous unit's compute
                _add_deps(roots, earlier(uses[gathers[k - 1]]), extra_deps)
            continue
        for n in chain:
            key[n] = -math.inf
        a = -1 if limit is None else k - (limit - 1)
        if a < 0:
            continue  # no anchor: issued as soon as its inputs exist
        anchor = gathers[a]
        reductions = _first_reductions(anchor, starts, waits, index)  # none in a forward graph
        if mode == "pre":
            _add_deps(roots, waits[anchor], extra_deps)
        else:
            grads = [x for r in reductions for x in _inputs(_reduction_prep(r, index) + [r])]
            _add_deps(roots, earlier(uses[anchor] + grads), extra_deps)
        for r in reductions:  # FSDP1 issues the prefetch before the current unit's reduction
            rchain = _reduction_prep(r, index) + [r]
            _add_deps([n for n in rchain if not any(x in rchain for x in n.all_input_nodes)], [ag], extra_deps)


def _unit_of(node: fx.Node):
    return (node.meta.get("custom") or {}).get("graphshard_unit")


def _first_reductions(gather: fx.Node, starts: list[fx.Node], waits: dict, index: dict[fx.Node, int]) -> list[fx.Node]:
    """The gradient reductions of ``gather``'s unit that read its gradients themselves (the
    reduce-scatter or all-to-all, not hybrid sharding's all-reduce of what it returns)."""
    unit = _unit_of(gather)
    if unit is None:
        return []
    reds = [s for s in starts if _STARTS[s.target] in _REDUCTIONS and waits[s] and _unit_of(s) == unit]
    return [r for r in reds if not _reads_from(r, [o for o in reds if o is not r], index)]


def _reads_from(node: fx.Node, sources: list[fx.Node], index: dict[fx.Node, int]) -> bool:
    """Whether ``node`` depends by data on one of ``sources``. The graph's order is topological, so
    a path from a source passes only nodes at or after it: the search stops below the earliest
    source, and stays within the unit instead of walking the whole graph above it."""
    if not sources:
        return False
    targets, low = set(sources), min(index[s] for s in sources)
    seen, stack = set(), list(node.all_input_nodes)
    while stack:
        n = stack.pop()
        if n in seen or index[n] < low:
            continue
        if n in targets:
            return True
        seen.add(n)
        stack.extend(n.all_input_nodes)
    return False


def _inputs(chain: list[fx.Node]) -> list[fx.Node]:
    """The nodes ``chain`` reads from outside itself."""
    return [a for n in chain for a in n.all_input_nodes if a not in chain]


def _add_deps(dependents: list[fx.Node], gate: list[fx.Node], extra_deps: dict) -> None:
    """Orders every node of ``dependents`` after every node of ``gate``, except a gate node
    that depends on one of them already (by data or an earlier ordering edge): that edge would
    be a cycle, and data comes first."""
    extra_users = _extra_users(extra_deps)
    after, stack = set(dependents), list(dependents)
    while stack:
        n = stack.pop()
        for u in itertools.chain(n.users, extra_users.get(n, ())):
            if u not in after:
                after.add(u)
                stack.append(u)
    keep = [x for x in dict.fromkeys(gate) if x not in after]
    for n in dependents:
        extra_deps.setdefault(n, []).extend(keep)


def _extra_users(extra_deps: dict[fx.Node, list[fx.Node]]) -> dict[fx.Node, list[fx.Node]]:
    """The ordering edges the other way: for each node, the nodes ordered after it."""
    users: dict[fx.Node, list[fx.Node]] = {}
    for n, ds in extra_deps.items():
        for d in ds:
            users.setdefault(d, []).append(n)
    return users


def _bound_reductions(starts: list[fx.Node], waits: dict, key: dict, extra_deps: dict) -> None:
    """At most two gradient reductions of a kind in flight, as FSDP2 keeps them: the wait
    of one is issued right after the next one starts. The reduction then has the next
    unit's backward to finish in, and its full-size input buffer is freed there instead
    of every unit's staying alive until the end of the backward."""
    extra_users = _extra_users(extra_deps)
    for kind in _REDUCTIONS:
        reds = [s for s in starts if _STARTS[s.target] == kind and waits[s]]
        for prev, nxt in zip(reds, reds[1:]):
            w = waits[prev][0]
            # searched from the wait down (a reduction's result feeds little but the output), not
            # from ``nxt`` up through the whole backward before it
            if _reaches(w, nxt, extra_users):
                continue  # already ordered (by data or a prefetch edge)
            extra_deps.setdefault(w, []).append(nxt)
            extra_users.setdefault(nxt, []).append(w)
            key[w] = -math.inf


def _reaches(node: fx.Node, target: fx.Node, extra_users: dict[fx.Node, list[fx.Node]]) -> bool:
    """Whether ``target`` comes after ``node`` by data or an ordering edge (``extra_users``: the
    nodes each node must precede)."""
    seen, stack = {node}, [node]
    while stack:
        n = stack.pop()
        for u in itertools.chain(n.users, extra_users.get(n, ())):
            if u is target:
                return True
            if u not in seen:
                seen.add(u)
                stack.append(u)
    return False


_VIEWS = {torch.ops.aten.t.default, torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default,
          torch.ops.aten.permute.default, torch.ops.aten.transpose.int, torch.ops.aten.slice.Tensor,
          torch.ops.aten.narrow.default, torch.ops.aten.split_with_sizes.default, torch.ops.aten.alias.default,
          torch.ops.aten.reshape.default, torch.ops.aten.expand.default, torch.ops.aten.unsqueeze.default,
          torch.ops.aten.select.int, torch.ops.aten.squeeze.dim, torch.ops.aten.as_strided.default,
          torch.ops.prims.convert_element_type.default, torch.ops.aten._to_copy.default, operator.getitem,
          torch.ops.graphshard.unpack.default, torch.ops.graphshard.unpack_reduced.default}


_LAYOUT = _VIEWS | {torch.ops.graphshard.pack.default, torch.ops.graphshard.pack_grads.default,
                    torch.ops.aten.cat.default, torch.ops.aten.constant_pad_nd.default,
                    torch.ops.aten.clone.default, torch.ops.aten.div.Tensor, torch.ops.aten.mul.Tensor}


def _view_chain(wait: fx.Node) -> list[fx.Node]:
    """The wait and the views/casts that only re-shape its result (they move with it)."""
    chain, stack = [wait], [wait]
    while stack:
        for u in stack.pop().users:
            if u.op == "call_function" and u.target in _VIEWS and u not in chain:
                chain.append(u)
                stack.append(u)
    return chain


def _is_unit_gather(ag: fx.Node) -> bool:
    """A data-parallel parameter gather (from graphshard::unshard), not a model-parallel activation gather."""
    return (ag.meta.get("custom") or {}).get("graphshard_unit") is not None or all(
        n.op == "placeholder" or n.target != _WAIT for n in _ancestors(ag)
    )


def _ancestors(node: fx.Node):
    seen, stack = set(), list(node.all_input_nodes)
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        yield n
        stack.extend(n.all_input_nodes)


def _priority_topo(nodes, key, extra_deps) -> list[fx.Node]:
    deps = {n: set(n.all_input_nodes) | set(extra_deps.get(n, ())) for n in nodes}
    users: dict[fx.Node, list[fx.Node]] = {n: [] for n in nodes}
    for n, ds in deps.items():
        for d in ds:
            users[d].append(n)
    pos = {n: i for i, n in enumerate(nodes)}
    missing = {n: len(ds) for n, ds in deps.items()}
    heap = [(key[n] if n.op not in ("placeholder", "output") else (-math.inf if n.op == "placeholder" else math.inf),
             pos[n], n) for n in nodes if missing[n] == 0]
    heapq.heapify(heap)
    out = []
    while heap:
        _, _, n = heapq.heappop(heap)
        out.append(n)
        for u in users[n]:
            missing[u] -= 1
            if missing[u] == 0:
                k = math.inf if u.op == "output" else key[u]
                heapq.heappush(heap, (k, pos[u], u))
    assert len(out) == len(nodes), "schedule_overlap: cycle in the scheduling constraints"
    return out


def _reorder(g: fx.Graph, order: list[fx.Node]) -> None:
    prev = None
    for n in order:
        if prev is not None and prev.next is not n:
            prev.append(n)
        prev = n


def _grad_units(gm: fx.GraphModule, ctx: PassContext) -> dict[fx.Node, str]:
    """Backward: names each gradient reduction by the unit whose gradients it produces."""
    out_node = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    outs = out_node.args[0] if isinstance(out_node.args[0], (list, tuple)) else [out_node.args[0]]
    position = {o: i for i, o in enumerate(outs) if isinstance(o, fx.Node)}
    names = {}
    for n in gm.graph.nodes:
        if n.target in _STARTS and _STARTS[n.target] != "all_gather":
            seen, stack = set(), [n]
            while stack:
                m = stack.pop()
                if m in position and position[m] < len(ctx.input_units) and ctx.input_units[position[m]] is not None:
                    names[n] = ctx.input_units[position[m]] or "<root>"
                    break
                for u in m.users:
                    if u not in seen:
                        seen.add(u)
                        stack.append(u)
    return names


def _record(gm: fx.GraphModule, ctx: PassContext, gathers: list[fx.Node]) -> None:
    names = {ag: unit_name(ag, f"#{i}") for i, ag in enumerate(gathers)}
    if ctx.stage == "backward":
        names.update(_grad_units(gm, ctx))
    events = []
    waited = set()
    for n in gm.graph.nodes:
        if n.target in _STARTS:
            kind = _STARTS[n.target]
            label = names.get(n, n.name)
            events.append(f"{kind}({label})")
            ins = n.args[0] if isinstance(n.args[0], (list, tuple)) else [n.args[0]]
            nbytes = sum(v.numel() * v.element_size() for v in (a.meta.get("val") for a in ins) if v is not None)
            ctx.report.collectives.append(CollectiveRecord(kind, _axis_of(n, ctx), nbytes, label, ctx.stage))
        elif n.target == _WAIT:
            src = collective_of_wait(n)
            if src not in waited:  # a coalesced collective's waits are one event
                waited.add(src)
                events.append(f"wait({names.get(src, src.name)})")
        elif n.op == "call_function" and n.target in _MATMULS:
            add_compute(events)
    ctx.report.order[ctx.stage] = events


def _axis_of(n: fx.Node, ctx: PassContext) -> str:
    group = n.args[-1]
    for name, axis in ctx.group_axes.items():
        if axis == group:
            return name
    return str(group)
