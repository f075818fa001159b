"""Stalled and drifting blocks: whether a side-by-side measurement was disturbed, which side drifted, and the
steadier of two measurements (``validators.speedup``'s "Stalled blocks")."""

from __future__ import annotations

import statistics
from typing import Callable, Sequence

from validators.ab_stats import order_correlation
from validators.ab_result import ABResult

DISTURBED_SPREAD = 0.25  # a side whose block medians spread by more than this (or DISTURBED_FLOORS floors)...
DISTURBED_FLOORS = 5.0   # ...was slowed by something outside the two workers for part of the run
DRIFT_CORRELATION = 0.6  # a disturbed side whose block medians follow their order this closely drifted (drift)
DRIFT_MIN_BLOCKS = 6     # fewer blocks say too little about a trend


def _spread(medians: Sequence[float]) -> float:
    """A side's relative spread of block medians (slowest / fastest - 1); 0 without positive medians."""
    return max(medians) / min(medians) - 1.0 if medians and min(medians) > 0 else 0.0


def block_spread(result: ABResult) -> float:
    """The larger of the two sides' relative spread of block medians (slowest / fastest - 1)."""
    return max(_spread(result.a.block_medians), _spread(result.b.block_medians))


def disturbed(result: ABResult, floor: float) -> bool:
    """Whether some blocks of a side ran far slower than its others: a spread above DISTURBED_SPREAD and
    DISTURBED_FLOORS noise floors. The median of pair ratios then mixes stalled pairs with steady ones
    (the final A/B of one H200 run: baseline blocks of 117, 117, 117, 220, 190 and 334 ms against a
    steady 29-30 ms gave 0.201, where its three steady pairs gave 0.250-0.258)."""
    return block_spread(result) > max(DISTURBED_SPREAD, DISTURBED_FLOORS * floor)


def drift(result: ABResult) -> str | None:
    """Says which side drifted, if any: a side whose block medians spread by more than DISTURBED_SPREAD and follow
    their order (``ab_stats.order_correlation`` at least DRIFT_CORRELATION either way) was not in a steady state
    while it was timed; None for steady sides and for stalls scattered among steady blocks. The final measurement
    of an H200 run at `large-cached` (2026-12-01), timed while the best configuration's device caches filled: its
    blocks took 24-26 ms for four blocks, 33 for the fifth, then 43-64 ms, rank correlation 0.80 (0.75 in its
    repeat; the baseline's 0.50 and 0.29)."""
    said = []
    for side in (result.a, result.b):
        medians = side.block_medians
        if len(medians) < DRIFT_MIN_BLOCKS or _spread(medians) <= DISTURBED_SPREAD:
            continue
        rho = order_correlation(medians)
        if abs(rho) >= DRIFT_CORRELATION:
            q = max(1, len(medians) // 4)
            said.append(f"{side.label}'s blocks {'slowed' if rho > 0 else 'sped up'} as it ran, from "
                        f"{statistics.median(medians[:q]) * 1e3:.1f} ms (the first {q}) to "
                        f"{statistics.median(medians[-q:]) * 1e3:.1f} ms (the last {q}), rank correlation {rho:.2f} "
                        f"with their order: it was not in a steady state")
    return "; ".join(said) or None


def steadier_of_two(measure: Callable[[int], ABResult]) -> tuple[ABResult, list[ABResult]]:
    """``measure(repeat)`` once; when ``disturbed`` (against its own floor) or not clean (``ABResult.clean``: outside
    load, no lock), once more (repeat 1), and quote the clean run, else the run of the smaller block spread, its
    ``note`` saying why: (quoted, every run made). The agent's final measurement and ``sg-opt bench --vs`` both
    measure this way, so that a run's figure and its fresh re-measurement are measured alike."""
    first = measure(0)
    stalled = disturbed(first, first.floor)
    if first.failure is not None or (not stalled and first.clean):
        return first, [first]
    repeat = measure(1)
    stalls, why = first.stalls(), []
    if stalled:
        why.append(f"disturbed (block spread {block_spread(first):.0%}, noise floor {first.floor:.3f}"
                   f"{'; ' + stalls if stalls else ''})")
    if not first.clean:
        why.append(f"not clean ({first.load_note()})")
    said = f"the first measurement was {' and '.join(why)}; it was repeated"
    if repeat.failure is not None:
        return first.model_copy(update={"note": f"{said}, the repeat failed ({repeat.failure.kind}), and the "
                                                f"first is quoted"}), [first, repeat]
    quoted = min((first, repeat), key=lambda run: (not run.clean, block_spread(run)))
    which = "the clean run" if first.clean != repeat.clean else "the steadier run"
    trend = drift(quoted)
    return quoted.model_copy(update={"note": f"{said} (block spread {block_spread(repeat):.0%}), and {which}, "
                                             f"{'the first' if quoted is first else 'the repeat'}, is quoted"
                                             + (f"; in it, {trend}" if trend else "")}), [first, repeat]

