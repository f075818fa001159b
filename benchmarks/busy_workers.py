"""Host steps of many short intra-op parallel operations (gathers, write-backs and top-k over a few million
entries: a host-bound step's pattern, e.g. a device cache's bookkeeping) beside busy single-thread processes (loader
workers drawing batches), with torch's threads on every core or leaving one core to each busy process.

With every core taken by an OpenMP team, a busy process preempts one of its threads, and every parallel region
waits at its barrier for that thread's next time slice. ``targets.haste_rec.data.loader.leave_cores_to_workers``
is why this exists.

    python benchmarks/busy_workers.py [--rounds 2] [--reps 15]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import time

import torch


def busy(stop) -> None:
    """A loader worker drawing batches: one core, always busy."""
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    while not stop.is_set():
        torch.rand(200_000, generator=gen, dtype=torch.float64).pow_(-1.1)


def step(table: torch.Tensor, index: torch.Tensor, keys: torch.Tensor) -> None:
    for _ in range(30):
        rows = table.index_select(0, index)
        table.index_copy_(0, index, rows * 0.5 + 1)
        keys.view(-1, 20_000).topk(64, dim=1, largest=False)


def run(threads: int, workers: int, reps: int) -> tuple[float, float]:
    torch.set_num_threads(threads)
    stop = mp.Event()
    procs = [mp.get_context("fork").Process(target=busy, args=(stop,), daemon=True) for _ in range(workers)]
    for proc in procs:
        proc.start()
    gen = torch.Generator().manual_seed(1)
    table = torch.randn(2_000_000, 32, generator=gen)
    index = torch.randint(0, table.shape[0], (20_000,), generator=gen)
    keys = torch.randint(0, 1 << 40, (26 * 20_000,), generator=gen)
    step(table, index, keys)
    times = []
    for _ in range(reps):
        begin = time.perf_counter()
        step(table, index, keys)
        times.append(time.perf_counter() - begin)
    stop.set()
    for proc in procs:
        proc.join()
    return statistics.median(times) * 1e3, max(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--reps", type=int, default=15)
    args = parser.parse_args()
    cpus = len(os.sched_getaffinity(0))
    for _ in range(args.rounds):
        for workers in (0, 1, 2):
            for threads in sorted({cpus, max(1, cpus - workers)}, reverse=True):
                median, worst = run(threads, workers, args.reps)
                print(f"{threads} threads, {workers} busy processes: median {median:.1f} ms, worst {worst:.1f} ms",
                      flush=True)


if __name__ == "__main__":
    main()
