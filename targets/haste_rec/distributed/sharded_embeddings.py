"""Table-wise sharded embeddings: each rank stores and updates only the tables it owns.

The owned tables are an ordinary `EmbeddingStore` (every placement, grad mode and backend knob
applies unchanged), fed the global batch's bags of those tables by the input dist. Since the owner
pools over the whole global batch, backward gives it each row's total gradient over that batch and
row-wise Adagrad runs once per row, exactly as in the single-process trainer.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from targets.haste_rec.batch import Batch
from targets.haste_rec.distributed.exchange import PooledOutputDist, SparseInputDist
from targets.haste_rec.distributed.plan import ShardingPlan
from targets.haste_rec.embedding_config import EmbeddingConfig
from targets.haste_rec.embeddings import EmbeddingStore
from targets.haste_rec.row_ops import TableLayout


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


def _no_phase(name: str):
    return contextlib.nullcontext()


class TableWiseEmbeddings(nn.Module):
    """Pooled embeddings [this rank's samples, T * dim] of all T tables, from tables sharded table-wise."""

    def __init__(self, plan: ShardingPlan, rank: int, table_rows: Sequence[int], dim: int,
                 cfg: EmbeddingConfig, device: torch.device, seed: int, group: Any, weighted: bool,
                 access_counts: list[torch.Tensor] | None = None, max_unique_per_batch: Sequence[int] | None = None,
                 phase: Callable = _no_phase):
        super().__init__()
        owned = plan.tables_of(rank)
        pick = lambda per_table: None if per_table is None else [per_table[t] for t in owned]  # noqa: E731
        self.owned, self.device, self.phase = owned, device, phase
        self.store = OwnedTables(table_rows, owned, dim, cfg, device, seed, access_counts=pick(access_counts),
                                 max_unique_per_batch=pick(max_unique_per_batch)) if owned else None
        self.input_dist = SparseInputDist(plan, rank, group, device, weighted)
        self.output_dist = PooledOutputDist(plan, rank, dim, group, device)

    def forward(self, batch: Batch, samples: list[int]) -> torch.Tensor:
        """`batch` is this rank's slice of a batch split over the ranks as `samples` says (one count per rank)."""
        with self.phase("input_dist"):
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
    def _sum_over_ranks(self, local: float) -> float:
        total = torch.tensor([local], dtype=torch.float64, device=self.device)
        dist.all_reduce(total)
        return float(total)

    def grad_sq_norm(self) -> float:
        """Squared norm of all tables' gradients since zero_grad, summed over the owners."""
        return self._sum_over_ranks(0.0 if self.store is None else self.store.grad_sq_norm())

    def table_sq_norm(self) -> float:
        """Squared norm of all tables' weights, summed over the owners."""
        tables = [] if self.store is None else self.store.current_tables()
        return self._sum_over_ranks(sum(float(t.detach().float().pow(2).sum()) for t in tables))

    def counters(self) -> dict[str, float]:
        """This rank's store counters (cache traffic of its tables) and the bytes its forward all-to-alls
        sent (the backward sends as many pooled-gradient bytes as the forward received)."""
        own = {} if self.store is None else self.store.counters()
        return {**own, "a2a_bytes_sent_input": float(self.input_dist.exchange.bytes_sent),
                "a2a_bytes_sent_pooled": float(self.output_dist.bytes_sent)}
