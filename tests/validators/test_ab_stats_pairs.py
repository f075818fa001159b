"""The interval over several pairs of workers (``ab_stats.pairs_ratio_ci``): each pair of workers one unit, so that
offsets a pair carries through all its blocks widen the interval instead of passing for a difference."""

from __future__ import annotations

import numpy as np
import pytest

from validators.ab_stats import bootstrap_ratio_ci, pairs_ratio, pairs_ratio_ci


def offset_pairs(seed: int, pairs: int, offset: float = 0.08, noise: float = 0.01, blocks: int = 10,
                 truth: float = 1.0) -> list[tuple[list[float], list[float]]]:
    """Block medians of ``pairs`` pairs of workers, B ``truth`` times A's time, each pair off by its own offset
    (log-normal, sd ``offset``) and each block by ``noise``."""
    rng = np.random.default_rng(seed)
    runs = []
    for _ in range(pairs):
        off = np.exp(rng.normal(0.0, offset))
        a = 0.01 * np.exp(rng.normal(0.0, noise, blocks))
        runs.append((a.tolist(), (truth * off * 0.01 * np.exp(rng.normal(0.0, noise, blocks))).tolist()))
    return runs


def flat(runs):
    return [m for a, _ in runs for m in a], [m for _, b in runs for m in b]


def test_one_pair_is_the_block_bootstrap():
    runs = offset_pairs(0, 1)
    assert pairs_ratio_ci(runs, 500, seed=3) == bootstrap_ratio_ci(*runs[0], 500, seed=3)
    assert pairs_ratio(runs) == pytest.approx(float(np.median(np.divide(runs[0][1], runs[0][0]))))


def test_every_pair_of_workers_weighs_the_same_however_many_blocks_it_ran():
    long_slow = ([0.01] * 20, [0.011] * 20)
    short_fast = ([0.01] * 2, [0.01 / 1.1] * 2)
    assert pairs_ratio([long_slow, short_fast]) == pytest.approx(1.0)
    assert pairs_ratio_ci([long_slow, short_fast], 500) == pytest.approx((1 / 1.1, 1.1), rel=1e-9)


def test_offsets_between_pairs_widen_the_interval_where_pooled_blocks_exclude_identical_code():
    """Eight pairs of identical workers, offsets of 8% and blocks steady to 1%: pooled as independent blocks the
    interval misses 1 about half the time (a regression or a win of nothing); with pairs as units it holds 1 in
    most draws and is wider in each."""
    held = {"pairs": 0, "blocks": 0}
    for seed in range(100):
        runs = offset_pairs(seed, 8)
        pairs, blocks = pairs_ratio_ci(runs, 500, seed=seed), bootstrap_ratio_ci(*flat(runs), 500, seed=seed)
        assert pairs[1] - pairs[0] > blocks[1] - blocks[0]
        held["pairs"] += pairs[0] <= 1.0 <= pairs[1]
        held["blocks"] += blocks[0] <= 1.0 <= blocks[1]
    assert held["blocks"] <= 65 and held["pairs"] >= 80, held


def test_a_real_difference_is_still_seen_through_the_offsets():
    """A 20% slowdown through offsets of 3%: over five pairs the interval is clear of a 10% budget every time."""
    for seed in range(20):
        low, high = pairs_ratio_ci(offset_pairs(seed, 5, offset=0.03, truth=1.2), 500, seed=seed)
        assert 1.1 < low < high < 1.3
