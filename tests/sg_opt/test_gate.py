"""The CI gate: its rules on known numbers and its extensions on canned measurements, then end to end on a
temporary git repository holding a small target, where an injected 15% slowdown and a change of the math must
fail, an unchanged tree pass and an impossible budget end inconclusive, and against figures saved with
`sg-opt bench --save`."""

from __future__ import annotations

import json
import re
import os
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

import sg_opt.gate as gate_module
import sg_opt.gate_side_by_side as side_by_side
from sg_opt import gate_report, run_machine, saved_baseline
from sg_opt.cli import app
from sg_opt.gate import (INCONCLUSIVE_EXIT, MAX_REGRESSION, GateOptions, GateResult, NumericsCheck, StepTimeCheck,
                         holds_a_bound, judge_step_time, outcome, step_verdict, until_clear)
from sg_opt.gate_side_by_side import Interleaved
from sg_opt.gate_report import write_reports
from targets.worker_client import scrubbed_env
from targets.worker_protocol import Environment, WorkerRequest
from validators.ab_stats import bootstrap_ratio_ci, floor_from
from validators.confirmation import pooled
from tests.fixtures.ab_results import measured
from validators.ab_result import ABResult, NoiseFloor

FIXTURE = Path(__file__).parents[1] / "fixtures" / "agent_target.py"
MODULE = "gate_target"
TARGET = f"{MODULE}:target"
# The copy's slow loader sleeps 15 ms a step and its batch is cut to 64 rows, so the step is mostly a
# sleep: a short measurement stays steady on a busy machine (the gate's logic is under test, not torch).
SHORT = ["--target", TARGET, "--size", "tiny", "--threads", "1", "--blocks", "4", "--block-steps", "3",
         "--warmup", "2", "--numerics-steps", "4", "--timeout", "120"]
# 2.5 ms more a step: a 15% slowdown of its 17 ms, which the default budget of 5% must fail (measured B/A
# 1.15-1.17, intervals within 1.14-1.20, floors of 1-3.5%, where identical code passed at 0.996-1.040)
SLOWER = ("        self.steps += 1\n", "        self.steps += 1\n        time.sleep(0.0025)\n")
OTHER_MATH = ("self.w -= 0.05 * self.w.grad", "self.w -= 0.04 * self.w.grad")

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

SPEC = WorkerRequest(target=TARGET, size="tiny", mode="bench")


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


# -- end to end on a git repository ----------------------------------------------------------------

def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True).stdout


def change(source: Path, edit: tuple[str, str]) -> None:
    text = source.read_text()
    assert edit[0] in text, f"the fixture changed: {edit[0]!r} is gone"
    source.write_text(text.replace(edit[0], edit[1]))


def commit_change(repo: Path, edit: tuple[str, str], message: str) -> None:
    change(repo / f"{MODULE}.py", edit)
    git(repo, "commit", "-qam", message)


@pytest.fixture
def repo(tmp_path, monkeypatch):
    """A git repository whose one commit holds a copy of the agent test target; the working directory."""
    root = tmp_path / "repo"
    root.mkdir()
    git(root, "init", "-q")
    git(root, "config", "user.email", "gate@test")
    git(root, "config", "user.name", "gate test")
    shutil.copy(FIXTURE, root / f"{MODULE}.py")
    git(root, "add", ".")
    git(root, "commit", "-qm", "base")
    monkeypatch.chdir(root)
    monkeypatch.setattr(sys, "path", list(sys.path))
    sys.modules.pop(MODULE, None)
    yield root
    sys.modules.pop(MODULE, None)


def gate(*args: str):
    return runner.invoke(app, ["gate", *SHORT, *args])


def worktrees(repo: Path) -> int:
    return git(repo, "worktree", "list", "--porcelain").count("worktree ")


@pytest.mark.slow
def test_unchanged_tree_passes_with_reports(repo, tmp_path, monkeypatch):
    summary = tmp_path / "summary.md"

    def write_reports_on_github(*args, **kwargs):
        # GitHub sets $GITHUB_STEP_SUMMARY for the whole job; here it is set as the gate writes its reports, where
        # it is read. Set before, it would be in the workers' environment, and each change of that starts another
        # fork server (seconds of torch imports): one for this test, one more for the next.
        monkeypatch.setenv("GITHUB_STEP_SUMMARY", str(summary))
        return write_reports(*args, **kwargs)

    monkeypatch.setattr(gate_report, "write_reports", write_reports_on_github)
    result = gate("--ref", "HEAD", "--blocks", "6", "--junit", str(tmp_path / "gate.xml"), "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["passed"] and report["outcome"] == "pass" and report["mode"] == "ref"
    assert re.match(r"\d+ interleaved A/A run", report["step_time"]["floor_source"])  # 2, more if extended
    assert report["ab"]["a"]["root"] != report["ab"]["b"]["root"] is None  # A ran in the checkout of HEAD
    suite = ET.parse(tmp_path / "gate.xml").getroot()
    assert suite.get("failures") == "0" and [c.get("name") for c in suite.iter("testcase")] == ["step-time", "numerics"]
    assert summary.read_text().startswith("## sg-opt gate: pass\n")
    assert worktrees(repo) == 1  # the checkout of the ref is gone


@pytest.mark.slow
def test_injected_slowdown_fails(repo, tmp_path):
    commit_change(repo, SLOWER, "sleep in the step")
    result = gate("--ref", "HEAD~1", "--aa-runs", "1", "--junit", str(tmp_path / "gate.xml"))
    assert result.exit_code == 1, result.output
    assert "REGRESSION" in result.stdout and "slower" in result.stdout
    suite = ET.parse(tmp_path / "gate.xml").getroot()
    failures = {c.get("name"): c.find("failure") for c in suite.iter("testcase")}
    assert suite.get("failures") == "1" and failures["step-time"].get("type") == "regression"
    assert "slower than A" in failures["step-time"].get("message")
    assert failures["numerics"] is None  # a sleep changes no number


@pytest.mark.slow
def test_a_base_tree_checked_out_already_is_compared_as_a_ref(repo, tmp_path):
    """--ref-tree: the base as a folder (a CI job's second checkout; no git needed), the change uncommitted."""
    base = tmp_path / "base"
    base.mkdir()
    shutil.copy(repo / f"{MODULE}.py", base / f"{MODULE}.py")
    change(repo / f"{MODULE}.py", SLOWER)
    result = gate("--ref-tree", str(base), "--floor", "0.03", "--json")
    assert result.exit_code == 1, result.output
    report = json.loads(result.stdout)
    assert not report["step_time"]["passed"] and report["numerics"]["passed"]
    assert report["ab"]["a"]["root"] == str(base.resolve()) and report["ab"]["b"]["root"] is None
    for args, words in ((("--ref-tree", str(tmp_path / "nowhere")), "is not a folder"),
                        (("--ref-tree", str(base), "--ref", "HEAD"), "give exactly one of"),
                        (("--ref-tree", str(base), "--floor", "0.1"), "is wider than --max-regression 0.05")):
        result = gate(*args)
        output = " ".join(result.output.split())  # rich wraps long lines
        assert result.exit_code == 2 and words in output and "Traceback" not in output


@pytest.mark.slow
def test_changed_math_fails_the_numerics(repo):
    commit_change(repo, OTHER_MATH, "another learning rate")
    # blocks of 0.1 s: the verdict here is the numerics', and a step-time budget of 50% passes noisier blocks too
    result = gate("--ref", "HEAD~1", "--floor", "0.03", "--max-regression", "0.5", "--block-seconds", "0.1", "--json")
    assert result.exit_code == 1, result.output
    report = json.loads(result.stdout)
    assert report["step_time"]["passed"] and not report["numerics"]["passed"] and report["outcome"] == "regression"
    assert report["numerics"]["verdict"]["failed_quantity"] == "loss"


@pytest.mark.slow
def test_an_inconclusive_gate_measures_more_then_exits_3_unless_allowed(repo, tmp_path):
    """An allowed regression of 0.1% is below any floor this machine can calibrate (at least 1%): no measurement
    can pass it, so the gate extends once (the cap) and exits 3; --allow-inconclusive makes that 0, loudly. Blocks
    of 0.1 s: a shorter block widens the floor and the interval, which keeps the verdict inconclusive."""
    tight = ("--ref", "HEAD", "--max-regression", "0.001", "--aa-runs", "1", "--block-seconds", "0.1")
    result = gate(*tight, "--max-extensions", "1", "--junit", str(tmp_path / "gate.xml"), "--json")
    assert result.exit_code == INCONCLUSIVE_EXIT, result.output
    report = json.loads(result.stdout)
    assert report["outcome"] == "inconclusive" and not report["passed"]
    step = report["step_time"]
    assert step["verdict"] == "inconclusive" and step["extensions"] == 1 and "pooled" in step["floor_source"]
    assert "of at most 1 (--max-extensions)" in step["message"] and report["warnings"][0].startswith("inconclusive")
    suite = ET.parse(tmp_path / "gate.xml").getroot()
    assert suite.get("failures") == "1" and next(suite.iter("failure")).get("type") == "inconclusive"

    # a fresh pair of identical workers may differ by more than one A/A run's floor (process offsets of up to 10% at
    # `tiny` on the 2-core VM), which reads as a regression: what is tested here is the inconclusive path, so again
    for _ in range(3):
        result = gate(*tight, "--max-extensions", "0", "--allow-inconclusive", "--junit", str(tmp_path / "allowed.xml"))
        if result.exit_code != 1 or "REGRESSION" not in result.output:
            break
    assert result.exit_code == 0, result.output
    assert "INCONCLUSIVE, let through by --allow-inconclusive" in " ".join(result.stdout.split())
    suite = ET.parse(tmp_path / "allowed.xml").getroot()
    assert (suite.get("failures"), suite.get("skipped")) == ("0", "1")
    assert worktrees(repo) == 1


@pytest.mark.slow
def test_set_up_errors_are_one_sentence_exit_2(repo, tmp_path, monkeypatch):
    result = gate("--ref", "no-such-rev")
    assert result.exit_code == 2 and "is not a commit" in result.output and "Traceback" not in result.output
    assert gate().exit_code == 2  # neither --ref nor --baseline
    git(repo, "rm", "-q", f"{MODULE}.py")
    git(repo, "commit", "-qm", "without the target")
    shutil.copy(FIXTURE, repo / f"{MODULE}.py")  # present here, absent at the ref: must not leak into A
    result = gate("--ref", "HEAD")
    assert result.exit_code == 2 and "does not run at" in result.output, result.output
    assert worktrees(repo) == 1
    elsewhere = tmp_path / "not-git"
    elsewhere.mkdir()
    shutil.copy(FIXTURE, elsewhere / f"{MODULE}.py")
    monkeypatch.chdir(elsewhere)
    result = gate("--ref", "HEAD")
    assert result.exit_code == 2 and "not inside a git repository" in result.output


@pytest.mark.slow
def test_saved_baseline_passes_unchanged_and_refuses_another_device(repo, tmp_path):
    saved = tmp_path / "baseline.json"
    result = runner.invoke(app, ["bench", "--target", TARGET, "--size", "tiny", "--threads", "1", "--steps", "16",
                                 "--warmup", "2", "--phase-steps", "0", "--save", str(saved)])
    assert result.exit_code == 0, result.output
    record = saved_baseline.load(str(saved))
    assert [len(run) for run in record.step_s] == [16, 16] and len(record.block_medians) == 8
    assert record.numerics.losses
    assert record.host.cpu_model and record.request.target == TARGET and record.commit

    # unpaired, the floor is 2% + both sides' spreads: a budget of 30% is one it can show on a busy machine
    result = runner.invoke(app, ["gate", "--baseline", str(saved), "--max-regression", "0.3", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["mode"] == "baseline" and report["passed"] and report["numerics"]["passed"]

    other = json.loads(saved.read_text())
    other["environment"]["device_name"] = "Imaginary Accelerator 9000"
    saved.write_text(json.dumps(other))
    result = runner.invoke(app, ["gate", "--baseline", str(saved)])
    assert result.exit_code == 2 and "cannot be compared" in result.output, result.output


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
