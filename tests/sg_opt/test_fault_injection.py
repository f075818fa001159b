"""SIGKILL at seeded random points: `sg-opt bench`, `optimize` and `gate` leave no process behind; a killed run
loses no accepted candidate and overwrites no file its checkpoint names, whatever the point; a killed gate's
worktree is pruned by the next gate.

A kill point is a time, or for optimize a number of the run's events followed by a time, so that kills land
inside every node and the run still gets on between them. Each command has TRIALS kills (SG_OPT_FAULT_TRIALS): 3 in
the suite, an early, a middle and a late one (``_kill_times``), and the full 20 in `make test-faults`.
"""

from __future__ import annotations

import hashlib
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

import pytest

from sg_opt.report import load_state
from tests.fixtures.orphans import kill_when, survivors
from tests.fixtures.quick_measurement import quick_measurement

ROOT = Path(__file__).resolve().parents[2]
SEED = 20261206
TRIALS = int(os.environ.get("SG_OPT_FAULT_TRIALS", "3"))  # `make test-faults`: the full 20 a command
CLI = [sys.executable, "-m", "sg_opt.cli"]
AGENT_TARGET = ROOT / "tests" / "fixtures" / "agent_target.py"

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]


def _start(args: list[str], cwd: Path) -> subprocess.Popen:
    return subprocess.Popen([*CLI, *args], cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)


def _after(seconds: float, first: Callable[[], bool] = lambda: True) -> Callable[[], bool]:
    """Ready ``seconds`` after ``first()`` first said so."""
    since: list[float] = []

    def ready() -> bool:
        if not since and first():
            since.append(time.monotonic())
        return bool(since) and time.monotonic() - since[0] >= seconds
    return ready


def _kill_times(rng: random.Random, low: float, high: float) -> list[float]:
    """TRIALS kill times, one drawn in each of TRIALS equal slices of [low, high], in random order: every part of
    the command's life gets a kill however few the trials (five plain uniform draws put two of the gate's kills
    0.04 s apart and none past 10.3 s of a 15 s gate)."""
    width = (high - low) / TRIALS
    times = [rng.uniform(low + i * width, low + (i + 1) * width) for i in range(TRIALS)]
    rng.shuffle(times)
    return times


def _killed(proc: subprocess.Popen, ready: Callable[[], bool], what: str) -> int:
    seen = kill_when(proc, ready)
    assert survivors(seen) == [], f"{what}: processes outlived the kill"
    return proc.returncode


def test_bench_killed_at_random_points_leaves_no_process():
    for trial, at in enumerate(_kill_times(random.Random(SEED), 0.2, 8.0)):
        _killed(_start(["bench", "--size", "tiny", "--steps", "5", "--warmup", "1", "--phase-steps", "1",
                        "--threads", "1"], ROOT), _after(at), f"bench trial {trial}, killed at {at:.2f} s")


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _checkpointed(run_dir: Path) -> tuple[set[int], dict[Path, str]]:
    """The accepted candidates of the run's last checkpoint, and every file it names with its digest (the report
    files aside: each report rewrites them)."""
    state = load_state(run_dir)
    if state is None:
        return set(), {}
    rewritten = {Path(f).name for f in state.report_files}
    named: dict[Path, str] = {}

    def walk(value: Any) -> None:
        if isinstance(value, str) and value.startswith(str(run_dir) + "/"):
            path = Path(value)
            if path.is_file() and path.name not in rewritten:
                named[path] = _digest(path)
        elif isinstance(value, dict):
            for item in value.values():
                walk(item)
        elif isinstance(value, list):
            for item in value:
                walk(item)
    walk(state.model_dump())
    return {e.candidate.id for e in state.history if e.verdict.accepted}, named


class RunRecord:
    """What a run's checkpoints promised so far: accepted candidates, named files, its logs' contents."""

    def __init__(self, run_dir: Path):
        self.run_dir, self.accepted, self.named, self.logs = run_dir, set(), {}, {}

    def check(self, what: str) -> None:
        accepted, named = _checkpointed(self.run_dir)
        assert self.accepted <= accepted, f"{what}: accepted candidates lost: {self.accepted - accepted}"
        for path, digest in self.named.items():
            assert path.is_file() and _digest(path) == digest, f"{what}: {path} was overwritten or removed"
        for name, text in self.logs.items():
            assert (self.run_dir / name).read_bytes().startswith(text), f"{what}: {name} was rewritten"
        self.accepted |= accepted
        self.named.update(named)
        self.logs = {name: (self.run_dir / name).read_bytes() for name in ("events.jsonl", "ledger.jsonl")
                     if (self.run_dir / name).is_file()}


def _events(run_dir: Path | None) -> int:
    try:
        return (run_dir / "events.jsonl").read_text().count("\n") if run_dir else 0
    except OSError:
        return 0


def test_optimize_killed_at_random_points_loses_no_accepted_candidate_and_overwrites_no_file(tmp_path):
    rng = random.Random(SEED + 1)
    out = tmp_path / "runs"
    start = ["optimize", "--target", "tests.fixtures.agent_target:target", "--size", "tiny", "--threads", "1",
             "--timeout", "20", "--max-iters", "3", *quick_measurement(), "--out", str(out), "--json"]
    run: RunRecord | None = None
    finished = 0
    for trial in range(TRIALS):
        args = start if run is None else ["optimize", "--resume", str(run.run_dir), "--out", str(out), "--json"]
        events, seconds = rng.choice([0, 0, 1, 1, 2, 3]), rng.uniform(0.2, 6.0)
        before = _events(run.run_dir if run else None)
        if run is None:
            made = set(out.iterdir()) if out.is_dir() else set()
            new = lambda: [p for p in (set(out.iterdir()) if out.is_dir() else set()) - made]  # noqa: E731
            reached = lambda: events == 0 or any(_events(p) >= events for p in new())  # noqa: E731
        else:
            reached = lambda: _events(run.run_dir) >= before + events  # noqa: E731
        what = f"optimize trial {trial} ({events} events, then {seconds:.2f} s)"
        code = _killed(_start(args, ROOT), _after(seconds, reached), what)
        if run is None:
            dirs = [p for p in new() if (p / "run.json").is_file()]
            run = RunRecord(dirs[0]) if dirs else None
        if run is not None:
            run.check(what)
            if code == 0:  # it finished before the kill: check it whole, then the next trials start another run
                assert (run.run_dir / "summary.json").is_file(), what
                run, finished = None, finished + 1
    if run is not None:  # the last one, to its end
        done = subprocess.run([*CLI, "optimize", "--resume", str(run.run_dir), "--out", str(out), "--json"], cwd=ROOT,
                              capture_output=True, text=True, timeout=400)
        assert done.returncode == 0, done.stderr[-3000:]
        run.check("the last resume")
        assert run.accepted, "no candidate was accepted: the kills never met one"


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, check=True).stdout


def _worktrees(repo: Path) -> list[str]:
    return [line.removeprefix("worktree ") for line in _git(repo, "worktree", "list", "--porcelain").splitlines()
            if line.startswith("worktree ")]


def test_gate_killed_at_random_points_leaves_no_process_and_no_worktree(tmp_path):
    repo = tmp_path / "repo"
    repo.mkdir()
    _git(repo, "init", "-q")
    shutil.copy(AGENT_TARGET, repo / "gate_target.py")
    _git(repo, "add", ".")
    _git(repo, "-c", "user.email=t@t", "-c", "user.name=t", "commit", "-qm", "base")
    args = ["gate", "--target", "gate_target:target", "--size", "tiny", "--threads", "1", "--blocks", "4",
            "--block-steps", "3", "--block-seconds", "0.15", "--warmup", "2", "--numerics-steps", "4", "--timeout",
            "60", "--ref", "HEAD", "--max-extensions", "0", "--allow-inconclusive", "--floor", "0.5",
            "--max-regression", "10"]
    trees: set[str] = set()
    # kills over the gate's whole life: 9 s here alone on the 2-core VM (2026-12-07), longer in the busy suite
    for trial, at in enumerate(_kill_times(random.Random(SEED + 2), 0.3, 10.0)):
        _killed(_start(args, repo), _after(at), f"gate trial {trial}, killed at {at:.2f} s")
        trees.update(_worktrees(repo)[1:])
    done = subprocess.run([*CLI, *args], cwd=repo, capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stderr[-3000:]
    assert _worktrees(repo) == [str(repo.resolve())]  # the last gate pruned what the killed ones left
    assert not [tree for tree in trees if Path(tree).exists()]
