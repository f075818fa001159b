"""How one device-cache budget is split across embedding tables.

Tables differ in size and skew: a strongly skewed table gets most of its lookups from a few rows,
a flat one needs many rows for the same hit rate. `plan_uniform` gives every table the same share
of its rows (the split a team writes first). `plan_by_frequency` spends the same total where it
saves the most misses: under an independent-reference model the best static cache holds the
globally most frequent rows, so all rows of all tables are ranked by measured access count and
each table gets the number of its rows in the global top-N. A per-table minimum (one batch's
distinct ids of that table must fit) is honoured first and the rest of the budget is ranked
globally, so the total equals the uniform total. Everything here is deterministic.
"""

from __future__ import annotations

from typing import Sequence

import torch

from targets.protocol import ConfigError

PLANS = ("uniform", "planned")


def _check(table_rows: Sequence[int], fraction: float, min_rows: Sequence[int]) -> None:
    if not 0.0 < fraction <= 1.0:
        raise ConfigError(f"a cache fraction must lie in (0, 1], not {fraction}")
    if len(min_rows) != len(table_rows):
        raise ConfigError(f"min_rows has {len(min_rows)} entries for {len(table_rows)} tables")


def plan_uniform(table_rows: Sequence[int], fraction: float, min_rows: Sequence[int]) -> list[int]:
    """Rows per table: round(fraction * rows), at least max(1, min_rows), at most the table's rows."""
    _check(table_rows, fraction, min_rows)
    return [min(rows, max(1, low, round(fraction * rows))) for rows, low in zip(table_rows, min_rows)]


def plan_by_frequency(access_counts: Sequence[torch.Tensor], fraction: float, min_rows: Sequence[int]) -> list[int]:
    """Rows per table that maximise hits of a static cache, at the uniform plan's total.

    Each table first gets its floor (min_rows, capped at its size; its most frequent rows), then
    the remaining budget goes to the globally most frequent of all other rows. Equal counts, common
    in a short measurement window, go to the row of lower rank within its table, then to the lower
    table index: tied budget is spread over the tables instead of all going to the first one.
    """
    table_rows = [int(c.numel()) for c in access_counts]
    budget = sum(plan_uniform(table_rows, fraction, min_rows))
    floors = [min(rows, max(1, low)) for rows, low in zip(table_rows, min_rows)]
    rest_freq, rest_rank, rest_table = [], [], []
    for t, (counts, floor) in enumerate(zip(access_counts, floors)):
        ranked = torch.sort(counts.to(torch.int64), descending=True, stable=True).values[floor:]
        rest_freq.append(ranked)
        rest_rank.append(torch.arange(floor, floor + ranked.numel()))
        rest_table.append(torch.full_like(ranked, t))
    by_rank = torch.sort(torch.cat(rest_rank), stable=True).indices        # ties: lower rank, then table
    order = by_rank[torch.sort(torch.cat(rest_freq)[by_rank], descending=True, stable=True).indices]
    chosen = torch.cat(rest_table)[order[: budget - sum(floors)]]
    extra = torch.bincount(chosen, minlength=len(table_rows)).tolist()
    return [floor + e for floor, e in zip(floors, extra)]


def expected_miss_rate(access_counts: Sequence[torch.Tensor], capacities: Sequence[int]) -> float:
    """Miss rate of a static cache holding each table's `capacities[t]` most frequent rows."""
    total = sum(int(c.sum()) for c in access_counts)
    if total == 0:
        return 0.0
    hits = sum(int(torch.topk(c.to(torch.int64), min(cap, c.numel())).values.sum())
               for c, cap in zip(access_counts, capacities))
    return 1.0 - hits / total


def plan_capacities(plan: str, table_rows: Sequence[int], fraction: float, min_rows: Sequence[int],
                    access_counts: Sequence[torch.Tensor] | None = None) -> list[int]:
    """Rows per table under `plan` (uniform | planned); planned needs every row's measured access count."""
    if plan == "uniform":
        return plan_uniform(table_rows, fraction, min_rows)
    if access_counts is None or [int(c.numel()) for c in access_counts] != list(table_rows):
        raise ConfigError("cache_plan planned needs access_counts: one count per row of every table")
    return plan_by_frequency(access_counts, fraction, min_rows)
