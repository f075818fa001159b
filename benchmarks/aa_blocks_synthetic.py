"""How many blocks should an A/A run take? The whole acceptance protocol on synthetic noisy blocks.

    python -m benchmarks.aa_blocks_synthetic                       # 300 trials a row, about a minute
    python -m benchmarks.aa_blocks_synthetic --trials 1000 --aa-blocks 6 20 40

The noise floor is the worst of two A/A runs' |1 - ratio| + half-width, so it is as loose as an A/A
interval. Each trial here sets the floor from two A/A runs of ``--aa-blocks`` blocks a side, then judges a
candidate with the agent's own ``validators.confirmation.confirm_win`` (6 blocks, extended once when it leans
faster, confirmed by a second measurement), its process-level measurement replaced by synthetic block
medians. Block medians are lognormal around the step (``--sigma`` per block; 0.07 is the spread of the
13.6 ms `large` incumbent's A/A blocks on an H200, 2026-11-30: 12.2-17.6 ms), with a random walk that both
sides share (``--drift`` per block pair) and a small bias per process (``--process-bias``). Prints the
median floor and the share of trials accepted for an identical candidate (false wins) and for true wins.
"""

from __future__ import annotations

import argparse
import itertools
from unittest import mock

import numpy as np

from targets.worker_protocol import WorkerRequest
from validators import confirmation
from validators.ab_stats import analyse, block_order, floor_from
from validators.confirmation import confirm_win
from validators.ab_result import ABResult, SideSummary, spec_digest

INCUMBENT = WorkerRequest(target="haste-rec", size="large", mode="bench")
CANDIDATE = INCUMBENT.model_copy(update={"config": {"pack_batches": True}})


def block_medians(rng: np.random.Generator, blocks: int, truth: float, sigma: float, drift: float,
                  process_bias: float) -> tuple[list[float], list[float]]:
    """Both sides' block medians in seconds, in ``block_order``: side b is ``truth`` x side a."""
    scale = {"a": rng.lognormal(0, process_bias), "b": rng.lognormal(0, process_bias) * truth}
    shared = np.cumsum(rng.normal(0, drift, blocks))  # the machine's own wander, one step per block pair
    out: dict[str, list[float]] = {"a": [], "b": []}
    for n, side in enumerate(block_order(blocks)):
        out[side].append(0.0136 * scale[side] * np.exp(shared[n // 2]) * rng.lognormal(0, sigma))
    return out["a"], out["b"]


def measured(a_medians: list[float], b_medians: list[float], floor: float, seed: int) -> ABResult:
    """A result as ``measure_ab`` makes it, from block medians (one step a block)."""
    stats = analyse([[m] for m in a_medians], [[m] for m in b_medians], floor, seed=seed)
    sides = [SideSummary(label=label, digest=spec_digest(spec), spec=spec, block_medians=medians)
             for label, spec, medians in (("incumbent", INCUMBENT, stats.a_medians),
                                          ("candidate", CANDIDATE, stats.b_medians))]
    return ABResult(a=sides[0], b=sides[1], ratio_definition="candidate_time / incumbent_time (below 1 is faster)",
                    ratio=stats.ratio, speedup=1.0 / stats.ratio, ci_low=stats.ci_low, ci_high=stats.ci_high,
                    floor=floor, verdict=stats.verdict, order=block_order(len(a_medians)), blocks=len(a_medians),
                    steps_per_block=1)


def trial_rates(aa_blocks: int, truth: float, trials: int, args: argparse.Namespace) -> tuple[float, float]:
    """(median floor, share of trials accepted) for candidates ``truth`` x the incumbent's step."""
    rng = np.random.default_rng(args.seed)
    noise = dict(sigma=args.sigma, drift=args.drift, process_bias=args.process_bias)
    seeds = itertools.count()

    def fake_measure(a, b, blocks, *rest, floor=0.0, seed=0, **kwargs):
        return measured(*block_medians(rng, blocks, truth, **noise), floor=floor, seed=seed)
    floors, accepted = [], 0
    with mock.patch.object(confirmation, "measure_ab", fake_measure):
        for trial in range(trials):
            aa = [measured(*block_medians(rng, aa_blocks, 1.0, **noise), floor=0.0, seed=next(seeds))
                  for _ in range(2)]
            floor = floor_from([(r.ratio, r.ci_low, r.ci_high) for r in aa])
            floors.append(floor)
            accepted += confirm_win(INCUMBENT, CANDIDATE, floor, args.blocks, 1, 60.0, seed=trial).accepted
    return float(np.median(floors)), accepted / trials


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--aa-blocks", type=int, nargs="+", default=[6, 20], help="blocks per side of an A/A run")
    parser.add_argument("--truths", type=float, nargs="+", default=[1.0, 0.90, 0.85],
                        help="candidate step / incumbent step (1.0: an identical candidate)")
    parser.add_argument("--blocks", type=int, default=6, help="blocks per side of a candidate's measurement")
    parser.add_argument("--trials", type=int, default=300)
    parser.add_argument("--sigma", type=float, default=0.07, help="lognormal sigma of a block median")
    parser.add_argument("--drift", type=float, default=0.02, help="sigma of the shared random walk per block pair")
    parser.add_argument("--process-bias", type=float, default=0.005, help="lognormal sigma of a process's speed")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    print(f"{args.trials} trials a cell; block sigma {args.sigma}, shared drift {args.drift}, process bias "
          f"{args.process_bias}; candidates measured on {args.blocks} blocks a side\n")
    print("| A/A blocks | median floor | " + " | ".join(f"accepted at {t:g}" for t in args.truths) + " |")
    print("|---|---|" + "---|" * len(args.truths))
    for aa_blocks in args.aa_blocks:
        cells = [trial_rates(aa_blocks, truth, args.trials, args) for truth in args.truths]
        print(f"| {aa_blocks} | {cells[0][0]:.1%} | " + " | ".join(f"{rate:.1%}" for _, rate in cells) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
