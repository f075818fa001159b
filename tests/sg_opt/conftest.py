"""Run directories shared by the report tests: one real short agent run per session, and a copy of it
given what a CPU offline run never has (LLM calls written by the real ledger, a real fine profile)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from sg_opt.cli import app
from sg_opt.ledger import TokenLedger
from sg_opt.tiers import Price
from state_machine.llm_interfaces import Usage
from validators.machine_load import LOAD_LIMIT_ENV
from tests.fixtures.openai_server import openai_server  # noqa: F401 (the scripted server, for every test here)
from tests.fixtures.quick_measurement import quick_measurement
from tests.fixtures.gate_repo import gate_repo

ROOT = Path(__file__).resolve().parents[2]
FINE = Path(__file__).with_name("test_report_fine.json")


@pytest.fixture(scope="session")
def agent_run(tmp_path_factory) -> Path:
    """One real `sg-opt optimize` of the agent test target, shared by the report tests."""
    out = tmp_path_factory.mktemp("runs")
    cmd = [sys.executable, "-m", "sg_opt.cli", "optimize", "--target", "tests.fixtures.agent_target:target",
           "--size", "tiny", "--threads", "1", "--timeout", "20", "--max-iters", "2",
           *quick_measurement(recalibrate_after=None), "--out", str(out), "--json"]
    # the report tests need a run that accepts its candidate on a busy machine too: load-awareness is tested apart
    env = {**os.environ, LOAD_LIMIT_ENV: "64"}
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=280, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    (run_dir,) = [p for p in out.iterdir() if p.is_dir()]
    return run_dir


@pytest.fixture(scope="session")
def rich_run(agent_run: Path, tmp_path_factory) -> Path:
    """A copy of agent_run with LLM calls in its ledger and a real fine profile (see test_report.py)."""
    run_dir = tmp_path_factory.mktemp("rich") / agent_run.name
    shutil.copytree(agent_run, run_dir)
    prices = {"m-normal": Price(input=1.0, output=4.0), "m-ultra": Price(input=3.0, output=12.0)}
    ledger = TokenLedger(run_dir, prices, budget_usd=10.0)
    for tier, ok in (("normal", True), ("normal", False), ("ultra", True), ("ultra", True)):
        ledger.record("propose", tier, f"m-{tier}", Usage(input_tokens=12_000, cached_input_tokens=2_000,
                                                          output_tokens=900, reasoning_tokens=300), 1.5, ok=ok)
    profile = run_dir / "profiles" / "01.json"
    data = json.loads(profile.read_text())
    data["fine"] = json.loads(FINE.read_text())
    profile.write_text(json.dumps(data))
    assert CliRunner().invoke(app, ["report", str(run_dir)]).exit_code == 0
    return run_dir


@pytest.fixture
def repo(tmp_path, monkeypatch):
    """A git repository holding a small target, the working directory (``tests.fixtures.gate_repo``)."""
    yield from gate_repo(tmp_path, monkeypatch)
