"""Host time of a step's device-cache bookkeeping once the caches are full, on the trainer's own batches: the
state a long `large-cached` run spends its steps in (every miss evicts). The caches are filled by replaying
the batches before the first (``TableCaches.replay``, as the trainer warms them), then batches 0.. are
prepared and timed; the rows are one float wide and the device is the CPU, so the time is the host
bookkeeping (slot lookup, victim choice, stamps). A step prepares the weights' cache for the lookup and the
optimizer state's for the update: timed with the state in a cache of its own, and riding in the weights'
slots (``SharedSlotRows``, what equal capacities get). A later worker does not replay: it reads the decisions
from the build cache and adopts them, timed here too (with the entry's size). ``--index cuda`` keeps the
bookkeeping on the GPU instead (knob embedding_cache_index device), timed with a synchronisation.

    python benchmarks/cache_steady.py [--size large-cached] [--fraction 0.2] [--eviction lru] [--threads 2] \
        [--index cpu|cuda]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from targets.haste_rec.cache import build_cache
from targets.haste_rec.cache.shared_slot_rows import SharedSlotRows
from targets.haste_rec.cache.table_caches import TableCaches, replay_until_full
from targets.haste_rec.embeddings.embedding_config import CPU
from targets.haste_rec.embeddings.row_ops import TableLayout, unique_ids
from targets.haste_rec.model import synthetic_data
from targets.haste_rec.sizes import get_size


def _adopted(replayed: TableCaches, table_rows, capacities, eviction: str) -> str:
    """How long a later worker takes to read the replayed decisions back from the build cache and adopt them."""
    with tempfile.TemporaryDirectory() as folder:
        entry = Path(folder) / "cache-warm.pt"
        build_cache._write(entry, {"params": replayed.decisions()})
        begin = time.perf_counter()
        fresh = TableCaches(torch.zeros(sum(table_rows), 1), table_rows, capacities, eviction, CPU)
        fresh.adopt(build_cache._read(entry)["params"])
        took = time.perf_counter() - begin
        assert torch.equal(fresh.slot_of_row, replayed.slot_of_row.cpu())
        return f"a later worker reads and adopts them in {took:.2f} s (an entry of {entry.stat().st_size / 1e6:.0f} MB)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="large-cached")
    parser.add_argument("--fraction", type=float, default=0.2, help="cache rows / table rows (the knob's default)")
    parser.add_argument("--eviction", default="lru", choices=("lru", "lfu"))
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--batches", type=int, default=25, help="batches timed, after 5 untimed")
    parser.add_argument("--max-warm", type=int, default=1000, help="most batches replayed to fill the caches")
    parser.add_argument("--index", default="cpu", choices=("cpu", "cuda"), help="where the bookkeeping runs")
    args = parser.parse_args()
    index = torch.device(args.index)

    def now() -> float:
        if index.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter()

    torch.set_num_threads(args.threads)
    size = get_size(args.size)
    data, layout = synthetic_data(size, 0), TableLayout(size.table_rows)
    capacities = [max(1, round(args.fraction * rows)) for rows in size.table_rows]

    def rows(index: int) -> torch.Tensor:
        return unique_ids(layout.flatten(data.train_batch(index), CPU)[0])[0]

    batches = [rows(i) for i in range(5 + args.batches)]
    for state in ("apart", "riding"):
        weights = TableCaches(torch.zeros(sum(size.table_rows), 1), size.table_rows, capacities, args.eviction, CPU,
                              index_device=index)
        states = (SharedSlotRows(weights, torch.zeros(sum(size.table_rows), 1)) if state == "riding" else
                  TableCaches(torch.zeros(sum(size.table_rows), 1), size.table_rows, capacities, args.eviction, CPU,
                              index_device=index))
        start = time.perf_counter()
        replayed = replay_until_full((weights, states), (rows(-1 - i) for i in range(args.max_warm)))
        print(f"{args.size}: {len(capacities)} tables, {sum(capacities):,} cache rows ({args.eviction}), state "
              f"{state}; " + (f"full after {replayed} batches replayed ({time.perf_counter() - start:.1f} s)"
                              if weights.full else f"not full after {replayed} batches"))
        if state == "riding":
            print("  " + _adopted(weights, size.table_rows, capacities, args.eviction))
        for batch in batches[:5]:
            weights.prepare(batch)
            states.prepare(batch)
        if state == "apart":  # what a prepare's topk takes per table (TableCaches._oldest_unused)
            first = batches[5]
            table = torch.bucketize(first, weights.row_edges, right=True)
            held = weights.slot_of_row.index_select(0, first) >= 0
            print(f"  one batch, most misses in a table {int(torch.bincount(table[~held]).max()):,}, most hits "
                  f"{int(torch.bincount(table[held]).max()):,}")
        times, again, misses = [], [], weights.misses
        for batch in batches[5:]:
            begin = now()
            weights.prepare(batch)
            states.prepare(batch)
            times.append(now() - begin)
            begin = now()
            weights.prepare(batch, record=False)  # what a fused update skips when nothing was evicted since
            again.append(now() - begin)
        per_batch = (weights.misses - misses) / args.batches
        print(f"  a step's two prepares: median {statistics.median(times) * 1e3:.2f} ms, fastest "
              f"{min(times) * 1e3:.2f} ms over {args.batches} batches of "
              f"{statistics.mean(b.numel() for b in batches[5:]):,.0f} distinct rows, {per_batch:,.0f} misses each; "
              f"{args.threads} threads, bookkeeping on {args.index}")
        print(f"  the weights' prepare again, every row resident (a fused update's before 2026-12-01): median "
              f"{statistics.median(again) * 1e3:.2f} ms")

if __name__ == "__main__":
    main()
