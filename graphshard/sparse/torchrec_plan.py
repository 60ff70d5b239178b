"""Which TorchRec embedding modules a model holds, under which plan, with which fused optimizer
(read by ``DistributedModelParallel`` and by the planners).

- Each sharded module is found once by identity, with every FQN it is reachable under (two
  towers holding one ``EmbeddingBagCollection``; an ``EmbeddingCollection`` likewise). The plan may name any of those FQNs; the
  same plan under several of them is one plan, two different plans for one module is an error.
- ``plan=None``: graphshard's planner chooses (``graphshard/planning/embedding_planner.py``); ``explain`` prints its plan.
- The fused optimizer of a module's tables: ``apply_optimizer_in_backward`` on its table
  weights (TorchRec's in-backward optimizer, read from the parameters), else the sharder's
  ``fused_params``, else fbgemm's defaults (EXACT_SGD, learning rate 0.01).
"""

from __future__ import annotations

import inspect
import logging
from dataclasses import dataclass

import torch.nn as nn

from graphshard.sparse.fused_tbe import optimizer_name

log = logging.getLogger("graphshard.model_parallel")


@dataclass
class Sharded:
    module: nn.Module
    fqns: tuple[str, ...]
    plan: dict            # table -> ParameterSharding
    fused_params: dict
    sharder: object


def _embedding_types() -> tuple[type, ...]:
    from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection

    return EmbeddingBagCollection, EmbeddingCollection


def find_modules(model: nn.Module) -> dict[int, tuple[nn.Module, list[str]]]:
    """Sharding candidates (TorchRec ``EmbeddingBagCollection`` s and ``EmbeddingCollection`` s) by
    identity, with all their FQNs."""
    found: dict[int, tuple[nn.Module, list[str]]] = {}
    kinds = _embedding_types()
    for fqn, mod in model.named_modules(remove_duplicate=False):
        if isinstance(mod, kinds):
            found.setdefault(id(mod), (mod, []))[1].append(fqn)
    return found


def _same(a, b) -> bool:
    return (a.sharding_type == b.sharding_type and a.compute_kernel == b.compute_kernel and a.ranks == b.ranks
            and str(a.sharding_spec) == str(b.sharding_spec))


def module_plan(fqns: list[str], plan) -> dict | None:
    """The plan entry for a module reachable under ``fqns``: None if the plan names none of them."""
    entries = [(f, plan.plan[f]) for f in fqns if plan is not None and f in plan.plan]
    if not entries:
        return None
    first_fqn, first = entries[0]
    for fqn, other in entries[1:]:
        tables = set(first) | set(other)
        if set(first) != set(other) or not all(_same(first[t], other[t]) for t in tables):
            raise ValueError(
                f"the plan gives the module reachable as {first_fqn!r} and {fqn!r} (one module, shared) two different "
                "shardings; a module is sharded once: give both FQNs the same plan or name only one"
            )
    return dict(first)


def fused_params_of(module: nn.Module, fqn: str, sharder) -> dict:
    """The fused optimizer's fbgemm keywords for ``module``'s tables."""
    from torchrec.distributed.utils import optimizer_type_to_emb_opt_type

    params = dict(getattr(sharder, "fused_params", None) or {})
    in_backward = {}
    for name, p in module.named_parameters():
        classes = getattr(p, "_optimizer_classes", None)
        if classes:
            kwargs = dict(p._optimizer_kwargs[0])
            in_backward[name] = (classes[0], tuple(sorted(kwargs.items())))
    if in_backward:
        if len(set(in_backward.values())) > 1:
            raise NotImplementedError(
                f"{fqn}: apply_optimizer_in_backward gave its tables different optimizers "
                f"({ {k: v[0].__name__ for k, v in in_backward.items()} }); graphshard fuses one optimizer per module"
            )
        cls, kwargs = next(iter(in_backward.values()))
        kwargs = dict(kwargs)
        try:
            emb = optimizer_type_to_emb_opt_type(cls)
            optimizer_name(emb)
        except (ValueError, KeyError, NotImplementedError):
            raise NotImplementedError(
                f"{fqn}: apply_optimizer_in_backward({cls.__module__}.{cls.__qualname__}) on its tables: graphshard's "
                f"fused kernels implement {', '.join(IN_BACKWARD)}; use one of them for the tables (or give the "
                "tables no in-backward optimizer and fused_params={'optimizer': ...} on the sharder)"
            ) from None
        params["optimizer"] = emb
        if "lr" in kwargs:
            params["learning_rate"] = kwargs.pop("lr")
        for k in ("eps", "weight_decay"):
            if k in kwargs:
                params[k] = kwargs.pop(k)
        defaults = inspect.signature(cls).parameters
        for k, v in kwargs.items():  # what the kernels cannot do is refused, unless it is the class's default
            if k not in defaults or defaults[k].default != v:
                raise NotImplementedError(
                    f"{fqn}: in-backward optimizer {cls.__name__}({k}={v!r}) has no equivalent in graphshard's fused "
                    f"kernels; drop {k} (its default is {defaults[k].default!r})" if k in defaults else
                    f"{fqn}: in-backward optimizer {cls.__name__} got {k}={v!r}, which it does not take")
    return params


IN_BACKWARD = ("torch.optim.SGD", "torch.optim.Adagrad", "torchrec.optim.RowWiseAdagrad")
"""The optimizer classes ``apply_optimizer_in_backward`` may put on sharded tables (fbgemm's EXACT_SGD,
EXACT_ADAGRAD and EXACT_ROWWISE_ADAGRAD, which graphshard's fbgemm op and Triton TBE implement)."""
