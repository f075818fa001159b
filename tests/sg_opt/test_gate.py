"""The CI gate's rules on known numbers, its extensions on canned measurements, and its reports (end to end on a
git repository: test_gate_end_to_end.py)."""

from __future__ import annotations

import os
import xml.etree.ElementTree as ET

import numpy as np
import pytest
from typer.testing import CliRunner

import sg_opt.gate as gate_module
import sg_opt.gate_side_by_side as side_by_side
from sg_opt import gate_report, run_machine, saved_baseline
from sg_opt.gate import (INCONCLUSIVE_EXIT, MAX_REGRESSION, GateOptions, GateResult, NumericsCheck, StepTimeCheck,
                         holds_a_bound, judge_step_time, outcome, step_verdict, until_clear)
from sg_opt.gate_side_by_side import Interleaved
from targets.worker_client import scrubbed_env
from targets.worker_protocol import Environment
from validators.ab_stats import bootstrap_ratio_ci, floor_from
from validators.confirmation import pooled
from tests.fixtures.ab_results import SPEC, measured
from validators.ab_result import ABResult, NoiseFloor

runner = CliRunner()


# -- the rules -------------------------------------------------------------------------------------

@pytest.mark.parametrize("ci_low,ci_high,floor,verdict", [
    (0.97, 1.03, 0.02, "pass"),  # noise
    (1.01, 1.04, 0.02, "pass"),  # real, but within the allowed 5%
    (1.06, 1.14, 0.02, "regression"),  # a real 10% slowdown
    (1.051, 1.07, 0.02, "regression"),  # the whole interval beyond 5%, and the floor below that
    (1.03, 1.09, 0.02, "inconclusive"),  # a 6% slowdown measured to +-3%: within 5% or not, it cannot say
    (1.01, 1.05, 0.02, "inconclusive"),  # an upper bound at the budget is not under it
    (0.98, 1.03, 0.08, "inconclusive"),  # under 5%, but on a machine where A/A runs differ by 8%
    (1.10, 1.20, 0.159, "inconclusive"),  # a 15% slowdown against a 15.9% floor (the old rule passed it)
    (1.30, 1.75, 0.627, "inconclusive"),  # a 52% slowdown against a 62.7% floor (likewise)
    (1.20, 1.30, 0.159, "regression"),  # beyond the allowed 5% and the 15.9% floor
])
def test_step_time_rule(ci_low, ci_high, floor, verdict):
    assert step_verdict(ci_low, ci_high, floor, 0.05) == verdict


def test_a_planted_slowdown_fails_and_a_no_op_passes_under_the_default_budget():
    """On synthetic block medians (2% noise a block): a 15% slowdown is a regression, identical code passes."""
    rng = np.random.default_rng(1)
    a = 0.010 * rng.lognormal(0, 0.02, 20)
    for truth, verdict in ((1.15, "regression"), (1.0, "pass")):
        b = truth * 0.010 * rng.lognormal(0, 0.02, 20)
        low, high = bootstrap_ratio_ci(a, b)
        assert step_verdict(low, high, 0.02, MAX_REGRESSION) == verdict


def test_step_time_check_says_why_it_is_inconclusive():
    check = judge_step_time(1.10, 1.06, 1.14, 0.02, "test", 0.05, 10.0, 11.0)
    assert check.verdict == "regression" and not check.passed and "10.0% slower" in check.message
    check = judge_step_time(1.01, 0.95, 1.07, 0.08, "test", 0.05, 10.0, 10.1)
    assert check.verdict == "inconclusive" and not check.passed
    assert "noise floor 8.0% is wider than the allowed 5%" in check.message and "holds 1.0500" in check.message
    check = judge_step_time(1.12, 1.08, 1.16, 0.10, "test", 0.05, 10.0, 11.2)
    assert "beyond the allowed regression but not clear of the noise floor" in check.message


def check_of(verdict: str, ci: tuple[float, float] = (0.99, 1.07), floor: float = 0.02) -> StepTimeCheck:
    ratio = sum(ci) / 2
    return StepTimeCheck(verdict=verdict, passed=verdict == "pass", ratio=ratio, ci_low=ci[0], ci_high=ci[1],
                         floor=floor, floor_source="test", max_regression=0.05, a_ms=10.0, b_ms=10.0 * ratio,
                         message=verdict)


def test_an_inconclusive_check_is_extended_up_to_the_cap_or_until_nothing_more_helps():
    seen = ["inconclusive", "inconclusive", "pass"]
    judged = until_clear(lambda: check_of(seen.pop(0)), lambda _: None, GateOptions(), lambda _: None)
    assert judged.verdict == "pass" and judged.extensions == 2 and judged.message == "pass"
    judged = until_clear(lambda: check_of("inconclusive"), lambda _: None, GateOptions(max_extensions=2),
                         lambda _: None)
    assert judged.extensions == 2 and judged.message.endswith("measured more 2 time(s) of at most 2 (--max-extensions)")
    judged = until_clear(lambda: check_of("inconclusive"), lambda _: "nothing left to measure", GateOptions(),
                         lambda _: None)
    assert judged.extensions == 0 and judged.message.endswith("then stopped: nothing left to measure")
    numerics_failed = NumericsCheck(passed=False, numerics_class="reorder", steps=4, message="loss differs")
    extend = gate_module.unless_numerics_failed(numerics_failed, lambda _: pytest.fail("measured more after numerics failed"))
    judged = until_clear(lambda: check_of("inconclusive"), extend, GateOptions(), lambda _: None)
    assert judged.message.endswith("then stopped: the numerics check fails the gate already")


def test_a_bound_in_the_interval_is_what_more_blocks_may_settle():
    assert holds_a_bound(check_of("inconclusive", (1.03, 1.09)))  # holds 1.05
    assert not holds_a_bound(check_of("inconclusive", (0.98, 1.03), floor=0.08))  # only the floor is too wide
    assert holds_a_bound(check_of("inconclusive", (1.06, 1.12), floor=0.08))  # holds 1.08, the floor's bound


def test_outcome_and_exit_code():
    numerics_ok = NumericsCheck(passed=True, numerics_class="reorder", steps=4, message="same")
    numerics_bad = numerics_ok.model_copy(update={"passed": False})
    allowed = GateOptions(allow_inconclusive=True)
    assert outcome(check_of("pass"), numerics_ok, GateOptions()) == ("pass", 0)
    assert outcome(check_of("regression"), numerics_ok, allowed) == ("regression", 1)
    assert outcome(check_of("pass"), numerics_bad, GateOptions()) == ("regression", 1)
    assert outcome(check_of("inconclusive"), numerics_bad, allowed) == ("regression", 1)  # a failure wins
    assert outcome(check_of("inconclusive"), numerics_ok, GateOptions()) == ("inconclusive", INCONCLUSIVE_EXIT)
    assert outcome(check_of("inconclusive"), numerics_ok, allowed) == ("inconclusive", 0)


# -- the extension, on canned measurements ---------------------------------------------------------

def canned(monkeypatch, aa: list[ABResult], ab: list[ABResult]) -> dict[str, int]:
    """measure_ab and calibrate_noise_floor as the gate calls them, answering from the lists; the calls counted."""
    calls = {"aa": 0, "ab": 0}

    def calibrate(spec, blocks, steps, timeout_s, repeats=2, **kwargs):
        runs = [aa.pop(0) for _ in range(repeats)]
        calls["aa"] += repeats
        return NoiseFloor(floor=floor_from([(r.ratio, r.ci_low, r.ci_high) for r in runs]), runs=runs)

    def measure(*args, floor=0.01, **kwargs):
        calls["ab"] += 1
        return ab.pop(0).model_copy(update={"floor": floor})
    monkeypatch.setattr(side_by_side, "calibrate_noise_floor", calibrate)
    monkeypatch.setattr(side_by_side, "measure_ab", measure)
    return calls


def noisy(seed: int, truth: float = 1.0, sigma: float = 0.04, blocks: int = 6) -> tuple[list[float], list[float]]:
    rng = np.random.default_rng(seed)
    return (0.01 * rng.lognormal(0, sigma, blocks)).tolist(), (truth * 0.01 * rng.lognormal(0, sigma, blocks)).tolist()


def test_a_wide_floor_is_calibrated_again_on_pooled_blocks_and_the_ab_pooled_until_it_is_clear(monkeypatch):
    """A/A runs of 6 blocks with 6% noise a block set a floor over 5%; more A/A and A/B runs, pooled (each pair of
    workers a unit), narrow the floor and the interval until identical code passes."""
    aa = [measured(*noisy(seed, sigma=0.06)) for seed in range(8)]
    ab = [measured(*noisy(100 + seed, sigma=0.03)) for seed in range(8)]
    calls = canned(monkeypatch, list(aa), list(ab))
    measurement = Interleaved(SPEC, ("ref", None), ("A", "B"), GateOptions(aa_runs=2), lambda _: None)
    measurement.measure()
    assert measurement.floor > MAX_REGRESSION  # the first floor: two short A/A runs, pooled
    check = until_clear(measurement.judge, measurement.extend, GateOptions(), lambda _: None)
    assert check.verdict == "pass" and 1 <= check.extensions <= 3, check.message
    assert calls["ab"] == 1 + 2 * check.extensions  # --ab-runs a look
    assert 2 < calls["aa"] <= 2 + 2 * check.extensions and calls["aa"] % 2 == 0  # --aa-runs where the floor is wide
    pooled_aa = pooled(aa[:calls["aa"]])
    assert check.floor == floor_from([(pooled_aa.ratio, pooled_aa.ci_low, pooled_aa.ci_high)]) <= MAX_REGRESSION
    assert "pooled" in check.floor_source and measurement.result.pools == calls["ab"]
    assert measurement.result.floor == check.floor


def test_a_clear_interval_under_a_wide_floor_extends_the_floor_only(monkeypatch):
    aa = [measured(*noisy(seed, sigma=0.06)) for seed in range(2)] + [measured([0.01] * 6, [0.01] * 6)] * 6
    same = [0.01, 0.0101, 0.0099, 0.01, 0.0101, 0.0099]
    calls = canned(monkeypatch, aa, [measured(same, same)])
    measurement = Interleaved(SPEC, ("ref", None), ("A", "B"), GateOptions(aa_runs=2), lambda _: None)
    measurement.measure()
    check = until_clear(measurement.judge, measurement.extend, GateOptions(), lambda _: None)
    assert calls["ab"] == 1 and calls["aa"] > 2 and check.verdict == "pass"


def offset_run(seed: int, offset: float) -> ABResult:
    """A run of identical code whose pair of workers carries an offset of its own, its blocks steady to 1%."""
    return measured(*noisy(seed, truth=offset, sigma=0.01, blocks=10))


def test_one_pair_of_workers_offset_from_the_others_is_no_regression_once_pairs_are_the_unit(monkeypatch):
    """Identical code; the first A/B pair of workers runs 9% apart, the others within 3%. Judged alone, or with
    every run's blocks pooled as one pair's, that reads as a regression; with the gate's first two A/B runs, each
    pair of workers a unit, it does not."""
    aa = [offset_run(seed, offset) for seed, offset in enumerate((1.03, 0.98, 1.0))]
    ab = [offset_run(100 + seed, offset) for seed, offset in
          enumerate((1.09, 1.0, 1.03, 0.99, 1.01, 0.98, 1.02, 1.0, 0.99))]
    calls = canned(monkeypatch, list(aa), list(ab))
    measurement = Interleaved(SPEC, ("ref", None), ("A", "B"), GateOptions(), lambda _: None)
    assert step_verdict(ab[0].ci_low, ab[0].ci_high, measurement.floor, MAX_REGRESSION) == "regression"
    measurement.measure(GateOptions().ab_runs)
    check = until_clear(measurement.judge, measurement.extend, GateOptions(), lambda _: None)
    assert check.verdict != "regression" and check.ci_low < 1.0 < check.ci_high, check.message
    used = ab[:calls["ab"]]
    blocks = bootstrap_ratio_ci([m for r in used for m in r.a.block_medians],
                                [m for r in used for m in r.b.block_medians])
    assert check.ci_high - check.ci_low > blocks[1] - blocks[0]
    assert measurement.result.pools == calls["ab"] >= 2


def test_once_a_run_has_waited_out_a_steady_outside_load_the_next_runs_start_at_once(monkeypatch):
    from validators.machine_load import LoadPolicy, LoadRecord
    steady = LoadRecord(outside_before=0.95, waited_s=60.0)
    same = [0.01, 0.0101, 0.0099, 0.01]
    canned(monkeypatch, [measured(same, same)] * 3, [])
    policies = []

    def measure(*args, load_policy=None, **kwargs):
        policies.append(load_policy)
        return measured(same, same).model_copy(update={"load": steady if len(policies) == 1 else LoadRecord()})
    monkeypatch.setattr(side_by_side, "measure_ab", measure)
    measurement = Interleaved(SPEC, ("ref", None), ("A", "B"), GateOptions(), lambda _: None)
    measurement.measure(3)
    assert policies[0] is None and policies[1] == policies[2] == LoadPolicy(wait_s=0.0)


# -- the reports -----------------------------------------------------------------------------------

def result_of(step: StepTimeCheck, options: GateOptions = GateOptions()) -> GateResult:
    numerics = NumericsCheck(passed=True, numerics_class="reorder", steps=4, message="same")
    return gate_module.gate_result("ref", SPEC, "A", "B", step, numerics, [], 0.0, options)


@pytest.mark.parametrize("verdict,allowed,first_line,failures,skipped,code", [
    ("pass", False, "## sg-opt gate: pass", "0", "0", 0),
    ("regression", False, "## sg-opt gate: regression (step time, +3.0%)", "1", "0", 1),
    ("inconclusive", False, "## sg-opt gate: inconclusive (step time)", "1", "0", 3),
    ("inconclusive", True, "## sg-opt gate: inconclusive (step time, let through by --allow-inconclusive)", "0",
     "1", 0),
])
def test_junit_and_summary_say_which_outcome(verdict, allowed, first_line, failures, skipped, code):
    result = result_of(check_of(verdict), GateOptions(allow_inconclusive=allowed))
    assert result.exit_code == code and result.passed is (verdict == "pass")
    assert gate_report.markdown(result).splitlines()[0] == first_line
    suite = ET.fromstring(gate_report.junit(result).split("\n", 1)[1])
    assert (suite.get("failures"), suite.get("skipped")) == (failures, skipped)
    step = next(c for c in suite.iter("testcase") if c.get("name") == "step-time")
    marked = step.find("failure") if step.find("failure") is not None else step.find("skipped")
    assert (marked is None) is (verdict == "pass")
    if marked is not None:
        assert marked.get("type") == verdict and marked.get("message").startswith(verdict)
    if verdict == "inconclusive":
        assert ("INCONCLUSIVE" in result.warnings[0]) is allowed and "neither within the allowed 5%" in \
            result.warnings[0]


def test_unpaired_comparison_separates_noise_from_a_real_slowdown():
    """Steps with 5% noise: the unpaired floor (2% + both sides' spreads) is near 9%, too wide to show that identical
    code is within 5%, wide enough to show a 15% slowdown."""
    rng = np.random.default_rng(0)
    saved = [(0.01 * rng.lognormal(0, 0.05, 20)).tolist() for _ in range(2)]
    for truth, verdicts in ((1.0, ("inconclusive", "pass")), (1.15, ("regression", "regression"))):
        current = [(0.01 * truth * rng.lognormal(0, 0.05, 20)).tolist() for _ in range(2)]
        ratio, low, high = saved_baseline.unpaired_ratio(saved, current)
        floor = saved_baseline.unpaired_floor(saved_baseline.block_medians(saved),
                                              saved_baseline.block_medians(current))
        assert low <= ratio <= high and floor >= saved_baseline.UNPAIRED_MIN_FLOOR
        assert tuple(step_verdict(low, high, floor, budget) for budget in (0.05, 0.10)) == verdicts


def test_a_worker_in_another_tree_imports_from_it_not_from_here(tmp_path):
    env = scrubbed_env(root=str(tmp_path))
    entries = env["PYTHONPATH"].split(os.pathsep)
    assert entries[0] == str(tmp_path) and os.getcwd() not in entries
    assert scrubbed_env()["PYTHONPATH"].split(os.pathsep)[0] == os.getcwd()


def test_machine_mismatch_names_the_difference():
    env = Environment(device="cuda", device_name="NVIDIA H200", torch="2.13", python="3.11", threads=8)
    host = run_machine.HostInfo(cpu_model="some CPU", cpu_count=8)
    record = saved_baseline.SavedBaseline.model_construct(environment=env, host=host)
    assert saved_baseline.machine_mismatch(record, env, host) is None
    assert "device cuda" in saved_baseline.machine_mismatch(record, env.model_copy(update={"device": "cpu"}), host)
    assert "H100" in saved_baseline.machine_mismatch(record, env.model_copy(update={"device_name": "H100"}), host)
    other_cpu = host.model_copy(update={"cpu_model": "another CPU"})
    assert saved_baseline.machine_mismatch(record, env, other_cpu) is None  # on a GPU the host CPU only warns
    assert saved_baseline.environment_warnings(record, env, other_cpu)
