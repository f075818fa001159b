"""Host-side gathers of a cache's missed rows (``row_cache.gather_to_device``'s index_select into a pinned buffer):
torch's one call against the same rows split over a few threads, each gathering a contiguous part of the index.

A large-cached step on an H200 gathered about 30K rows of 128 floats from the 13.3 GB weights and as many single
floats from the 104 MB Adagrad state, 1.6 and 1.2 ms of host time (profile, 2026-12-02): random reads, bound by
memory latency, where more threads keep more misses in flight. Fresh random rows each round.

    python benchmarks/host_gather.py [--rows 26000000] [--width 128] [--picked 30000] [--rounds 9]
"""

from __future__ import annotations

import argparse
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import torch


def threaded_gather(host: torch.Tensor, index: torch.Tensor, out: torch.Tensor, pool: ThreadPoolExecutor,
                    parts: int) -> None:
    bounds = [index.numel() * p // parts for p in range(parts + 1)]
    list(pool.map(lambda p: torch.index_select(host, 0, index[bounds[p]:bounds[p + 1]],
                                               out=out[bounds[p]:bounds[p + 1]]), range(parts)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=26_000_000)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--picked", type=int, default=30_000)
    parser.add_argument("--rounds", type=int, default=9)
    args = parser.parse_args()
    print(f"torch threads {torch.get_num_threads()}")
    pool = ThreadPoolExecutor(max_workers=16)
    for width in (args.width, 1):
        host = torch.empty(args.rows, width)
        host.view(-1)[::1024].fill_(1.0)  # touch every page once
        out = torch.empty(args.picked, width, pin_memory=torch.cuda.is_available())
        gen = torch.Generator().manual_seed(0)
        results = {}
        for way in ("index_select", 2, 4, 8, 16):
            times = []
            for _ in range(args.rounds):
                index = torch.randperm(args.rows, generator=gen)[:args.picked].sort().values
                begin = time.perf_counter()
                if way == "index_select":
                    torch.index_select(host, 0, index, out=out)
                else:
                    threaded_gather(host, index, out, pool, way)
                times.append(time.perf_counter() - begin)
            results[way] = statistics.median(times) * 1e3
        print(f"width {width}: " + ", ".join(f"{k if k == 'index_select' else f'{k} threads'} {v:.2f} ms"
                                              for k, v in results.items()))


if __name__ == "__main__":
    main()
