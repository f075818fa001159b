"""benchmarks/cache_miss.py's production workload at a tiny scale: every split of a budget holds the same device
bytes, counts are consistent, the best static split is no worse than any other, and the planned split misses
less than the uniform one wherever a skew is there to exploit. Its numbers back a claim, so they are checked."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow  # each runs the benchmark script in a fresh interpreter


def _run(tmp_path: Path, *args: str) -> tuple[str, dict]:
    out = tmp_path / "cache_miss.json"
    run = subprocess.run([sys.executable, "benchmarks/cache_miss.py", *args, "--quick", "--json", str(out)],
                         cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert run.returncode == 0, run.stderr[-2000:]
    return run.stdout, json.loads(out.read_text())


def test_production_workload_numbers_are_consistent(tmp_path):
    stdout, report = _run(tmp_path, "--workload", "production", "--scale", "0.05", "--draws", "2")
    assert "| budget | eviction | split |" in stdout and "best cut" in stdout
    rows, dim = report["tables"]["rows"], report["dim"]
    assert max(rows) >= 100 * min(rows) and len(report["analytic_best_cuts"]) == 2
    lookups = {run["lookups"] for r in report["results"] for runs in r["replay"].values() for run in runs.values()}
    assert len(lookups) == 1  # every split and eviction replays the same batches
    for r in report["results"]:
        uniform, planned = r["uniform_caps"], r["planned_caps"]
        own = r["own_state_caps"]
        assert sum(planned) == sum(uniform)
        assert sum(own["params"]) >= sum(planned)
        assert sum(own["params"]) * dim + sum(own["states"]) <= sum(uniform) * (dim + 1)  # the same device bytes
        assert all(f <= c <= n for f, c, n in zip(report["tables"]["floors"], planned, rows))
        for runs in r["replay"].values():
            for run in runs.values():
                assert 0 < run["misses"] <= run["lookups"] and 0 <= run["state_miss_rate"] <= 1
            assert runs["planned+own-state"]["miss_rate"] <= runs["planned"]["miss_rate"] + 1e-3
        static = r["static"]
        assert static["best"] <= min(static["uniform"], static["planned"]) + 1e-12
        if static["best_cut"] >= 0.2:  # a skew to exploit: the planner must take some of it
            for runs in r["replay"].values():
                assert runs["planned"]["misses"] < runs["uniform"]["misses"]


def test_trainer_workload_still_runs(tmp_path):
    stdout, report = _run(tmp_path, "--size", "tiny")
    assert report["workload"] == "trainer" and all(r["static"] is None for r in report["results"])
    assert "planned+own-state" in stdout
