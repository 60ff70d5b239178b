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
* ``accumulate`` and ``flush``: derived from it by `graphshard.passes.no_sync_programs` (the graph
  rewrites, with their dumps and golden graphs); this module selects and runs them.

Model-parallel reductions (tensor parallelism's gradient all-reduces) always run: no_sync
is a data-parallel notion, as in torch's FSDP and DDP.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Callable, Iterator

import torch
import torch.fx as fx
import torch.nn as nn

from graphshard.passes.no_sync_programs import accumulate_variant, flush_variant, sent

log = logging.getLogger(__name__)


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


class GradSync:
    """The backward, in aot_autograd's boxed convention: ``plain``, or, while the model's
    ``sync_gradients`` is off, ``accumulate`` (keeping the pending buffers), then ``flush``
    on the first synchronizing call. The two derived programs are built from the backward graph
    ``plain`` was lowered from (``source()``: the partitioned graph, its data-parallel roots and its
    example inputs; read on first use, so a program loaded from the cache loads that graph only
    when ``no_sync`` is used) and lowered by ``lower`` on their first use, and kept; ``dump`` (with
    ``dump_graphs``) is handed each derived graph by name before it is lowered."""

    _boxed_call = True

    def __init__(self, plain: Callable, source: Callable[[], tuple[fx.GraphModule, list[fx.Node], list]],
                 models: tuple, lower: Callable[[fx.GraphModule, list], Callable],
                 dump: Callable[[str, fx.GraphModule], None] | None = None):
        self.plain, self.source, self.dump = plain, source, dump
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
            if self.dump is not None:
                self.dump(name, graph)
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
