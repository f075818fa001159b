"""How long the trainer waits to take one batch from its loader workers, with their queues full.

With ``data_workers`` > 0 a packed batch crosses from a worker process to the trainer through a shared slot made
once (``targets.haste_rec.data.shared_ring``; ``SG_OPT_LOADER_RING=0``: as a DataLoader storage, one hand-over of a
file descriptor, a socket round trip and a mapping per storage); the trainer pays for it in its data phase,
every step. This times ``next()`` on the trainer's batch stream after the workers have had time to
fill their queues, so building batches is not what is timed (on a 2-core machine the workers do compete for
the cores again as soon as a batch is taken, hence the spread: read the fastest rounds).

    python benchmarks/loader_handover.py --size large                      # this checkout
    SG_OPT_LOADER_RING=0 python benchmarks/loader_handover.py --size large # the DataLoader's hand-over
    python benchmarks/loader_handover.py --size large --root /path/to/old  # another checkout, to compare
"""

from __future__ import annotations

import argparse
import sys
import time


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="large")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--unpacked", action="store_true", help="pack_batches off (one storage per table tensor)")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--root", help="import the trainer from this checkout instead")
    args = parser.parse_args(argv)
    if args.root:
        sys.path.insert(0, args.root)
    import torch
    from targets.haste_rec.knobs import KNOB_SPACE
    from targets.haste_rec.session import loader_first
    from targets.haste_rec.target import training_data

    source, size = training_data(args.size, 0)
    config = KNOB_SPACE.resolve({"data_workers": args.workers, "pack_batches": not args.unpacked})
    batches = loader_first(source, size, config, torch.device("cpu"))
    per_batch = []
    for _ in range(args.rounds):
        time.sleep(4.0)  # every worker's queue full, the workers idle
        start = time.perf_counter()
        for _ in range(args.workers * 2):
            batch = next(batches)
        per_batch.append((time.perf_counter() - start) / (args.workers * 2))
    storages = len(batch.tensors())
    kind = "unpacked" if args.unpacked else "packed"
    plural = "s" if storages > 1 else ""
    print(f"{args.size}, {args.workers} workers, {kind} ({storages} storage{plural} a batch): "
          + ", ".join(f"{1e3 * t:.2f}" for t in sorted(per_batch)) + " ms a batch, fastest first")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
