"""A canonical, process-independent description of the compiler's records, for the program cache's key.

The program cache (`graphshard.compiler.program_cache`) may serve a stored program only to a compile
that would have produced the same one. Keeping a list of "what matters" beside the records is how a
cache goes stale: a field added to `ShardedParam` or `FullyShard` and read by a pass would be left
out of the list. So the key is `canonical` of the records themselves, walked field by field:

- a dataclass is every field, except those declared with ``field(metadata=unkeyed("why"))``;
- another object is its ``__dict__``, except the names its class lists in ``__unkeyed__``
  (name -> why);
- a value of a type this module does not know raises `Unkeyable`, naming the path to it, so a
  record that grows a field of a new type fails the cache's tests instead of being keyed by
  ``repr`` (an address) or left out.

An unkeyed field is one the compile does not read (explain's output, per-call state, the module
objects that hold the storage) or one that cannot differ between two compiles whose keyed fields
agree; the reason is written beside it.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import hashlib
import types
from typing import Any

import torch
import torch.nn as nn

from graphshard import _compat

UNKEYED = "graphshard_unkeyed"
"""The dataclass field metadata that leaves a field out of the key; its value says why."""


def unkeyed(reason: str) -> dict:
    """``field(metadata=unkeyed("..."))``: the field is not part of the program cache's key."""
    assert reason, "say why the compile's result cannot depend on it"
    return {UNKEYED: reason}


class Unkeyable(TypeError):
    """A record holds a value `canonical` cannot describe."""


def canonical(obj: Any, path: str = "record") -> Any:
    """``obj`` as nested tuples of str/int/float/bool/None, the same in every process for records
    that the compile would read the same way (no addresses, no ids, sets and dicts in a fixed
    order). ``path`` names where ``obj`` sits, for `Unkeyable`'s message."""
    return _Walk().canonical(obj, path)


_ATOMS = (type(None), bool, int, float, str, bytes)


class _Walk:
    """One `canonical` walk: each object described once (a mesh or an axis is shared by every
    parameter's record), cycles named instead of followed."""

    def __init__(self):
        self.done: dict[int, Any] = {}
        self.active: set[int] = set()

    def canonical(self, obj: Any, path: str) -> Any:
        if isinstance(obj, _ATOMS):
            return obj
        if id(obj) in self.done:
            return self.done[id(obj)]
        if id(obj) in self.active:
            return ("cycle", _name(type(obj)))
        self.active.add(id(obj))
        try:
            out = self.done[id(obj)] = self._describe(obj, path)
        finally:
            self.active.discard(id(obj))
        return out

    def _describe(self, obj: Any, path: str) -> Any:
        walk = self.canonical
        if isinstance(obj, (torch.dtype, torch.device, torch.layout, torch.memory_format)):
            return ("torch", str(obj))
        if isinstance(obj, torch.Size):
            return ("Size", tuple(obj))
        if isinstance(obj, enum.Enum):
            return (_name(type(obj)), obj.name)
        if isinstance(obj, type):
            return ("type", _name(obj))
        if isinstance(obj, torch.Tensor):
            # a record's tensors are storage or state (an embedding table's weight); the compile reads
            # their metadata, never their values
            return ("tensor", _name(type(obj)), tuple(obj.shape), str(obj.dtype), str(obj.device), obj.requires_grad)
        if isinstance(obj, nn.Module):
            raise Unkeyable(f"{path} is a module ({type(obj).__name__}): a record's modules hold its storage; declare "
                            "the field unkeyed with the reason, and key what the compile reads of the module instead")
        if _is_device_mesh(obj):
            return ("DeviceMesh", obj.device_type, tuple(obj.mesh.flatten().tolist()), tuple(obj.mesh.shape),
                    tuple(obj.mesh_dim_names or ()))
        if isinstance(obj, (types.FunctionType, types.MethodType, functools.partial, types.BuiltinFunctionType)):
            return self._function(obj, path)
        if isinstance(obj, (list, tuple)):
            return (type(obj).__name__, tuple(walk(v, f"{path}[{i}]") for i, v in enumerate(obj)))
        if isinstance(obj, (set, frozenset)):
            return ("set", tuple(sorted((walk(v, f"{path}{{}}") for v in obj), key=repr)))
        if isinstance(obj, dict):
            items = [(walk(k, f"{path} key"), walk(v, f"{path}[{k!r}]")) for k, v in obj.items()]
            return ("dict", tuple(sorted(items, key=repr)))
        if _compat.is_op(obj):  # an operator named in a record (a selective checkpoint's save list)
            return ("op", str(obj))
        if _is_placement(obj):
            return ("placement", repr(obj))
        if _compat.is_remote_device(obj):  # TorchRec's shard placements ("rank:0/cpu")
            return ("remote_device", str(obj))
        if dataclasses.is_dataclass(obj):
            return (_name(type(obj)), tuple((f.name, walk(getattr(obj, f.name), f"{path}.{f.name}"))
                                            for f in dataclasses.fields(obj) if UNKEYED not in f.metadata))
        if hasattr(obj, "__dict__") and type(obj).__module__.split(".")[0] in ("graphshard", "passes", "kernels"):
            skip = _unkeyed_names(type(obj))
            return (_name(type(obj)), tuple((k, walk(v, f"{path}.{k}")) for k, v in sorted(vars(obj).items())
                                            if k not in skip))
        raise Unkeyable(f"{path} is a {_name(type(obj))}, which the program cache's key cannot describe: teach "
                        "graphshard.fingerprint.canonical the type, or declare the field unkeyed with the reason")

    def _function(self, fn, path: str) -> Any:
        """A callable in a record (a checkpoint policy, a style's hook): its qualified name and code,
        constants and the values it closes over. Two lambdas of one module differ by their code."""
        if isinstance(fn, functools.partial):
            return ("partial", self.canonical(fn.func, path), self.canonical(fn.args, f"{path}.args"),
                    self.canonical(fn.keywords, f"{path}.keywords"))
        if isinstance(fn, types.MethodType):
            return ("method", self.canonical(fn.__func__, path), _name(type(fn.__self__)))
        code = getattr(fn, "__code__", None)
        if code is None:
            return ("builtin", getattr(fn, "__module__", None), getattr(fn, "__qualname__", repr(fn)))
        cells = tuple(self.canonical(c.cell_contents, f"{path} closure") for c in (fn.__closure__ or ()))
        return ("function", fn.__module__, fn.__qualname__, hashlib.sha256(code.co_code).hexdigest(),
                repr(_constants(code)), cells)


def _unkeyed_names(cls: type) -> set[str]:
    names: set[str] = set()
    for c in cls.__mro__:
        names.update(getattr(c, "__unkeyed__", {}))
    return names


def _constants(code: types.CodeType) -> tuple:
    return tuple(_constants(c) if isinstance(c, types.CodeType) else c for c in code.co_consts
                 if isinstance(c, (types.CodeType, *_ATOMS, tuple, frozenset)))


def _name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _is_device_mesh(obj) -> bool:
    from torch.distributed.device_mesh import DeviceMesh

    return isinstance(obj, DeviceMesh)


def _is_placement(obj) -> bool:
    from torch.distributed.tensor import Placement

    return isinstance(obj, Placement)

