"""How long one loader worker takes to build (and pack) a training batch, on one thread as a worker runs.

With ``data_workers`` = n the loader can hand the trainer a batch every (build time / n) at best, whatever the
hand-over costs (``benchmarks/loader_handover.py`` times that): a step shorter than that waits in its data phase.
At large-cached's best configuration with the cache prefetch (8.58 ms a step side by side on an H200, 2026-12-04)
the main thread spent 3.01 ms a step taking its batch from two workers; this says whether the workers, not the
hand-over, bound it.

    python benchmarks/batch_build.py --size large-cached            # unpacked and packed, 20 batches each
"""

from __future__ import annotations

import argparse
import statistics
import time


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="large-cached")
    parser.add_argument("--batches", type=int, default=20)
    args = parser.parse_args(argv)
    import torch

    from targets.haste_rec.embeddings.row_ops import TableLayout
    from targets.haste_rec.target import training_data

    torch.set_num_threads(1)  # as a loader worker (shared_ring._worker, DataLoader workers)
    source, size = training_data(args.size, 0)
    layout = TableLayout(size.table_rows)
    source.train_batch(0)  # first-call costs (allocations, lazy set-up) out of the figures
    for name, build in (("build", source.train_batch), ("build + pack", lambda i: layout.pack(source.train_batch(i)))):
        times = []
        for i in range(1, args.batches + 1):
            start = time.perf_counter()
            build(i)
            times.append(time.perf_counter() - start)
        ms = 1e3 * statistics.median(times)
        print(f"{name}: {ms:.2f} ms a batch (median of {args.batches}; fastest {1e3 * min(times):.2f}); "
              + ", ".join(f"{n} worker(s): a batch every {ms / n:.2f} ms at best" for n in (1, 2, 4)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
