"""graphshard's embedding sharding planner: TorchRec's ``EmbeddingShardingPlanner`` API, one cost model.

``plan(module, sharders)`` places every table of every ``EmbeddingBagCollection`` /
``EmbeddingCollection`` (each module once, however many FQNs reach it) and returns TorchRec's
``ShardingPlan``; ``collective_plan(module, sharders, pg)`` plans on rank 0 and broadcasts, so
every rank gets the same plan (an error on rank 0 is raised on every rank, none is left waiting).

How it plans (the cost model is ``cost_model.py``, written out in docs/cost-model.md):

1. Each table's options: the sharding types its ``ParameterConstraints`` allow (default: all),
   that its sharder knows (on any device) and that graphshard runs (table-, row-, column-wise,
   table-row-wise on several hosts, data-parallel); column-wise into k shards where the dim
   divides and each shard keeps ``min_partition`` columns (TorchRec's default, 128).
2. Proposals: every table under one sharding type (for each type), and a free choice per table.
   Each proposal places the tables largest first, each where it raises the most loaded rank's
   estimated step least (then the sum over ranks), within every rank's memory.
3. The best proposal (smallest most-loaded rank) is improved by moving one table at a time to
   another option while that lowers the estimate.

Its estimates per table and rank are kept (``estimate``) for ``explain``.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field

import torch.distributed as dist
import torch.nn as nn

from graphshard.planning import cost as cost_model
from graphshard.planning.cost import CW, DP, RW, TW, TWRW, Cost, Hardware, Option, TableStats
from graphshard.sparse import torchrec_plan

log = logging.getLogger("graphshard.model_parallel")

SUPPORTED = (TW, RW, CW, TWRW, DP)
"""The sharding types graphshard's DMP runs, in the order proposals are tried."""


@dataclass
class TableEstimate:
    fqn: str
    table: str
    option: Option
    cost: Cost


@dataclass
class PlanEstimate:
    """The planner's estimate of the plan it returned: per table and per rank."""

    tables: list[TableEstimate]
    load: list[float]       # seconds per rank
    memory: list[int]       # bytes per rank
    capacity: list[int]
    batch: int
    measured: list[float] = field(default_factory=list)  # step times seen by DMP (seconds), newest last

    def format(self) -> str:
        lines = [f"embedding plan (graphshard planner; batch {self.batch} per rank; estimates: lookups and "
                 "their input/output distributions, forward + backward):"]
        for t in self.tables:
            busiest = max(t.cost.ranks(), key=t.cost.time)
            mem = max(t.cost.memory.values(), default=0)
            lines.append(f"  {t.fqn}.{t.table}: {t.option.describe()} (kernel {t.option.compute_kernel}); "
                         f"est {t.cost.time(busiest) * 1e3:.3f} ms on rank {busiest} (lookup "
                         f"{t.cost.lookup.get(busiest, 0) * 1e3:.3f}, input {t.cost.input_dist.get(busiest, 0) * 1e3:.3f}, "
                         f"output {t.cost.output_dist.get(busiest, 0) * 1e3:.3f}); {_mib(mem)} per rank at most")
        for r, (load, mem, cap) in enumerate(zip(self.load, self.memory, self.capacity)):
            lines.append(f"  rank {r}: est {load * 1e3:.3f} ms a step, {_mib(mem)} of {_mib(cap)}")
        est = max(self.load) * 1e3
        if self.measured:
            recent = sorted(self.measured[-20:])
            lines.append(f"  step: est {est:.3f} ms (embeddings only), measured {recent[len(recent) // 2] * 1e3:.3f} ms "
                         f"(median of {len(recent)} steps, the whole step)")
        else:
            lines.append(f"  step: est {est:.3f} ms (embeddings only), measured: no step yet")
        return "\n".join(lines)


def _mib(n: float) -> str:
    return f"{n / 2**20:.1f} MiB"


class EmbeddingShardingPlanner:
    """TorchRec's ``EmbeddingShardingPlanner(topology, batch_size, ..., constraints, debug)`` with
    graphshard's cost model. ``topology``: TorchRec's ``Topology`` (default: the process group's
    world, ``LOCAL_WORLD_SIZE`` ranks per host, the CPU); ``batch_size``: samples per rank
    (default TorchRec's 512); ``constraints``: table name -> TorchRec ``ParameterConstraints``
    (``sharding_types``, ``compute_kernels``, ``min_partition``, ``pooling_factors``,
    ``batch_sizes``, ``is_weighted`` are honoured). TorchRec's pluggable parts (enumerator,
    proposer, partitioner, performance model, storage reservation, stats, callbacks, plan loader)
    are refused: graphshard's planner has one cost model."""

    def __init__(self, topology=None, batch_size: int | None = None, enumerator=None, storage_reservation=None,
                 proposer=None, partitioner=None, performance_model=None, stats=None, constraints=None,
                 debug: bool = True, callbacks=None, timeout_seconds=None, plan_loader=None) -> None:
        given = {"enumerator": enumerator, "storage_reservation": storage_reservation, "proposer": proposer,
                 "partitioner": partitioner, "performance_model": performance_model, "stats": stats,
                 "callbacks": callbacks, "plan_loader": plan_loader}
        for name, value in given.items():
            if value is not None:
                raise NotImplementedError(
                    f"EmbeddingShardingPlanner({name}=...): graphshard's planner has one cost model "
                    "(docs/cost-model.md) and no pluggable parts; steer it with `constraints` "
                    "(ParameterConstraints per table) and `topology`"
                )
        self._topology = topology
        self._batch_size = int(batch_size) if batch_size is not None else _torchrec_default("BATCH_SIZE")
        self._constraints = dict(constraints or {})
        self._debug = debug
        self.estimate: PlanEstimate | None = None

    # ---- TorchRec's API ----
    def collective_plan(self, module: nn.Module, sharders=None, pg=None):
        """``plan`` on the group's first rank, broadcast to the others: every rank returns the same plan."""
        pg = pg if pg is not None else dist.group.WORLD
        world = dist.get_world_size(pg)
        if self._topology is not None and self._topology.world_size != world:
            raise ValueError(
                f"the planner's Topology has world_size={self._topology.world_size} but the process group has "
                f"{world} ranks; build the Topology with world_size={world}"
            )
        payload = [None]
        if dist.get_rank(pg) == 0:
            try:
                plan = self.plan(module, sharders, world=world)
                payload = [("plan", plan, self.estimate)]
            except (ValueError, NotImplementedError) as e:
                payload = [("error", e, None)]
        dist.broadcast_object_list(payload, src=dist.get_global_rank(pg, 0), group=pg)
        kind, value, estimate = payload[0]
        if kind == "error":
            raise value
        self.estimate = estimate
        return value

    def plan(self, module: nn.Module, sharders=None, *, world: int | None = None):
        """A TorchRec ``ShardingPlan`` for every embedding module of ``module`` that a sharder handles."""
        from torchrec.distributed.types import ShardingPlan

        topology, hw, tables = self._tables(module, sharders, world)
        assignment = _best(tables, hw, self._min_partition)
        self.estimate = PlanEstimate(
            tables=[TableEstimate(fqn, cfg.name, assignment.options[i], assignment.costs[i])
                    for i, (fqn, _, cfg, _, _) in enumerate(tables)],
            load=assignment.load, memory=assignment.memory, capacity=list(hw.capacity), batch=self._batch_size)
        plans: dict[str, tuple[nn.Module, dict]] = {}
        for i, (fqn, mod, cfg, _, _) in enumerate(tables):
            plans.setdefault(fqn, (mod, {}))[1][cfg.name] = assignment.options[i]
        plan = ShardingPlan({fqn: module_plan(mod, options, hw, topology.compute_device)
                             for fqn, (mod, options) in plans.items()})
        if self._debug:
            log.info("planner:\n%s", self.estimate.format())
        return plan

    def estimate_plan(self, module: nn.Module, plan, sharders=None, *, world: int | None = None) -> PlanEstimate:
        """The cost model's estimate of any TorchRec ``plan`` for ``module`` (a hand plan, TorchRec's
        planner's), on this planner's topology and workload: what ``plan`` estimates for its own."""
        _, hw, tables = self._tables(module, sharders, world)
        found = torchrec_plan.find_modules(module)
        load, memory, estimates = [0.0] * hw.world, [0] * hw.world, []
        for fqn, mod, cfg, stats, _ in tables:
            mp = torchrec_plan.module_plan(found[id(mod)][1], plan)
            if mp is None or cfg.name not in mp:
                raise ValueError(f"the plan has no entry for table {cfg.name!r} of {fqn}")
            option = _option_of(mp[cfg.name], hw)
            cost = cost_model.estimate(stats, option, hw)
            estimates.append(TableEstimate(fqn, cfg.name, option, cost))
            for r in range(hw.world):
                load[r] += cost.time(r)
                memory[r] += cost.memory.get(r, 0)
        return PlanEstimate(tables=estimates, load=load, memory=memory, capacity=list(hw.capacity),
                            batch=self._batch_size)

    def _tables(self, module: nn.Module, sharders, world: int | None):
        """The topology, its cost-model view, and each planned table: (fqn, module, config, stats, kinds)."""
        topology = self._topology or _default_topology(world)
        hw = cost_model.hardware_of(topology)
        sharders = list(sharders) if sharders is not None else _default_sharders()
        tables: list[tuple[str, nn.Module, object, TableStats, list[str]]] = []
        for mod, fqns in torchrec_plan.find_modules(module).values():
            sharder = next((s for s in sharders if isinstance(mod, s.module_type)), None)
            if sharder is None:
                log.warning("planner: no sharder handles %s (%s); it is not planned", fqns[0], type(mod).__name__)
                continue
            fused = torchrec_plan.fused_params_of(mod, fqns[0], sharder)
            for cfg in _table_configs(mod):
                stats = self._stats(mod, cfg, fused)
                tables.append((fqns[0], mod, cfg, stats, self._kinds(fqns[0], mod, cfg, sharder, topology, hw)))
        known = {cfg.name for _, _, cfg, _, _ in tables}
        unknown = sorted(set(self._constraints) - known)
        if unknown:
            raise ValueError(f"ParameterConstraints name table(s) {unknown} that the model does not have; "
                             f"its tables are {sorted(known)}")
        return topology, hw, tables

    # ---- per table ----
    def _min_partition(self, name: str) -> int:
        c = self._constraints.get(name)
        if c is not None and c.min_partition is not None:
            return int(c.min_partition)
        return _torchrec_default("MIN_CW_DIM")

    def _stats(self, mod: nn.Module, cfg, fused: dict) -> TableStats:
        from graphshard.sparse.torchrec import is_sequence

        c = self._constraints.get(cfg.name)
        n = len(cfg.feature_names)
        pooling = list(c.pooling_factors) if c is not None and c.pooling_factors else [1.0]
        if len(pooling) == 1:  # TorchRec's default, [POOLING_FACTOR]: the same for every feature
            pooling = pooling * n
        if len(pooling) != n:
            raise ValueError(f"ParameterConstraints of table {cfg.name!r}: {len(pooling)} pooling_factors for its "
                             f"{n} features {list(cfg.feature_names)}; give one per feature (or one for all)")
        batch = max(c.batch_sizes) if c is not None and c.batch_sizes else self._batch_size
        weighted = bool(c is not None and c.is_weighted) or _is_weighted(mod)
        optimizer = getattr(fused.get("optimizer"), "name", "EXACT_SGD")  # fbgemm's default
        state = 1 if "ROWWISE_ADAGRAD" in optimizer else cfg.embedding_dim if "ADAGRAD" in optimizer else 0
        elem = {"FP32": 4, "FP16": 2, "BF16": 2}.get(getattr(cfg.data_type, "name", "FP32"), 4)
        return TableStats(name=cfg.name, rows=cfg.num_embeddings, dim=cfg.embedding_dim, features=n,
                          ids_per_sample=float(sum(pooling)), batch=batch, weighted=weighted, elem_bytes=elem,
                          state_per_row=state, sequence=is_sequence(mod))

    def _kinds(self, fqn: str, mod: nn.Module, cfg, sharder, topology, hw: Hardware) -> list[str]:
        """The sharding types the table may take, in proposal order; none is an error naming the table."""
        from graphshard.sparse.torchrec import is_sequence

        # the types the sharder knows on any device: TorchRec offers row-wise and table-row-wise on
        # GPUs only; graphshard runs them on the CPU too
        offered = set(sharder.sharding_types(topology.compute_device)) | set(sharder.sharding_types("cuda"))
        c = self._constraints.get(cfg.name)
        asked = list(c.sharding_types) if c is not None and c.sharding_types else list(SUPPORTED)
        kinds = []
        for kind in SUPPORTED:
            if kind not in asked or kind not in offered:
                continue
            if kind == TWRW and (hw.hosts == 1 or is_sequence(mod)):
                continue
            if kind != DP and c is not None and c.compute_kernels and "fused" not in c.compute_kernels:
                continue
            if kind == CW and not _cw_splits(cfg.embedding_dim, hw.world, self._min_partition(cfg.name)):
                continue
            kinds.append(kind)
        if not kinds:
            raise ValueError(
                f"table {cfg.name!r} of {fqn}: no sharding graphshard can run is allowed (constraints: sharding types "
                f"{asked}, compute kernels {list(c.compute_kernels) if c is not None and c.compute_kernels else 'any'}; "
                f"the sharder offers {sorted(offered)}); graphshard runs {list(SUPPORTED)} with the 'fused' kernel "
                "('dense' for data_parallel); column-wise needs a split of the dim into shards of at least "
                "min_partition columns, table-row-wise several hosts"
            )
        return kinds


# ---------------------------------------------------------------------------------------------
# Placement
# ---------------------------------------------------------------------------------------------
@dataclass
class Assignment:
    options: dict[int, Option]
    costs: dict[int, Cost]
    load: list[float]
    memory: list[int]

    def score(self) -> tuple[float, float]:
        return max(self.load), sum(self.load)


class Infeasible(ValueError):
    pass


def _cw_splits(dim: int, world: int, min_partition: int) -> list[int]:
    return [k for k in range(2, world + 1) if dim % k == 0 and dim // k >= min_partition]


def _candidates(stats: TableStats, kinds: list[str], hw: Hardware, load: list[float], min_partition: int):
    ranks = tuple(range(hw.world))
    by_load = sorted(ranks, key=lambda r: (load[r], r))
    for kind in kinds:
        if kind == TW:
            yield from (Option(TW, (r,)) for r in ranks)
        elif kind == RW:
            yield Option(RW, ranks)
        elif kind == CW:
            for k in _cw_splits(stats.dim, hw.world, min_partition):
                yield Option(CW, tuple(sorted(by_load[:k])))
        elif kind == TWRW:
            yield from (Option(TWRW, tuple(range(h * hw.local, (h + 1) * hw.local))) for h in range(hw.hosts))
        elif kind == DP:
            yield Option(DP, ranks)


def _fits(cost: Cost, memory: list[int], hw: Hardware) -> bool:
    return all(memory[r] + m <= hw.capacity[r] for r, m in cost.memory.items())


def place(tables, hw: Hardware, min_partition, only: str | None = None) -> Assignment:
    """Largest table first, each under the option (of ``only``'s type where the table allows it)
    that raises the most loaded rank least, then the sum, within memory."""
    load, memory = [0.0] * hw.world, [0] * hw.world
    options, costs = {}, {}
    size = {i: cost_model.estimate(t[3], Option(TW, (0,)), hw).time(0) for i, t in enumerate(tables)}
    for i in sorted(range(len(tables)), key=lambda i: (-size[i], i)):
        fqn, _, cfg, stats, kinds = tables[i]
        kinds = [only] if only in kinds else kinds
        best = None
        for order, option in enumerate(_candidates(stats, kinds, hw, load, min_partition(cfg.name))):
            cost = cost_model.estimate(stats, option, hw)
            if not _fits(cost, memory, hw):
                continue
            after = [load[r] + cost.time(r) for r in range(hw.world)]
            key = (max(after), sum(after), order)
            if best is None or key < best[0]:
                best = (key, option, cost)
        if best is None:
            raise Infeasible(_infeasible_message(fqn, cfg, stats, kinds, hw, memory, min_partition(cfg.name)))
        _, options[i], costs[i] = best
        for r in range(hw.world):
            load[r] += costs[i].time(r)
            memory[r] += costs[i].memory.get(r, 0)
    return Assignment(options, costs, load, memory)


def _improve(a: Assignment, tables, hw: Hardware, min_partition, passes: int = 4) -> Assignment:
    """Moves one table at a time to another option while that lowers the estimate."""
    for _ in range(passes):
        moved = False
        for i, (_, _, cfg, stats, kinds) in enumerate(tables):
            old = a.costs[i]
            load = [a.load[r] - old.time(r) for r in range(hw.world)]
            memory = [a.memory[r] - old.memory.get(r, 0) for r in range(hw.world)]
            for option in _candidates(stats, kinds, hw, load, min_partition(cfg.name)):
                cost = cost_model.estimate(stats, option, hw)
                if option == a.options[i] or not _fits(cost, memory, hw):
                    continue
                after = [load[r] + cost.time(r) for r in range(hw.world)]
                if (max(after), sum(after)) < tuple(v - 1e-15 for v in a.score()):
                    a.options[i], a.costs[i] = option, cost
                    a.load = after
                    a.memory = [memory[r] + cost.memory.get(r, 0) for r in range(hw.world)]
                    moved = True
                    break
        if not moved:
            break
    return a


def _best(tables, hw: Hardware, min_partition) -> Assignment:
    proposals, error = [], None
    for only in (None,) + SUPPORTED:
        if only is not None and not any(only in t[4] for t in tables):
            continue
        try:
            proposals.append(place(tables, hw, min_partition, only))
        except Infeasible as e:
            error = error or e
    if not proposals:
        raise error
    best = min(proposals, key=Assignment.score)  # first of equals: the free proposal, then SUPPORTED's order
    return _improve(best, tables, hw, min_partition)


def _infeasible_message(fqn, cfg, stats, kinds, hw: Hardware, memory, min_partition) -> str:
    need = min((max(cost_model.estimate(stats, o, hw).memory.values()) for o in
                _candidates(stats, kinds, hw, [0.0] * hw.world, min_partition)), default=0)
    free = max(c - m for c, m in zip(hw.capacity, memory))
    return (f"the tables do not fit: table {cfg.name!r} of {fqn} needs at least {_mib(need)} on a rank "
            f"(sharding types allowed: {kinds}), and the most free memory left on a rank is {_mib(free)} "
            f"(of {_mib(max(hw.capacity))}); raise the Topology's ddr_cap/hbm_cap, add ranks, or allow row-wise "
            "sharding in its ParameterConstraints")


# ---------------------------------------------------------------------------------------------
# TorchRec types
# ---------------------------------------------------------------------------------------------
def module_plan(mod: nn.Module, options: dict, hw: Hardware, device_type: str) -> dict:
    from torchrec.distributed.sharding_plan import (
        column_wise,
        construct_module_sharding_plan,
        data_parallel,
        row_wise,
        table_row_wise,
        table_wise,
    )

    per_param = {}
    for name, o in options.items():
        if o.sharding_type == TW:
            per_param[name] = table_wise(rank=o.ranks[0], compute_kernel="fused")
        elif o.sharding_type == RW:
            per_param[name] = row_wise(compute_kernel="fused")
        elif o.sharding_type == CW:
            per_param[name] = column_wise(ranks=list(o.ranks), compute_kernel="fused")
        elif o.sharding_type == TWRW:
            per_param[name] = table_row_wise(host_index=hw.host_of(o.ranks[0]))
        else:
            per_param[name] = data_parallel()
    plan = construct_module_sharding_plan(mod, per_param_sharding=per_param, local_size=hw.local,
                                          world_size=hw.world, device_type=device_type)
    for ps in plan.values():  # table_row_wise() takes no kernel; every sharded table runs fused
        if ps.sharding_type != DP:
            ps.compute_kernel = "fused"
    return plan


def _option_of(ps, hw: Hardware) -> Option:
    """A TorchRec ``ParameterSharding`` -> the cost model's option (its shards' ranks, in column order)."""
    kind = str(ps.sharding_type)
    if kind in (RW, DP):
        return Option(kind, tuple(range(hw.world)))
    if kind in (CW, "table_column_wise"):  # TorchRec's table-column-wise: column-wise's program, on one host
        shards = sorted(ps.sharding_spec.shards, key=lambda md: md.shard_offsets[1])
        return Option(CW, tuple(md.placement.rank() for md in shards))
    return Option(kind, tuple(sorted(set(ps.ranks))))


def _table_configs(mod: nn.Module) -> list:
    from graphshard.sparse.torchrec import table_configs

    return table_configs(mod)


def _is_weighted(mod: nn.Module) -> bool:
    f = getattr(mod, "is_weighted", None)
    return bool(f()) if callable(f) else False


def _default_sharders() -> list:
    from torchrec.distributed.embedding import EmbeddingCollectionSharder
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder

    return [EmbeddingBagCollectionSharder(), EmbeddingCollectionSharder()]


def _torchrec_default(name: str):
    from torchrec.distributed.planner import constants

    return getattr(constants, name)


def _default_topology(world: int | None):
    """TorchRec's default: the process group's world, ``LOCAL_WORLD_SIZE`` ranks per host, the CPU."""
    if world is None:
        if not dist.is_initialized():
            raise ValueError("EmbeddingShardingPlanner: no topology given and no process group; pass "
                             "topology=Topology(world_size=..., compute_device='cpu')")
        world = dist.get_world_size()
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    from torchrec.distributed.planner import types

    factory = getattr(types, "TopologyFactory", None)
    if factory is not None:
        return factory.create_topology(types.TrainerConfig(world_size=world, local_world_size=local),
                                       kernel_config=types.KernelConfig(compute_device="cpu"))
    return types.Topology(world_size=world, local_world_size=local, compute_device="cpu")
