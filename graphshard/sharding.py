"""What the compiler knows about one sharded model: the one input of every compile.

`storage.shard` builds a `ShardedModel` once and stores it as ``model._graphshard``. The
backend is bound to it when a frontend compiles (`compiler.make_backend`), the pass context
carries it, and the decompositions of graphshard's ops read it; nothing in a compile looks a
parameter up in a process-wide table. Its records:

- `ShardedParam`, one per parameter however many FQNs reach it (FSDP2's ``FSDPParam``): the
  key its marker carries, the FQNs, the placements over the mesh and its data-parallel and
  model-parallel axes, the module attribute that holds it, and its views: the stored local
  shard, the DTensor, the local gradient, a full copy.
- `ShardedUnit`, one per unit (FSDP2's ``FSDPParamGroup``): its parameters, its spec (sharding
  axis, reshard policy, dtypes), its flat storage, and the repeated body dynamo traces it with;
  every reader of a unit's facts (the passes through its parameters, the outline of repeated
  blocks, dynamo's regions, the frontends) reads them here.
- `FlatUnit` / `FlatSlot`: a unit whose parameters live in one flat 1-D parameter (FSDP1's
  ``use_orig_params=False``) and each parameter's place in it.
- the embedding collections sharded with the model (`graphshard.sparse.collection`).

Only the eager implementations of the marker ops, which run outside any compile, resolve a
key through `params.resolve` (a weak map, filled here).
"""

from __future__ import annotations

import functools
import math
import weakref

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Shard

from graphshard import _compat, params
from graphshard.fingerprint import unkeyed
from graphshard.params import AxisGroup, chunk_size, local_size
from graphshard.plan import FullyShard, ParamLayout, Plan, StridedShard, UnitSpec

FLAT_PARAM = "_flat_param"
"""The attribute name of a unit's flat parameter (FSDP1's)."""


@dataclass(frozen=True)
class FlatSlot:
    """Where one parameter's local shard lies in its unit's flat parameter."""

    key: str
    offset: int                   # first element in the flat parameter
    shape: tuple[int, ...]        # the local shard's shape
    numel: int                    # its elements
    padded: int                   # elements reserved: the shard padded to its chunk (what the gather packs)
    logical_shape: tuple[int, ...]


@dataclass(eq=False)
class FlatUnit:
    """A unit whose parameters live in one flat 1-D parameter ``module._flat_param``."""

    module: nn.Module = field(repr=False, metadata=unkeyed("the module holding the flat parameter: storage, not layout"))
    slots: list[FlatSlot]

    @property
    def param(self) -> nn.Parameter:
        return self.module._parameters[FLAT_PARAM]

    def local(self, slot: FlatSlot) -> torch.Tensor:
        """The local shard of ``slot``'s parameter: a view of the flat parameter."""
        return self.param.narrow(0, slot.offset, slot.numel).view(slot.shape)


@dataclass(eq=False)
class ShardedUnit:
    """One unit: the parameters gathered before its forward and reduced after its backward together,
    and how (FSDP2's ``FSDPParamGroup``)."""

    fqn: str                          # the module's FQN, "" for the root
    keys: list[str]                   # its parameters' keys, in registration order
    spec: UnitSpec | None             # the plan's spec: sharding axis, reshard policy, dtypes, flat_params
    flat: FlatUnit | None = field(default=None, repr=False)  # its flat parameter, with flat_params
    body: str | None = field(  # the repeated body dynamo traces it with (`compiler.regions`), None: traced in line
        default=None, metadata=unkeyed("decides the graph dynamo hands the backend, which aot_autograd keys"))

    @property
    def reshard_after_forward(self) -> bool:
        """Whether its gathered parameters are freed after forward and gathered again in backward:
        FULL_SHARD, except the root unit (``""``), which keeps them whatever its spec says, as FSDP2's
        root does (the backward needs the root's output head first)."""
        return isinstance(self.spec, FullyShard) and self.spec.reshard_after_forward and self.fqn != ""

    @property
    def param_dtype(self) -> torch.dtype | None:
        """The dtype its parameters compute in (mixed precision), None: their own."""
        return getattr(self.spec, "param_dtype", None)

    @property
    def reduce_dtype(self) -> torch.dtype | None:
        """The dtype its gradients are reduced in, None: the parameters' compute dtype."""
        return getattr(self.spec, "reduce_dtype", None)


@dataclass(eq=False)
class ShardedParam:
    """One sharded parameter: its layout, where it is stored, and its views."""

    key: str                      # what its graphshard::param marker carries: "m<model id>/<canonical fqn>"
    fqn: str                      # its canonical FQN (the first by registration order); ``layout.fqns`` has every alias
    layout: ParamLayout
    logical_shape: tuple[int, ...]
    dtype: torch.dtype
    mesh: DeviceMesh
    shard: AxisGroup | None            # data-parallel axis the parameter is sharded over (FullyShard)
    replicate: tuple[AxisGroup, ...]   # data-parallel axes it is replicated over (grads all-reduced)
    model_parallel: tuple[tuple[AxisGroup, Placement], ...]  # model-parallel axes and placements
    # where it is stored (set by storage.shard; left out of the repr, which would print the module)
    owner: tuple[nn.Module, str] | None = field(  # the module holding it, the attribute
        default=None, repr=False, metadata=unkeyed("where it is stored; its layout is the fields above"))
    unit: ShardedUnit | None = field(default=None, repr=False)  # its unit (None: outside any data-parallel unit)
    slot: FlatSlot | None = None                                # its place in the unit's flat parameter, if any

    @property
    def flat(self) -> FlatUnit | None:
        """Its unit's flat parameter, when it lives in one."""
        return self.unit.flat if self.unit is not None else None

    # ---- data-parallel storage (the tensor as seen before the dp all-gather) ----
    @property
    def dp_full_shape(self) -> tuple[int, ...]:
        """Shape after the data-parallel gather: logical, with model-parallel sharding applied."""
        shape = list(self.logical_shape)
        for axis, pl in self.model_parallel:
            if isinstance(pl, (Shard, StridedShard)):
                shape[pl.dim] = local_size(shape[pl.dim], pl, axis.world, axis.rank)
        return tuple(shape)

    @property
    def chunk_rows(self) -> int:
        """Rows of dim 0 per data-parallel shard, padded (torch.chunk semantics)."""
        assert self.shard is not None
        return math.ceil(self.dp_full_shape[0] / self.shard.world) if self.dp_full_shape else 1

    @property
    def row_numel(self) -> int:
        return math.prod(self.dp_full_shape[1:])

    @property
    def local_rows(self) -> int:
        assert self.shard is not None
        return chunk_size(self.dp_full_shape[0], self.shard.world, self.shard.rank)

    @property
    def param_dtype(self) -> torch.dtype:
        return (self.unit.param_dtype if self.unit is not None else None) or self.dtype

    @property
    def reduce_dtype(self) -> torch.dtype:
        return (self.unit.reduce_dtype if self.unit is not None else None) or self.param_dtype

    @property
    def reshard_after_forward(self) -> bool:
        """Its unit's policy (`ShardedUnit.reshard_after_forward`); False outside any unit."""
        return self.unit is not None and self.unit.reshard_after_forward

    @functools.cached_property
    def placements(self) -> tuple:
        """The DTensor placements the parameter is stored with over ``mesh``: the plan's, except that
        a data-parallel shard of a dim a model-parallel axis shards too (FSDP over a column-parallel
        Linear, both on dim 0) is a strided shard of each model-parallel piece, as FSDP2 stores it."""
        placements = [_compat.strided_shard(pl.dim, pl.split_factor) if isinstance(pl, StridedShard) else pl
                      for pl in self.layout.placements]
        if self.shard is not None and any(pl == Shard(0) for _, pl in self.model_parallel):
            mp_world = math.prod(axis.world for axis, pl in self.model_parallel if pl == Shard(0))
            placements[self.mesh.mesh_dim_names.index(self.shard.name)] = _compat.strided_shard(0, mp_world)
        return tuple(placements)

    # ---- views ----
    def local(self) -> torch.Tensor:
        """The tensor that holds this rank's shard: the DTensor parameter's local tensor, or its view
        of the unit's flat parameter. Writing into it changes the model."""
        if self.slot is not None:
            return self.flat.local(self.slot)
        mod, name = self.owner
        return mod._parameters[name]._local_tensor

    def local_grad(self) -> torch.Tensor | None:
        """This rank's shard of the parameter's gradient (a view of the flat gradient in a flat unit)."""
        if self.slot is not None:
            g = self.flat.param.grad
            return None if g is None else g.narrow(0, self.slot.offset, self.slot.numel).view(self.slot.shape)
        mod, name = self.owner
        g = mod._parameters[name].grad
        return None if g is None else g._local_tensor

    def dtensor(self) -> DTensor:
        """This rank's shard as a DTensor over the plan's mesh (sharing storage)."""
        return self.dtensor_of(self.local())

    def dtensor_of(self, local: torch.Tensor) -> DTensor:
        """``local``, a tensor laid out as this rank's shard (its optimizer state, say), as a DTensor
        with the parameter's placements (sharing storage)."""
        return DTensor.from_local(local, self.mesh, self.placements, run_check=False,
                                  shape=torch.Size(self.logical_shape),
                                  stride=torch.empty(self.logical_shape, device="meta").stride())

    def full(self, local: torch.Tensor | None = None) -> torch.Tensor:
        """The whole parameter from ``local`` (its shard by default, or a tensor laid out like it), on
        every rank, in a tensor of its own. Over a world of one (or with no sharding) a DTensor's
        ``full_tensor`` is the local tensor itself; a state dict or optimizer state that aliased the
        live shard would change with the next step, so that case is copied."""
        local = (self.local() if local is None else local).detach()
        full = self.dtensor_of(local).full_tensor()
        if full.untyped_storage().data_ptr() == local.untyped_storage().data_ptr():
            full = full.clone()
        return full


@dataclass(eq=False)
class ShardedModel:
    """What graphshard knows about a sharded model; stored as ``model._graphshard``."""

    plan: Plan
    model_id: int
    params: dict[str, ShardedParam]                   # by key, in registration order
    units: dict[str, ShardedUnit]                     # by unit FQN, in registration order
    axes: dict[str, AxisGroup]                        # every mesh axis of the plan, as c10d sees it
    collections: list = field(default_factory=list)   # its sharded embedding collections (SparseCollection)
    name: str = field(default="", metadata=unkeyed("the root's class name, for logs and explain"))
    # what compiles and calls write, and what explain prints: not part of a stored program's key
    explain: list = field(default_factory=list, metadata=unkeyed("written by compiles"))  # one report per compiled graph
    preamble: list = field(default_factory=list, metadata=unkeyed("explain's first lines"))  # objects with .format()
    checkpointing: list = field(  # the plan's checkpointed modules and notes (explain prints them)
        default_factory=list, metadata=unkeyed("explain's lines; the checkpoint specs are keyed in plan"))
    dynamo_regions: Any = field(  # the repeated units dynamo traces once, or why not (compiler.regions.RegionMarks)
        default=None, metadata=unkeyed("decides the graph dynamo hands the backend, which aot_autograd keys"))
    eager_reads: dict = field(  # key -> where a frame run eagerly in a compiled call read it
        default_factory=dict, metadata=unkeyed("written by calls"))
    sync_gradients: bool = field(  # False inside graphshard.no_sync: backward skips dp reductions
        default=True, metadata=unkeyed("read per call by compiler.grad_sync.GradSync, not by the compile"))
    local_outputs: bool = False  # use_local_output=True sharded module outputs read as each rank's piece
    fed_locals: dict = field(  # id(local shard) -> its DTensor, during a compiled call (`storage.feeding_local_shards`)
        default_factory=dict, metadata=unkeyed("this call's tensors"))

    def __repr__(self) -> str:  # short: a backend bound to it (functools.partial) shows it in dynamo's errors
        return (f"ShardedModel(model_id={self.model_id}, {len(self.params)} parameters, units={list(self.units)}, "
                f"axes={list(self.axes)}, {len(self.collections)} embedding collections)")

    def param_for_fqn(self, fqn: str) -> ShardedParam:
        for p in self.params.values():
            if fqn in p.layout.fqns:
                return p
        raise KeyError(fqn)

    def keys_by_object(self) -> dict[int, str]:
        """Each parameter's key by the identity of the DTensor its module holds now, and of the local
        shard this compiled call handed dynamo for it (`fed_locals`)."""
        held = ((p.owner[0]._parameters.get(p.owner[1]), p.key) for p in self.params.values() if p.owner is not None)
        keys = {id(t): key for t, key in held if t is not None}
        keys.update({shard: keys[id(d)] for shard, d in self.fed_locals.items() if id(d) in keys})
        return keys

    def owns(self, key: str) -> bool:
        """Whether ``key`` (a parameter's or a declared layout's) names something of this model."""
        return key.startswith(f"m{self.model_id}/")

    def meshes(self) -> dict:
        """Each model-parallel axis's 1-D mesh (DTensor outputs and random-op seeds are agreed over it)."""
        mesh = self.plan.mesh
        return {axis: mesh if mesh.ndim == 1 else mesh[axis] for axis in self.plan.model_parallel_axes}


_MODELS: "weakref.WeakValueDictionary[int, ShardedModel]" = weakref.WeakValueDictionary()


def register(model: ShardedModel) -> None:
    """Makes ``model``'s keys resolvable by the eager marker implementations (`params.resolve`) and
    by `model_for_key`, for as long as the model lives."""
    _MODELS[model.model_id] = model
    for p in model.params.values():
        params.remember(p.key, p)


TRACED_FQN = "?"
"""The FQN part of a marker's key as dynamo traces it (`traced_key`)."""


def traced_key(key: str) -> str:
    """``key`` (``"m<id>/<fqn>"``) as a traced marker carries it: ``"m<id>/?"``, the same for the parameters
    of every repeated block, so a block's trace does not depend on which block it is. The backend puts
    the key back from the DTensor the marker wraps (`ShardedModel.keys_by_object`)."""
    return f"{key.split('/', 1)[0]}/{TRACED_FQN}"


def is_traced_key(key: str) -> bool:
    return key.endswith(f"/{TRACED_FQN}")


def model_for_key(key: str) -> ShardedModel | None:
    """The sharded model a key (``"m<id>/..."``) belongs to. Used only where no model is bound: a
    model compiled by name (``torch.compile(model, backend="graphshard")``), at the backend's entry,
    and a parameter read in a frame run eagerly inside a compiled call (storage's markers)."""
    head = key.split("/", 1)[0]
    return _MODELS.get(int(head[1:])) if head[:1] == "m" and head[1:].isdigit() else None
