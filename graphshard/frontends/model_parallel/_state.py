"""DMP's state: input checks, state dicts, parameter and buffer listings (the fused optimizer: `_optimizer`)."""

from __future__ import annotations

import logging
from collections import namedtuple
from typing import Any, Iterator

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor, distribute_tensor

_TBE_PREFIX = "_graphshard_tbes"
log = logging.getLogger("graphshard.model_parallel")
IncompatibleKeys = namedtuple("IncompatibleKeys", ["missing_keys", "unexpected_keys"])


def materialize_meta(module: nn.Module, device: torch.device, group, init_parameters: bool,
                     was_meta: list[str]) -> None:
    """The parameters and buffers still on the meta device after the tables are sharded, as
    TorchRec's ``init_parameters`` makes them: each module with a meta parameter gets empty ones on
    ``device`` and its ``reset_parameters()`` (meta buffers: zeros). Every rank draws its own, so
    the parameters made from meta ones (``was_meta``, before sharding: the dense part's, and
    data-parallel tables', which ``install`` drew) are then broadcast from rank 0 over ``group``,
    as DDP syncs TorchRec's at wrap time."""
    on_meta = [fqn for fqn, p in module.named_parameters() if p.is_meta]
    if on_meta and not init_parameters:
        raise ValueError(
            f"parameter {on_meta[0]!r} (and {len(on_meta) - 1} more) is on the meta device and init_parameters=False: "
            "graphshard compiles the model at construction, so pass init_parameters=True (TorchRec's default) or "
            "build the dense part on the device"
        )
    for name, mod in module.named_modules():
        made = False
        for pname, p in mod._parameters.items():
            if isinstance(p, torch.Tensor) and p.is_meta:
                mod._parameters[pname] = nn.Parameter(torch.empty_like(p, device=device), requires_grad=p.requires_grad)
                made = True
        for bname, b in mod._buffers.items():
            if isinstance(b, torch.Tensor) and b.is_meta:
                mod._buffers[bname] = torch.zeros_like(b, device=device)
        if made:
            if hasattr(mod, "reset_parameters"):
                mod.reset_parameters()
            else:
                log.warning("DistributedModelParallel: %s has parameters on the meta device and no reset_parameters(); "
                            "they are left uninitialized, as TorchRec leaves them (load a checkpoint into them)",
                            name or type(mod).__name__)
    was_meta = set(was_meta)
    drawn = [p for fqn, p in module.named_parameters() if fqn in was_meta]
    with torch.no_grad():
        for p in drawn:
            dist.broadcast(p.data, src=dist.get_global_rank(group, 0), group=group)


def check_inputs(args, kwargs) -> None:
    """Every KeyedJaggedTensor argument (top level or one attribute down) has as many values as its
    lengths sum to; checked before the compiled program, which could not say which input is wrong."""
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    def visit(x, where):
        if isinstance(x, KeyedJaggedTensor):
            total = int(x.lengths().sum()) if x.lengths().numel() else 0
            if total != x.values().numel():
                raise ValueError(
                    f"{where}: the KeyedJaggedTensor's lengths sum to {total} but it has {x.values().numel()} values "
                    f"(keys {x.keys()}); lengths are per feature and sample, values all the ids"
                )
            w = x.weights_or_none()
            if w is not None and w.numel() != x.values().numel():
                raise ValueError(f"{where}: the KeyedJaggedTensor has {w.numel()} weights for {x.values().numel()} values")

    for i, a in enumerate(args):
        visit(a, f"argument {i}")
        for k, v in getattr(a, "__dict__", {}).items():
            visit(v, f"argument {i}.{k}")
    for k, a in kwargs.items():
        visit(a, f"argument {k!r}")


def _strip(name: str) -> bool:
    """Whether a state-dict or buffer name is graphshard's TBE storage (shown as the tables instead)."""
    return _TBE_PREFIX in name.split(".")


def named_parameters(dmp, prefix: str, recurse: bool, remove_duplicate: bool) -> Iterator[tuple[str, nn.Parameter]]:
    """TorchRec's ``DistributedModelParallel.named_parameters``: the module tree walked child by child,
    each sharded collection giving every table under ``<fqn>.<embedding_bags|embeddings>.<table>.weight``
    (a fused table: a DTensor view of its TBE, or TorchRec's ShardedTensor where no DTensor placement
    fits, marked with ``_in_backward_optimizers`` so that TorchRec's ``in_backward_optimizer_filter``
    leaves it to ``fused_optimizer``; a data-parallel table: its parameter). As TorchRec's, ``recurse``
    is handed to the sharded collections (the rest of the tree is walked either way) and duplicates
    are dropped by identity unless ``remove_duplicate=False``."""
    sharded = {id(c): c for c in dmp._collections}
    memo: set[int] = set()
    for name, p in _named_parameters(dmp.module, prefix, recurse, sharded):
        if id(p) in memo:
            continue
        if remove_duplicate:
            memo.add(id(p))
        yield name, p


def _named_parameters(module: nn.Module, prefix: str, recurse: bool, sharded: dict):
    coll = getattr(module, "_graphshard_sparse", None)
    if coll is not None and id(coll) in sharded:
        if recurse:
            from graphshard.sparse.state import table_parameter

            tables = getattr(module, coll.layout.attr)
            for t in coll.layout.tables:
                p = table_parameter(coll, t.name) if t.fused else tables[t.name].weight
                yield f"{prefix}.{coll.layout.attr}.{t.name}.weight" if prefix else f"{coll.layout.attr}.{t.name}.weight", p
        return
    yield from module.named_parameters(prefix=prefix, recurse=False)
    for name, child in module.named_children():
        yield from _named_parameters(child, f"{prefix}.{name}" if prefix else name, recurse, sharded)


def named_buffers(dmp, prefix: str, recurse: bool, remove_duplicate: bool) -> Iterator[tuple[str, torch.Tensor]]:
    for name, b in dmp.module.named_buffers(prefix=prefix, recurse=recurse, remove_duplicate=remove_duplicate):
        if not _strip(name):
            yield name, b


def state_dict(dmp, destination, prefix: str, keep_vars: bool) -> dict[str, Any]:
    out = dmp.module.state_dict(destination=destination, prefix=prefix, keep_vars=keep_vars)
    for k in [k for k in out if _strip(k)]:
        del out[k]
    from graphshard.sparse.state import table_entries

    for coll in dmp._collections:
        for fqn in coll.layout.fqns:
            out.update(table_entries(coll, f"{prefix}{fqn}." if fqn else prefix))
    return out


def load_state_dict(dmp, state: dict, prefix: str, strict: bool):
    from graphshard.sparse.state import load_tables

    state = dict(state)
    missing, unexpected = [], []
    for coll in dmp._collections:
        load_tables(coll, state, prefix, missing)
    own = {k: v for k, v in dmp.module.state_dict().items()}
    rest = {}
    for k, v in state.items():
        if not k.startswith(prefix):
            continue
        name = k[len(prefix):]
        current = own.get(name)
        if isinstance(current, DTensor) and isinstance(v, torch.Tensor) and not isinstance(v, DTensor):
            # a full tensor (TorchRec's DDP parameters, an unsharded model): laid out as ours
            v = distribute_tensor(v.to(current.dtype), current.device_mesh, current.placements)
        rest[name] = v
    result = dmp.module.load_state_dict(rest, strict=False)
    missing += [f"{prefix}{k}" for k in result.missing_keys if not _strip(k)]
    unexpected += [f"{prefix}{k}" for k in result.unexpected_keys]
    if strict and (missing or unexpected):
        raise RuntimeError(f"Error(s) in loading state_dict for DistributedModelParallel: missing keys {missing}, "
                           f"unexpected keys {unexpected}")
    return IncompatibleKeys(missing, unexpected)
