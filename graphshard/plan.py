"""Plans: which module is a unit, how each parameter is laid out over the mesh.

A plan maps module FQN globs to specs: ``*`` matches within one FQN component
(``"layers.*"`` is every direct child of ``layers``), ``**`` matches across dots,
``?`` and ``[...]`` as in fnmatch; ``""`` is the root.
A module matched by a data-parallel spec (`FullyShard`, `Replicate`) becomes a
*unit*: it owns those of its parameters that no deeper unit owns, the bottom-up
semantics of FSDP's auto-wrapping, and its parameters are gathered by one
collective. A `ShardParams` spec lays parameters out over a model-parallel mesh
axis; the tensor-parallel styles (`ColwiseParallel`, `RowwiseParallel`,
`SequenceParallel`, `PrepareModuleInput`, `PrepareModuleOutput`) apply to the
``"tp"`` mesh axis and also declare their module's input and output layouts.
"""

from __future__ import annotations

import difflib
import functools
import re
from dataclasses import dataclass, field
from typing import Iterable, Mapping, Union

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Placement, Replicate as _R, Shard as _S

from graphshard.checkpointing import Checkpoint
from graphshard.styles import ModuleIO, ParallelStyle, from_torch


@dataclass(frozen=True, kw_only=True)
class FullyShard:
    """FSDP / ZeRO-3: parameters sharded on dim 0 over a data-parallel mesh axis.

    On a 2-D data-parallel mesh this is hybrid sharding (HSDP): sharded over
    ``shard_axis``, replicated over the other data-parallel axes.
    """

    reshard_after_forward: bool = True
    """True: FULL_SHARD, the gathered parameters are freed after forward and
    gathered again in backward. False: SHARD_GRAD_OP, kept from forward to backward."""
    param_dtype: torch.dtype | None = None
    """Dtype the parameters are cast to before the all-gather and computed in."""
    reduce_dtype: torch.dtype | None = None
    """Dtype gradients are reduced in (default: ``param_dtype``, else the parameter's)."""
    shard_axis: str | None = None
    """Mesh axis to shard over; default the last data-parallel axis of the mesh."""
    flat_params: bool = False
    """Store this rank's shards of the unit's parameters as one flat 1-D parameter,
    ``_flat_param`` on the unit's module (FSDP1's ``use_orig_params=False``): the original
    parameters are no longer registered, so ``named_parameters()`` and the optimizer see one
    tensor per unit (a few large tensors: the fast optimizer path). Each original parameter
    stays readable as a module attribute: a view of the flat parameter (a DTensor outside
    forward). Needs one dtype and one ``requires_grad`` across the unit's parameters."""


@dataclass(frozen=True, kw_only=True)
class Replicate:
    """Plain data parallelism (DDP): parameters replicated, gradients all-reduced (averaged)."""

    param_dtype: torch.dtype | None = None
    """Dtype the parameters are computed in."""
    reduce_dtype: torch.dtype | None = None
    """Dtype gradients are reduced in."""
    flat_params: bool = False
    """One flat 1-D parameter per unit, as `FullyShard`'s ``flat_params`` (here unsharded)."""


@dataclass(frozen=True)
class ShardParams:
    """Lays out parameters of the matched module over a model-parallel mesh axis.

    ``ShardParams("tp", weight=Shard(0), bias=Shard(0))``: the named parameters
    are sharded; the module's other parameters are replicated over that axis.
    Placement propagation then shards the computation that uses them.
    """

    mesh_axis: str
    placements: Mapping[str, Placement] = field(default_factory=dict)

    def __init__(self, mesh_axis: str, /, **placements: Placement):
        object.__setattr__(self, "mesh_axis", mesh_axis)
        object.__setattr__(self, "placements", dict(placements))


@dataclass(frozen=True)
class StridedShard:
    """Dim ``dim`` is ``split_factor`` equal blocks laid end to end, each sharded over the axis:
    a rank holds its piece of every block. It is the layout of a fused weight whose output
    features are several projections side by side (GPT-2's ``c_attn`` = q | k | v,
    ``StridedShard(1, split_factor=3)`` on its ``(in, 3 * out)`` weight; a mixture of experts'
    ``gate_up_proj`` = gate | up, ``StridedShard(1, split_factor=2)``): splitting the fused
    output into its projections then leaves each of them sharded, where a plain ``Shard``
    would hand whole projections to some ranks and none to others. Propagation also derives
    it for values (a sharded dim merged into the dims before it), and a view that splits the
    blocks apart turns it back into ``Shard``. Stored as DTensor's strided shard."""

    dim: int
    split_factor: int


@dataclass(frozen=True)
class ShardEmbedding:
    """Shards an ``nn.EmbeddingBag``'s table like TorchRec's sharding types, with a fused optimizer.

    ``ShardEmbedding("row_wise")``: ``sharding_type`` is ``"table_wise"`` (the whole table on
    ``ranks[0]``, default rank 0), ``"row_wise"`` (a block of rows per rank), ``"column_wise"``
    (equal column blocks on ``ranks``, default every rank) or ``"data_parallel"`` (replicated, a
    dense parameter the plan's unit specs handle). Ranks count along ``mesh_axis`` (default the
    plan's data-parallel axis), whose ranks each feed their own batch. The lookup's ids go to the
    owners and the pooled rows come back as graph collectives (the ``shard_embeddings`` pass);
    the table is updated in its backward by fbgemm's fused ``optimizer`` (``"sgd"``,
    ``"adagrad"``, ``"rowwise_adagrad"``) with ``learning_rate`` and ``eps``, on the global
    batch's mean gradient; its weight stays readable in ``state_dict()`` as a DTensor.
    ``kernel`` runs the lookup and the fused update: ``"fbgemm"`` (fbgemm's TBE; CPU tables),
    ``"triton"`` (graphshard's Triton TBE, ``kernels/triton_tbe.py``: on CUDA, or on the CPU under
    ``TRITON_INTERPRET=1``; its program needs no fbgemm at all) or ``"auto"``: fbgemm's where it can
    run (the CPU, fbgemm installed), else the Triton TBE.
    """

    sharding_type: str = "table_wise"
    ranks: tuple[int, ...] | None = None
    mesh_axis: str | None = None
    optimizer: str = "sgd"
    learning_rate: float = 0.01
    eps: float = 1e-8
    kernel: str = "auto"


UnitSpec = Union[FullyShard, Replicate]
Spec = Union[FullyShard, Replicate, ShardParams, ParallelStyle, ShardEmbedding]
_SPEC_TYPES = (FullyShard, Replicate, ShardParams, ParallelStyle, ShardEmbedding)
TP_AXIS = "tp"
"""The mesh axis the tensor-parallel styles apply to (on a 1-D mesh: its only axis)."""
COLLECTIVE_FORMS = ("auto", "nccl")
"""The values of `Plan`'s ``collectives``."""


@functools.lru_cache(maxsize=None)
def _glob_regex(pattern: str) -> re.Pattern:
    out, i = [], 0
    while i < len(pattern):
        c = pattern[i]
        if pattern.startswith("**", i):
            out.append(".*"); i += 2; continue
        if c == "*":
            out.append("[^.]*")
        elif c == "?":
            out.append("[^.]")
        elif c == "[":
            j = pattern.find("]", i)
            if j == -1:
                out.append(re.escape(c))
            else:
                body = pattern[i + 1 : j]
                out.append("[" + ("^" + body[1:] if body.startswith("!") else body) + "]")
                i = j
        else:
            out.append(re.escape(c))
        i += 1
    return re.compile("".join(out) + r"\Z")


def fqn_join(prefix: str, name: str) -> str:
    """``prefix.name``, either part possibly the root's empty FQN."""
    return f"{prefix}.{name}" if prefix and name else prefix or name


def fqn_match(fqn: str, pattern: str) -> bool:
    """Whether module FQN ``fqn`` matches plan key ``pattern``."""
    return _glob_regex(pattern).match(fqn) is not None


class Plan:
    """How a model is sharded over ``mesh``: ``Plan(mesh, {fqn_glob: spec})``.

    ``collectives`` picks the form of each unit's data-parallel collectives:

    - ``"auto"`` (default): by the backend of the axis's process group. NCCL (and any
      backend but gloo): the unit's shards packed into one bucket, one
      ``all_gather_into_tensor``, unpacked (lowered by Inductor, the pack writes this rank's
      slot of the gathered buffer and the gather runs in place); gradients packed rank-major, one
      ``reduce_scatter_tensor`` (``avg``). gloo: one coalesced all-gather with an output
      per parameter, and the gradients' reduce-scatter as one all-to-all of the other ranks'
      rows (gloo has no reduce-scatter of its own; see docs/design/collectives.md).
    - ``"nccl"``: NCCL's forms on every backend. On gloo this runs, op for op, the
      collectives a GPU run issues, so CPU-only CI exercises that path; it costs gloo
      an extra copy per gather and an all-reduce per reduce-scatter.

    ``ignored_params``: parameter FQN globs (``"head.**"``: every parameter under ``head``)
    that graphshard leaves as they are, as FSDP's ignored modules and parameters: not
    sharded, not gathered, their gradients not reduced (each rank keeps its own), plain
    tensors in ``named_parameters()`` and ``state_dict()``. A parameter reachable under
    several FQNs is ignored when any of them matches.

    ``checkpoint``: module FQN globs -> `graphshard.Checkpoint`: activation checkpointing of those
    modules' forward (full, or selective with a policy), compiled as recomputation in the
    backward. Put it on the units (``"layers.*"``) as FSDP users put ``checkpoint_wrapper``:
    a checkpointed module inside a unit, or one spanning several units, is allowed and
    ``explain`` says what that costs.

    ``notes``: lines ``explain`` prints before the compiled graphs (``auto_plan``'s reasons).
    ``torchrec_plan``: the TorchRec ``ShardingPlan`` of the model's TorchRec embedding modules
    (``auto_plan`` on a TorchRec model); ``model_parallel.DistributedModelParallel(plan=<this
    Plan>)`` shards those modules by it and lays the dense part out by the rules.
    """

    def __init__(self, mesh: DeviceMesh, rules: Mapping[str, Spec], *, collectives: str = "auto",
                 ignored_params: Iterable[str] = (), checkpoint: Mapping[str, Checkpoint] | None = None,
                 notes: Iterable[str] = (), torchrec_plan=None):
        if not isinstance(mesh, DeviceMesh):
            raise ValueError(f"Plan needs a DeviceMesh, got {type(mesh).__name__}; build one with init_device_mesh")
        if collectives not in COLLECTIVE_FORMS:
            raise ValueError(f"Plan(collectives={collectives!r}): expected one of {COLLECTIVE_FORMS}")
        rules = {key: from_torch(spec) or spec for key, spec in rules.items()}  # torch's styles: graphshard's
        for key, spec in rules.items():
            if not isinstance(key, str):
                raise ValueError(f"plan key {key!r} is not a string; keys are module FQN globs ('' is the root)")
            if not isinstance(spec, _SPEC_TYPES):
                raise ValueError(
                    f"plan key {key!r} has spec {spec!r}; expected FullyShard(), Replicate(), ShardParams(...), "
                    "ShardEmbedding(...) or a tensor-parallel style (ColwiseParallel(), RowwiseParallel(), ...)"
                )
        styled = any(isinstance(s, ParallelStyle) for s in rules.values())
        if mesh.mesh_dim_names is not None:
            axes = tuple(mesh.mesh_dim_names)
        elif mesh.ndim == 1 and rules and all(isinstance(s, ParallelStyle) for s in rules.values()):
            axes = (TP_AXIS,)  # parallelize_module on an unnamed 1-D mesh: that mesh is the tp axis
        else:
            raise ValueError("Plan needs a mesh with named axes: init_device_mesh(..., mesh_dim_names=('dp',))")
        self.mesh = mesh
        self.axis_names = axes
        self.rules = dict(rules)
        self.collectives = collectives
        if isinstance(ignored_params, str) or not all(isinstance(g, str) for g in ignored_params):
            raise ValueError(f"Plan(ignored_params={ignored_params!r}): expected parameter FQN globs (strings), "
                             "e.g. ('head.**', 'emb.weight')")
        self.ignored_params = tuple(ignored_params)
        self.checkpoint = dict(checkpoint or {})
        for key, spec in self.checkpoint.items():
            if not isinstance(key, str) or not isinstance(spec, Checkpoint):
                raise ValueError(f"Plan(checkpoint={{{key!r}: {spec!r}}}): expected module FQN globs mapped to "
                                 "graphshard.Checkpoint(...) (e.g. {'layers.*': Checkpoint()})")
        self.notes = tuple(notes)
        self.torchrec_plan = torchrec_plan
        # Styles apply to the axis named "tp", or to the only axis of a 1-D mesh.
        self.tp_axis = TP_AXIS if TP_AXIS in axes or len(axes) != 1 else axes[0]
        mp_axes = {s.mesh_axis for s in self.rules.values() if isinstance(s, ShardParams)}
        if styled:
            mp_axes.add(self.tp_axis)
        for key, spec in self.rules.items():
            if isinstance(spec, ShardParams) and spec.mesh_axis not in axes:
                raise ValueError(f"plan key {key!r}: ShardParams axis {spec.mesh_axis!r} is not a mesh axis {axes}")
            if isinstance(spec, ParallelStyle) and self.tp_axis not in axes:
                raise ValueError(
                    f"plan key {key!r}: {type(spec).__name__} applies to the {TP_AXIS!r} mesh axis, but the mesh has "
                    f"{axes}; name the tensor-parallel axis {TP_AXIS!r}"
                )
        self.model_parallel_axes = tuple(a for a in axes if a in mp_axes)
        self.data_parallel_axes = tuple(a for a in axes if a not in mp_axes)
        for key, spec in self.rules.items():
            if isinstance(spec, (FullyShard, Replicate)) and not self.data_parallel_axes:
                raise ValueError(
                    f"plan key {key!r}: {type(spec).__name__} needs a data-parallel mesh axis, but every axis of "
                    f"{axes} is used by ShardParams; add a 'dp' axis to the mesh"
                )
            if isinstance(spec, FullyShard) and spec.shard_axis is not None and spec.shard_axis not in self.data_parallel_axes:
                raise ValueError(
                    f"plan key {key!r}: FullyShard(shard_axis={spec.shard_axis!r}) is not a data-parallel axis of the "
                    f"mesh; choose one of {self.data_parallel_axes}"
                )

    def spec_axis(self, spec: ShardParams | ParallelStyle) -> str:
        """The model-parallel mesh axis a parameter-layout spec applies to."""
        return spec.mesh_axis if isinstance(spec, ShardParams) else self.tp_axis

    def group(self, axis: str):
        """The process group of mesh axis ``axis``."""
        return self.mesh.get_group(self.axis_names.index(axis))

    def shard_axis(self, spec: FullyShard) -> str:
        return spec.shard_axis or self.data_parallel_axes[-1]

    def __repr__(self) -> str:
        forms = "" if self.collectives == "auto" else f", collectives={self.collectives!r}"
        ignored = f", ignored_params={self.ignored_params!r}" if self.ignored_params else ""
        ckpt = f", checkpoint={self.checkpoint!r}" if self.checkpoint else ""
        return f"Plan(mesh={self.mesh!r}, rules={self.rules!r}{forms}{ignored}{ckpt})"


@dataclass(frozen=True)
class ParamLayout:
    """Where one (deduplicated) parameter lives."""

    fqns: tuple[str, ...]                     # every FQN it is reachable under; fqns[0] is canonical
    placements: tuple[Placement, ...]         # one per mesh axis: the stored (sharded) layout
    unit: str | None                          # FQN of the owning unit, None if no data-parallel axis
    unit_spec: UnitSpec | None


@dataclass(frozen=True)
class Resolution:
    """A plan applied to a model."""

    layouts: dict[int, ParamLayout]           # by parameter identity; parameters the plan leaves alone are absent
    io: dict[int, tuple[str, ModuleIO]]       # by module identity: declared activation layouts (styles)
    checkpoints: dict[int, Checkpoint] = field(default_factory=dict)  # by module identity: activation checkpointing
    checkpoint_notes: tuple[str, ...] = ()    # checkpointed modules that are not one unit, and what that costs


def _normalized(placement: Placement, ndim: int) -> Placement:
    """``placement`` with a negative dim counted from the front (``Shard(-1)`` of a matrix is ``Shard(1)``)."""
    if isinstance(placement, StridedShard) and placement.dim < 0:
        return StridedShard(placement.dim + ndim, placement.split_factor)
    if isinstance(placement, _S) and placement.dim < 0:
        return _S(placement.dim + ndim)
    return placement


def resolve(model: nn.Module, plan: Plan) -> Resolution:
    """Match plan keys to modules and give every planned parameter (by identity) its layout.

    On a mesh with a data-parallel axis every parameter needs a unit; on a purely
    model-parallel mesh, parameters of modules no spec names stay as they are
    (plain tensors, replicated, as torch's ``parallelize_module`` leaves them).
    Raises ValueError, naming the key or FQN, for keys that match nothing or
    match a parameter, modules claimed twice, and parameters that no unit owns
    on a mesh with a data-parallel axis.
    """
    modules: dict[str, nn.Module] = dict(model.named_modules(remove_duplicate=False))
    params_by_fqn = dict(model.named_parameters(remove_duplicate=False))
    matched: dict[str, list[tuple[str, nn.Module]]] = {}
    for key in plan.rules:
        hits = [(fqn, m) for fqn, m in modules.items() if fqn_match(fqn, key)]
        if not hits:
            if any(fqn_match(p, key) for p in params_by_fqn):
                owner = key.rsplit(".", 1)[0] if "." in key else ""
                raise ValueError(
                    f"plan key {key!r} names a parameter, not a module; keys name modules (try {owner!r})"
                )
            close = difflib.get_close_matches(key, [f for f in modules if f], n=3, cutoff=0.4)
            raise ValueError(
                f"plan key {key!r} matches no module of {type(model).__name__}; closest FQNs: {close or 'none'}"
            )
        matched[key] = hits

    # Unit specs: one per module object; a shared module is a unit once.
    unit_of_module: dict[int, tuple[str, UnitSpec, int, str]] = {}  # (fqn, spec, depth, plan key)
    mp_of_module: dict[int, list[tuple[str, ShardParams | ParallelStyle, str]]] = {}  # (fqn, spec, plan key)
    io: dict[int, tuple[str, ModuleIO]] = {}
    style_of: dict[int, tuple[str, ParallelStyle, str]] = {}
    for key, spec in plan.rules.items():
        if isinstance(spec, ShardEmbedding):
            continue  # graphshard.sparse.modules shards these before resolution
        for fqn, mod in matched[key]:
            if isinstance(spec, ParallelStyle):
                prev = style_of.setdefault(id(mod), (fqn, spec, key))
                if prev[1] != spec:
                    raise ValueError(
                        f"module {fqn!r} is given two tensor-parallel styles ({prev[1]!r} under {prev[0]!r} by plan "
                        f"key {prev[2]!r} and {spec!r} by plan key {key!r}); a module object gets one style: fix "
                        "the plan keys"
                    )
                if prev[0] != fqn:
                    continue  # a shared module, reached again under another FQN: parallelized once
                module_io = spec.io(fqn, mod)
                if module_io is not None:
                    io[id(mod)] = (fqn, module_io)
            if isinstance(spec, (ShardParams, ParallelStyle)):
                mp_of_module.setdefault(id(mod), []).append((fqn, spec, key))
                continue
            prev = unit_of_module.get(id(mod))
            if prev is not None and prev[1] != spec:
                raise ValueError(f"module {fqn!r} is matched by two unit specs ({prev[1]} by plan key "
                                 f"{prev[3]!r} and {spec} by plan key {key!r}); keep one key")
            depth = 0 if fqn == "" else fqn.count(".") + 1
            if prev is None or depth > prev[2]:
                unit_of_module[id(mod)] = (fqn, spec, depth, key) if prev is None else (prev[0], spec, depth, prev[3])

    fqns_of: dict[int, list[str]] = {}
    param_of: dict[int, nn.Parameter] = {}
    for fqn, p in params_by_fqn.items():
        fqns_of.setdefault(id(p), []).append(fqn)
        param_of[id(p)] = p
    ignored = _ignored(plan, params_by_fqn)

    # Bottom-up ownership: deepest unit first.
    owner: dict[int, tuple[str, UnitSpec]] = {}
    for mid, (ufqn, spec, _, _) in sorted(unit_of_module.items(), key=lambda kv: -kv[1][2]):
        mod = modules[ufqn]
        for p in mod.parameters():
            owner.setdefault(id(p), (ufqn, spec))

    # Model-parallel placements per parameter.
    mp_place: dict[int, dict[str, Placement]] = {}
    mp_source: dict[tuple[int, str], tuple[str, object, str]] = {}  # (param, axis) -> the FQN, spec and key that set it
    planned: set[int] = set()
    for mid, entries in mp_of_module.items():
        for mfqn, spec, mkey in entries:
            mod = modules[mfqn]
            local = dict(mod.named_parameters(recurse=False))
            planned.update(id(p) for p in local.values())
            placements = spec.placements if isinstance(spec, ShardParams) else spec.param_placements(mfqn, mod)
            for pname, placement in placements.items():
                if pname not in local:
                    raise ValueError(
                        f"ShardParams on {mfqn!r} names parameter {pname!r}, but that module has {sorted(local)}"
                    )
                if not isinstance(placement, (_S, _R, StridedShard)):
                    raise ValueError(f"{mfqn}.{pname}: placement {placement!r} must be Shard(dim), "
                                     "StridedShard(dim, split_factor) or Replicate()")
                p = local[pname]
                if isinstance(placement, (_S, StridedShard)) and not -p.dim() <= placement.dim < p.dim():
                    raise ValueError(f"{mfqn}.{pname}: {placement!r} is out of range for shape {tuple(p.shape)}")
                if isinstance(placement, StridedShard) and (
                        placement.split_factor < 1 or p.shape[placement.dim] % placement.split_factor):
                    raise ValueError(
                        f"{mfqn}.{pname}: {placement!r} needs dim {placement.dim} (size {p.shape[placement.dim]}) "
                        f"to be {placement.split_factor} equal blocks; give the number of fused projections"
                    )
                axis = plan.spec_axis(spec)
                prev = mp_place.get(id(p), {}).get(axis)
                if prev is not None and _normalized(prev, p.dim()) != _normalized(placement, p.dim()):
                    src_fqn, src_spec, src_key = mp_source[(id(p), axis)]
                    raise ValueError(
                        f"{mfqn}.{pname}: plan key {mkey!r} ({spec!r} on {mfqn!r}) places it {placement!r} on mesh "
                        f"axis {axis!r}, but plan key {src_key!r} ({src_spec!r} on {src_fqn!r}) places it {prev!r}; "
                        "a parameter gets one placement per axis: fix the plan keys so they agree"
                    )
                mp_place.setdefault(id(p), {})[axis] = placement
                mp_source.setdefault((id(p), axis), (mfqn, spec, mkey))

    layouts: dict[int, ParamLayout] = {}
    orphans = []
    for pid, fqns in fqns_of.items():
        p = param_of[pid]
        if pid in ignored:
            if pid in mp_place:
                raise ValueError(f"parameter {fqns[0]!r} is in ignored_params and also laid out by a model-parallel "
                                 "spec; drop one of the two")
            continue
        unit, spec = owner.get(pid, (None, None))
        if plan.data_parallel_axes and unit is None:
            orphans.append(fqns[0])
            continue
        if not plan.data_parallel_axes and pid not in planned:
            continue
        placements = []
        for axis in plan.axis_names:
            if axis in plan.model_parallel_axes:
                placements.append(_normalized(mp_place.get(pid, {}).get(axis, _R()), p.dim()))
            elif isinstance(spec, FullyShard) and axis == plan.shard_axis(spec):
                placements.append(_S(0))
            else:
                placements.append(_R())
        layouts[pid] = ParamLayout(tuple(fqns), tuple(placements), unit, spec)
    if orphans:
        raise ValueError(
            f"parameters {orphans[:5]}{' ...' if len(orphans) > 5 else ''} belong to no unit; every parameter needs "
            "a FullyShard() or Replicate() owner on a data-parallel mesh: add a root key, e.g. {'': FullyShard()}"
        )
    checkpoints, notes = _checkpoints(plan, model, modules, {v[0] for v in unit_of_module.values()})
    return Resolution(layouts, io, checkpoints, notes)


def _checkpoints(plan: Plan, model: nn.Module, modules: dict[str, nn.Module],
                 units: set[str]) -> tuple[dict[int, Checkpoint], tuple[str, ...]]:
    """The checkpointed modules by identity, and a note for each that is not a unit boundary (on a
    mesh with data-parallel units): inside a unit, its recomputation reads the unit's parameters
    gathered again (FULL_SHARD) or kept (SHARD_GRAD_OP); spanning several units, it needs all of them
    gathered at once in the backward."""
    chosen: dict[int, tuple[str, Checkpoint, str]] = {}
    for key, spec in plan.checkpoint.items():
        hits = [(fqn, m) for fqn, m in modules.items() if fqn_match(fqn, key)]
        if not hits:
            close = difflib.get_close_matches(key, [f for f in modules if f], n=3, cutoff=0.4)
            raise ValueError(f"Plan(checkpoint=...) key {key!r} matches no module of {type(model).__name__}; "
                             f"closest FQNs: {close or 'none'}")
        for fqn, mod in hits:
            prev = chosen.setdefault(id(mod), (fqn, spec, key))
            if prev[1] != spec:
                raise ValueError(f"module {fqn!r} is given two Checkpoint specs (by checkpoint keys {prev[2]!r} and "
                                 f"{key!r}); keep one")
    notes = []
    for fqn, spec, _ in chosen.values():
        if fqn in units or not units:
            continue
        inner = sorted(u for u in units if u != fqn and (fqn == "" or u.startswith(fqn + ".")))
        if inner:
            notes.append(f"checkpointed module {fqn or '<root>'!r} spans units {inner[:4]}{' ...' if len(inner) > 4 else ''}: "
                         "its recomputation in the backward needs all of their parameters gathered at once; "
                         "checkpoint the units themselves to gather one at a time")
        else:
            owner = max((u for u in units if u == "" or fqn.startswith(u + ".")), key=len, default="")
            notes.append(f"checkpointed module {fqn!r} is part of unit {owner or '<root>'!r}: its recomputation "
                         "reads that unit's parameters (gathered again if the unit reshards after forward)")
    return {mid: spec for mid, (_, spec, _) in chosen.items()}, tuple(notes)


def _ignored(plan: Plan, params_by_fqn: dict[str, nn.Parameter]) -> set[int]:
    """Identities of the parameters ``plan.ignored_params`` names; a glob naming none is an error."""
    out = set()
    for pattern in plan.ignored_params:
        hits = [p for fqn, p in params_by_fqn.items() if fqn_match(fqn, pattern)]
        if not hits:
            close = difflib.get_close_matches(pattern, list(params_by_fqn), n=3, cutoff=0.4)
            raise ValueError(f"ignored_params entry {pattern!r} matches no parameter; closest FQNs: {close or 'none'}")
        out.update(id(p) for p in hits)
    return out
