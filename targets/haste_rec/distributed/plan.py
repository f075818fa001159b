"""The sharding plan: which rank owns which embedding rows and which samples of the global batch.

Embeddings are sharded table-wise (table t on rank t % world size) or row-wise (every table's rows
split over all ranks in contiguous blocks of ceil(rows / world size), rank r holding the r-th block;
the last blocks may be shorter or empty), as TorchRec's two basic schemes. The HASTE tail is
replicated, or sharded by label groups (each rank whole groups, `group_range`).

The plan is configuration, not code: each part of the model names its scheme, and a scheme that is
not implemented yet is a ConfigError with one sentence for the user, never a silent fallback.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from targets.haste_rec.data.batch import Batch
from targets.haste_rec.data.loader import BatchSource
from targets.haste_rec.knobs import KNOB_SPACE
from targets.protocol import ConfigError

EMBEDDING_SHARDINGS = KNOB_SPACE["embedding_sharding"].choices
TAIL_SHARDINGS = KNOB_SPACE["tail_sharding"].choices


def check_ranked_config(config) -> None:
    """A ConfigError for a knob value this torch.distributed path has none for (``Knob.single_process``), on any
    world size: one sentence before training, not a run that quietly measures without it."""
    KNOB_SPACE.check_ranks(config, ranks=2)


@dataclass(frozen=True)
class ShardingPlan:
    """Table t lives on rank t % world_size (table-wise), or each rank holds a block of every table's
    rows (row-wise, `row_range`); the encoder and the HASTE head are replicated on every rank (data
    parallel), and so is the HASTE tail, unless tail_sharding label-groups gives each rank whole tail
    groups (`group_range`)."""

    world_size: int
    num_tables: int
    embedding_sharding: str = "table-wise"
    tail_sharding: str = "replicated"

    def __post_init__(self) -> None:
        if self.world_size < 1 or self.num_tables < 1:
            raise ConfigError(f"a sharding plan needs at least one rank and one table, not {self.world_size} "
                              f"rank(s) and {self.num_tables} table(s)")
        for name, known in (("embedding_sharding", EMBEDDING_SHARDINGS), ("tail_sharding", TAIL_SHARDINGS)):
            if getattr(self, name) not in known:
                raise ConfigError(f"{name} must be one of {', '.join(known)}, not {getattr(self, name)!r}")

    def table_owner(self, table: int) -> int:
        """The rank that holds `table` whole (table-wise)."""
        return table % self.world_size

    def tables_of(self, rank: int) -> list[int]:
        """The tables `rank` holds rows of, in table order: table-wise its own (none when there are more
        ranks than tables), row-wise every table (a block of each)."""
        if self.embedding_sharding == "row-wise":
            return list(range(self.num_tables))
        return [t for t in range(self.num_tables) if self.table_owner(t) == rank]

    def owner_order(self) -> list[int]:
        """All tables grouped by owner (rank 0's first), the order in which the table-wise exchanges lay
        them out."""
        return [t for rank in range(self.world_size) for t in self.tables_of(rank)]

    def row_block(self, rows: int) -> int:
        """Rows per block of a table of `rows` rows (row-wise): ceil(rows / world size), so that the
        owner of row i is i // row_block, one integer division per id in the input dist."""
        return -(-rows // self.world_size)

    def row_range(self, rows: int, rank: int) -> tuple[int, int]:
        """The rows [start, stop) of a table of `rows` rows that `rank` holds (row-wise): contiguous
        blocks in rank order, so every row has exactly one owner; with more ranks than rows, or an
        uneven split, the last ranks' blocks are shorter or empty (start == stop == rows)."""
        block = self.row_block(rows)
        start = min(rows, rank * block)
        return start, min(rows, start + block)

    def group_range(self, rank: int, num_groups: int) -> range:
        """The tail groups `rank` owns under label-groups: contiguous blocks in rank order, the first
        num_groups % world_size ranks one group more (none when there are more ranks than groups)."""
        base, extra = divmod(num_groups, self.world_size)
        start = rank * base + min(rank, extra)
        return range(start, start + base + (rank < extra))

    def to_dict(self) -> dict:
        return {**asdict(self), "tables_of_rank": [self.tables_of(r) for r in range(self.world_size)]}


def sample_counts(batch_size: int, world_size: int) -> list[int]:
    """Samples of a global batch per rank: contiguous slices, the first batch_size % world_size ranks
    one larger, so rank r's samples follow rank r-1's and the global order is the single-process order."""
    if batch_size < world_size:
        raise ConfigError(f"a batch of {batch_size} samples cannot be split over {world_size} ranks: every rank "
                          f"needs at least one sample")
    base, extra = divmod(batch_size, world_size)
    return [base + (r < extra) for r in range(world_size)]


def sample_slice(batch_size: int, world_size: int, rank: int) -> tuple[int, int]:
    counts = sample_counts(batch_size, world_size)
    start = sum(counts[:rank])
    return start, start + counts[rank]


class RankSamples:
    """A rank's share of each global training batch (a BatchSource for the loader).

    Every batch is a pure function of (seed, index), so each rank builds the global batch and keeps
    its slice: the global batch is the single-process batch by construction. A real input pipeline
    would read only its shard; the slice is the same.
    """

    def __init__(self, source: BatchSource, start: int, stop: int):
        self.source, self.start, self.stop = source, start, stop

    def train_batch(self, index: int) -> Batch:
        return self.source.train_batch(index).slice(self.start, self.stop)
