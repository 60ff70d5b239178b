"""DMP's ``fused_optimizer``: TorchRec's ``KeyedOptimizer`` over the sharded tables' fused updates.

Imported when a ``DistributedModelParallel`` is built (TorchRec is an optional dependency).
"""

from __future__ import annotations

from typing import Any

from torchrec.optim.fused import FusedOptimizer as _TorchRecFusedOptimizer

from graphshard.sparse.fused_tbe import optimizer_name
from graphshard.sparse.state import optimizer_state, table_dtensor, weight_key


class FusedOptimizer(_TorchRecFusedOptimizer):
    """The sharded tables' fused optimizer, laid out as TorchRec's DMP lays out its own:

    - ``params``: each fused table this rank holds a piece of, keyed by its FQN in the model's state
      dict: a DTensor over the ranks that hold the table (a view of the TBE, as ``state_dict()``
      shows it);
    - ``state[weight]``: ``{"<table>.momentum1": DTensor}``, a view of the TBE's optimizer state
      (Adagrad: one value per element; row-wise Adagrad: one per row, per column block for a
      column-wise table); ``{}`` for SGD;
    - ``param_groups``: one per sharded module, ``{"params": [...], "lr": ...}``.

    The update runs in the backward, inside the compiled program; ``step`` and ``zero_grad``
    apply each group's ``lr`` to its kernels, as TorchRec's do, so ``CombinedOptimizer``,
    ``KeyedOptimizerWrapper``, ``WarmupOptimizer`` and torch's LR schedulers drive it; setting a
    group's ``lr`` applies it at once too. ``state_dict`` / ``load_state_dict`` are
    ``KeyedOptimizer``'s: loading copies into the views, so into the kernels' state.
    """

    def __init__(self, collections: list) -> None:
        params: dict[str, Any] = {}
        state: dict[Any, dict] = {}
        groups = []
        for coll in collections:
            kind = optimizer_name(coll.fused_params.get("optimizer", "sgd"))
            weights = []
            for t in coll.layout.tables:
                if not t.fused:
                    continue
                # every rank builds every table's DTensors (a table's mesh is made by all ranks together)
                weight = table_dtensor(coll, t.name)
                momentum = None if kind == "sgd" else optimizer_state(coll, t.name)
                if not coll.local_pieces(t.name):
                    continue  # as TorchRec's: the tables this rank holds
                params[weight_key(coll, coll.layout.fqns[0], t.name)] = weight
                state[weight] = {} if momentum is None else {f"{t.name}.momentum1": momentum}
                weights.append(weight)
            groups.append(_Group(coll, weights))
        super().__init__(params, state, groups)

    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            group.apply()

    def zero_grad(self, set_to_none: bool = False) -> None:
        self.step()


class _Group(dict):
    """A module's param group; its ``lr`` is the module's kernels' learning rate."""

    def __init__(self, coll, weights: list):
        tbes = coll.fused()
        lr = float(tbes[0].lr) if tbes else float(coll.fused_params.get("learning_rate", 0.0))
        super().__init__(params=weights, lr=lr)
        self._tbes = tbes

    def __setitem__(self, key, value):
        super().__setitem__(key, value)
        if key == "lr":
            self.apply()

    def apply(self) -> None:
        for t in self._tbes:
            t.lr.fill_(float(self["lr"]))
