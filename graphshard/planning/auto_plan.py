"""``graphshard.auto_plan``: one cost model places dense and sparse parameters together.

Given a model, a mesh, a memory budget per rank and one step's example input, it returns a
``Plan`` that picks, and says why:

- **tensor parallelism** on the mesh's ``"tp"`` axis: each group of ``nn.Linear`` s that read
  the same input (attention's q/k/v, a gated MLP's two input projections) is column-wise, and
  the next linear of the same module that reads their result and returns to their input width
  is row-wise (attention's output projection, the MLP's down projection). Found from one
  forward of the example input (the order of the calls and which tensor each one reads), not
  from names. A pair whose widths do not divide by the tp axis is left replicated, with a
  reason. Any pairing is correct (the compiler inserts the collectives a layout needs); this
  one is the layout whose only collectives are the row-wise outputs' reductions.
- **data parallelism** per unit (each block of a repeated ``ModuleList`` / ``Sequential``, and
  the root for the rest): ``Replicate`` (DDP: an all-reduce of the gradients, 2(n-1)/n of the
  unit's bytes a step) unless the budget needs ``FullyShard`` (a third more bytes a step:
  gathers forward and backward and a reduce-scatter, for 1/n of the memory). The largest
  units are sharded first, until the plan fits.
- **embedding tables** (``nn.EmbeddingBag``): ``ShardEmbedding`` sharding types over the
  data-parallel axis, placed by the embedding planner's cost model (docs/cost-model.md) in the
  memory the dense part leaves. The example input gives the ids per bag.

Memory per rank counts parameters, gradients and ``optimizer_states`` fp32 values per
parameter (Adam: 2) for the dense part, and the tables' weights and fused optimizer state;
activations are not counted. The reasons are the plan's ``notes``, printed by ``explain``.

A TorchRec model (``EmbeddingBagCollection`` / ``EmbeddingCollection``, fed a
``KeyedJaggedTensor``) gets the same: its tables' ids per sample are read from the example
KJT, they are placed in the same budget, and the plan carries their TorchRec ``ShardingPlan``
(``plan.torchrec_plan``); ``DistributedModelParallel(model, plan=<the Plan>)`` runs it, the dense
part laid out by the plan's rules.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from types import SimpleNamespace

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from graphshard.plan import FullyShard, Plan, Replicate, ShardEmbedding
from graphshard.styles import ColwiseParallel, RowwiseParallel

TP_AXIS = "tp"
_LINK_BW, _MEM_BW = 10e9, 50e9
"""Bytes per second the tables' estimates use (they rank options; only ratios matter)."""


@dataclass
class _Call:
    fqn: str
    module: nn.Module
    parent: str
    input_id: int
    ids: int = 0        # EmbeddingBag: ids in the call
    bags: int = 0       # EmbeddingBag: bags in the call
    input: object = None  # held for the probe's length, so no two inputs ever share an id()


@dataclass
class _Table:
    """One table to place: an ``nn.EmbeddingBag`` (``module`` is it) or a table of a TorchRec
    collection (``module`` is the collection, ``name`` its table)."""

    fqn: str
    name: str
    module: nn.Module
    weight: torch.Tensor
    stats: object  # _cost.TableStats
    torchrec: bool


@dataclass
class _Decision:
    rules: dict = field(default_factory=dict)
    notes: list = field(default_factory=list)


def auto_plan(model: nn.Module, mesh: DeviceMesh, *, memory_budget: int, batch, optimizer_states: int = 2,
              table_optimizer: str = "rowwise_adagrad", learning_rate: float = 0.01) -> Plan:
    """A ``Plan`` for ``model`` on ``mesh`` within ``memory_budget`` bytes per rank.

    ``batch``: one step's example input on one data-parallel rank (a tensor, or a tuple of the
    forward's arguments); the model runs forward once on it, without gradients.
    ``optimizer_states``: fp32 values the dense optimizer keeps per parameter (Adam 2, SGD 0).
    ``table_optimizer`` / ``learning_rate``: the fused optimizer of sharded tables.

    The mesh's first rank plans (with its ``batch``) and the plan is broadcast, so every rank
    gets the same plan; an error there is raised on every rank.
    """
    payload = None
    if mesh.mesh.flatten()[0].item() == mesh.get_rank():
        try:
            payload = ("plan", _plan_here(model, mesh, memory_budget, batch, optimizer_states, table_optimizer,
                                          learning_rate))
        except (ValueError, NotImplementedError) as e:
            payload = ("error", e)
    kind, value = _broadcast(mesh, payload)
    if kind == "error":
        raise value
    rules, notes, torchrec_plan = value
    return Plan(mesh, rules, notes=notes, torchrec_plan=torchrec_plan)


def _broadcast(mesh: DeviceMesh, payload):
    """The mesh's first rank's ``payload`` on every rank of the mesh: along each axis in turn, from
    the axis group's first rank (after the first axis, every rank of the second holds it)."""
    import torch.distributed as dist

    for axis in range(mesh.ndim):
        group = mesh.get_group(axis)
        box = [payload]
        dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group)
        payload = box[0]
    return payload


def _plan_here(model, mesh, memory_budget, batch, optimizer_states, table_optimizer, learning_rate):
    if mesh.mesh_dim_names is None:
        raise ValueError("auto_plan needs a mesh with named axes (init_device_mesh(..., mesh_dim_names=('dp',)) "
                         "or ('dp', 'tp'))")
    axes = tuple(mesh.mesh_dim_names)
    dp_axes = [a for a in axes if a != TP_AXIS]
    if len(dp_axes) != 1:
        raise ValueError(f"auto_plan plans one data-parallel axis and an optional 'tp' axis; the mesh has {axes}")
    dp_axis = dp_axes[0]
    dp, tp = mesh.size(axes.index(dp_axis)), (mesh.size(axes.index(TP_AXIS)) if TP_AXIS in axes else 1)
    collections = _torchrec_collections(model)
    if collections and tp > 1:
        raise NotImplementedError("auto_plan: a model with TorchRec embedding modules runs under DistributedModelParallel, "
                                  "whose dense part is data-parallel: plan it on a 1-D ('dp',) mesh")
    calls, kjts = _probe(model, batch, collections)
    out = _Decision()
    tp_sharded = _tensor_parallel(model, calls, tp, out) if tp > 1 else set()
    units = [u for u in _units(model) if not any(u == f or u.startswith(f + ".") for f in collections)]
    tables = ([_bag_table(c, table_optimizer) for c in calls if isinstance(c.module, nn.EmbeddingBag)]
              + _torchrec_tables(collections, kjts, table_optimizer))
    placed, hw = _data_parallel(model, units, tables, tp_sharded, dp, tp, memory_budget, optimizer_states,
                                table_optimizer, learning_rate, dp_axis, out)
    return out.rules, tuple(out.notes), _torchrec_plan(tables, placed, hw)


# ---------------------------------------------------------------------------------------------
# One forward: which linear reads which tensor, in which order; ids per bag
# ---------------------------------------------------------------------------------------------
def _probe(model: nn.Module, batch, collections: dict) -> tuple[list[_Call], dict]:
    """The linears' and bags' first calls in order, and each TorchRec collection's input KJT."""
    kjts: dict[int, object] = {}
    names = {}
    for fqn, mod in model.named_modules(remove_duplicate=False):
        names.setdefault(id(mod), fqn)
    calls: list[_Call] = []
    seen: set[int] = set()

    def hook(mod, args, kwargs):
        if id(mod) in seen:  # a module called twice (shared) is planned once, at its first call
            return
        seen.add(id(mod))
        fqn = names[id(mod)]
        first = args[0] if args else kwargs.get("input")
        call = _Call(fqn, mod, fqn.rpartition(".")[0], id(first), input=first)
        if isinstance(mod, nn.EmbeddingBag):
            ids = first
            offsets = args[1] if len(args) > 1 else kwargs.get("offsets")
            call.ids = ids.numel()
            call.bags = ids.shape[0] if ids.dim() == 2 else (offsets.numel() if offsets is not None else 1)
        calls.append(call)

    def kjt_hook(mod, args):
        kjts.setdefault(id(mod), args[0] if args else None)

    inside = {id(m) for c, _ in collections.values() for m in c.modules()}  # TorchRec's own bags: its tables
    handles = [m.register_forward_pre_hook(hook, with_kwargs=True) for m in model.modules()
               if isinstance(m, (nn.Linear, nn.EmbeddingBag)) and id(m) not in inside]
    handles += [m.register_forward_pre_hook(kjt_hook) for m, _ in collections.values()]
    try:
        with torch.no_grad():
            model(*(batch if isinstance(batch, tuple) else (batch,)))
    finally:
        for h in handles:
            h.remove()
    for call in calls:
        call.input = None
    return calls, kjts


# ---------------------------------------------------------------------------------------------
# Tensor parallelism
# ---------------------------------------------------------------------------------------------
def _tensor_parallel(model, calls, tp: int, out: _Decision) -> set[str]:
    linears = [c for c in calls if isinstance(c.module, nn.Linear)]
    styles: dict[str, object] = {}
    i = 0
    while i < len(linears):
        group = [linears[i]]
        while (i + len(group) < len(linears) and linears[i + len(group)].parent == group[0].parent
               and linears[i + len(group)].input_id == group[0].input_id):
            group.append(linears[i + len(group)])
        width = group[0].module.out_features
        same_width = all(g.module.out_features == width for g in group)
        nxt = next((c for c in linears[i + len(group):] if c.parent == group[0].parent and c.input_id != group[0].input_id
                    and c.module.in_features == width), None) if same_width else None
        if nxt is not None and nxt.fqn not in styles and nxt.module.out_features == group[0].module.in_features:
            names = ", ".join(g.fqn for g in group)
            if width % tp:
                out.notes.append(f"{names} -> {nxt.fqn}: replicated on the tp axis ({width} columns do not divide by {tp})")
            else:
                for g in group:
                    styles[g.fqn] = ColwiseParallel()
                styles[nxt.fqn] = RowwiseParallel()
        i += len(group)
    rules = _compress([f for f, m in model.named_modules() if isinstance(m, nn.Linear)], styles)
    for key, spec in rules.items():
        out.rules[key] = spec
    pairs = sum(isinstance(s, RowwiseParallel) for s in styles.values())
    if styles:
        out.notes.append(
            f"tensor parallel over tp={tp}: {pairs} column-wise -> row-wise linear pairs (linears that read one input "
            "column-wise, the linear that returns to their width row-wise: one reduction per pair); "
            + ", ".join(f"{k}: {type(v).__name__}" for k, v in rules.items()))
    else:
        out.notes.append(f"tensor parallel over tp={tp}: no column-wise -> row-wise linear pair found")
    return set(styles)


def _compress(modules: list[str], specs: dict) -> dict:
    """Exact FQNs -> globs (``layers.*.attn.wq``) where every one of ``modules`` the glob matches
    has a spec, the same."""
    by_glob: dict[str, list[str]] = {}
    for fqn in specs:
        by_glob.setdefault(re.sub(r"(^|\.)\d+(?=\.|$)", r"\1*", fqn), []).append(fqn)
    rules = {}
    for glob, fqns in by_glob.items():
        rx = re.compile("^" + re.escape(glob).replace(r"\*", r"[^.]+") + "$")
        matched = [f for f in modules if rx.match(f)]
        same = len({repr(specs[f]) for f in fqns}) == 1
        if glob != fqns[0] and same and sorted(matched) == sorted(fqns):
            rules[glob] = specs[fqns[0]]
        else:
            rules.update({f: specs[f] for f in fqns})
    return rules


# ---------------------------------------------------------------------------------------------
# Data parallelism and tables, in one memory budget
# ---------------------------------------------------------------------------------------------
def _units(model: nn.Module) -> list[str]:
    """The blocks of repeated containers (``layers.0``, ``layers.1``, ...): one unit each."""
    units = []
    for fqn, mod in model.named_modules():
        if isinstance(mod, (nn.ModuleList, nn.Sequential)) and len(mod) > 1:
            kinds = {type(m) for m in mod}
            if len(kinds) == 1 and any(p.numel() for p in mod[0].parameters()):
                units.extend(f"{fqn}.{i}" if fqn else str(i) for i in range(len(mod)))
    # a unit inside another unit would be gathered twice: keep the outermost
    return [u for u in units if not any(u.startswith(o + ".") for o in units if o != u)]


def _param_bytes(model, prefix: str, tp_sharded: set[str], tp: int, skip: set[int]) -> int:
    total, seen = 0, set()
    root = model.get_submodule(prefix) if prefix else model
    for mfqn, mod in root.named_modules():
        full = f"{prefix}.{mfqn}".strip(".") if prefix else mfqn
        for _, p in mod.named_parameters(recurse=False):
            if id(p) in seen or id(p) in skip:
                continue
            seen.add(id(p))
            total += p.numel() * p.element_size() // (tp if full in tp_sharded else 1)
    return total


def _data_parallel(model, units, tables, tp_sharded, dp, tp, budget, states, table_optimizer, lr, dp_axis,
                   out: _Decision):
    """Replicate or FullyShard per unit, and the tables' options, in ``budget``: (option, cost) per
    table, and the hardware view they were placed on."""
    table_params = {id(t.weight) for t in tables}
    unit_params = {id(p) for u in units for p in model.get_submodule(u).parameters()}
    sizes = {u: _param_bytes(model, u, tp_sharded, tp, table_params) for u in units}
    sizes[""] = _param_bytes(model, "", tp_sharded, tp, table_params | unit_params)
    per_param = 2 + states  # the parameter, its gradient, the optimizer's states (fp32 each)
    sharded: set[str] = set()

    def dense_memory() -> int:
        mem = sum(s * per_param // (dp if u in sharded else 1) for u, s in sizes.items())
        if sharded:  # gathered units alive at once: the one computing and the one prefetched
            mem += 2 * max(sizes[u] for u in sharded)
        return mem

    stats = [t.stats for t in tables]
    order = sorted(sizes, key=lambda u: (-sizes[u], u))
    while True:
        left = budget - dense_memory()
        try:
            if left < 0:
                raise ValueError(f"the dense part alone is {_size(-left)} over")
            placed, hw = _place_tables(stats, dp, left)
            break
        except ValueError as e:  # over budget, or the planner's Infeasible: a table fits nowhere
            candidates = [u for u in order if u not in sharded and sizes[u]]
            if not candidates:
                raise ValueError(
                    f"auto_plan: the model does not fit in memory_budget={_size(budget)} per rank: with every "
                    f"unit FullyShard over {dp_axis}={dp} the dense part needs {_size(dense_memory())} a rank, "
                    f"and then {e}; raise memory_budget, add ranks, or lower optimizer_states"
                ) from None
            sharded.add(candidates[0])
    specs = {u: FullyShard() if u in sharded else Replicate() for u in units if sizes[u]}
    out.rules.update(_compress(units, specs))
    if sizes[""]:
        out.rules[""] = FullyShard() if "" in sharded else Replicate()
    for u in sorted(sizes, key=lambda u: (u != "", u)):
        if not sizes[u]:
            continue
        gb = sizes[u] * (dp - 1) / dp
        choice = ("FullyShard" if u in sharded else "Replicate")
        why = ("to fit the budget" if u in sharded else "fits the budget; fewer bytes than FullyShard")
        out.notes.append(f"unit {u or '<root>'}: {choice} over {dp_axis}={dp} ({why}): {_size(sizes[u])} of "
                         f"parameters, {_size(sizes[u] * per_param / (dp if u in sharded else 1))} a rank; "
                         f"{_size((3 if u in sharded else 2) * gb)} moved a step "
                         f"(the other choice: {_size((2 if u in sharded else 3) * gb)})")
    for t, (option, cost) in zip(tables, placed):
        if not t.torchrec:
            out.rules[t.fqn] = ShardEmbedding(
                option.sharding_type, ranks=option.ranks if option.sharding_type in ("table_wise", "column_wise") else None,
                mesh_axis=dp_axis, optimizer=table_optimizer, learning_rate=lr)
        busiest = max(cost.ranks(), key=cost.time)
        out.notes.append(f"table {t.fqn}{'.' + t.name if t.torchrec else ''}: {option.describe()} "
                         f"({t.stats.ids_per_sample / t.stats.features:.1f} ids a bag; est "
                         f"{cost.time(busiest) * 1e3:.3f} ms on rank {busiest}, "
                         f"{_size(max(cost.memory.values()))} a rank at most)")
    out.notes.insert(0, f"auto_plan: memory_budget {_size(budget)} per rank; dense part "
                        f"{_size(dense_memory())} a rank (parameters, gradients, {states} optimizer states), "
                        f"tables {_size(max(sum(cost.memory.get(r, 0) for _, cost in placed) for r in range(dp)))}")
    return placed, hw


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def _state_per_row(optimizer: str, dim: int) -> int:
    return {"sgd": 0, "rowwise_adagrad": 1}.get(optimizer, dim)


def _bag_table(call: _Call, optimizer: str) -> _Table:
    from graphshard.planning.cost import TableStats

    w = call.module.weight
    rows, dim = w.shape
    stats = TableStats(name=call.fqn, rows=rows, dim=dim, features=1, ids_per_sample=call.ids / max(call.bags, 1),
                       batch=call.bags, weighted=False, elem_bytes=w.element_size(),
                       state_per_row=_state_per_row(optimizer, dim), sequence=False)
    return _Table(call.fqn, call.fqn, call.module, w, stats, torchrec=False)


def _torchrec_collections(model: nn.Module) -> dict:
    """TorchRec ``EmbeddingBagCollection`` s / ``EmbeddingCollection`` s by identity: (module, first FQN)."""
    from graphshard.sparse.torchrec_plan import find_modules

    try:
        found = find_modules(model)
    except ImportError:  # TorchRec is not installed: no such modules
        return {}
    return {fqns[0]: (mod, fqns[0]) for mod, fqns in found.values()}


def _torchrec_tables(collections: dict, kjts: dict, optimizer: str) -> list[_Table]:
    """Each table of each TorchRec collection, its ids per sample read from the KJT it got."""
    from graphshard.planning.cost import TableStats
    from graphshard.sparse.torchrec import is_sequence, table_configs

    tables = []
    for fqn, (mod, _) in collections.items():
        kjt = kjts.get(id(mod))
        if kjt is None:
            raise ValueError(f"auto_plan: {fqn} was not called by the example batch; give a batch that reaches it")
        per_key = dict(zip(kjt.keys(), kjt.length_per_key()))
        batch = kjt.stride()
        weights = dict(mod.named_parameters())
        for cfg in table_configs(mod):
            missing = [f for f in cfg.feature_names if f not in per_key]
            if missing:
                raise ValueError(f"auto_plan: the example KJT for {fqn} lacks features {missing} of table {cfg.name!r}")
            ids = sum(per_key[f] for f in cfg.feature_names) / max(batch, 1)
            weight = next(w for n, w in weights.items() if n.split(".")[-2:] == [cfg.name, "weight"])
            stats = TableStats(name=f"{fqn}.{cfg.name}", rows=cfg.num_embeddings, dim=cfg.embedding_dim,
                               features=len(cfg.feature_names), ids_per_sample=ids, batch=batch,
                               weighted=bool(getattr(mod, "is_weighted", lambda: False)()),
                               elem_bytes=weight.element_size(), state_per_row=_state_per_row(optimizer, cfg.embedding_dim),
                               sequence=is_sequence(mod))
            tables.append(_Table(fqn, cfg.name, mod, weight, stats, torchrec=True))
    return tables


def _torchrec_plan(tables: list[_Table], placed: list, hw):
    """TorchRec's ``ShardingPlan`` for the TorchRec collections' tables (None if there are none)."""
    chosen: dict[str, tuple[nn.Module, dict]] = {}
    for t, (option, _) in zip(tables, placed):
        if t.torchrec:
            chosen.setdefault(t.fqn, (t.module, {}))[1][t.name] = option
    if not chosen:
        return None
    from torchrec.distributed.types import ShardingPlan

    from graphshard.planning.embedding_planner import module_plan

    return ShardingPlan({fqn: module_plan(mod, options, hw, "cpu") for fqn, (mod, options) in chosen.items()})


def _place_tables(stats, dp: int, capacity: int) -> list:
    """The embedding planner's placement (largest table first, the option that raises the most
    loaded rank least) in ``capacity`` bytes per rank: (option, cost) per table."""
    from graphshard.planning import embedding_planner
    from graphshard.planning.cost import CW, DP, RW, TW, Hardware

    hw = Hardware(world=dp, local=dp, mem_bw=_MEM_BW, intra_bw=_LINK_BW, inter_bw=_LINK_BW, bwd_multiplier=2.0,
                  capacity=(max(capacity, 0),) * dp)
    kinds = [TW, RW, CW, DP] if dp > 1 else [TW]
    tables = [(t.name, None, SimpleNamespace(name=t.name), t, kinds) for t in stats]
    a = embedding_planner.place(tables, hw, lambda _: 1)  # ShardEmbedding splits columns into any equal blocks
    return [(a.options[i], a.costs[i]) for i in range(len(stats))], hw
