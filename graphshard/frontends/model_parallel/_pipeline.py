"""``TrainPipelineSparseDist``: TorchRec's training pipeline (same constructor, same ``progress``)
for graphshard's DMP, with the next batch's ids exchanged while this batch's step runs.

TorchRec's own pipelines drive graphshard's DMP too, as one opaque call (``_dmp._opaque_call``):
they find no TorchRec ``ShardedModule`` in it, so each step exchanges its own batch's ids inside
the compiled program. This class does what TorchRec's pipeline does for its sharded modules, for
graphshard's collections (`graphshard.sparse.input_dist`):

- before batch i's forward: batch i+1's lengths all-to-all starts (TorchRec's
  ``start_sparse_data_dist``);
- after batch i's forward: batch i+1's ids all-to-all starts (``wait_sparse_data_dist``), and runs
  under batch i's backward and optimizer step;
- after the step: batch i+1's ids are waited for and attached to its KJT; its step starts at
  the lookup (``graphshard::embedding_bags_received``).

The compiled step, batch i's collectives included, is the compiler's, as without a pipeline.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import deque
from typing import Any, Callable, Iterator

import torch

from graphshard.sparse.input_dist import Prefetch
from graphshard.sparse.program import exchanged_groups
from graphshard.storage import state_of

log = logging.getLogger("graphshard.model_parallel")

# TorchRec's TrainPipelineSparseDist options this class takes at their defaults only
_TORCHREC_DEFAULTS = {"pipeline_postproc": False, "dmp_collection_sync_interval_batches": 1,
                      "enqueue_batch_after_forward": False, "enable_inplace_copy_batch": False,
                      "free_features_storage_early": False, "clear_data_dist_inputs": False,
                      "async_inplace_copy": False}


def _kjts(batch, depth: int = 2) -> list:
    """The ``KeyedJaggedTensor`` s a batch carries: itself, or among its fields (a TorchRec
    ``Batch``'s ``sparse_features``, a dataclass's, a dict's, a tuple's), ``depth`` levels down."""
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    if isinstance(batch, KeyedJaggedTensor):
        return [batch]
    if depth == 0:
        return []
    if dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        items = [getattr(batch, f.name) for f in dataclasses.fields(batch)]
    elif isinstance(batch, dict):
        items = list(batch.values())
    elif isinstance(batch, (list, tuple)):
        items = list(batch)
    else:
        items = list(vars(batch).values()) if hasattr(batch, "__dict__") else []
    return [k for item in items for k in _kjts(item, depth - 1)]


class _Ahead:
    """What the pipeline exchanges ahead, found from the first batch; ``explain`` prints it."""

    def __init__(self):
        self.ahead: list[str] = []
        self.in_step: list[str] = []

    def format(self) -> str:
        lines = ["training pipeline (graphshard.model_parallel.TrainPipelineSparseDist):"]
        lines += [f"  {fqn}: ids exchanged a batch ahead" for fqn in self.ahead]
        lines += [f"  {note}" for note in self.in_step]
        return "\n".join(lines)


class TrainPipelineSparseDist:
    """TorchRec's ``TrainPipelineSparseDist(model, optimizer, device)`` for graphshard's
    ``DistributedModelParallel``: ``progress(dataloader_iter)`` runs one training step (zero_grad,
    forward, ``sum(losses).backward()``, ``optimizer.step()``) and returns the model's output, as
    TorchRec's does, with the next batch's ids exchanged during this step. Raises
    ``StopIteration`` once the iterator and the batches in flight are spent. In eval mode
    (``model.eval()``) a step is the forward alone."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, device: torch.device,
                 execute_all_batches: bool = True, apply_jit: bool = False,
                 custom_model_fwd: Callable[[Any], tuple[torch.Tensor, Any]] | None = None, **options) -> None:
        from graphshard.frontends.model_parallel._dmp import DistributedModelParallel

        if not isinstance(model, DistributedModelParallel):
            raise TypeError(f"model is a {type(model).__name__}: graphshard.model_parallel.TrainPipelineSparseDist "
                            "drives graphshard's DistributedModelParallel; drive TorchRec's with TorchRec's pipeline")
        if apply_jit:
            raise NotImplementedError("apply_jit=True: graphshard compiles the model itself (torch.compile); "
                                      "leave apply_jit False")
        for name, value in options.items():
            if name not in _TORCHREC_DEFAULTS and name != "context_type":
                raise TypeError(f"TrainPipelineSparseDist got an unexpected keyword argument {name!r}")
            if name in _TORCHREC_DEFAULTS and value != _TORCHREC_DEFAULTS[name]:
                raise NotImplementedError(f"{name}={value!r}: graphshard's pipeline runs TorchRec's default "
                                          f"({_TORCHREC_DEFAULTS[name]!r}); leave it out")
        self._model, self._optimizer, self._device = model, optimizer, torch.device(device)
        self._execute_all_batches = execute_all_batches
        self._forward = custom_model_fwd if custom_model_fwd is not None else model
        # the collections with ids to exchange ahead (table-, column- or row-wise tables)
        self._collections = [c for c in model._collections if not c.layout.sequence and exchanged_groups(c.plan)]
        self._batches: deque = deque()  # [batch, its Prefetches]: the current one, then the next
        self._exhausted = False
        self._report: _Ahead | None = None

    # ---- batches in flight ----
    def _next(self, dataloader_iter: Iterator) -> bool:
        """Fetches a batch, moves it to the device and starts its exchange; False when none is left."""
        if self._exhausted:
            return False
        try:
            batch = next(dataloader_iter)
        except StopIteration:
            self._exhausted = True
            return False
        if hasattr(batch, "to"):
            batch = batch.to(self._device, non_blocking=True)
        self._batches.append([batch, [Prefetch(c, kjt) for c, kjt in self._pairs(batch)]])
        return True

    def _pairs(self, batch) -> list:
        """Each collection and the KJT of ``batch`` it looks up: the one whose keys hold its features.
        A collection with none or several such KJTs exchanges its ids in the step (logged, and
        printed by ``explain``)."""
        kjts = _kjts(batch)
        fits = [(coll, [k for k in kjts if set(coll.layout.features) <= set(k.keys())]) for coll in self._collections]
        if self._report is None:  # once: the first batch says what the pipeline does
            self._report = _Ahead()
            for coll, found in fits:
                fqn, features = coll.layout.fqns[0], list(coll.layout.features)
                if len(found) == 1:
                    self._report.ahead.append(fqn)
                else:
                    note = (f"{fqn}: ids exchanged in the step: the batch has {len(found)} KeyedJaggedTensors with "
                            f"its features {features}, not one")
                    self._report.in_step.append(note)
                    log.warning("TrainPipelineSparseDist: %s", note)
            state = state_of(self._model.module)
            if state is not None:
                state.preamble.append(self._report)
        return [(coll, found[0]) for coll, found in fits if len(found) == 1]

    # ---- TorchRec's API ----
    def progress(self, dataloader_iter: Iterator) -> Any:
        if not self._batches:  # fill: the first batch's exchange runs through
            if not self._next(dataloader_iter):
                raise StopIteration
            for p in self._batches[0][1]:
                p.finish()
        if not self._execute_all_batches and self._exhausted:
            self._batches.clear()
            raise StopIteration
        training = self._model.training
        if training:
            self._optimizer.zero_grad()
        if len(self._batches) < 2:
            self._next(dataloader_iter)  # batch i+1: its lengths' all-to-all starts
        batch = self._batches[0][0]
        losses, output = self._forward(batch)
        following = self._batches[1][1] if len(self._batches) > 1 else []
        for p in following:
            p.send_ids()  # batch i+1's ids go while batch i's backward and step run
        if training:
            torch.sum(losses, dim=0).backward()
            self._optimizer.step()
        for p in following:
            p.finish()
        self._batches.popleft()
        return output

    def reset(self) -> None:
        """Forgets the batches in flight (their exchanges are waited for first)."""
        for _, prefetches in self._batches:
            for p in prefetches:
                p.finish()
        self._batches.clear()
        self._exhausted = False
