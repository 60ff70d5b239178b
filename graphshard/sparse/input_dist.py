"""A collection's input distribution run a batch ahead of its step, as TorchRec's pipelines run it.

In the compiled step the ids' exchange (``program.send_ids``) waits for the lengths' all-to-all
(their sums size the ids' all-to-all) and then for the ids: two waits before the lookup, which
the scheduler can only hide under the bottom of the dense network. A training pipeline knows the
next batch, so it can start that batch's exchange while this batch's step runs
(`graphshard.model_parallel.TrainPipelineSparseDist`). `Prefetch` is that exchange for one
collection and one batch, in three stages the pipeline interleaves with the step:

1. ``Prefetch(coll, kjt)``: the bounds check, the ids grouped by destination
   (``program.outgoing``) and the lengths' all-to-all started;
2. ``send_ids()``: the lengths waited for, the ids' (and weights') all-to-all started;
3. ``finish()``: the ids waited for and regrouped feature-major (``program.regroup``), then
   attached to the KJT (``attach``), where the collection's forward finds them and calls
   ``graphshard::embedding_bags_received``: the step's program then starts at the lookup.

Only the ``program.EXCHANGED`` groups (table-, column- and row-wise tables) move ahead; the
table-row-wise and data-parallel tables exchange their ids in the step, as before. The
collectives are the functional ones the step uses, on the collection's group; every rank runs the
same stages in the same order, so they pair up as the step's do.
"""

from __future__ import annotations

import torch

from graphshard import _compat
from graphshard.sparse.program import destinations, exchanged_groups, outgoing, read_kjt, regroup

ATTR = "_graphshard_received"
"""The KJT attribute a finished `Prefetch` leaves: ``{collection key: (groups, tensors)}``."""

_c10d = _compat.c10d


class _Group:
    """One group's exchange in flight."""

    def __init__(self, out, batch: int, group: str, world: int):
        self.out, self.batch, self.group, self.world = out, batch, group, world
        self.in_splits = destinations(out.lengths2d, out.send, world)
        self.lengths = _c10d.all_to_all_single(out.lengths2d.reshape(-1).contiguous(), [out.recv * batch] * world,
                                               [n * batch for n in out.send], group)
        self.values = self.weights = None

    def send_ids(self) -> None:
        self.lengths = _c10d.wait_tensor(self.lengths)
        out_splits = self.lengths.view(self.world, -1).sum(1).tolist()
        in_splits = self.in_splits.tolist()
        self.values = _c10d.all_to_all_single(self.out.values.contiguous(), out_splits, in_splits, self.group)
        if self.out.weights is not None:
            self.weights = _c10d.all_to_all_single(self.out.weights.contiguous(), out_splits, in_splits, self.group)

    def finish(self, kjt_ops) -> list[torch.Tensor]:
        values = _c10d.wait_tensor(self.values)
        weights = _c10d.wait_tensor(self.weights) if self.weights is not None else None
        lengths, values, weights = regroup(self.lengths, values, weights, self.out.recv, self.batch, self.world,
                                           kjt_ops)
        for t in (values, weights):
            if t is not None:
                _compat.maybe_mark_dynamic(t, 0)
        return [lengths, values] + ([weights] if weights is not None else [])


class Prefetch:
    """The input distribution of collection ``coll`` (a `SparseCollection`) for the KJT ``kjt``."""

    def __init__(self, coll, kjt):
        layout = coll.layout
        self.coll, self.kjt = coll, kjt
        self.groups = exchanged_groups(coll.plan)
        keys = list(kjt.keys())
        weights = kjt.weights_or_none() if layout.weighted else None
        for t in (kjt.values(), kjt.weights_or_none()):
            if t is not None:  # the batch's ids are as many as the data says: one program for all
                _compat.maybe_mark_dynamic(t, 0)
        with torch.no_grad():
            kpos, batch, lengths2d, values = read_kjt(layout, keys, kjt.values(), kjt.lengths(), coll.bounds_check)
            self._flight = [_Group(outgoing(layout, coll.plan, g, kpos, lengths2d, values, weights, layout.kjt_ops),
                                   batch, layout.group, layout.world) for g in self.groups]
        self._stage = 1

    def send_ids(self) -> None:
        if self._stage == 1:
            with torch.no_grad():
                for g in self._flight:
                    g.send_ids()
            self._stage = 2

    def finish(self) -> None:
        """Waits for the ids and attaches them to the KJT."""
        self.send_ids()
        with torch.no_grad():
            tensors = [t for g in self._flight for t in g.finish(self.coll.layout.kjt_ops)]
        attach(self.kjt, self.coll.layout.key, self.groups, tensors)
        self._flight = []


def attach(kjt, key: str, groups: list[str], tensors: list[torch.Tensor]) -> None:
    received = getattr(kjt, ATTR, None)
    if received is None:
        received = {}
        setattr(kjt, ATTR, received)
    received[key] = (tuple(groups), tensors)


def received_of(kjt, key: str):
    """The ids a pipeline exchanged ahead for collection ``key``: ``(groups, tensors)``, or None."""
    received = getattr(kjt, ATTR, None)
    return None if received is None else received.get(key)


def unpack(groups, tensors, weighted: bool) -> dict[str, tuple]:
    """``tensors`` as ``program.sharded_lookup``'s ``received``: (lengths, values, weights) by group."""
    step = 3 if weighted else 2
    out = {}
    for i, g in enumerate(groups):
        part = list(tensors[i * step:(i + 1) * step])
        out[g] = (part[0], part[1], part[2] if weighted else None)
    return out
