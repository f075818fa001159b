"""Faults around a run: a memory cap, runs started together, a damaged or emptied checkpoint, a gate killed with
its worktree registered, and what a run directory holds for others to read. Each ends in one sentence, with
nothing lost and nothing overwritten."""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import json
import multiprocessing
import re
import shutil
import signal
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from sg_opt.cli import app
from sg_opt.gate_checkout import prune_left_behind
from sg_opt.report import load_state
from sg_opt.run_store import RunRequest, create_run
from state_machine import events, nodes
from state_machine.context import RunContext
from state_machine.node_clock import CLOCK_FILE
from state_machine.portable import TRACES_FILE, portable
from tests.fixtures.orphans import kill_when
from tests.fixtures.quick_measurement import quick_measurement

ROOT = Path(__file__).resolve().parents[2]
runner = CliRunner()


@pytest.mark.slow
def test_a_memory_cap_hit_is_an_oom_failure():
    """Under a cap (ulimit -v, a container's limit) torch's CPU allocator raises a plain RuntimeError."""
    code = ("import resource, torch\n"
            "from targets.worker import failure_of\n"
            "size = int(open('/proc/self/statm').read().split()[0]) * resource.getpagesize()\n"
            "resource.setrlimit(resource.RLIMIT_AS, (size + 2**28, resource.RLIM_INFINITY))\n"
            "try:\n"
            "    torch.ones(2**30, dtype=torch.uint8)\n"
            "except Exception as exc:\n"
            "    print(failure_of(exc).kind, type(exc).__name__)\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.stdout.split() == ["oom", "RuntimeError"], done.stderr[-2000:]


def _create_many(out: str, start, count: int, made) -> None:
    start.wait()
    for _ in range(count):
        made.put(create_run(out, RunRequest(run_id="20261201-000000-t-tiny-offline", target="t", size="tiny")).name)


def test_runs_started_together_with_the_same_out_each_get_a_directory(tmp_path):
    """Six processes, twenty runs each, all in the same second under the same --out (5 of 360 failed before)."""
    out = str(tmp_path / "runs")
    ctx = multiprocessing.get_context("fork")
    start, made = ctx.Barrier(6), ctx.Queue()
    procs = [ctx.Process(target=_create_many, args=(out, start, 20, made)) for _ in range(6)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(60)
    assert [proc.exitcode for proc in procs] == [0] * 6
    names = [made.get(timeout=5) for _ in range(120)]
    assert len(set(names)) == 120 and sorted(p.name for p in Path(out).iterdir()) == sorted(names)
    for name in names:
        assert json.loads((Path(out) / name / "run.json").read_text())["run_id"] == name


def _digests(run_dir: Path) -> dict[str, str]:
    return {str(p.relative_to(run_dir)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(run_dir.rglob("*")) if p.is_file() and p.name != "checkpoints.sqlite"}


@pytest.fixture
def finished_run(agent_run: Path, tmp_path) -> Path:
    """A copy of the session's real finished run, to damage."""
    run_dir = tmp_path / "runs" / agent_run.name
    shutil.copytree(agent_run, run_dir)
    return run_dir


@pytest.mark.parametrize("damage", ["truncated", "empty", "missing"])
def test_a_damaged_or_emptied_checkpoint_refuses_resume_and_report_still_works(finished_run, damage):
    db = finished_run / "checkpoints.sqlite"
    if damage == "truncated":
        db.write_bytes(db.read_bytes()[: db.stat().st_size // 3])
    elif damage == "empty":
        db.write_bytes(b"")
    else:
        db.unlink()
    before = _digests(finished_run)
    resumed = runner.invoke(app, ["optimize", "--resume", str(finished_run)])
    assert resumed.exit_code == 2, resumed.output
    assert "cannot be resumed" in resumed.output and "Traceback" not in resumed.output
    assert _digests(finished_run) == before  # baseline/, candidates/ and the rest untouched
    report = runner.invoke(app, ["report", str(finished_run)])
    assert report.exit_code == 0, report.output
    assert "accepted" in report.output


def test_the_run_directory_holds_no_absolute_path_and_no_trace(agent_run: Path):
    here = str(agent_run.resolve())
    for name in ("summary.json", "events.jsonl"):
        text = (agent_run / name).read_text()
        assert here not in text and str(agent_run) not in text, name
        assert "Traceback" not in text and not re.search(r'File ".*", line \d+', text), name
    summary = json.loads((agent_run / "summary.json").read_text())
    if summary["final"] is not None:
        assert (agent_run / summary["final"]["file"]).is_file()  # relative to the run directory


def test_an_event_keeps_paths_relative_and_moves_a_trace_to_the_log(tmp_path):
    run_dir = tmp_path / "runs" / "r"
    run_dir.mkdir(parents=True)
    trace = 'Traceback (most recent call last):\n  File "/x/y.py", line 3, in f\n    g()\nValueError: bad'
    ctx = RunContext(target=None)
    ctx.event(str(run_dir), events.IncumbentFailed(id=1, kind="crash",
                                                   reason=f"details in {run_dir}/candidates/001/ab.json"))
    ctx.event(str(run_dir), events.Report(stop_reason=trace, files=[str(run_dir / "report.md")]))
    failed, report = (json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines())
    assert failed["reason"] == "details in candidates/001/ab.json" and report["files"] == ["report.md"]
    assert report["stop_reason"] == f"ValueError: bad (trace in {TRACES_FILE})"
    assert 'File "/x/y.py", line 3' in (run_dir / TRACES_FILE).read_text()
    assert portable({"a": str(run_dir.resolve())}, str(run_dir)) == {"a": "."}


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), "-c", "user.email=t@t", "-c", "user.name=t", *args],
                          capture_output=True, text=True, check=True).stdout


def _checkout_then(repo: Path, commit: str, then: str) -> subprocess.Popen:
    """A process that checks ``commit`` out as a gate does, prints the tree, then runs ``then``."""
    code = ("import os, signal, sys, time\nfrom pathlib import Path\nfrom sg_opt.gate_checkout import ref_checkout\n"
            f"checkout = ref_checkout(Path({str(repo)!r}), {commit!r})\n"
            "print(checkout.__enter__(), flush=True)\n" + then)
    return subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE, text=True)


@pytest.mark.slow
def test_a_worktree_left_by_a_killed_gate_is_pruned_by_the_next_and_a_running_ones_is_kept(tmp_path):
    repo = tmp_path / "repo"
    repo.mkdir()
    _git(repo, "init", "-q")
    (repo / "a.txt").write_text("a\n")
    _git(repo, "add", "a.txt")
    _git(repo, "commit", "-qm", "a")
    commit = _git(repo, "rev-parse", "HEAD").strip()
    killed = _checkout_then(repo, commit, "os.kill(os.getpid(), signal.SIGKILL)\n")
    dead_tree = Path(killed.stdout.readline().strip())
    assert killed.wait(30) == -signal.SIGKILL
    assert str(dead_tree) in _git(repo, "worktree", "list")  # git keeps a killed gate's worktree
    running = _checkout_then(repo, commit, "time.sleep(120)\n")  # the next gate
    try:
        live_tree = Path(running.stdout.readline().strip())
        listed = _git(repo, "worktree", "list")
        assert str(dead_tree) not in listed and not dead_tree.parent.exists()
        assert prune_left_behind(repo) == []  # a running gate's worktree is kept
        assert str(live_tree) in _git(repo, "worktree", "list") and (live_tree / "a.txt").is_file()
    finally:
        running.send_signal(signal.SIGKILL)
        running.wait(30)
    assert prune_left_behind(repo) == [live_tree]
    assert _git(repo, "worktree", "list").count("\n") == 1


def _before_the_report(run_dir: Path) -> None:
    """Roll a finished run back to its checkpoint before the report node, as a run killed during it is."""
    with contextlib.closing(sqlite3.connect(run_dir / "checkpoints.sqlite")) as db, db:
        last, parent = db.execute("SELECT checkpoint_id, parent_checkpoint_id FROM checkpoints "
                                  "ORDER BY checkpoint_id DESC LIMIT 1").fetchone()
        db.execute("DELETE FROM checkpoints WHERE checkpoint_id = ?", (last,))
        db.execute("DELETE FROM writes WHERE checkpoint_id IN (?, ?)", (last, parent))


@pytest.mark.slow
def test_a_final_measurement_that_times_out_is_retried_reported_and_redone_on_resume(finished_run, monkeypatch):
    """It said "no faster configuration was proven" and exited 0, dropping the run's accepted changes."""
    _before_the_report(finished_run)
    measure_ab, calls = nodes.measure_ab, []

    def timing_out(*args, **kwargs):
        calls.append(1)
        bound = inspect.signature(measure_ab).bind(*args, **kwargs)
        bound.arguments["timeout_s"] = 0.01
        return measure_ab(*bound.args, **bound.kwargs)
    monkeypatch.setattr(nodes, "measure_ab", timing_out)
    failed = runner.invoke(app, ["optimize", "--resume", str(finished_run)])
    assert failed.exit_code == 1, failed.output
    assert "failed twice (timeout" in failed.output and "--resume" in failed.output and len(calls) == 2
    summary = json.loads((finished_run / "summary.json").read_text())
    assert summary["accepted"] >= 1 and summary["final"]["ratio"] is None
    assert "failed twice" in summary["final"]["note"] and "failed twice" in (finished_run / "report.md").read_text()
    assert "final-retry" in (finished_run / "events.jsonl").read_text()
    monkeypatch.setattr(nodes, "measure_ab", measure_ab)
    done = runner.invoke(app, ["optimize", "--resume", str(finished_run)])
    assert done.exit_code == 0, done.output
    assert "best: x" in done.output, done.output
    assert json.loads((finished_run / "summary.json").read_text())["final"]["ratio"]


@pytest.mark.slow
def test_a_baseline_killed_half_way_keeps_its_finished_parts_and_its_time(tmp_path):
    """Killed after its numerics runs, the baseline redid all of them on resume, and its minutes went uncounted
    ("5.1 minutes used of 4", really 8.1)."""
    out = tmp_path / "runs"
    cmd = [sys.executable, "-m", "sg_opt.cli", "optimize", "--target", "tests.fixtures.agent_target:target",
           "--size", "tiny", "--threads", "1", "--timeout", "20", "--max-iters", "1",
           *quick_measurement(recalibrate_after=None), "--out", str(out), "--json"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    parts = lambda: list(out.glob("*/baseline/parts/reordered.json"))  # noqa: E731
    kill_when(proc, lambda: bool(parts()))
    (done_part,) = parts()
    run_dir = done_part.parents[2]
    kept = _digests(run_dir / "baseline" / "parts")
    clock = json.loads((run_dir / CLOCK_FILE).read_text())
    assert clock["node"] == "baseline"
    killed_s = clock["alive"] - clock["started"]
    resumed = subprocess.run([sys.executable, "-m", "sg_opt.cli", "optimize", "--resume", str(run_dir), "--out",
                              str(out), "--pause-after", "0"], cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert resumed.returncode == 3, resumed.stderr[-3000:]  # paused after the baseline, its first node
    after = _digests(run_dir / "baseline" / "parts")  # the resumed baseline adds its A/A runs' part
    assert {name: after.get(name) for name in kept} == kept  # neither numerics run was redone
    lost = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()
            if '"lost-time"' in line]
    assert [(e["node"], round(e["seconds"], 3)) for e in lost] == [("baseline", round(killed_s, 3))]
    state = load_state(run_dir)
    assert state.baseline is not None and state.node_s["baseline"] > killed_s and state.elapsed_s > killed_s
