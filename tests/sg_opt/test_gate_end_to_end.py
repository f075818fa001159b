"""`sg-opt gate` end to end on a temporary git repository holding a small target: an injected 15% slowdown and a
change of the math must fail, an unchanged tree pass, an impossible budget end inconclusive, set-up errors be one
sentence, and figures saved with `sg-opt bench --save` serve as the baseline."""

from __future__ import annotations

import json
import re
import shutil
import xml.etree.ElementTree as ET

import pytest
from typer.testing import CliRunner

from sg_opt import gate_report, saved_baseline
from sg_opt.cli import app
from sg_opt.gate import INCONCLUSIVE_EXIT
from sg_opt.gate_report import write_reports
from tests.fixtures.gate_repo import (FIXTURE, MODULE, OTHER_MATH, SLOWER, TARGET, change, commit_change, git,
                                      worktrees)

# The copy's slow loader sleeps 15 ms a step and its batch is cut to 64 rows, so the step is mostly a
# sleep: a short measurement stays steady on a busy machine (the gate's logic is under test, not torch). Blocks of
# 0.15 s, not the default 0.5: an unchanged tree's gate then took 19 s instead of 43, with floors of 1% and
# intervals within 1.2% of 1, beside a one-core busy loop too (2-core VM, 2026-12-07).
SHORT = ["--target", TARGET, "--size", "tiny", "--threads", "1", "--blocks", "4", "--block-steps", "3",
         "--block-seconds", "0.15", "--warmup", "2", "--numerics-steps", "4", "--timeout", "120"]

runner = CliRunner()


def gate(*args: str):
    return runner.invoke(app, ["gate", *SHORT, *args])


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
