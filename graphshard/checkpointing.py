"""Activation checkpointing as a plan fact: `Checkpoint`, in ``Plan(checkpoint={glob: Checkpoint()})``.

A matched module's forward runs under ``torch.utils.checkpoint.checkpoint`` (non-reentrant), as
``checkpoint_wrapper`` would run it, without a wrapper module in the tree (FQNs stay as they
are). The compiled program then recomputes the module's forward in the backward: the trace
tags the module's ops and aot_autograd's partitioner recomputes them
(``passes/tag_recomputation.py``). Selective checkpointing saves the outputs of the ops a
policy names (by default the matmuls and attention: torchtitan's "op" mode) and recomputes the
rest, through ``torch.utils.checkpoint.create_selective_checkpoint_contexts``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable, Literal

import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from graphshard import _compat

aten = torch.ops.aten


def _ops(*names: str) -> tuple:
    """The ATen op packets of ``names`` that this torch has (attention kernels differ by version and device)."""
    return tuple(getattr(aten, n) for n in names if hasattr(aten, n))


MATMULS_AND_ATTENTION = _ops("mm", "addmm", "bmm", "baddbmm", "_scaled_mm", "_scaled_dot_product_flash_attention",
                             "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
                             "_scaled_dot_product_flash_attention_for_cpu")
"""What selective checkpointing saves by default: the outputs of the compute-bound ops, whose
recomputation would cost most (torchtitan's "op" selective mode saves these)."""


@dataclass(frozen=True, kw_only=True)
class Checkpoint:
    """Recompute the matched module's forward in the backward instead of keeping its activations.

    ``Checkpoint()`` is full activation checkpointing: only the module's inputs are kept, every
    op is recomputed. ``Checkpoint(mode="selective")`` keeps the outputs of the ops in ``save``
    (matmuls and attention by default) and recomputes the rest; ``policy`` instead takes torch's
    selective-checkpoint policy function ``(ctx, op, *args, **kwargs) -> CheckpointPolicy | bool``.
    """

    mode: Literal["full", "selective"] = "full"
    """'full': recompute every op of the module. 'selective': save what ``save`` (or ``policy``) names."""
    save: tuple = MATMULS_AND_ATTENTION
    """Selective mode: ATen ops (packets such as ``torch.ops.aten.mm`` or overloads) whose outputs are saved."""
    policy: Callable | None = None
    """Selective mode: torch's policy function, used instead of ``save``."""

    def __post_init__(self):
        if self.mode not in ("full", "selective"):
            raise ValueError(f"Checkpoint(mode={self.mode!r}): expected 'full' or 'selective'")
        if self.mode == "full" and self.policy is not None:
            raise ValueError("Checkpoint(policy=...) is a selective policy: pass mode='selective' with it")
        if self.save != MATMULS_AND_ATTENTION and (self.mode == "full" or self.policy is not None):
            raise ValueError("Checkpoint(save=...) names what selective checkpointing saves: pass mode='selective' "
                             "with it, and no policy (a policy decides for itself)")
        if not isinstance(self.save, tuple) or not all(map(_compat.is_op, self.save)):
            raise ValueError(f"Checkpoint(save={self.save!r}): expected a tuple of ATen ops, e.g. "
                             "(torch.ops.aten.mm, torch.ops.aten.addmm.default)")
        if self.mode == "selective" and self.policy is None and not self.save:
            raise ValueError("Checkpoint(mode='selective', save=()) saves nothing, which is full checkpointing: "
                             "use Checkpoint() (mode='full'), or name the ops to save")
        if self.policy is not None and not callable(self.policy):
            raise ValueError(f"Checkpoint(policy={self.policy!r}): expected a function (ctx, op, *args, **kwargs)")

    def context_fn(self) -> Callable | None:
        """The ``context_fn`` for ``torch.utils.checkpoint.checkpoint``: None under full checkpointing."""
        if self.mode == "full":
            return None
        policy = self.policy or functools.partial(_save_listed, frozenset(self.save))
        return functools.partial(create_selective_checkpoint_contexts, policy)

    def describe(self) -> str:
        if self.mode == "full":
            return "full"
        if self.policy is not None:
            return f"selective (policy {getattr(self.policy, '__name__', self.policy)!r})"
        return "selective (saves " + ", ".join(sorted(str(op).removeprefix("aten.") for op in self.save)) + ")"


def _save_listed(save: frozenset, ctx, op, *args, **kwargs) -> CheckpointPolicy:
    listed = op in save or getattr(op, "overloadpacket", None) in save
    return CheckpointPolicy.MUST_SAVE if listed else CheckpointPolicy.PREFER_RECOMPUTE


def run_checkpointed(spec: Checkpoint, forward: Callable, *args, **kwargs):
    """``forward(*args, **kwargs)`` under ``torch.utils.checkpoint.checkpoint`` with ``spec``'s policy."""
    context_fn = spec.context_fn()
    if context_fn is None:
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)
    return checkpoint(forward, *args, use_reentrant=False, context_fn=context_fn, **kwargs)
