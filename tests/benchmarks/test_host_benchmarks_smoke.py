"""benchmarks/loader_handover.py, benchmarks/host_adagrad.py and benchmarks/build_cost.py at tiny sizes: each
runs and prints its figures (host_adagrad also checks that both forms give the same bits)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _run(*args: str) -> str:
    run = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert run.returncode == 0, run.stderr[-2000:]
    return run.stdout


def test_loader_handover_times_a_packed_batch_of_one_storage():
    out = _run("benchmarks/loader_handover.py", "--size", "tiny", "--rounds", "1")
    assert "packed (1 storage a batch)" in out and "ms a batch" in out


def test_host_adagrad_times_both_forms_and_they_agree():
    out = _run("benchmarks/host_adagrad.py", "--rows", "20000", "--touched", "1000", "--repeats", "1")
    assert "(same bits: True)" in out and "as written:" in out and "in place:" in out


def test_build_cost_times_each_stage_and_profiles_the_first_build():
    out = _run("benchmarks/build_cost.py", "--size", "tiny", "--profile-build", "5")
    stages = [line.rsplit(maxsplit=2)[0] for line in out.splitlines() if line.endswith(" s")]
    assert stages == ["imports", "device context", "build", "first step", "5 more steps", "probe", "param digest",
                      "build again"]
    assert out.rstrip().endswith("(imports included)")
    assert "Ordered by: cumulative time" in out and "target.py" in out and "(build)" in out
