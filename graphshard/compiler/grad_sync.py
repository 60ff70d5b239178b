"""Gradient accumulation without communication: ``graphshard.no_sync(model)``.

Inside the context a backward skips the data-parallel gradient reductions: each unit's
unreduced gradient (the buffer its reduce-scatter or all-reduce would send, and on gloo's
all-to-all form the row this rank keeps) is added to a pending buffer that the compiled
backward keeps; the sharded gradients are left as they are. The next backward outside the context adds the pending buffers to its own before
reducing, so one reduction carries every accumulated micro-batch (reductions are linear:
the result equals reducing each micro-batch's gradient and summing).

The compiled backward is one graph, so the three behaviours are three programs derived
from it, each built and lowered once, on its first use (a model trained without
``no_sync`` never pays for them), and selected per call by the model's ``sync_gradients``
flag (`GradSync`): no recompile per toggle.

* ``plain``: the backward as partitioned, scheduled and lowered.
* ``accumulate``: the root data-parallel reductions and everything downstream of them
  removed; their inputs become extra outputs (the pending buffers), the parameter
  gradients they produced are ``None``.
* ``flush``: each root reduction's input is ``input + pending`` (a graph input per unit, and
  one more for a kept row).

Model-parallel reductions (tensor parallelism's gradient all-reduces) always run: no_sync
is a data-parallel notion, as in torch's FSDP and DDP.
"""

from __future__ import annotations

import contextlib
import logging
import operator
from typing import Callable, Iterator

import torch
import torch.fx as fx
import torch.nn as nn

from graphshard._compat import c10d

log = logging.getLogger(__name__)

_REDUCTIONS = frozenset({c10d.reduce_scatter_tensor.default, c10d.all_reduce.default,
                         c10d.all_to_all_single.default})


@contextlib.contextmanager
def no_sync(model: nn.Module) -> Iterator[None]:
    """Within the context, backward passes of the sharded ``model`` accumulate gradients
    locally without data-parallel communication; the first backward after it reduces the
    accumulated gradients with its own (torch's ``FSDP.no_sync`` / ``DDP.no_sync``).
    Forward and backward must both run inside the context; gradients of unsharded
    (replicated) units accumulate unreduced too, and so need the synchronizing backward
    before the optimizer step."""
    from graphshard.storage import state_of

    state = state_of(model)
    if state is None:
        raise ValueError(f"no_sync: {type(model).__name__} is not sharded by graphshard; call graphshard.compile "
                         "(or wrap it with graphshard.fsdp.FullyShardedDataParallel) first")
    prev = state.sync_gradients
    state.sync_gradients = False
    try:
        yield
    finally:
        state.sync_gradients = prev


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


class GradSync:
    """The backward, in aot_autograd's boxed convention: ``plain``, or, while the model's
    ``sync_gradients`` is off, ``accumulate`` (keeping the pending buffers), then ``flush``
    on the first synchronizing call. The two derived programs are built from the backward graph
    ``plain`` was lowered from (``source()``: the partitioned graph, its data-parallel roots and its
    example inputs; read on first use, so a program loaded from the cache loads that graph only
    when ``no_sync`` is used) and lowered by ``lower`` on their first use, and kept."""

    _boxed_call = True

    def __init__(self, plain: Callable, source: Callable[[], tuple[fx.GraphModule, list[fx.Node], list]],
                 models: tuple, lower: Callable[[fx.GraphModule, list], Callable]):
        self.plain, self.source = plain, source
        self.models = models  # the sharded models whose no_sync state selects the program
        self.lower = lower
        self.compiled: dict[str, Callable] = {}
        self.n_extra = 0  # flush's pending buffers: one input per value a root reduces
        self.pending: list[torch.Tensor] | None = None

    def _program(self, name: str) -> Callable:
        if name not in self.compiled:
            log.info("no_sync: building and lowering the %s backward program", name)
            backward, roots, inputs = self.source()
            values = [x for r in roots for x in sent(r)]
            self.n_extra = len(values)
            if name == "accumulate":
                graph = accumulate_variant(backward, roots)
            else:
                graph = flush_variant(backward, roots)
                inputs = inputs + [x.meta["val"] for x in values]
            self.compiled[name] = self.lower(graph, inputs)
        return self.compiled[name]

    def __call__(self, args: list):
        if any(not m.sync_gradients for m in self.models):
            outs = list(_call(self._program("accumulate"), args))
            extra, outs = outs[len(outs) - self.n_extra:], outs[:len(outs) - self.n_extra]
            if self.pending is None:
                self.pending = extra
            else:
                for acc, g in zip(self.pending, extra):
                    acc.add_(g)
            return outs
        if self.pending is not None:
            pending, self.pending = self.pending, None
            return _call(self._program("flush"), list(args) + pending)
        return _call(self.plain, args)


def _call(fn: Callable, args: list):
    if getattr(fn, "_boxed_call", False):
        return fn(args)
    out = fn(*args)
    args.clear()
    return out
