"""Identical workers against each other: how far apart two fresh processes of one configuration time.

Each run is a side-by-side measurement (``validators.speedup.measure_ab``) of a spec against itself, in a fresh
pair of workers; its ratio's distance from 1, beyond its interval, is an offset the pair of processes carries (a
reason ``validators.confirmation.across_process_pairs`` pools several pairs). Prints each run's ratio, interval,
bias plus noise, and the two sides' block medians.

    python benchmarks/aa_offsets.py --size tiny --runs 3 --blocks 30 --block-seconds 0.2 [--threads 1]
    SG_OPT_FORK_SERVER=0 python benchmarks/aa_offsets.py ...     # workers as fresh interpreters
"""

from __future__ import annotations

import argparse
import time

from targets.worker_protocol import WorkerRequest
from validators.ab_stats import bias_plus_noise
from validators.speedup import measure_ab


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="haste-rec")
    parser.add_argument("--size", default="tiny")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--blocks", type=int, default=30)
    parser.add_argument("--block-steps", type=int, default=10)
    parser.add_argument("--block-seconds", type=float, default=0.2)
    args = parser.parse_args()
    spec = WorkerRequest(target=args.target, size=args.size, mode="bench", device=args.device, warmup=5,
                         threads=args.threads)
    for run_index in range(args.runs):
        start = time.monotonic()
        run = measure_ab(spec, spec, args.blocks, args.block_steps, 600, "A1", "A2", floor=0.01, seed=run_index,
                         block_seconds=args.block_seconds)
        if run.failure is not None:
            print(f"run {run_index}: failed ({run.failure.kind}): {run.failure.message}")
            continue
        print(f"run {run_index}: ratio {run.ratio:.4f} [{run.ci_low:.4f}, {run.ci_high:.4f}], bias plus noise "
              f"{bias_plus_noise(run.ratio, run.ci_low, run.ci_high):.4f}, clean {run.clean}, "
              f"{time.monotonic() - start:.0f} s", flush=True)
        for side in (run.a, run.b):
            print(f"  {side.label} ms:", " ".join(f"{m * 1e3:.1f}" for m in side.block_medians))


if __name__ == "__main__":
    main()
