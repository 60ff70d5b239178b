"""DMP's batches before the compiled step: variable batch per feature (VBE), and per rank.

The compiled program's id exchange has static shapes: every feature of a ``KeyedJaggedTensor`` has
the KJT's batch (its stride). ``prepare`` runs eagerly in ``DistributedModelParallel.forward`` on
every KJT among the call's arguments (top level or one attribute down: TorchRec's ``ModelInput``,
``Batch``):

- *variable batch per feature* (VBE: ``stride_per_key_per_rank`` with ``inverse_indices``): each
  feature's bags are deduplicated over the batch, and the inverse indices say which bag each sample
  reads. The KJT is expanded to the full batch (each sample's bag copied from the bag it reads), so
  the lookup pools every sample's bag itself: the output is TorchRec's (its EBC selects the pooled
  rows by the inverse indices, ``group_index_select_dim0``) and so is the gradient, the sum over the
  samples that read a bag. What is given up is VBE's saving: the duplicated ids travel. Logged once,
  and listed by ``explain`` (a `BatchFallback` in the model's preamble).
- *variable batch per rank* (TorchRec's ``variable_batch_size``: the ranks' KJTs have different
  strides) is refused. Each rank's program is compiled from its own input's shapes; with different
  batches the programs differ (TestSparseNN's own code branches on the batch to pad its output), and
  the compile-time collective check finds the ranks' collectives in different orders. Nothing is
  spent on the normal path to detect it: where the check raises, `batches_differ` (every rank is
  there) gathers the ranks' strides and, if they differ, the error names the option instead.
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass

import torch
import torch.distributed as dist

log = logging.getLogger("graphshard.model_parallel")



def _kjt_type():
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    return KeyedJaggedTensor


def _slots(args: tuple, kwargs: dict) -> list[tuple]:
    """Where the call's KJTs are: (container, key) pairs, top level and one attribute down."""
    kjt = _kjt_type()
    out = []
    for i, a in enumerate(args):
        if isinstance(a, kjt):
            out.append(("args", i, None))
        else:
            for k, v in getattr(a, "__dict__", {}).items():
                if isinstance(v, kjt):
                    out.append(("args", i, k))
    for name, a in kwargs.items():
        if isinstance(a, kjt):
            out.append(("kwargs", name, None))
    return out


def expand_vbe(kjt):
    """A variable-batch-per-feature KJT as the full batch: sample i of feature f reads the bag
    ``inverse_indices[f][i]`` of f's own (deduplicated) bags."""
    KeyedJaggedTensor = _kjt_type()
    keys = kjt.keys()
    inv_keys, inverse = kjt.inverse_indices()
    row = {k: i for i, k in enumerate(inv_keys)}
    missing = [k for k in keys if k not in row]
    if missing:
        raise ValueError(f"a KeyedJaggedTensor with a variable batch per feature has no inverse indices for {missing}; "
                         f"its inverse indices name {list(inv_keys)}")
    strides = kjt.stride_per_key()
    lengths = kjt.lengths()
    starts = [0]
    for s in strides:
        starts.append(starts[-1] + s)
    bags = torch.cat([inverse[row[k]].to(torch.int64) + starts[i] for i, k in enumerate(keys)])
    offsets = torch.zeros(lengths.numel() + 1, dtype=torch.int64, device=lengths.device)
    offsets[1:] = lengths.to(torch.int64).cumsum(0)
    new_lengths = lengths.index_select(0, bags)
    counts = new_lengths.to(torch.int64)
    total = int(counts.sum())
    first = torch.repeat_interleave(offsets.index_select(0, bags) - (counts.cumsum(0) - counts), counts,
                                    output_size=total)
    index = first + torch.arange(total, dtype=torch.int64, device=lengths.device)
    weights = kjt.weights_or_none()
    return KeyedJaggedTensor(keys=keys, values=kjt.values().index_select(0, index),
                             weights=weights.index_select(0, index) if weights is not None else None,
                             lengths=new_lengths)


@dataclass(frozen=True)
class BatchFallback:
    """What `prepare` did to a batch, once per kind: logged, and printed by ``explain`` (the model's
    ``preamble``) among the fallbacks."""

    what: str

    def format(self) -> str:
        return f"fallbacks (DistributedModelParallel input): {self.what}"


def prepare(args: tuple, kwargs: dict, notes: list) -> tuple[tuple, dict]:
    """The call's arguments with VBE KJTs expanded to the full batch (see the module's docstring).
    ``notes``: where each kind of change is recorded once (the model's ``preamble``, which
    ``explain`` prints). Arguments are copied where changed, never changed in place."""
    slots = [slot for slot in _slots(args, kwargs) if _get(args, kwargs, *slot).variable_stride_per_key()]
    if not slots:
        return args, kwargs
    args, kwargs = list(args), dict(kwargs)
    for slot in slots:
        _note(notes, "a KeyedJaggedTensor with a variable batch per feature (VBE) is expanded to the full batch "
                     "before the lookup (each sample's bag copied from the bag its inverse index names): TorchRec's "
                     "output and gradient, without VBE's smaller id exchange")
        _put(args, kwargs, *slot, expand_vbe(_get(args, kwargs, *slot)))
    return tuple(args), kwargs


def _get(args, kwargs, where, key, attr):
    holder = args[key] if where == "args" else kwargs[key]
    return holder if attr is None else getattr(holder, attr)


def _put(args, kwargs, where, key, attr, value) -> None:
    if attr is None:
        (args if where == "args" else kwargs)[key] = value
        return
    holder = copy.copy(args[key] if where == "args" else kwargs[key])
    setattr(holder, attr, value)
    if where == "args":
        args[key] = holder
    else:
        kwargs[key] = holder


def batches_differ(args: tuple, kwargs: dict, group) -> str | None:
    """Called on every rank where the collective check refused the step: the ranks' KJT batch sizes
    when they differ (the cause, in words), else None."""
    strides = [_get(args, kwargs, *slot).stride() for slot in _slots(args, kwargs)]
    world = dist.get_world_size(group)
    gathered = [None] * world
    dist.all_gather_object(gathered, strides, group=group)
    if all(g == gathered[0] for g in gathered):
        return None
    return ", ".join(f"rank {r}: {g}" for r, g in enumerate(gathered))


def _note(notes: list, text: str) -> None:
    if not any(isinstance(n, BatchFallback) and n.what == text for n in notes):
        notes.append(BatchFallback(text))
        log.warning("DistributedModelParallel: %s", text)
