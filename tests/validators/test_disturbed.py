"""Measurements with unsteady blocks: stalls mark a result disturbed and the steadier of two runs is quoted; a side
that slows block after block (not in a steady state) is named as drifting, in a quoted run's note and in an
accepted win's reason."""

from __future__ import annotations

import pytest

from tests.validators.test_speedup import CANDIDATE, INCUMBENT, result_for, scripted, timed
from validators.confirmation import confirm_win


def test_bench_vs_repeats_a_disturbed_measurement_and_quotes_the_steadier_run(monkeypatch):
    """As the agent's final measurement does (the x10.63 `large` run of 2026-11-30: winner blocks of 9.4-16.0 ms)."""
    import sg_opt.compare as compare
    stalled = timed(INCUMBENT, CANDIDATE, [110.3, 110.5, 110.4, 109.1], [10.2, 16.0, 9.4, 15.6])
    steady = timed(INCUMBENT, CANDIDATE, [110.1, 110.2, 110.0, 109.9], [10.1, 10.3, 10.2, 10.4])
    for runs, quoted, words in (([stalled, steady], steady, "the repeat, is quoted"),
                                ([steady], steady, None), ([stalled, stalled], stalled, "the first, is quoted")):
        queue = list(runs)
        monkeypatch.setattr(compare, "measure_ab", lambda *args, **kwargs: queue.pop(0))
        result, _ = compare.compare(INCUMBENT, CANDIDATE, 4, 3, 60, floor=0.01, pairs=1)
        assert not queue and result.ratio == quoted.ratio
        assert (result.note is None) if words is None else (words in result.note and "disturbed" in result.note)


def test_stalled_blocks_mark_a_measurement_disturbed():
    from validators.steadiness import block_spread, disturbed
    run = result_for(INCUMBENT, CANDIDATE)
    run.a.block_medians, run.b.block_medians = [0.117, 0.117, 0.117, 0.220, 0.190, 0.334], [0.029, 0.030, 0.029]
    assert block_spread(run) == pytest.approx(0.334 / 0.117 - 1) and disturbed(run, 0.011)
    run.a.block_medians = [0.117, 0.1184, 0.1165]  # a steady side: 1.6% (the GPU's A/A blocks)
    assert not disturbed(run, 0.011)
    run.a.block_medians = [0.100, 0.140]  # 40%: disturbed on a GPU (floor 0.011), noise on a busy CPU box
    assert disturbed(run, 0.011) and not disturbed(run, 0.10)


# The final measurement of the 2026-12-01 H200 run at `large-cached` (docs/results/2026-12-01-h200-large-cached/):
# host tables against the best configuration, timed while its device caches filled.
LARGE_CACHED_BASELINE = [0.1239, 0.1255, 0.125, 0.1434, 0.1264, 0.1322, 0.1263, 0.1259, 0.1298, 0.1318, 0.1262,
                         0.1296, 0.126, 0.1374, 0.1299, 0.171, 0.1324, 0.1285, 0.1393, 0.1282]
LARGE_CACHED_FILLING = [0.0249, 0.024, 0.0259, 0.024, 0.033, 0.0454, 0.0463, 0.0503, 0.0509, 0.048, 0.0505, 0.0557,
                        0.0582, 0.0536, 0.0555, 0.0521, 0.0636, 0.0589, 0.0629, 0.0426]


def test_a_side_that_slows_block_after_block_is_named_as_drifting_not_stalled():
    from validators.ab_stats import order_correlation
    from validators.steadiness import drift
    assert order_correlation(LARGE_CACHED_FILLING) > 0.75 and abs(order_correlation(LARGE_CACHED_BASELINE)) < 0.6
    assert order_correlation(LARGE_CACHED_FILLING[::-1]) < -0.75 and order_correlation([1.0, 1.0, 1.0]) == 0.0
    run = result_for(INCUMBENT, CANDIDATE)
    run.a.block_medians, run.b.block_medians = LARGE_CACHED_BASELINE, LARGE_CACHED_FILLING
    said = drift(run)
    assert said is not None and said.startswith(f"{run.b.label}'s blocks slowed as it ran, from 24.9 ms (the first 5)")
    assert "not in a steady state" in said and run.a.label not in said
    run.b.block_medians = [0.029, 0.030, 0.029, 0.060, 0.029, 0.030, 0.058, 0.029]  # stalls among steady blocks
    assert drift(run) is None


def test_bench_vs_says_when_the_quoted_run_drifted(monkeypatch):
    import sg_opt.compare as compare
    filling = timed(INCUMBENT, CANDIDATE, LARGE_CACHED_BASELINE, LARGE_CACHED_FILLING)
    queue = [filling, filling]
    monkeypatch.setattr(compare, "measure_ab", lambda *args, **kwargs: queue.pop(0))
    result, _ = compare.compare(INCUMBENT, CANDIDATE, 20, 3, 60, floor=0.038, pairs=1)
    assert not queue and "the first, is quoted; in it, " in result.note and "slowed as it ran" in result.note


def test_a_win_measured_while_a_side_drifted_says_so(monkeypatch):
    """The 2026-12-01 `large-cached` run accepted the device cache (#2) while its caches filled: a win whose
    measurements show a side slowing block after block is still accepted (the protocol's verdict), and its reason
    says the side was not in a steady state."""
    drifting = timed(INCUMBENT, CANDIDATE, LARGE_CACHED_BASELINE, LARGE_CACHED_FILLING)
    assert drifting.verdict == "faster"
    scripted(monkeypatch, drifting, drifting)
    confirmation = confirm_win(INCUMBENT, CANDIDATE, 0.038, 20, 3, 60)
    assert confirmation.accepted and "; but candidate's blocks slowed as it ran" in confirmation.reason
    steady = timed(INCUMBENT, CANDIDATE, [0.110, 0.111, 0.110, 0.109], [0.050, 0.051, 0.050, 0.050])
    scripted(monkeypatch, steady, steady)
    assert "steady state" not in confirm_win(INCUMBENT, CANDIDATE, 0.01, 4, 3, 60).reason


def test_a_disturbed_measurement_says_what_the_machine_stalled_on_in_its_blocks():
    """The 2026-12-04 A/A calibration at `large-cached`: both sides slowed together for a few blocks, and nothing in
    the measurement said why; the blocks' pressure stall shares now go into the repeat's note."""
    from validators.steadiness import steadier_of_two
    stalled = timed(INCUMBENT, CANDIDATE, [110.3, 110.5, 110.4, 109.1], [10.2, 16.0, 9.4, 15.6])
    quiet = {"cpu": 0.01, "memory": 0.0, "io": 0.0}
    stalled.a.block_pressure = [quiet, quiet, quiet, quiet]
    stalled.b.block_pressure = [quiet, {"cpu": 0.02, "memory": 0.31, "io": 0.0}, quiet,
                                {"cpu": 0.02, "memory": 0.27, "io": 0.0}]
    steady = timed(INCUMBENT, CANDIDATE, [110.1, 110.2, 110.0, 109.9], [10.1, 10.3, 10.2, 10.4])
    runs = [stalled, steady]
    quoted, _ = steadier_of_two(lambda repeat: runs[repeat])
    assert quoted.ratio == steady.ratio
    assert ("block spread 70%, noise floor 0.010; the machine stalled tasks waiting for memory 31% of a block at "
            "most (2 of 8 blocks over 5%)); it was repeated") in quoted.note
    runs = [stalled.model_copy(update={"a": stalled.a.model_copy(update={"block_pressure": []}),
                                       "b": stalled.b.model_copy(update={"block_pressure": []})}), steady]
    assert "stalled tasks" not in steadier_of_two(lambda repeat: runs[repeat])[0].note  # no counts: no claim


def test_a_measurement_that_was_not_clean_is_repeated_and_the_clean_run_quoted():
    """Outside load flags a run even when its blocks look steady: the repeat is quoted if it is clean."""
    from validators.machine_load import LoadRecord
    from validators.steadiness import steadier_of_two
    loaded = timed(INCUMBENT, CANDIDATE, [110.1, 110.2, 110.0, 109.9], [10.1, 10.3, 10.2, 10.4])
    loaded.load = LoadRecord(reruns=4, rerun_load=[1.5], loaded_pairs=1, clean=False)
    clean = timed(INCUMBENT, CANDIDATE, [110.3, 110.5, 110.4, 109.1], [10.2, 12.0, 9.4, 11.6])
    quoted, made = steadier_of_two(lambda repeat: [loaded, clean][repeat])
    assert len(made) == 2 and quoted.ratio == clean.ratio and quoted.clean
    assert quoted.note.startswith("the first measurement was not clean (1 block pairs ran with more than 0.30 CPUs")
    assert "and the clean run, the repeat, is quoted" in quoted.note
    quoted, made = steadier_of_two(lambda repeat: [loaded, loaded][repeat])
    assert not quoted.clean and "the steadier run, the first, is quoted" in quoted.note


def test_a_quoted_figure_pools_fresh_pairs_of_workers_and_stops_at_a_failure():
    from validators.confirmation import across_process_pairs
    from validators.speedup import Failure
    made = []

    def measure(seed, blocks):
        offset = 1 + 0.05 * len(made)  # each pair of workers with an offset of its own
        made.append(timed(INCUMBENT, CANDIDATE, [100.0] * blocks, [50.0 * offset] * blocks, seed=seed))
        return made[-1]
    result = across_process_pairs(measure, 20, 3, seed=7)
    assert [r.blocks for r in made] == [8, 8, 8] and result.blocks == 24
    middle = (0.5 * 0.525 * 0.55) ** (1 / 3)  # the pairs' geometric mean: each pair of workers a unit
    assert result.ratio == pytest.approx(middle) and result.ci_low <= middle <= result.ci_high
    made.clear()
    assert across_process_pairs(measure, 20, 1).blocks == 20 and len(made) == 1

    def failing(seed, blocks):
        run = measure(seed, blocks)
        return run.model_copy(update={"failure": Failure(kind="crash", message="died")}) if len(made) == 2 else run
    made.clear()
    assert across_process_pairs(failing, 6, 3).failure.kind == "crash" and len(made) == 2
