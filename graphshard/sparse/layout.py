"""Where each embedding table's rows and columns live: the facts the sharded lookup is built from.

A *collection* is one embedding module: tables, each looked up by one or more features (a feature
may be looked up by several tables: TorchRec names each lookup's output ``feature@table``). A
pooled collection (TorchRec's ``EmbeddingBagCollection``) pools each feature's ids per sample;
a sequence collection (``EmbeddingCollection``, ``sequence=True``) returns one row per id. Each table has a sharding type and its
shards (a rank, a block of rows, a block of columns):

- ``table_wise``: one shard, the whole table, on one rank;
- ``column_wise``: shards of whole rows and a block of columns each, on any ranks (several blocks on
  one rank, blocks of unequal width);
- ``table_column_wise``: column-wise with every block on one host (TorchRec's; the program is
  column-wise's);
- ``row_wise``: one block of rows per rank (``ceil(rows / world)`` each, the last one shorter);
- ``table_row_wise``: the ranks are hosts of ``local_world`` ranks; the table lives on one
  host, one block of rows per rank of that host (``ceil(rows / local_world)`` each);
- ``data_parallel``: the table replicated, looked up locally, its gradient averaged (or, with
  ``dp_gathered``, every rank's bags looked up on every rank, so each computes the whole
  batch's gradient itself and nothing is reduced).

The layout is the only place these facts live; the sharded program (``program.py``) and the
state dict read it.
"""

from __future__ import annotations

from dataclasses import dataclass

SHARDING_TYPES = ("table_wise", "column_wise", "table_column_wise", "row_wise", "table_row_wise", "data_parallel")

COLUMN_WISE = ("column_wise", "table_column_wise")
"""The sharding types whose shards are column blocks of whole rows, looked up where they live (one all-to-all
each way). TorchRec's table-column-wise keeps a table's blocks on one host; its data flow is column-wise's."""


@dataclass(frozen=True)
class TableShard:
    rank: int
    row_offset: int
    rows: int
    col_offset: int
    cols: int


@dataclass(frozen=True)
class TableLayout:
    name: str
    num_embeddings: int
    embedding_dim: int
    features: tuple[str, ...]
    pooling: str  # "sum" | "mean"
    sharding_type: str
    shards: tuple[TableShard, ...]

    @property
    def fused(self) -> bool:
        """Looked up by a fused TBE (a sharded table); data-parallel tables are dense parameters."""
        return self.sharding_type != "data_parallel"

    def check(self, world: int, local_world: int | None = None) -> None:
        where = f"table {self.name!r}"
        if self.sharding_type not in SHARDING_TYPES:
            raise NotImplementedError(
                f"{where}: sharding type {self.sharding_type!r} is not supported; use one of {SHARDING_TYPES}"
            )
        for s in self.shards:
            if not 0 <= s.rank < world:
                raise ValueError(f"{where}: a shard is placed on rank {s.rank}, outside the world of {world} ranks")
        if self.sharding_type == "table_wise" and (
                len(self.shards) != 1 or self.shards[0].rows != self.num_embeddings
                or self.shards[0].cols != self.embedding_dim):
            raise ValueError(f"{where}: table-wise sharding places the whole table on one rank")
        if self.sharding_type == "table_column_wise" and local_world:
            hosts = {s.rank // local_world for s in self.shards}
            if len(hosts) != 1:
                raise ValueError(f"{where}: table-column-wise shards on ranks {sorted(s.rank for s in self.shards)} "
                                 f"span hosts {sorted(hosts)} of {local_world} ranks each; the blocks of a "
                                 "table-column-wise table live on one host (use column_wise to spread them)")
        if self.sharding_type in COLUMN_WISE:
            cols = sorted((s.col_offset, s.cols) for s in self.shards)
            at = 0
            for off, n in cols:
                if off != at or n <= 0:
                    break
                at += n
            if at != self.embedding_dim or any(s.rows != self.num_embeddings for s in self.shards):
                raise ValueError(
                    f"{where}: column-wise shards {[(o, n) for o, n in cols]} do not tile the embedding dim "
                    f"{self.embedding_dim}; the column split must divide the dim into whole blocks"
                )
        if self.sharding_type in ("row_wise", "table_row_wise"):
            ranks = [s.rank for s in sorted(self.shards, key=lambda s: s.row_offset)]
            if self.sharding_type == "row_wise" and ranks != list(range(world)):
                raise NotImplementedError(
                    f"{where}: row-wise sharding needs row block i on rank i for every rank, got ranks {ranks}"
                )
            if self.sharding_type == "table_row_wise":
                host = ranks[0] // local_world if local_world else 0
                if not local_world or ranks != list(range(host * local_world, (host + 1) * local_world)):
                    raise NotImplementedError(
                        f"{where}: table-row-wise sharding needs row block i on local rank i of one host "
                        f"({local_world} ranks per host, LOCAL_WORLD_SIZE), got ranks {ranks}"
                    )
            block = self.row_block
            for i, s in enumerate(sorted(self.shards, key=lambda s: s.row_offset)):
                want = min(block, self.num_embeddings - i * block)
                if s.row_offset != i * block or s.rows != want or want <= 0:
                    raise NotImplementedError(
                        f"{where}: row-wise shards must be blocks of ceil(rows / ranks) = {block} rows in order "
                        f"(the last one shorter, none empty); got rows {s.row_offset}..{s.row_offset + s.rows - 1} "
                        f"as block {i}"
                    )

    @property
    def row_block(self) -> int:
        return max(s.rows for s in self.shards)

    def host(self, local_world: int) -> int:
        """The host a table-row-wise table lives on."""
        return self.shards[0].rank // local_world

    def shard_on(self, rank: int) -> list[TableShard]:
        return [s for s in self.shards if s.rank == rank]


@dataclass(frozen=True)
class CollectionLayout:
    """One embedding collection on one rank of ``world`` (c10d group ``group``)."""

    key: str
    fqns: tuple[str, ...]
    tables: tuple[TableLayout, ...]
    weighted: bool
    world: int
    rank: int
    group: str
    local_world: int | None = None  # ranks per host (table-row-wise)
    host_group: str | None = None   # c10d group of this rank's host (table-row-wise: reduce-scatter)
    cross_group: str | None = None  # c10d group of the ranks with this rank's local index (table-row-wise: all-to-all)
    global_ranks: tuple[int, ...] | None = None  # the group's ranks in the default group (None: the same)
    all_groups: tuple[tuple[int, ...], ...] | None = None  # every group along the axis (N-D mesh), same on all ranks
    sequence: bool = False  # one row per id (EmbeddingCollection), not pooled per sample
    dp_gathered: bool = False  # data-parallel tables look up every rank's bags (program._gathered_bags)
    attr: str = "embedding_bags"  # the module's table container, as the state dict names it
    kernel: str = "fbgemm"  # the sharded tables' TBE kernel: fbgemm's ('fused') or graphshard's Triton ('fused_triton')
    device: str = "cpu"  # the device type the tables and the ids live on
    kernel_note: str = ""  # why ``kernel`` is not the one the plan asked for (logged; listed by explain)

    @property
    def kjt_ops(self):
        """The program's KJT ops: fbgemm's beside fbgemm's TBE, graphshard's torch ones beside the Triton TBE."""
        from graphshard.ops.kjt import kjt_ops

        return kjt_ops(self.kernel)

    @property
    def hosts(self) -> int:
        return self.world // (self.local_world or self.world)

    @property
    def features(self) -> tuple[str, ...]:
        """The features in output order: each table's, tables in order (TorchRec's EBC order)."""
        return tuple(f for t in self.tables for f in t.features)

    @property
    def dims(self) -> tuple[int, ...]:
        return tuple(t.embedding_dim for t in self.tables for _ in t.features)

    @property
    def total_dim(self) -> int:
        return sum(self.dims)

    def check(self) -> None:
        for t in self.tables:
            if self.sequence and t.sharding_type == "table_row_wise":
                raise NotImplementedError(
                    f"{self.fqns[0]}: table {t.name!r} is table_row_wise; sequence embeddings (EmbeddingCollection) "
                    "are sharded table_wise, column_wise, row_wise or data_parallel (as TorchRec's sharder allows)"
                )
            t.check(self.world, self.local_world)
            if self.kernel == "fbgemm" and t.fused:
                widths = sorted({s.cols for s in t.shards})
                if any(w % 4 for w in widths):
                    raise ValueError(
                        f"{self.fqns[0]}: table {t.name!r} is {t.sharding_type} in shards {widths} wide; fbgemm's "
                        "TBE (compute_kernel 'fused') needs widths that are multiples of 4. Use graphshard's Triton "
                        "TBE, which takes any width (compute_kernel='fused_triton'; ShardEmbedding(kernel='triton')), "
                        "or a column split into multiples of 4"
                    )
            if self.sequence and t.embedding_dim != self.tables[0].embedding_dim:
                raise ValueError(
                    f"{self.fqns[0]}: table {t.name!r} has dim {t.embedding_dim}, table {self.tables[0].name!r} "
                    f"{self.tables[0].embedding_dim}; the tables of a sequence collection share one dim"
                )
            if self.weighted and t.pooling == "mean":
                raise NotImplementedError(
                    f"{self.fqns[0]}: table {t.name!r} pools by mean with per-sample weights; "
                    "weighted lookups pool by sum (torch.nn.EmbeddingBag refuses the same)"
                )
