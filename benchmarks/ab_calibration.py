"""Does the side-by-side benchmark fool itself? Real A/A runs and a real injected slowdown, on the CPU.

    python -m benchmarks.ab_calibration                      # tiny trainer, 20 A/A runs, a few minutes
    python -m benchmarks.ab_calibration --aa-runs 50 --blocks 12 --steps 20

1. Calibrate the noise floor from A/A runs (two workers of the same spec).
2. Run ``--aa-runs`` further A/A comparisons in fresh workers with that floor: every ``faster`` is a
   false accept, every ``slower`` a false reject.
3. Inject a real 10% slowdown (``benchmarks.slowed_target``: a busy-wait of 10% of the median step)
   and measure it both ways: the slowed candidate must come out ``slower``, and the unslowed one,
   against a slowed incumbent, ``faster`` and confirmed in fresh processes.
Prints Markdown tables.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from targets.worker_protocol import WorkerRequest
from validators.confirmation import confirm_win
from validators.ab_result import ABResult, NoiseFloor
from validators.speedup import calibrate_noise_floor, measure_ab

TARGET = "benchmarks.slowed_target:TARGET"


def _row(name: str, result: ABResult, expected: str) -> str:
    if result.failure is not None:
        return f"| {name} | - | - | failed: {result.failure.kind}: {result.failure.message} | {expected} |"
    return (f"| {name} | {result.ratio:.4f} | [{result.ci_low:.4f}, {result.ci_high:.4f}] | {result.verdict} "
            f"| {expected} |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="tiny")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--blocks", type=int, default=60, help="timed blocks per side (even)")
    parser.add_argument("--steps", type=int, default=5, help="steps per block")
    parser.add_argument("--calibration-repeats", type=int, default=2)
    parser.add_argument("--aa-runs", type=int, default=20)
    parser.add_argument("--slowdown", type=float, default=0.1)
    parser.add_argument("--timeout", type=float, default=300.0)
    args = parser.parse_args(argv)

    def spec(slowdown: float) -> WorkerRequest:
        return WorkerRequest(target=TARGET, size=args.size, mode="bench", config={"slowdown": slowdown},
                             threads=args.threads, warmup=5)

    plain, slowed = spec(0.0), spec(args.slowdown)
    start = time.monotonic()
    floor: NoiseFloor = calibrate_noise_floor(plain, args.blocks, args.steps, args.timeout,
                                              repeats=args.calibration_repeats)
    print(f"\nhaste-rec @ {args.size} on the CPU, {args.threads} thread(s) per worker, {args.blocks} blocks x "
          f"{args.steps} steps per side, load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    print(f"noise floor {floor.floor:.4f} from {len(floor.runs)} A/A calibration runs "
          f"({', '.join(f'ratio {r.ratio:.4f} [{r.ci_low:.4f}, {r.ci_high:.4f}]' for r in floor.runs)})\n")

    print("| A/A run | ratio | 95% CI | verdict | expected |\n|---|---|---|---|---|")
    verdicts = []
    for i in range(args.aa_runs):
        result = measure_ab(plain, plain, args.blocks, args.steps, args.timeout, "A1", "A2", floor=floor, seed=i)
        verdicts.append(result.verdict)
        print(_row(str(i + 1), result, "not faster"), flush=True)
    false_accepts, false_rejects = verdicts.count("faster"), verdicts.count("slower")
    failed = verdicts.count("failed")
    print(f"\nA/A: {false_accepts}/{args.aa_runs} false accepts (faster), {false_rejects}/{args.aa_runs} "
          f"called slower, {failed} failed\n")

    pct = f"{100 * args.slowdown:g}%"
    print(f"| injected {pct} slowdown | ratio | 95% CI | verdict | expected |\n|---|---|---|---|---|")
    slower = measure_ab(plain, slowed, args.blocks, args.steps, args.timeout, floor=floor, seed=100)
    print(_row(f"candidate slowed by {pct}", slower, "slower"), flush=True)
    confirmation = confirm_win(slowed, plain, floor, args.blocks, args.steps, args.timeout, seed=200)
    for i, run in enumerate(confirmation.runs):
        what = f"pooled over {run.pools} measurements" if run.pools > 1 else ("first" if i == 0 else "fresh re-measure")
        print(_row(f"incumbent slowed by {pct} ({what})", run, "faster"))
    print(f"\nslowdown detected: {slower.verdict == 'slower'}; win over the slowed incumbent confirmed: "
          f"{confirmation.accepted} ({confirmation.reason})")
    print(f"wall time {time.monotonic() - start:.0f} s")
    ok = false_accepts == 0 and slower.verdict == "slower" and confirmation.accepted and not failed
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
