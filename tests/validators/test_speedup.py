"""The side-by-side benchmark cannot fool itself: its statistics on synthetic timings with known truth and its
protocol on canned results (real workers: ``test_ab_workers.py``; disturbed and drifting runs:
``test_disturbed.py``)."""

from __future__ import annotations

import os

import numpy as np
import pytest

import validators.confirmation as confirmation
import validators.speedup as speedup
from targets.worker_protocol import Failure, WorkerRequest
from validators.ab_stats import (MIN_FLOOR, analyse, block_order, bootstrap_ratio_ci, decide, floor_from, paired_ratio,
                                 pairs_ratio, pairs_ratio_ci)
from validators.ab_result import ABResult, SidesMismatch, SideSummary, assert_sides, spec_digest
from validators.speedup import MAX_STEP_FACTOR, CalibrationFailed, calibrate_noise_floor, equal_time_steps
from validators.confirmation import confirm_win
from validators.machine_load import LoadRecord
from validators.timing_worker import overlap_builds, shared_cpus

BASE_STEP_S = 3e-3


def synthetic(seed: int, blocks: int = 10, steps: int = 10, truth: float = 1.0, sigma: float = 0.05,
              drift: float = 0.1, outlier_rate: float = 0.02, process_bias: float = 0.005):
    """Per-step times of both sides run in ``block_order``: lognormal noise, a linear drift over the run,
    rare 3x outliers (GC, preemption), a small random bias per process; side b is ``truth`` x side a."""
    rng = np.random.default_rng(seed)
    order = block_order(blocks)
    total = len(order) * steps
    scale = {"a": rng.lognormal(0, process_bias), "b": rng.lognormal(0, process_bias) * truth}
    out: dict[str, list[list[float]]] = {"a": [], "b": []}
    for n, side in enumerate(order):
        t = np.arange(n * steps, (n + 1) * steps)
        times = (BASE_STEP_S * scale[side] * (1 + drift * t / total) * rng.lognormal(0, sigma, steps)
                 * np.where(rng.random(steps) < outlier_rate, 3.0, 1.0))
        out[side].append(times.tolist())
    return out["a"], out["b"]


def calibrated_verdict(seed: int, truth: float, **kwargs) -> tuple[str, float]:
    """The protocol a caller follows: an A/A run sets the floor, then the A/B run is judged with it."""
    aa = analyse(*synthetic(10_000 + seed, **kwargs), floor=0.0, seed=seed)
    floor = floor_from([(aa.ratio, aa.ci_low, aa.ci_high)])
    ab = analyse(*synthetic(seed, truth=truth, **kwargs), floor=floor, seed=seed)
    return ab.verdict, ab.ratio


# -- pure statistics -------------------------------------------------------------------------------

def test_block_order_is_balanced():
    assert block_order(4) == ["a", "b", "b", "a", "a", "b", "b", "a"]
    order = block_order(10)
    positions = {s: np.mean([i for i, x in enumerate(order) if x == s]) for s in "ab"}
    assert positions["a"] == positions["b"]


def test_linear_drift_cancels_where_a_sequential_order_would_not():
    a, b = synthetic(0, sigma=0.0, drift=0.3, outlier_rate=0.0, process_bias=0.0)
    assert paired_ratio([np.median(x) for x in a], [np.median(x) for x in b]) == pytest.approx(1.0, abs=2e-3)
    a_then_b = [BASE_STEP_S * (1 + 0.3 * i / 20) for i in range(20)]  # all of A first, then all of B
    assert paired_ratio(a_then_b[:10], a_then_b[10:]) > 1.1


def test_outliers_do_not_move_the_ratio():
    a, b = synthetic(1, sigma=0.01, drift=0.0, outlier_rate=0.0)
    for block in b[::3]:
        block[0] *= 50.0  # one huge stall in every third block of one side
    stats = analyse(a, b, floor=0.01)
    assert stats.ratio == pytest.approx(1.0, abs=0.02) and stats.verdict == "no-difference"


def test_bootstrap_interval_is_seeded_and_brackets_the_estimate():
    a, b = synthetic(2, truth=1.05)
    medians = ([np.median(x) for x in a], [np.median(x) for x in b])
    assert bootstrap_ratio_ci(*medians, seed=7) == bootstrap_ratio_ci(*medians, seed=7)
    low, high = bootstrap_ratio_ci(*medians, seed=7)
    assert low <= paired_ratio(*medians) <= high
    with pytest.raises(ValueError):
        bootstrap_ratio_ci(medians[0], medians[1][:-1])


def test_decision_rule_needs_the_whole_interval_beyond_the_floor():
    assert decide(0.90, 0.97, floor=0.02) == "faster"
    assert decide(0.90, 0.985, floor=0.02) == "no-difference"
    assert decide(1.03, 1.10, floor=0.02) == "slower"
    assert decide(0.95, 1.05, floor=0.02) == "no-difference"


def test_floor_is_bias_plus_noise_of_the_worst_aa_run_and_never_below_one_percent():
    assert floor_from([(1.0, 0.998, 1.002)]) == 0.01
    assert floor_from([(1.02, 1.00, 1.04), (0.99, 0.98, 1.00)]) == pytest.approx(0.04)


def test_aa_false_accept_rate_is_at_most_one_percent():
    runs = 200
    verdicts = [calibrated_verdict(seed, truth=1.0) for seed in range(runs)]
    false_accepts = sum(v == "faster" for v, _ in verdicts)
    naive = sum(ratio < 1.0 for _, ratio in verdicts)  # "the ratio is below 1": what the rule guards against
    print(f"\nA/A synthetic: {false_accepts}/{runs} false accepts ({100 * false_accepts / runs:.1f}%); "
          f"a bare ratio < 1 would accept {naive}/{runs}")
    assert false_accepts / runs <= 0.01
    assert naive / runs > 0.3  # the data is noisy enough for a careless rule to fail this test


@pytest.mark.parametrize("truth,expected", [(1.10, "slower"), (1 / 1.10, "faster")])
def test_a_true_ten_percent_change_is_detected(truth, expected):
    runs = 100
    hits = sum(calibrated_verdict(seed, truth=truth)[0] == expected for seed in range(runs))
    assert hits / runs >= 0.95, f"{hits}/{runs}"


# -- sides -----------------------------------------------------------------------------------------

INCUMBENT = WorkerRequest(target="haste-rec", size="tiny", mode="bench", threads=1)
CANDIDATE = INCUMBENT.model_copy(update={"config": {"embedding_grad_mode": "fused"}})


def result_for(a: WorkerRequest, b: WorkerRequest, verdict: str = "faster", ratio: float = 0.8,
               ci: tuple[float, float] = (0.78, 0.82)) -> ABResult:
    sides = [SideSummary(label=label, digest=spec_digest(spec), spec=spec)
             for label, spec in (("incumbent", a), ("candidate", b))]
    return ABResult(a=sides[0], b=sides[1], ratio_definition="candidate_time / incumbent_time (below 1 is faster)",
                    ratio=ratio, ci_low=ci[0], ci_high=ci[1], floor=0.01, verdict=verdict, order=block_order(2),
                    blocks=2, steps_per_block=1)


def scripted(monkeypatch, *results: ABResult) -> list[tuple]:
    """Replace the process-level measurement with canned results (for calibrations and decisions alike),
    recording each call's sides."""
    calls, queue = [], list(results)

    def fake(a, b, *args, **kwargs):
        calls.append((a, b))
        return queue.pop(0)
    for module in (speedup, confirmation):
        monkeypatch.setattr(module, "measure_ab", fake)
    return calls


def test_calibration_takes_the_worst_aa_run(monkeypatch):
    calls = scripted(monkeypatch, result_for(INCUMBENT, INCUMBENT, "no-difference", 1.01, (0.99, 1.03)),
                     result_for(INCUMBENT, INCUMBENT, "no-difference", 0.97, (0.95, 1.01)))
    seen = []
    floor = calibrate_noise_floor(INCUMBENT, 4, 5, 60, repeats=2, on_run=seen.append)
    assert floor.floor == pytest.approx(0.03 + 0.03) and len(floor.runs) == 2
    assert calls == [(INCUMBENT, INCUMBENT)] * 2
    assert [r.ratio for r in seen] == [1.01, 0.97]  # each run as it ended (bench --vs prints them)


def test_calibration_refuses_a_failed_aa_run(monkeypatch):
    failed = result_for(INCUMBENT, INCUMBENT, "failed")
    failed.failure = Failure(kind="crash", message="A2: the worker was killed by SIGKILL")
    scripted(monkeypatch, failed)
    with pytest.raises(CalibrationFailed, match="SIGKILL"):
        calibrate_noise_floor(INCUMBENT, 4, 5, 60, repeats=1)


@pytest.mark.parametrize("second,accepted", [("faster", True), ("no-difference", False), ("failed", False)])
def test_a_win_is_accepted_only_if_fresh_processes_confirm_it(monkeypatch, second, accepted):
    calls = scripted(monkeypatch, result_for(INCUMBENT, CANDIDATE),
                     result_for(INCUMBENT, CANDIDATE, second, 0.99, (0.95, 1.02)))
    confirmed = confirm_win(INCUMBENT, CANDIDATE, 0.02, 4, 5, 60)
    assert confirmed.accepted is accepted and len(confirmed.runs) == 2 and len(calls) == 2


@pytest.mark.parametrize("which", [0, 1])
def test_a_win_from_a_measurement_that_was_not_clean_is_refused_unjudged(monkeypatch, which):
    """Outside load past the re-runs (or no lock) taints a measurement: its ``faster`` is no win, either time."""
    runs = [result_for(INCUMBENT, CANDIDATE), result_for(INCUMBENT, CANDIDATE)]
    runs[which].load = LoadRecord(reruns=4, rerun_load=[1.2], loaded_pairs=2, clean=False)
    calls = scripted(monkeypatch, *runs)
    confirmed = confirm_win(INCUMBENT, CANDIDATE, 0.02, 4, 5, 60)
    assert not confirmed.accepted and not confirmed.clean and len(calls) == which + 1
    assert "not measured clean (2 block pairs ran with more than 0.30 CPUs" in confirmed.reason
    assert "the candidate was not judged" in confirmed.reason
    assert result_for(INCUMBENT, CANDIDATE).clean  # a result from before load was recorded counts as clean


def test_no_win_means_no_second_measurement_and_swaps_are_caught(monkeypatch):
    calls = scripted(monkeypatch, result_for(INCUMBENT, CANDIDATE, "no-difference", 0.99, (0.95, 1.02)))
    assert not confirm_win(INCUMBENT, CANDIDATE, 0.02, 4, 5, 60).accepted and len(calls) == 1
    with pytest.raises(SidesMismatch, match="swapped"):
        confirm_win(INCUMBENT, CANDIDATE, 0.02, 4, 5, 60, first=result_for(CANDIDATE, INCUMBENT))


def timed(a: WorkerRequest, b: WorkerRequest, a_medians, b_medians, floor: float = 0.01, seed: int = 0) -> ABResult:
    """A result as measure_ab makes it from the two sides' block medians (one step a block)."""
    stats = analyse([[m] for m in a_medians], [[m] for m in b_medians], floor, seed=seed)
    result = result_for(a, b, stats.verdict, stats.ratio, (stats.ci_low, stats.ci_high))
    result.a.block_medians, result.b.block_medians = stats.a_medians, stats.b_medians
    result.floor, result.blocks, result.order = floor, len(a_medians), block_order(len(a_medians))
    return result


def test_pooled_judges_both_measurements_each_pair_of_workers_a_unit():
    first = timed(INCUMBENT, CANDIDATE, [10.0, 11.0, 10.0, 14.0], [9.0, 10.5, 9.2, 15.0])
    more = timed(INCUMBENT, CANDIDATE, [10.0, 10.2, 10.1, 10.0], [9.3, 9.4, 9.3, 9.2])
    first.a.ready_s, first.a.startup = 13.3, {"start": 4.0, "build": 6.0, "warmup": 3.3}
    first.load, more.load = LoadRecord(reruns=1, rerun_load=[0.5]), LoadRecord(loaded_pairs=1, clean=False)
    first.a.clock_agreement, more.a.clock_agreement = 0.97, 0.91
    both = confirmation.pooled([first, more])
    assert both.pools == 2 and both.blocks == 8 and len(both.order) == 16
    assert not both.clean and both.load.reruns == 1 and both.a.clock_agreement == 0.91
    assert both.a.ready_s is None and both.a.startup is None  # two pairs of workers: each measurement keeps its own
    assert both.a.block_medians == first.a.block_medians + more.a.block_medians
    runs = [(r.a.block_medians, r.b.block_medians) for r in (first, more)]
    low, high = pairs_ratio_ci(runs)
    assert (both.ratio, both.ci_low, both.ci_high, both.verdict) == (pairs_ratio(runs), low, high,
                                                                     decide(low, high, 0.01))
    with pytest.raises(SidesMismatch):
        confirmation.pooled([first, timed(INCUMBENT, INCUMBENT, [1.0, 1.0], [1.0, 1.0])])


def test_a_measurement_that_leans_faster_is_extended_once(monkeypatch):
    leaning = timed(INCUMBENT, CANDIDATE, [10.0, 13.0, 10.0, 12.5], [9.1, 12.6, 9.0, 13.0])
    assert leaning.verdict == "no-difference" and confirmation.leans_faster(leaning)
    steady = timed(INCUMBENT, CANDIDATE, [10.0, 10.1, 10.0, 10.1], [9.1, 9.2, 9.1, 9.0])
    calls = scripted(monkeypatch, leaning, steady, leaning, steady)
    confirmed = confirm_win(INCUMBENT, CANDIDATE, 0.01, 4, 5, 60)
    assert len(calls) == 4 and [r.pools for r in confirmed.runs] == [1, 1, 2, 1, 1, 2]
    assert confirmed.accepted and "extended once" in confirmed.reason
    # a measurement that says no-difference without leaning, or slower, is not extended
    calls = scripted(monkeypatch, timed(INCUMBENT, CANDIDATE, [10.0, 13.0, 10.0, 12.5], [10.2, 12.6, 10.1, 13.0]))
    assert not confirm_win(INCUMBENT, CANDIDATE, 0.01, 4, 5, 60).accepted and len(calls) == 1


def synthetic_protocol(monkeypatch, truth: float, extend: bool, trials: int = 150) -> float:
    """The share of trials in which confirm_win accepts, each trial with its own floor from an A/A run of a
    quiet incumbent (the agent calibrates on its baseline), then timed on noisy blocks (a few steps each, 12%
    per-step noise: at `large` the incumbent became host-bound and its intervals ran to +-10%)."""
    noisy, quiet = dict(blocks=6, steps=3, sigma=0.12), dict(blocks=6, steps=10, sigma=0.03)
    draws = iter(range(10**6))

    def fake(a, b, blocks, steps_per_block, timeout_s, *args, floor=0.0, seed=0, **kwargs):
        stats = analyse(*synthetic(20_000 + next(draws), truth=truth, **noisy), floor=floor, seed=seed)
        return timed(a, b, stats.a_medians, stats.b_medians, floor, seed)
    accepted = 0
    with monkeypatch.context() as patched:
        patched.setattr(confirmation, "measure_ab", fake)
        if not extend:
            patched.setattr(confirmation, "leans_faster", lambda result: False)
        for trial in range(trials):
            aa = analyse(*synthetic(50_000 + trial, **quiet), floor=0.0, seed=trial)
            floor = floor_from([(aa.ratio, aa.ci_low, aa.ci_high)])
            accepted += confirm_win(INCUMBENT, CANDIDATE, floor, 6, 3, 60, seed=trial).accepted
    return accepted / trials


def test_the_extension_finds_more_true_wins_and_no_more_false_ones(monkeypatch):
    null_with, null_without = (synthetic_protocol(monkeypatch, 1.0, e) for e in (True, False))
    win_with, win_without = (synthetic_protocol(monkeypatch, 0.9, e) for e in (True, False))
    print(f"\nconfirm_win on noisy synthetic blocks: A/A accepted {null_with:.1%} extended, {null_without:.1%} not; "
          f"a true 10% win accepted {win_with:.1%} extended, {win_without:.1%} not")
    assert null_with <= 0.01
    assert win_with >= win_without + 0.1


def test_assert_sides_accepts_the_right_sides_and_catches_a_swap():
    assert_sides(result_for(INCUMBENT, CANDIDATE), INCUMBENT, CANDIDATE)
    with pytest.raises(SidesMismatch, match="swapped"):
        assert_sides(result_for(CANDIDATE, INCUMBENT), INCUMBENT, CANDIDATE)
    other = CANDIDATE.model_copy(update={"config": {"precision": "bf16"}})
    with pytest.raises(SidesMismatch, match="side b"):
        assert_sides(result_for(INCUMBENT, other), INCUMBENT, CANDIDATE)


def test_shared_cpus_are_the_last_allowed_cpus_for_the_thread_count():
    allowed = sorted(os.sched_getaffinity(0))
    one = INCUMBENT.model_copy(update={"threads": 1})
    assert shared_cpus(one, one) == allowed[-1:]
    assert shared_cpus(one, one.model_copy(update={"threads": 64})) == allowed  # never more than allowed
    assert shared_cpus(one, one.model_copy(update={"threads": None})) == allowed  # torch's choice: all cores


def test_spec_digest_sees_kernel_sources_not_just_their_path(tmp_path):
    (tmp_path / "tail_forward.py").write_text("def tail_forward(*a): ...\n")
    spec = INCUMBENT.model_copy(update={"kernels_dir": str(tmp_path)})
    before = spec_digest(spec)
    (tmp_path / "tail_forward.py").write_text("def tail_forward(*a): return None\n")
    assert spec_digest(spec) != before
    assert spec_digest(INCUMBENT) == spec_digest(INCUMBENT.model_copy(update={"steps": 99}))


def test_a_faster_side_runs_more_steps_so_both_blocks_last_as_long():
    settle = {"a": [0.116, 0.115, 0.117], "b": [0.0088, 0.0087, 0.0090]}  # the 2026-11-30 x13.36 `large` final, roughly
    assert equal_time_steps(settle, 3) == {"a": 3, "b": 40}  # ceil(3 * 0.116 / 0.0088)
    assert equal_time_steps({"a": [1.0], "b": [1.0]}, 5) == {"a": 5, "b": 5}
    assert equal_time_steps({"a": [0.5], "b": [1.0]}, 5) == {"a": 10, "b": 5}  # whichever side is faster
    assert equal_time_steps({"a": [1.0], "b": [1e-6]}, 4) == {"a": 4, "b": 4 * MAX_STEP_FACTOR}


def test_blocks_last_block_seconds_after_the_incumbent_got_faster():
    # the x12.42 `large` run (2026-11-30): steps_per_block 3 was sized on the 115 ms baseline; the incumbent then
    # took 9 ms
    settle = {"a": [0.0092, 0.0091, 0.0093], "b": [0.0080, 0.0081, 0.0079]}
    assert equal_time_steps(settle, 3) == {"a": 3, "b": 4}  # 27 ms blocks without a floor on their length
    assert equal_time_steps(settle, 3, block_seconds=0.3) == {"a": 33, "b": 38}  # ceil(0.3 / median)
    # a block already longer than block_seconds is left as it was, and the cap still holds
    assert equal_time_steps({"a": [0.116], "b": [0.0088]}, 3, block_seconds=0.3) == {"a": 3, "b": 40}
    assert equal_time_steps({"a": [1e-6], "b": [1e-6]}, 3, block_seconds=0.3) == {"a": 96, "b": 96}


def test_sides_build_at_once_only_on_a_gpu():
    cpu = INCUMBENT
    gpu = INCUMBENT.model_copy(update={"device": "cuda"})
    assert overlap_builds(gpu, gpu.model_copy(update={"device": "cuda:0"}))
    assert not overlap_builds(cpu, cpu) and not overlap_builds(gpu, cpu)


def test_calibration_asks_its_aa_runs_to_stop_once_settled_below_half_the_minimum_floor(monkeypatch):
    asked = []
    monkeypatch.setattr(speedup, "measure_ab", lambda *a, **kw: asked.append(kw["settled_below"])
                        or result_for(INCUMBENT, INCUMBENT, verdict="no-difference", ratio=1.0))
    calibrate_noise_floor(INCUMBENT, 40, 3, 60, repeats=2)
    assert asked == [MIN_FLOOR / 2] * 2
