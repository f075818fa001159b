"""Host time of preparing every table's device cache for a batch: ``TableCaches`` (all tables at once)
against one ``RowCache`` per table in a loop, on the same Zipf batches, after a warm-up that fills the
caches. Both decide the same slots (checked here on every batch); the device is the CPU, so the time is
the caches' host-side bookkeeping plus the row copies.

    python benchmarks/cache_prepare.py [--tables 26] [--rows 1000000] [--capacity 60000] [--batches 75]
"""

from __future__ import annotations

import argparse
import time

import torch

from targets.haste_rec.cache.row_cache import RowCache
from targets.haste_rec.cache.table_caches import TableCaches

CPU = torch.device("cpu")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tables", type=int, default=26)
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--capacity", type=int, default=60_000)
    parser.add_argument("--ids", type=int, default=5120, help="ids per table per batch (Zipf, exponent 1.05)")
    parser.add_argument("--batches", type=int, default=75)
    parser.add_argument("--timed", type=int, default=15, help="the last batches, timed")
    parser.add_argument("--width", type=int, default=4)
    args = parser.parse_args()
    tables, rows = args.tables, args.rows
    probs = torch.arange(1, rows + 1, dtype=torch.float64).pow(-1.05)
    gen = torch.Generator().manual_seed(1)
    batches = [torch.unique(torch.cat([torch.multinomial(probs, args.ids, replacement=True, generator=gen) + t * rows
                                       for t in range(tables)])) for _ in range(args.batches)]
    together = TableCaches(torch.zeros(tables * rows, args.width), [rows] * tables, [args.capacity] * tables, "lru",
                           CPU)
    alone = [RowCache(torch.zeros(rows, args.width), args.capacity, "lru", CPU) for _ in range(tables)]

    def per_table(batch: torch.Tensor, record: bool) -> torch.Tensor:
        parts = torch.split(batch, torch.bincount(batch // rows, minlength=tables).tolist())
        return torch.cat([c.prepare(p - t * rows, record) + t * args.capacity
                          for t, (c, p) in enumerate(zip(alone, parts))])

    spent = {"TableCaches": 0.0, "one RowCache per table": 0.0}
    for i, batch in enumerate(batches):
        timed = i >= len(batches) - args.timed
        for record in (True, False):  # the lookup's prepare, then the update's
            start = time.perf_counter()
            got = together.prepare(batch, record)
            middle = time.perf_counter()
            want = per_table(batch, record)
            if timed:
                spent["TableCaches"] += middle - start
                spent["one RowCache per table"] += time.perf_counter() - middle
            assert torch.equal(got, want), f"batch {i}: the two decided different slots"
    misses = together.counters()["misses"] / (together.counters()["hits"] + together.counters()["misses"])
    print(f"{tables} tables x {rows} rows, {args.capacity} cache rows each, {batches[-1].numel()} distinct ids in the "
          f"last batch, miss rate {misses:.3f}; ms per batch (lookup + update prepare), last {args.timed} batches:")
    for name, seconds in spent.items():
        print(f"  {name}: {seconds / args.timed * 1e3:.1f}")


if __name__ == "__main__":
    main()
