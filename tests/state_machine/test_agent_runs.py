"""`sg-opt optimize` end to end with the offline tier: real workers, real measurements, real checkpoints.

These run the console command in a subprocess, as a user would, on two real targets: the bundled
trainer at size tiny (whose dense embedding gradient is a real bottleneck) and the agent test
target (a known win plus candidates that segfault, abort, hang, run out of memory or turn NaN).
"""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from sg_opt.cli import app
from tests.fixtures.quick_measurement import quick_measurement

AGENT_TARGET = "tests.fixtures.agent_target:target"
ROOT = Path(__file__).resolve().parents[2]


def optimize(*args: str, out: Path, timeout: float = 600) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "sg_opt.cli", "optimize", "--out", str(out), "--threads", "1", *args]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def only_run(out: Path) -> Path:
    (run_dir,) = [p for p in out.iterdir() if p.is_dir()]
    return run_dir


def events(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_a_killed_run_resumes_and_each_failing_candidate_costs_one_rejection(tmp_path):
    """Kill -9 mid-run, resume: no accepted result is lost, at most the candidate in flight is redone,
    and the candidates that segfault, abort, hang, OOM or turn NaN are each one rejection. (The hang costs the
    whole --timeout; this target's measurements take under 2 s each, beside a one-core busy loop too.)"""
    cmd = [sys.executable, "-m", "sg_opt.cli", "optimize", "--out", str(tmp_path), "--threads", "1", "--target",
           AGENT_TARGET, "--size", "tiny", "--timeout", "12", "--max-iters", "6", *quick_measurement(),
           "--json"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    run_dir = None
    while time.monotonic() < deadline:
        dirs = [p for p in tmp_path.iterdir() if p.is_dir()]
        if dirs and (dirs[0] / "events.jsonl").exists():
            run_dir = dirs[0]
            if any(e["event"] == "propose" and e["id"] == 2 for e in events(run_dir)):
                break  # candidate 1 was decided (accepted) and candidate 2 is in flight
        time.sleep(0.2)
    else:
        proc.kill()
        raise AssertionError("the run never reached its second candidate")
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not (run_dir / "summary.json").exists()

    done = optimize("--resume", run_dir.name, "--json", out=tmp_path)
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout)
    assert summary["candidates"][0]["change"] == "slow_loader=False" and summary["candidates"][0]["accepted"]
    assert [c["id"] for c in summary["candidates"]] == [1, 2, 3, 4, 5, 6]
    assert summary["stop_reason"].startswith("max-iters")
    by_change = {c["change"]: c for c in summary["candidates"]}
    expected = {"segfault": "SIGSEGV", "abort": "SIGABRT", "hang": "timeout", "oom": "oom", "nan": "nan"}
    for behaviour, words in expected.items():
        row = by_change[f"behaviour={behaviour}"]
        assert not row["accepted"] and row["stage"] == "validate" and words in row["reason"], row
    proposed = [e["id"] for e in events(run_dir) if e["event"] == "propose"]
    redone = {i for i in proposed if proposed.count(i) > 1}
    assert redone <= {2}, proposed  # at most the candidate in flight is redone
    assert sum(e["event"] == "baseline" for e in events(run_dir)) == 1


@pytest.mark.slow
def test_a_run_split_by_pause_after_pauses_between_nodes_and_resumes_to_the_end_an_unsplit_one_reaches(tmp_path):
    """The offline tier on tiny, given a few seconds per invocation (a job limit): it pauses at a checkpoint, exit
    3, saying how to go on; each invocation starts at least one step (here: setup, then the baseline), however
    little time it was given; resumed, it redoes nothing (one baseline) and ends as an unsplit run would: the
    dense embedding gradient's fix found and kept, a rejection explained, a report written. (One run checks both
    halves: each haste-rec run here costs a CI half-minute.)"""
    args = ("--target", "haste-rec", "--size", "tiny", "--max-iters", "2",
            *quick_measurement(block_steps=5, final_pairs=3))  # the default's pooling over fresh pairs, end to end
    first = optimize(*args, "--pause-after", "0", out=tmp_path)
    assert first.returncode == 3, first.stderr
    run_dir = only_run(tmp_path)
    assert "paused before baseline" in first.stderr and f"sg-opt optimize --resume {run_dir}" in first.stderr
    second = optimize("--resume", run_dir.name, "--pause-after", "0.05", out=tmp_path)
    assert second.returncode == 3, second.stderr
    paused = [e for e in events(run_dir) if e["event"] == "paused"]
    assert len(paused) == 2 and paused[1]["node"] not in ("setup", "baseline"), paused
    assert "--pause-after" in paused[1]["reason"]
    assert not (run_dir / "summary.json").exists()
    with sqlite3.connect(run_dir / "checkpoints.sqlite") as conn:  # compacted at the pause: what a resume reads
        assert conn.execute("SELECT count(*) FROM checkpoints").fetchone()[0] <= 4
    done = optimize("--resume", run_dir.name, "--json", out=tmp_path)
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout)
    assert summary["evaluated"] == 2 and summary["stop_reason"].startswith("max-iters")
    assert sum(e["event"] == "baseline" for e in events(run_dir)) == 1

    accepted = [c for c in summary["candidates"] if c["accepted"]]
    rejected = [c for c in summary["candidates"] if not c["accepted"]]
    assert accepted and accepted[0]["change"] == "embedding_grad_mode=fused"
    assert accepted[0]["numerics_class"] == "reorder" and accepted[0]["ratio"] < 1 - summary["noise_floor"]
    assert rejected and all(c["reason"] for c in rejected)
    assert summary["final"]["verdict"] == "faster" and summary["final"]["speedup"] > 1.5
    assert summary["spend"]["cost_usd"] == 0 and summary["spend"]["calls"] == 0
    for name in ("report.md", "summary.json", "best_config.toml", "ledger.jsonl", "checkpoints.sqlite"):
        assert (run_dir / name).exists(), name
    assert 'embedding_grad_mode = "fused"' in (run_dir / "best_config.toml").read_text()
    assert json.loads((run_dir / "final_ab.json").read_text())["pools"] == 3  # the final's three fresh pairs


def test_bad_input_gets_one_sentence_and_exit_2(tmp_path, monkeypatch):
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    monkeypatch.delenv("OPENAI_BASE_URL", raising=False)
    monkeypatch.setattr("torch.cuda.device_count", lambda: 4)  # --device cuda passes its own check on any machine
    bad_toml = tmp_path / "bad.toml"
    bad_toml.write_text("precision = \n")
    cases = [
        (["--target", "nope"], "unknown target"),
        (["--size", "giant"], "has no size"),
        (["--set", "precision=fp8"], "must be one of"),
        (["--resume", "no-such-run"], "no run"),
        (["--tier", "platinum"], "platinum"),
        (["--tier", "normal"], "OPENAI_API_KEY or pass --base-url"),
        (["--tiers", str(tmp_path / "missing.toml")], "missing.toml"),
        (["--tier", "normal", "--base-url", "http://127.0.0.1:9/v1"], "is unreachable"),
        (["--config", str(bad_toml)], "not valid TOML"),
        (["--gpus", "2"], "--gpus 2 evaluates candidates on separate GPUs: it needs --device cuda"),
        (["--gpus", "3", "--ranks", "2", "--device", "cuda"], "must be a multiple of --ranks 2"),
    ]
    for args, words in cases:
        result = CliRunner().invoke(app, ["optimize", "--out", str(tmp_path / "runs"), *args])
        assert result.exit_code == 2, (args, result.output)
        message = " ".join(result.stderr.split())  # rich wraps long lines
        assert words in message and "Traceback" not in message, (args, message)
    assert not (tmp_path / "runs").exists() or not list((tmp_path / "runs").iterdir())  # nothing left behind


@pytest.mark.slow
def test_a_run_whose_incumbent_fails_while_timed_stops_in_one_sentence_and_resumes(tmp_path, monkeypatch):
    """The measurement of candidate #1 finds the incumbent's worker failing (as the TPE oracle's hung in session
    15): the run stops with exit code 1 and one sentence, #1 undecided; resumed, it measures #1 and goes on."""
    from state_machine import nodes

    def measure(state, ctx):  # the graph names its nodes by their functions
        raise nodes.IncumbentFailed(f"the incumbent's worker failed while timed beside candidate "
                                    f"#{state.current.candidate.id} "
                                    "(timeout: incumbent: no ready line before the time limit)")
    real_measure = nodes.measure
    monkeypatch.setattr(nodes, "measure", measure)
    runner = CliRunner()
    args = ["optimize", "--out", str(tmp_path), "--threads", "1"]
    first = runner.invoke(app, [*args, "--target", AGENT_TARGET, "--size", "tiny", "--max-iters", "1",
                                *quick_measurement(), "--json"])
    assert first.exit_code == 1 and "the incumbent's worker failed while timed beside candidate #1" in first.output
    assert "Traceback" not in first.output
    run_dir = only_run(tmp_path)
    assert not any(e["event"] == "decide" for e in events(run_dir))
    monkeypatch.setattr(nodes, "measure", real_measure)
    done = runner.invoke(app, [*args, "--resume", run_dir.name, "--json"])
    assert done.exit_code == 0, done.output
    summary = json.loads(done.stdout)
    assert [c["id"] for c in summary["candidates"]] == [1] and summary["candidates"][0]["accepted"]
