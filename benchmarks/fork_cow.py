"""Why the trainer forks its loader workers before it builds the embedding tables.

A forked child shares the parent's pages copy-on-write: the parent's first write to each page afterwards
copies it. Host tables are written row by row every step (row-wise Adagrad on the host), so a fork after
the tables exist makes those writes slow for as long as untouched pages remain. This times random row
writes into a table before and after forking an idle child.

    python benchmarks/fork_cow.py [--rows 4000000] [--dim 128] [--writes 100000] [--steps 8]
"""

from __future__ import annotations

import argparse
import os
import signal
import time

import torch


def timed_writes(table: torch.Tensor, writes: int, steps: int, gen: torch.Generator) -> list[float]:
    """ms of each step's index_copy_ of `writes` random rows."""
    out, ones = [], torch.ones(writes, table.shape[1])
    for _ in range(steps):
        index = torch.randint(0, table.shape[0], (writes,), generator=gen)
        start = time.perf_counter()
        table.index_copy_(0, index, ones)
        out.append((time.perf_counter() - start) * 1e3)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=4_000_000)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--writes", type=int, default=100_000)
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args()
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    table = torch.randn(args.rows, args.dim, generator=gen)
    print(f"table {table.numel() * 4 / 2**30:.1f} GiB, {args.writes} random row writes a step")
    print("no child:     ", " ".join(f"{ms:.1f}" for ms in timed_writes(table, args.writes, args.steps, gen)), "ms")
    child = os.fork()
    if child == 0:
        time.sleep(3600)
        os._exit(0)
    try:
        print("forked child: ", " ".join(f"{ms:.1f}" for ms in timed_writes(table, args.writes, args.steps, gen)), "ms")
    finally:
        os.kill(child, signal.SIGKILL)
        os.waitpid(child, 0)


if __name__ == "__main__":
    main()
