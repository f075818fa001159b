"""Sharded embeddings: each rank stores and updates only the rows it owns, behind the two exchanges.

The owned rows are an ordinary `EmbeddingStore` (every placement, grad mode and backend knob
applies unchanged), fed the global batch's bags of those rows by the input dist: table-wise whole
tables (`OwnedTables`), row-wise one block of every table (`OwnedRowBlocks`, each block a table of
the store, ids local to it). Since the owner pools over the whole global batch, backward gives it
each row's total gradient over that batch and row-wise Adagrad runs once per row, exactly as in the
single-process trainer (row-wise, the pooled vectors are partial sums, added over the owners by the
output dist).
"""

from __future__ import annotations

import contextlib
from collections import deque
from typing import Any, Callable, Sequence

import torch
from torch import nn

from targets.haste_rec.data.batch import Batch
from targets.haste_rec.distributed.exchange import (RowWiseInputDist, RowWiseOutputDist, TableWiseInputDist,
                                                    TableWiseOutputDist, sum_over_ranks)
from targets.haste_rec.distributed.plan import ShardingPlan
from targets.haste_rec.embeddings.embedding_config import EmbeddingConfig
from targets.haste_rec.embeddings.embeddings import EmbeddingStore
from targets.haste_rec.embeddings.row_ops import TableLayout
from targets.digest import sq_norm
from targets.protocol import ConfigError


class OwnedTables(EmbeddingStore):
    """The store of some of the tables, each initialised exactly as the single-process store draws it.

    TableLayout draws table t from the generator of (seed, t); a layout of ALL tables in which the
    tables owned elsewhere have zero rows draws the owned ones from their global t and nothing else.
    (The base class has drawn its local layout already; that draw is replaced, at the cost of drawing
    this rank's tables twice at set-up.)
    """

    def __init__(self, table_rows: Sequence[int], owned: Sequence[int], dim: int, cfg: EmbeddingConfig,
                 device: torch.device, seed: int, **kwargs: Any):
        self.global_rows, self.owned, self.init_seed = tuple(table_rows), tuple(owned), seed
        super().__init__([table_rows[t] for t in owned], dim, cfg, device, seed, **kwargs)

    def _build(self, init: torch.Tensor):
        padded = TableLayout(tuple(rows if t in self.owned else 0 for t, rows in enumerate(self.global_rows)))
        init.copy_(padded.initial_rows(self.dim, self.cfg.init_std, self.init_seed, self.device, init.device))
        return super()._build(init)


class OwnedRowBlocks(EmbeddingStore):
    """The store of one block of rows [start, stop) of every table (row-wise), each block initialised
    exactly as the single-process store draws those rows.

    Table t is drawn whole from the generator of (seed, t), by a layout of ALL tables in which the
    others have zero rows, and its block sliced out: one table at a time, so that set-up holds at most
    one whole table beside the blocks. (The base class has drawn its local layout already; that draw
    is replaced.)
    """

    def __init__(self, table_rows: Sequence[int], ranges: Sequence[tuple[int, int]], dim: int, cfg: EmbeddingConfig,
                 device: torch.device, seed: int, **kwargs: Any):
        self.global_rows, self.ranges, self.init_seed = tuple(table_rows), tuple(ranges), seed
        super().__init__([stop - start for start, stop in ranges], dim, cfg, device, seed, **kwargs)

    def _build(self, init: torch.Tensor):
        for t, (block, (start, stop)) in enumerate(zip(self.layout.split(init), self.ranges)):
            alone = TableLayout(tuple(rows if u == t else 0 for u, rows in enumerate(self.global_rows)))
            block.copy_(alone.initial_rows(self.dim, self.cfg.init_std, self.init_seed, self.device)[start:stop])
        return super()._build(init)


def _no_phase(name: str):
    return contextlib.nullcontext()


class ShardedEmbeddings(nn.Module):
    """Pooled embeddings [this rank's samples, T * dim] of all T tables, from the rows this rank owns: input
    dist, store, output dist. The schemes below differ only in how they build the three."""

    def __init__(self, store: EmbeddingStore | None, input_dist: Callable, output_dist: Callable,
                 device: torch.device, phase: Callable, cfg: EmbeddingConfig):
        super().__init__()
        self.store, self.input_dist, self.output_dist = store, input_dist, output_dist
        self.device, self.phase = device, phase
        # cache_prefetch: every rank alike (a rank that owns no table still takes part in each input dist)
        self.prefetches = cfg.prefetches
        self._exchanged: deque[tuple[Batch, Batch]] = deque()  # (batch, its owned bags), input-dist'ed ahead

    def prefetch_next(self, batch: Batch, samples: list[int]) -> None:
        """The batch the next step takes, input-dist'ed now (a collective: every rank, in the same order), so that
        its owner's store prepares its lookup on the prefetch thread while this step runs, as the single-process
        store does (``cache_prefetch``); the next ``forward`` of the same batch takes its owned bags from here."""
        with self.phase("input_dist"):
            owned_batch = self.input_dist(batch, samples)
        self._exchanged.append((batch, owned_batch))
        if self.store is not None:
            self.store.prefetch_next(owned_batch)

    def forward(self, batch: Batch, samples: list[int]) -> torch.Tensor:
        """`batch` is this rank's slice of a batch split over the ranks as `samples` says (one count per rank)."""
        with self.phase("input_dist"):
            if self._exchanged and self._exchanged[0][0] is batch:
                owned_batch = self._exchanged.popleft()[1]
            else:
                owned_batch = self.input_dist(batch, samples)
        with self.phase("embed"):
            pooled = None if self.store is None else self.store(owned_batch)
        with self.phase("output_dist"):
            return self.output_dist(pooled, samples)

    def optimizer_step(self) -> None:
        if self.store is not None:
            self.store.optimizer_step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self.store is not None:
            self.store.zero_grad()

    # -- collective reads (every rank must call them) -------------------------------------------
    def grad_sq_norm(self) -> float:
        """Squared norm of all tables' gradients since zero_grad, summed over the owners."""
        return sum_over_ranks(0.0 if self.store is None else self.store.grad_sq_norm(), self.device)

    def table_sq_norm(self) -> float:
        """Squared norm of all tables' weights, summed over the owners."""
        tables = [] if self.store is None else self.store.current_tables()
        return sum_over_ranks(sum(sq_norm(t) for t in tables), self.device)

    def counters(self) -> dict[str, float]:
        """This rank's store counters (cache traffic of its rows) and the bytes its forward all-to-alls
        sent (the backward sends as many pooled-gradient bytes as the forward received)."""
        own = {} if self.store is None else self.store.counters()
        return {**own, "a2a_bytes_sent_input": float(self.input_dist.exchange.bytes_sent),
                "a2a_bytes_sent_pooled": float(self.output_dist.exchange.bytes_sent)}


class TableWiseEmbeddings(ShardedEmbeddings):
    """Table-wise: whole tables on their owners (no store on a rank that owns none)."""

    def __init__(self, plan: ShardingPlan, rank: int, table_rows: Sequence[int], dim: int,
                 cfg: EmbeddingConfig, device: torch.device, seed: int, group: Any, weighted: bool,
                 access_counts: list[torch.Tensor] | None = None, max_unique_per_batch: Sequence[int] | None = None,
                 phase: Callable = _no_phase):
        owned = plan.tables_of(rank)
        pick = lambda per_table: None if per_table is None else [per_table[t] for t in owned]  # noqa: E731
        store = OwnedTables(table_rows, owned, dim, cfg, device, seed, access_counts=pick(access_counts),
                            max_unique_per_batch=pick(max_unique_per_batch)) if owned else None
        super().__init__(store, TableWiseInputDist(plan, rank, group, device, weighted),
                         TableWiseOutputDist(plan, rank, dim, group, device), device, phase, cfg)


def _check_blocks_fit_cache(plan: ShardingPlan, table_rows: Sequence[int], cfg: EmbeddingConfig) -> None:
    """ConfigError on EVERY rank (the last rank's blocks are the smallest) when a small table leaves some
    rank an empty block under placement cached, whose caches need at least one row per table."""
    if cfg.placement != "cached":
        return
    last = plan.world_size - 1
    for t, rows in enumerate(table_rows):
        start, stop = plan.row_range(rows, last)
        if start == stop:
            raise ConfigError(f"embedding_placement cached needs a row block of every table on every rank, but "
                              f"embedding_sharding row-wise leaves rank {last} none of table {t} ({rows} rows in "
                              f"blocks of {plan.row_block(rows)}): use placement device or host, or "
                              f"embedding_sharding table-wise")


class RowWiseEmbeddings(ShardedEmbeddings):
    """Row-wise: a block of every table's rows on every rank (`ShardingPlan.row_range`)."""

    def __init__(self, plan: ShardingPlan, rank: int, table_rows: Sequence[int], dim: int,
                 cfg: EmbeddingConfig, device: torch.device, seed: int, group: Any, weighted: bool,
                 access_counts: list[torch.Tensor] | None = None, max_unique_per_batch: Sequence[int] | None = None,
                 phase: Callable = _no_phase):
        _check_blocks_fit_cache(plan, table_rows, cfg)
        ranges = [plan.row_range(rows, rank) for rows in table_rows]
        # The cache planner sees the block as a table: its rows' access counts, and as floor the most
        # distinct ids one global batch has in the table, capped at the block (they may all fall in it).
        counts = None if access_counts is None else [c[a:b] for c, (a, b) in zip(access_counts, ranges)]
        floors = None if max_unique_per_batch is None else [
            min(b - a, most) for most, (a, b) in zip(max_unique_per_batch, ranges)]
        store = OwnedRowBlocks(table_rows, ranges, dim, cfg, device, seed, access_counts=counts,
                               max_unique_per_batch=floors)
        super().__init__(store, RowWiseInputDist(plan, rank, table_rows, group, device, weighted),
                         RowWiseOutputDist(rank, len(table_rows) * dim, group), device, phase, cfg)
