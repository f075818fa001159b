"""benchmarks/loader_handover.py, host_adagrad.py, build_cost.py, session_build.py and cache_steady.py at small
sizes: each runs and prints its figures (host_adagrad also checks that both forms give the same bits)."""

from __future__ import annotations

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CACHED = ("--size", "tiny", "--device", "cpu", "--set", "embedding_placement=cached", "--set",
          "embedding_grad_mode=fused", "--steps", "2", "--stacks", "0")
RUNS = {  # each test's script runs, the longest first
    "test_build_cost_times_each_stage_and_profiles_the_first_build": [
        ("benchmarks/build_cost.py", "--size", "tiny", "--profile-build", "5")],
    "test_loader_handover_times_a_packed_batch_of_one_storage": [
        ("benchmarks/loader_handover.py", "--size", "tiny", "--rounds", "1")],
    "test_session_build_times_a_build_and_its_steps_or_a_numerics_request": [
        ("benchmarks/session_build.py", *CACHED), ("benchmarks/session_build.py", *CACHED, "--numerics")],
    "test_cache_steady_times_the_prepares_of_full_or_filling_caches": [
        ("benchmarks/cache_steady.py", "--size", "small", "--batches", "2", "--max-warm", "40", "--threads", "1")],
    "test_host_adagrad_times_both_forms_and_they_agree": [
        ("benchmarks/host_adagrad.py", "--rows", "20000", "--touched", "1000", "--repeats", "1")],
}


def _run(*args: str) -> str:
    run = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert run.returncode == 0, run.stderr[-2000:]
    return run.stdout


@pytest.fixture(scope="module")
def started(request):
    """The runs of this module's selected tests, started together, as many at a time as there are cores: each
    is a fresh process, mostly importing torch and building data, so they need not take turns on one core."""
    selected = {item.originalname for item in request.session.items if item.module is request.module}
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        yield {test: [pool.submit(_run, *args) for args in commands]
               for test, commands in RUNS.items() if test in selected}


def _outputs(started, request) -> list[str]:
    """The stdout of each of this test's runs (each asserted to exit 0)."""
    return [run.result() for run in started[request.node.originalname]]


def test_loader_handover_times_a_packed_batch_of_one_storage(started, request):
    [out] = _outputs(started, request)
    assert "packed (1 storage a batch)" in out and "ms a batch" in out


def test_host_adagrad_times_both_forms_and_they_agree(started, request):
    [out] = _outputs(started, request)
    assert "(same bits: True)" in out and "as written:" in out and "in place:" in out


def test_build_cost_times_each_stage_and_profiles_the_first_build(started, request):
    [out] = _outputs(started, request)
    stages = [line.rsplit(maxsplit=2)[0] for line in out.splitlines() if line.endswith(" s")]
    assert stages == ["imports", "device context", "build", "first step", "5 more steps", "probe", "param digest",
                      "build again"]
    assert out.rstrip().endswith("(imports included)")
    assert "Ordered by: cumulative time" in out and "target.py" in out and "(build)" in out


def test_session_build_times_a_build_and_its_steps_or_a_numerics_request(started, request):
    out, numerics = _outputs(started, request)
    assert "built in" in out and "cache_warm_batches" in out and "2 steps, ms each:" in out
    assert numerics.startswith("numerics run of 2 steps:") and "of which the build" in numerics


def test_cache_steady_times_the_prepares_of_full_or_filling_caches(started, request):
    [out] = _outputs(started, request)
    assert out.count("a step's two prepares: median") == 2 and "bookkeeping on cpu" in out
    assert "the weights' prepare again" in out and "a later worker reads and adopts them" in out
