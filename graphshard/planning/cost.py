"""The embedding planner's cost model (docs/cost-model.md writes it out with its reasons).

For one table under one sharding option, each rank's share of a training step:

- *lookup*: the rows the rank's kernel reads in the forward, ``ids x dim x element bytes``, times
  ``1 + bwd_compute_multiplier`` for the fused backward, over the memory bandwidth;
- *input distribution*: the ids (8 bytes, 12 weighted) and bag lengths (8 bytes) the rank sends
  and receives, over the link bandwidth;
- *output distribution*: the pooled rows (4 bytes a value) the rank sends and receives, forward
  and backward, over the link bandwidth;

and the memory it holds: its shard of the weights and of the fused optimizer's state
(row-wise Adagrad: one value per row; Adagrad: one per weight; SGD: none). A data-parallel
table is whole on every rank, with its gradient (it is trained by the dense optimizer).

The bandwidths and the backward multiplier are TorchRec's ``Topology``'s (its defaults, or the
user's): the planner ranks options, it does not predict a machine's wall-clock time.
"""

from __future__ import annotations

from dataclasses import dataclass, field

TW, RW, CW, TWRW, DP = "table_wise", "row_wise", "column_wise", "table_row_wise", "data_parallel"
ID_BYTES, WEIGHT_BYTES, LENGTH_BYTES, POOLED_BYTES = 8, 4, 8, 4


@dataclass(frozen=True)
class TableStats:
    """What the cost of one table depends on."""

    name: str
    rows: int
    dim: int
    features: int          # features looked up in the table (bags per sample)
    ids_per_sample: float  # the features' pooling factors, summed
    batch: int             # samples per rank
    weighted: bool         # per-sample weights travel with the ids
    elem_bytes: int        # bytes of one weight
    state_per_row: int     # optimizer state values per row (0, 1 or dim)
    sequence: bool         # an EmbeddingCollection's table: rows per id, not per bag


@dataclass(frozen=True)
class Hardware:
    """The planner's view of the machines (bytes per second, bytes)."""

    world: int
    local: int                  # ranks per host
    mem_bw: float
    intra_bw: float
    inter_bw: float
    bwd_multiplier: float
    capacity: tuple[int, ...]   # per rank: memory for tables

    @property
    def hosts(self) -> int:
        return self.world // self.local

    def host_of(self, rank: int) -> int:
        return rank // self.local

    def link_bw(self) -> float:
        """The link an exchange among all ranks is limited by: within the host, or across hosts."""
        return self.intra_bw if self.hosts == 1 else self.inter_bw


@dataclass(frozen=True)
class Option:
    """One way to shard a table: the sharding type and the ranks of its shards (in column order for
    column-wise; a host's ranks for table-row-wise; every rank for row-wise and data-parallel)."""

    sharding_type: str
    ranks: tuple[int, ...]

    @property
    def compute_kernel(self) -> str:
        return "dense" if self.sharding_type == DP else "fused"

    def describe(self) -> str:
        if self.sharding_type in (RW, DP):
            return self.sharding_type
        return f"{self.sharding_type} on {list(self.ranks)}"


@dataclass
class Cost:
    """Per rank: seconds a step (by part) and bytes held."""

    lookup: dict[int, float] = field(default_factory=dict)
    input_dist: dict[int, float] = field(default_factory=dict)
    output_dist: dict[int, float] = field(default_factory=dict)
    memory: dict[int, int] = field(default_factory=dict)

    def add(self, part: str, rank: int, value) -> None:
        d = getattr(self, part)
        d[rank] = d.get(rank, 0) + value

    def time(self, rank: int) -> float:
        return self.lookup.get(rank, 0.0) + self.input_dist.get(rank, 0.0) + self.output_dist.get(rank, 0.0)

    def ranks(self) -> set[int]:
        return set(self.lookup) | set(self.input_dist) | set(self.output_dist) | set(self.memory)


def _lookup_s(ids: float, dim: int, t: TableStats, hw: Hardware) -> float:
    return ids * dim * t.elem_bytes * (1 + hw.bwd_multiplier) / hw.mem_bw


def _weights_bytes(rows: float, dim: int, t: TableStats) -> int:
    state = t.state_per_row if t.state_per_row <= 1 else dim  # Adagrad's state is per weight, so per shard column
    return int(rows * dim * t.elem_bytes + rows * state * 4)


def estimate(t: TableStats, option: Option, hw: Hardware) -> Cost:
    """Each rank's share of a step for ``t`` under ``option`` (see the module docstring)."""
    W, B, n = hw.world, t.batch, t.features
    ids_rank = B * t.ids_per_sample            # ids this rank's samples give the table
    ids_all = W * ids_rank                     # the global batch's
    id_bytes = ID_BYTES + (WEIGHT_BYTES if t.weighted else 0)
    sent_ids = ids_rank * id_bytes + B * n * LENGTH_BYTES   # one rank's ids and lengths for the table
    out_rows = ids_rank if t.sequence else B * n            # rows a rank's samples get back
    bw = hw.link_bw()
    c = Cost()
    kind = option.sharding_type
    if kind in (TW, CW):
        width = t.dim // len(option.ranks)
        for r in option.ranks:
            c.add("lookup", r, _lookup_s(ids_all, width, t, hw))
            c.add("memory", r, _weights_bytes(t.rows, width, t))
        for r in range(W):
            shards_here = option.ranks.count(r)
            others = len(option.ranks) - shards_here
            # every rank sends its ids to each shard's rank; a shard's rank receives every other rank's
            c.add("input_dist", r, (others * sent_ids + shards_here * (W - 1) * sent_ids) / bw)
            # pooled rows: forward to the samples' ranks, gradients back (x2)
            c.add("output_dist", r, 2 * (others * out_rows * width + shards_here * (W - 1) * out_rows * width)
                  * POOLED_BYTES / bw)
    elif kind == RW:
        for r in range(W):
            c.add("lookup", r, _lookup_s(ids_all / W, t.dim, t, hw))
            c.add("memory", r, _weights_bytes(t.rows / W, t.dim, t))
            c.add("input_dist", r, 2 * sent_ids * (W - 1) / W / bw)
            # forward reduce-scatter of every rank's partial sums, backward all-gather (send + receive each)
            c.add("output_dist", r, 4 * (W - 1) * out_rows * t.dim * POOLED_BYTES / bw)
    elif kind == TWRW:
        L = len(option.ranks)
        for r in option.ranks:
            c.add("lookup", r, _lookup_s(ids_all / L, t.dim, t, hw))
            c.add("memory", r, _weights_bytes(t.rows / L, t.dim, t))
            c.add("input_dist", r, (W - 1) * sent_ids / L / hw.link_bw())
            # within the host: reduce-scatter and all-gather of W x B partial rows; then across hosts
            intra = 4 * (L - 1) / L * W * out_rows * t.dim * POOLED_BYTES / hw.intra_bw
            inter = 2 * (hw.hosts - 1) * out_rows * t.dim * POOLED_BYTES / hw.inter_bw
            c.add("output_dist", r, intra + inter)
        for r in range(W):
            if r not in option.ranks:
                c.add("input_dist", r, sent_ids / bw)
                c.add("output_dist", r, 2 * out_rows * t.dim * POOLED_BYTES / bw)
    elif kind == DP:
        for r in range(W):
            if t.sequence:  # looked up locally; DDP all-reduces the whole table's gradient
                c.add("lookup", r, _lookup_s(ids_rank, t.dim, t, hw))
                c.add("output_dist", r, 2 * (W - 1) / W * t.rows * t.dim * t.elem_bytes / bw)
            else:  # every rank looks up every rank's ids and computes the whole gradient
                c.add("lookup", r, _lookup_s(ids_all, t.dim, t, hw))
                c.add("input_dist", r, 2 * (W - 1) * sent_ids / bw)
                c.add("output_dist", r, (W - 1) * out_rows * t.dim * POOLED_BYTES / bw)
            c.add("memory", r, 2 * t.rows * t.dim * t.elem_bytes)  # weights and their gradient
    else:
        raise AssertionError(kind)
    return c


def hardware_of(topology) -> Hardware:
    """A TorchRec ``Topology`` -> the cost model's view (its bandwidths are bytes per ms)."""
    cpu = topology.compute_device == "cpu"
    mem_bw = topology.ddr_mem_bw if cpu else topology.hbm_mem_bw
    capacity = tuple(int(d.storage.ddr if cpu else d.storage.hbm) for d in topology.devices)
    return Hardware(world=topology.world_size, local=topology.local_world_size, mem_bw=mem_bw * 1e3,
                    intra_bw=topology.intra_host_bw * 1e3, inter_bw=topology.inter_host_bw * 1e3,
                    bwd_multiplier=float(topology.bwd_compute_multiplier), capacity=capacity)
