"""The sharding plan: which rank owns which embedding table and which samples of the global batch.

The plan is configuration, not code: each part of the model names its scheme, and a scheme that is
not implemented yet is a ConfigError with one sentence for the user, never a silent fallback.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from targets.haste_rec.batch import Batch
from targets.haste_rec.knobs import KNOB_SPACE
from targets.haste_rec.loader import BatchSource
from targets.protocol import ConfigError

EMBEDDING_SHARDINGS = KNOB_SPACE["embedding_sharding"].choices
TAIL_SHARDINGS = KNOB_SPACE["tail_sharding"].choices


@dataclass(frozen=True)
class ShardingPlan:
    """Table t lives on rank t % world_size (table-wise); the dense parts, the HASTE tail included,
    are replicated on every rank (data parallel)."""

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
        if self.embedding_sharding == "row-wise":
            raise ConfigError("embedding_sharding row-wise is not implemented yet: the distributed trainer shards "
                              "embeddings table-wise only (table t on rank t % world size)")
        if self.tail_sharding == "label-groups":
            raise ConfigError("tail_sharding label-groups is not implemented yet: the distributed trainer replicates "
                              "the HASTE output layer on every rank (tail_sharding replicated)")

    def table_owner(self, table: int) -> int:
        return table % self.world_size

    def tables_of(self, rank: int) -> list[int]:
        """The tables `rank` owns, in table order (none when there are more ranks than tables)."""
        return [t for t in range(self.num_tables) if self.table_owner(t) == rank]

    def owner_order(self) -> list[int]:
        """All tables grouped by owner (rank 0's first), the order in which the exchanges lay them out."""
        return [t for rank in range(self.world_size) for t in self.tables_of(rank)]

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
