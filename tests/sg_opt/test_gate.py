"""The CI gate: its rules on known numbers, then end to end on a temporary git repository holding a
small target, where an injected slowdown and a change of the math must fail and an unchanged tree pass,
and against figures saved with `sg-opt bench --save`."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from sg_opt import gate_report, saved_baseline
from sg_opt.cli import app
from sg_opt.gate import is_regression, judge_step_time
from sg_opt.gate_report import write_reports
from targets.worker_client import scrubbed_env
from targets.worker_protocol import Environment

FIXTURE = Path(__file__).parents[1] / "fixtures" / "agent_target.py"
MODULE = "gate_target"
TARGET = f"{MODULE}:target"
# The copy's slow loader sleeps 15 ms a step and its batch is cut to 64 rows, so the step is mostly a
# sleep: a short measurement stays steady on a busy machine (the gate's logic is under test, not torch).
SHORT = ["--target", TARGET, "--size", "tiny", "--threads", "1", "--blocks", "4", "--block-steps", "3",
         "--warmup", "2", "--numerics-steps", "4", "--timeout", "120"]
SLOWER = ("        self.steps += 1\n", "        self.steps += 1\n        time.sleep(0.02)\n")
OTHER_MATH = ("self.w -= 0.05 * self.w.grad", "self.w -= 0.04 * self.w.grad")

runner = CliRunner()


# -- the rules -------------------------------------------------------------------------------------

@pytest.mark.parametrize("ratio,ci_low,floor,regression", [
    (1.00, 0.97, 0.02, False),  # noise
    (1.04, 1.03, 0.02, False),  # real, but within the allowed 5%
    (1.08, 1.01, 0.02, False),  # beyond 5% by its point, yet the interval touches the floor: not shown
    (1.10, 1.06, 0.02, True),  # a real 10% slowdown
    (1.06, 1.04, 0.02, True),  # a real 6% slowdown: the interval need not clear 5%, only the floor
    (1.20, 1.07, 0.08, False),  # a noisy machine cannot show it
])
def test_regression_rule(ratio, ci_low, floor, regression):
    assert is_regression(ratio, ci_low, floor, 0.05) is regression


def test_step_time_check_explains_itself_and_warns_when_the_floor_is_too_wide():
    check, warnings = judge_step_time(1.10, 1.06, 1.14, 0.02, "test", 0.05, 10.0, 11.0)
    assert not check.passed and "10.0% slower" in check.message and not warnings
    check, warnings = judge_step_time(1.01, 0.95, 1.07, 0.08, "test", 0.05, 10.0, 10.1)
    assert check.passed and len(warnings) == 1 and "wider than the allowed" in warnings[0]


def test_unpaired_comparison_separates_noise_from_a_real_slowdown():
    rng = np.random.default_rng(0)
    saved = [(0.01 * rng.lognormal(0, 0.05, 20)).tolist() for _ in range(2)]
    for truth, regression in ((1.0, False), (1.15, True)):
        current = [(0.01 * truth * rng.lognormal(0, 0.05, 20)).tolist() for _ in range(2)]
        ratio, low, high = saved_baseline.unpaired_ratio(saved, current)
        floor = saved_baseline.unpaired_floor(saved_baseline.block_medians(saved),
                                              saved_baseline.block_medians(current))
        assert low <= ratio <= high and floor >= saved_baseline.UNPAIRED_MIN_FLOOR
        assert is_regression(ratio, low, floor, 0.05) is regression


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
    assert report["passed"] and report["mode"] == "ref" and report["step_time"]["floor_source"].startswith("2 ")
    assert report["ab"]["a"]["root"] != report["ab"]["b"]["root"] is None  # A ran in the checkout of HEAD
    suite = ET.parse(tmp_path / "gate.xml").getroot()
    assert suite.get("failures") == "0" and [c.get("name") for c in suite.iter("testcase")] == ["step-time", "numerics"]
    assert "sg-opt gate: passed" in summary.read_text()
    assert worktrees(repo) == 1  # the checkout of the ref is gone


def test_injected_slowdown_fails(repo, tmp_path):
    commit_change(repo, SLOWER, "sleep in the step")
    result = gate("--ref", "HEAD~1", "--floor", "0.1", "--junit", str(tmp_path / "gate.xml"))
    assert result.exit_code == 1, result.output
    assert "FAIL" in result.stdout and "slower" in result.stdout
    failures = {c.get("name"): c.find("failure") for c in ET.parse(tmp_path / "gate.xml").getroot().iter("testcase")}
    assert failures["step-time"] is not None and "slower than A" in failures["step-time"].get("message")
    assert failures["numerics"] is None  # a sleep changes no number


def test_a_base_tree_checked_out_already_is_compared_as_a_ref(repo, tmp_path):
    """--ref-tree: the base as a folder (a CI job's second checkout; no git needed), the change uncommitted."""
    base = tmp_path / "base"
    base.mkdir()
    shutil.copy(repo / f"{MODULE}.py", base / f"{MODULE}.py")
    change(repo / f"{MODULE}.py", SLOWER)
    result = gate("--ref-tree", str(base), "--floor", "0.1", "--json")
    assert result.exit_code == 1, result.output
    report = json.loads(result.stdout)
    assert not report["step_time"]["passed"] and report["numerics"]["passed"]
    assert report["ab"]["a"]["root"] == str(base.resolve()) and report["ab"]["b"]["root"] is None
    for args, words in ((("--ref-tree", str(tmp_path / "nowhere")), "is not a folder"),
                        (("--ref-tree", str(base), "--ref", "HEAD"), "give exactly one of")):
        result = gate(*args)
        output = " ".join(result.output.split())  # rich wraps long lines
        assert result.exit_code == 2 and words in output and "Traceback" not in output


def test_changed_math_fails_the_numerics(repo):
    commit_change(repo, OTHER_MATH, "another learning rate")
    result = gate("--ref", "HEAD~1", "--floor", "0.1", "--json")
    assert result.exit_code == 1, result.output
    report = json.loads(result.stdout)
    assert report["step_time"]["passed"] and not report["numerics"]["passed"]
    assert report["numerics"]["verdict"]["failed_quantity"] == "loss"


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


def test_saved_baseline_passes_unchanged_and_refuses_another_device(repo, tmp_path):
    saved = tmp_path / "baseline.json"
    result = runner.invoke(app, ["bench", "--target", TARGET, "--size", "tiny", "--threads", "1", "--steps", "16",
                                 "--warmup", "2", "--phase-steps", "0", "--save", str(saved)])
    assert result.exit_code == 0, result.output
    record = saved_baseline.load(str(saved))
    assert [len(run) for run in record.step_s] == [16, 16] and len(record.block_medians) == 8
    assert record.numerics.losses
    assert record.host.cpu_model and record.request.target == TARGET and record.commit

    result = runner.invoke(app, ["gate", "--baseline", str(saved), "--json"])
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
    host = saved_baseline.HostInfo(cpu_model="some CPU", cpu_count=8)
    record = saved_baseline.SavedBaseline.model_construct(environment=env, host=host)
    assert saved_baseline.machine_mismatch(record, env, host) is None
    assert "device cuda" in saved_baseline.machine_mismatch(record, env.model_copy(update={"device": "cpu"}), host)
    assert "H100" in saved_baseline.machine_mismatch(record, env.model_copy(update={"device_name": "H100"}), host)
    other_cpu = host.model_copy(update={"cpu_model": "another CPU"})
    assert saved_baseline.machine_mismatch(record, env, other_cpu) is None  # on a GPU the host CPU only warns
    assert saved_baseline.environment_warnings(record, env, other_cpu)
