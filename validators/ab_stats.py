"""The statistics of a side-by-side measurement, pure functions of block timings: the balanced block order,
block medians, the paired ratio and its bootstrap interval (over one pair of workers' block pairs, or over several
pairs of workers, each pair of workers the unit), the decision rule and the noise floor.
``validators.speedup`` says why each is so and runs the measurements; these are tested on synthetic timing
distributions without processes (``tests/validators/test_speedup.py``)."""

from __future__ import annotations

from typing import Literal, Sequence

import numpy as np
from pydantic import BaseModel

from validators.timing_worker import Side

Verdict = Literal["faster", "slower", "no-difference", "failed"]

RESAMPLES = 2000
CONFIDENCE = 0.95
MIN_FLOOR = 0.01


def block_order(blocks: int) -> list[Side]:
    """The run order of ``blocks`` blocks per side: A B, B A, A B, ... (pairs alternate who goes first)."""
    return [side for r in range(blocks) for side in (("a", "b") if r % 2 == 0 else ("b", "a"))]


def block_medians(blocks: Sequence[Sequence[float]]) -> list[float]:
    return [float(np.median(block)) for block in blocks]


def order_correlation(medians: Sequence[float]) -> float:
    """Spearman's rank correlation of a side's block medians with the order they ran in: near +1 for a side that
    slowed block after block (a cache filling, a queue building up), near -1 for one that sped up, near 0 for
    stalls scattered among steady blocks. 0 for fewer than three blocks or all alike."""
    if len(medians) < 3:
        return 0.0
    values = np.asarray(medians, float)
    _, tie, ties = np.unique(values, return_inverse=True, return_counts=True)
    ranks = np.empty(values.size)
    ranks[np.argsort(values, kind="stable")] = np.arange(values.size)
    ranks = (np.bincount(tie, weights=ranks) / ties)[tie]  # equal medians share their mean rank
    if np.ptp(ranks) == 0:
        return 0.0
    return float(np.corrcoef(np.arange(len(medians), dtype=float), ranks)[0, 1])


def pair_ratios(a_medians: Sequence[float], b_medians: Sequence[float]) -> np.ndarray:
    """B's block median over A's, pair by pair (pair r ran in round r of ``block_order``)."""
    a, b = np.asarray(a_medians, float), np.asarray(b_medians, float)
    if a.size != b.size or a.size == 0:
        raise ValueError(f"need the same, non-zero number of blocks per side, not {a.size} and {b.size}")
    return b / a


def paired_ratio(a_medians: Sequence[float], b_medians: Sequence[float]) -> float:
    """The point estimate of candidate/incumbent time: the median of the pair ratios."""
    return float(np.median(pair_ratios(a_medians, b_medians)))


def bootstrap_ratio_ci(a_medians: Sequence[float], b_medians: Sequence[float], resamples: int = RESAMPLES,
                       confidence: float = CONFIDENCE, seed: int = 0) -> tuple[float, float]:
    """Percentile interval of the paired ratio, resampling block pairs."""
    ratios = pair_ratios(a_medians, b_medians)
    pick = np.random.default_rng(seed).integers(0, ratios.size, size=(resamples, ratios.size))
    ratios = np.median(ratios[pick], axis=1)
    tail = (1.0 - confidence) / 2.0
    low, high = np.quantile(ratios, [tail, 1.0 - tail])
    return float(low), float(high)


def pairs_ratio(runs: Sequence[tuple[Sequence[float], Sequence[float]]]) -> float:
    """The ratio over several pairs of workers, each given as (A's block medians, B's): the geometric mean of
    each pair's ``paired_ratio``, every pair of workers weighing the same however many blocks it ran."""
    return float(np.exp(np.mean([np.log(paired_ratio(a, b)) for a, b in runs])))


def pairs_ratio_ci(runs: Sequence[tuple[Sequence[float], Sequence[float]]], resamples: int = RESAMPLES,
                   confidence: float = CONFIDENCE, seed: int = 0) -> tuple[float, float]:
    """Percentile interval of ``pairs_ratio``, resampling at two levels: pairs of workers, then the block pairs
    of each pair drawn. Two identical workers differ by an offset of their own that lasts as long as they do
    (the allocator's state decides how many of a step's pages fault anew: `tiny` on the 2-core VM paid 3,460-4,005
    minor faults a step on average in six fresh processes, and at ~2 us each that was over half its 14 ms step),
    so one pair's blocks are not independent draws of the ratio: pooled as if they were, the interval over eight
    pairs of identical workers, offsets of 8% (sd) and block noise of 1%, held 1 in 50% of 200 synthetic draws, and
    drawn this way in 89%. It carries the spread between pairs, and narrows as pairs, not blocks, accrue. Over
    few pairs whose offsets far exceed their block noise it still runs narrow (57% for two such pairs; with
    offsets no larger than the noise of a pair's median, as on the VM, over 95%). One pair: ``bootstrap_ratio_ci``."""
    if len(runs) == 1:
        return bootstrap_ratio_ci(*runs[0], resamples, confidence, seed)
    ratios = [pair_ratios(a, b) for a, b in runs]
    rng = np.random.default_rng(seed)
    pick = rng.integers(0, len(ratios), size=(resamples, len(ratios)))
    logs = np.empty(pick.shape)
    for j, pairs in enumerate(ratios):
        drawn = pick == j
        draws = pairs[rng.integers(0, pairs.size, size=(int(drawn.sum()), pairs.size))]
        logs[drawn] = np.log(np.median(draws, axis=1))
    tail = (1.0 - confidence) / 2.0
    low, high = np.quantile(np.exp(logs.mean(axis=1)), [tail, 1.0 - tail])
    return float(low), float(high)


def decide(ci_low: float, ci_high: float, floor: float) -> Verdict:
    """The accept rule: the whole interval must clear the noise floor."""
    if ci_high < 1.0 - floor:
        return "faster"
    if ci_low > 1.0 + floor:
        return "slower"
    return "no-difference"


class RatioStats(BaseModel):
    a_medians: list[float]
    b_medians: list[float]
    ratio: float
    ci_low: float
    ci_high: float
    floor: float
    verdict: Verdict


def analyse(a_blocks: Sequence[Sequence[float]], b_blocks: Sequence[Sequence[float]], floor: float,
            resamples: int = RESAMPLES, confidence: float = CONFIDENCE, seed: int = 0) -> RatioStats:
    """Per-step times of each side's blocks -> ratio, bootstrap interval and verdict."""
    a, b = block_medians(a_blocks), block_medians(b_blocks)
    low, high = bootstrap_ratio_ci(a, b, resamples, confidence, seed)
    return RatioStats(a_medians=a, b_medians=b, ratio=paired_ratio(a, b), ci_low=low, ci_high=high,
                      floor=floor, verdict=decide(low, high, floor))


def bias_plus_noise(ratio: float, ci_low: float, ci_high: float) -> float:
    """What an A/A run says this machine can fake: how far its ratio is from 1 plus its interval's half-width."""
    return abs(1.0 - ratio) + (ci_high - ci_low) / 2.0


def floor_from(aa_runs: Sequence[tuple[float, float, float]]) -> float:
    """The noise floor from A/A runs given as (ratio, ci_low, ci_high): bias plus noise of the worst
    one, never below MIN_FLOOR."""
    return max([MIN_FLOOR] + [bias_plus_noise(*run) for run in aa_runs])
