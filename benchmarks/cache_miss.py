"""Miss rate of the embedding row cache: frequency-planned vs uniform budget split, LRU and LFU.

The trainer's cached placement splits one device-cache budget across tables either uniformly or by
measured access frequency (targets.haste_rec.cache.cache_plan). This script measures what the planned
split buys on the trainer's own synthetic workload (several tables of different size and Zipf
skew): it plans on one window of training batches, then replays a separate, later window through
the real RowCache of every table and counts misses after a warm-up. Prints a Markdown table.

    PYTHONPATH=. python benchmarks/cache_miss.py [--quick] [--size small]
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass

import torch

from targets.haste_rec.cache.cache_plan import plan_by_frequency, plan_uniform
from targets.haste_rec.cache.row_cache import RowCache
from targets.haste_rec.data.batch import Batch
from targets.haste_rec.data.data import SyntheticData, SyntheticSpec
from targets.haste_rec.sizes import SIZES, HasteRecSize

BUDGETS = (0.05, 0.10, 0.20)
EVICTIONS = ("lru", "lfu")
HELDOUT_START = 100_000  # replayed batches come from far past the planning window


@dataclass
class Workload:
    size: HasteRecSize
    plan_counts: list[torch.Tensor]   # accesses per row over the planning window
    heldout: list[Batch]              # warm-up batches first, then the measured ones
    floors: list[int]                 # rows one batch of a table can need at most


def build_workload(size: HasteRecSize, seed: int, plan_batches: int, warm: int, measure: int) -> Workload:
    data = SyntheticData(SyntheticSpec(
        num_labels=size.num_labels, num_clusters=size.num_clusters, table_rows=size.table_rows,
        table_zipf=size.table_zipf, pooling=size.pooling, num_dense=size.num_dense, batch_size=size.batch_size,
        heldout_size=size.heldout_size, seed=seed))
    heldout = [data.train_batch(HELDOUT_START + i) for i in range(warm + measure)]
    # SyntheticSpec: a bag holds pooling +- 50% ids, so a batch never needs more distinct rows than this
    floors = [min(rows, size.batch_size * (pool + pool // 2)) for rows, pool in zip(size.table_rows, size.pooling)]
    return Workload(size, data.id_access_counts(plan_batches), heldout, floors)


def replay_miss_rate(work: Workload, capacities: list[int], eviction: str, warm: int) -> float:
    """Misses / lookups of per-table RowCaches over the held-out batches after `warm` of them."""
    caches = [RowCache(torch.zeros(rows, 1), cap, eviction, torch.device("cpu"))
              for rows, cap in zip(work.size.table_rows, capacities)]
    for i, batch in enumerate(work.heldout):
        if i == warm:
            for cache in caches:
                cache.hits = cache.misses = 0
        for cache, ids in zip(caches, batch.ids):
            cache.prepare(torch.unique(ids))
    misses = sum(c.misses for c in caches)
    return misses / (misses + sum(c.hits for c in caches))


def report(work: Workload, warm: int) -> list[str]:
    lines = ["| budget | cache rows | eviction | uniform miss rate | planned miss rate | planned / uniform |",
             "| --- | --- | --- | --- | --- | --- |"]
    for budget in BUDGETS:
        uniform = plan_uniform(work.size.table_rows, budget, work.floors)
        planned = plan_by_frequency(work.plan_counts, budget, work.floors)
        for eviction in EVICTIONS:
            u, p = (replay_miss_rate(work, caps, eviction, warm) for caps in (uniform, planned))
            lines.append(f"| {budget:.0%} | {sum(uniform)} | {eviction} | {u:.4f} | {p:.4f} | {p / u:.3f} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="small", choices=sorted(SIZES))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--plan-batches", type=int, default=64, help="training batches whose counts plan the split")
    parser.add_argument("--warm-batches", type=int, default=32, help="held-out batches that fill the caches first")
    parser.add_argument("--measure-batches", type=int, default=128, help="held-out batches whose misses count")
    parser.add_argument("--quick", action="store_true", help="16 planning, 8 warm-up and 24 measured batches")
    args = parser.parse_args()
    if args.quick:
        args.plan_batches, args.warm_batches, args.measure_batches = 16, 8, 24
    torch.set_num_threads(1)  # the replay is many small host-side operations
    start = time.perf_counter()
    size = SIZES[args.size]
    work = build_workload(size, args.seed, args.plan_batches, args.warm_batches, args.measure_batches)
    print(f"size {size.name}: {size.num_tables} tables, rows {list(size.table_rows)}, zipf {list(size.table_zipf)}, "
          f"batch {size.batch_size}, pooling {list(size.pooling)}; per-table floor {work.floors}")
    print(f"planned on training batches [0, {args.plan_batches}); replayed batches {HELDOUT_START}+ "
          f"({args.warm_batches} warm-up, {args.measure_batches} measured); cache budget = share of all "
          f"{sum(size.table_rows)} rows\n")
    print("\n".join(report(work, args.warm_batches)))
    print(f"\n({time.perf_counter() - start:.1f} s)")


if __name__ == "__main__":
    main()
