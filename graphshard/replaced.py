"""The parameters `storage.shard` replaced, remembered weakly, so that an optimizer built over them
(before ``graphshard.compile``) stops at its first step instead of training nothing.

Sharding swaps each parameter for a new ``nn.Parameter`` holding a DTensor (as FSDP does); an
optimizer created earlier still holds the old tensors, which no longer belong to the model and
never get a gradient, so ``step()`` silently does nothing. FSDP1 documents the rule ("create the
optimizer after wrapping"); graphshard checks it with torch's public global optimizer hook
(``torch.optim.optimizer.register_optimizer_step_pre_hook``), registered once, at the first
shard. The hook returns at once while nothing graphshard replaced is alive, and checks each
optimizer once per set of parameter groups (a tuple of their lengths, per step), so an optimizer
of any other model pays a dictionary lookup.
"""

from __future__ import annotations

import weakref

import torch
import torch.nn as nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

_replaced: dict[int, tuple[weakref.ref, str, str]] = {}  # id(old parameter) -> (weak ref to it, its FQN, the model)
_checked: "weakref.WeakKeyDictionary[torch.optim.Optimizer, tuple]" = weakref.WeakKeyDictionary()
_hook = None


def remember(old: nn.Parameter, fqn: str, model: str) -> None:
    """Notes that ``old``, the parameter ``fqn`` of ``model`` (its class name), was replaced by sharding."""
    global _hook
    key = id(old)

    def forget(ref, key=key):
        if _replaced.get(key, (None,))[0] is ref:
            del _replaced[key]

    _replaced[key] = (weakref.ref(old, forget), fqn, model)
    if _hook is None:
        _hook = register_optimizer_step_pre_hook(_check_step)


def _check_step(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
    if not _replaced:
        return
    groups = optimizer.param_groups
    seen = tuple(len(g["params"]) for g in groups)
    try:
        if _checked.get(optimizer) == seen:
            return
    except TypeError:  # an optimizer that cannot be weakly referenced: checked at every step
        pass
    stale = []
    for group in groups:
        for p in group["params"]:
            entry = _replaced.get(id(p))
            if entry is not None and entry[0]() is p:
                stale.append(entry[1:])
    if stale:
        models = sorted({m for _, m in stale})
        shown = ", ".join(repr(f) for f, _ in stale[:6]) + (f", ... ({len(stale)} in all)" if len(stale) > 6 else "")
        raise ValueError(
            f"{type(optimizer).__name__} steps over {len(stale)} parameter(s) that graphshard replaced with "
            f"sharded DTensors when it sharded {' and '.join(models)} ({shown}): the optimizer was created before "
            "graphshard.compile (or graphshard.shard, or the frontend's wrapper), so it holds the old tensors, "
            "which are no longer the model's and never get a gradient; this step would train nothing. "
            "Create the optimizer after graphshard.compile, from the compiled model's parameters() "
            "(as FSDP requires)")
    try:
        _checked[optimizer] = seen
    except TypeError:
        pass
