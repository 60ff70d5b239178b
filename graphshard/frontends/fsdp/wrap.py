"""FSDP1's wrapping API, and the units torch's ``FullyShardedDataParallel`` would create.

The policies and the manual-wrapping context are torch's own public objects, re-exported:
a policy built from ``torch.distributed.fsdp.wrap`` works here unchanged, and ``wrap``
inside ``enable_wrap(wrapper_cls=..., **kwargs)`` builds ``wrapper_cls(module, **kwargs)``
whichever module the two were imported from.

``decide_units`` computes, without changing the model, the modules FSDP1's auto-wrapping
turns into units, in the order torch creates them. FSDP1 has two paths:

* ``ModuleWrapPolicy`` / ``CustomPolicy``: the policy names its targets among
  ``root.modules()`` (each module once, ignored modules left out), then a post-order walk
  that visits each module once wraps the targets. A shared module is one unit, at its first
  FQN in ``named_modules()`` order.
* a callable ``policy(module=, recurse=, nonwrapped_numel=)``: a bottom-up recursion that
  asks ``recurse=True`` (descend?) before a module's children and ``recurse=False`` (wrap?)
  after them; ``nonwrapped_numel`` counts the parameters of the module's subtree that are
  not ignored and not held by a unit created before; a wrapped child gives back what it
  counted, and a parent decides on the remainder. The root is only asked ``recurse=True``.

The two agree on trees. On a module reachable from two parents they differ: torch's
recursion walks it again on the second path, and then its answer depends on the world
size (it counts the first unit's local ``FlatParameter`` shard) and can wrap the same
module in a second, empty FSDP instance (or fail when the module holds a unit).
``decide_units`` walks a module once on both paths: the second path skips it.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

import torch.nn as nn
from torch.distributed.fsdp import FullyShardedDataParallel as _TorchFSDP
from torch.distributed.fsdp.wrap import (
    CustomPolicy,
    ModuleWrapPolicy,
    always_wrap_policy,
    enable_wrap,
    lambda_auto_wrap_policy,
    size_based_auto_wrap_policy,
    transformer_auto_wrap_policy,
    wrap,
)

__all__ = [
    "CustomPolicy",
    "ModuleWrapPolicy",
    "always_wrap_policy",
    "decide_units",
    "enable_wrap",
    "lambda_auto_wrap_policy",
    "size_based_auto_wrap_policy",
    "transformer_auto_wrap_policy",
    "wrap",
]

Unit = tuple[str, nn.Module, dict[str, Any]]


def decide_units(
    root: nn.Module,
    policy: Callable[..., bool] | ModuleWrapPolicy | CustomPolicy | None,
    *,
    ignored_modules: Iterable[nn.Module] = frozenset(),
    ignored_params: Iterable[nn.Parameter] = frozenset(),
    full_precision_classes: tuple[type[nn.Module], ...] = (),
) -> list[Unit]:
    """The units ``torch.distributed.fsdp.FullyShardedDataParallel(root,
    auto_wrap_policy=policy, ignored_modules=..., ignored_states=...)`` creates, as
    ``(fqn, module, kwargs)`` in creation order (children before parents), ``root`` last
    with fqn ``""``. ``fqn`` names the module in the unwrapped ``root``; ``kwargs`` are the
    unit's overrides of the root's FSDP arguments (a ``CustomPolicy``'s dict, else ``{}``).

    As in torch, the subtrees of ``ignored_modules`` are never wrapped, and their
    parameters and ``ignored_params`` count in no ``nonwrapped_numel``. ``policy=None``
    wraps the root only. ``root`` is not changed.

    ``full_precision_classes`` (``MixedPrecision._module_classes_to_ignore`` when mixed
    precision is on): with a policy, every module of these classes is a unit of its own too,
    with the override ``mixed_precision=None``, as torch's auto-wrapping makes them.
    """
    if policy is not None and not isinstance(policy, (ModuleWrapPolicy, CustomPolicy)) and not callable(policy):
        raise ValueError(
            f"auto_wrap_policy={policy!r} (a {type(policy).__name__}) is not a wrapping policy: expected a "
            "callable policy(module=, recurse=, nonwrapped_numel=) -> bool (e.g. "
            "functools.partial(size_based_auto_wrap_policy, min_num_params=...)), a ModuleWrapPolicy or a CustomPolicy"
        )
    ignored = {m for top in ignored_modules for m in top.modules()}
    ignored_params = set(ignored_params) | {p for m in ignored for p in m.parameters()}
    root_unit = ("", root, {})
    if policy is None:
        return [root_unit]
    for fqn, module in root.named_modules():
        if isinstance(module, _TorchFSDP):
            raise ValueError(
                f"{fqn or 'the root'} is already wrapped by torch's FullyShardedDataParallel: auto-wrapping needs "
                "a model without FSDP applied (as in torch); pass the unwrapped module, or wrap manually "
                "(enable_wrap/wrap) without an auto_wrap_policy"
            )
    classes = tuple(set(full_precision_classes))
    if isinstance(policy, (ModuleWrapPolicy, CustomPolicy)):
        targets = _policy_targets(policy, root, ignored)
        for m in root.modules():
            if classes and m not in ignored and isinstance(m, classes):
                targets.setdefault(m, {})["mixed_precision"] = None
        units = targeted_units(root, targets)
    else:
        if classes:
            user_policy = policy

            def policy(module, recurse, nonwrapped_numel):  # torch's _or_policy with _wrap_module_cls_individually
                return recurse or isinstance(module, classes) or user_policy(
                    module=module, recurse=recurse, nonwrapped_numel=nonwrapped_numel)
        units = _RecursiveWalk(policy, ignored, ignored_params).units(root)
        units = [(f, m, {"mixed_precision": None} if classes and isinstance(m, classes) else o) for f, m, o in units]
    return units + [root_unit]


def _policy_targets(
    policy: ModuleWrapPolicy | CustomPolicy, root: nn.Module, ignored: set[nn.Module]
) -> dict[nn.Module, dict[str, Any]]:
    """The modules ``policy`` targets, each with its kwargs overrides: torch's own answer.

    ``_run_policy`` with empty root kwargs leaves exactly the overrides (torch copies the
    root's kwargs into each target, then a ``CustomPolicy`` updates them with its dict).
    A ``CustomPolicy`` keeps its function privately, so this is the one private name here.
    """
    return policy._run_policy(root, ignored, {})


def targeted_units(root: nn.Module, targets: dict[nn.Module, dict[str, Any]]) -> list[Unit]:
    """The targets other than ``root`` in post-order, each module visited once (its first FQN)."""
    units: list[Unit] = []
    visited = {root}

    def visit(module: nn.Module, fqn: str) -> None:
        for name, child in module.named_children():
            if child in visited:
                continue
            visited.add(child)
            child_fqn = f"{fqn}.{name}" if fqn else name
            visit(child, child_fqn)
            if child in targets:
                units.append((child_fqn, child, dict(targets[child])))

    visit(root, "")
    return units


class _RecursiveWalk:
    """FSDP1's recursion for a callable policy, each module walked at most once."""

    def __init__(self, policy: Callable[..., bool], ignored: set[nn.Module], ignored_params: set[nn.Parameter]):
        self.policy = policy
        self.ignored = ignored
        self.ignored_params = ignored_params
        self.walked: set[nn.Module] = set()
        self.held: set[nn.Module] = set()  # modules in a unit's subtree: their parameters are wrapped
        self.found: list[Unit] = []

    def units(self, root: nn.Module) -> list[Unit]:
        self.walk(root, "", is_root=True)
        return self.found

    def nonwrapped_numel(self, module: nn.Module) -> int:
        """Parameters of ``module``'s subtree, each once, neither ignored nor held by a unit."""
        seen: set[nn.Parameter] = set()
        for m in module.modules():
            if m not in self.held:
                seen.update(p for p in m.parameters(recurse=False) if p not in self.ignored_params)
        return sum(p.numel() for p in seen)

    def walk(self, module: nn.Module, fqn: str, is_root: bool = False) -> int:
        """Walks ``module``'s subtree; returns the numel it wrapped (torch's accounting:
        a wrapped module gives back everything it counted)."""
        self.walked.add(module)
        numel = self.nonwrapped_numel(module)
        if not self.policy(module=module, recurse=True, nonwrapped_numel=numel):
            return 0
        wrapped = 0
        for name, child in module.named_children():
            if child in self.ignored or child in self.walked:
                continue
            wrapped += self.walk(child, f"{fqn}.{name}" if fqn else name)
        if is_root or not self.policy(module=module, recurse=False, nonwrapped_numel=numel - wrapped):
            return wrapped
        self.found.append((fqn, module, {}))
        self.held.update(module.modules())
        return numel
