"""benchmarks/loader_handover.py, batch_build.py, host_adagrad.py, build_cost.py, session_build.py, cache_steady.py
and embed_host.py at small sizes: each runs and prints its figures (host_adagrad also checks that both forms give the same bits)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow  # each runs a benchmark script in a fresh interpreter


def _run(*args: str) -> str:
    run = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert run.returncode == 0, run.stderr[-2000:]
    return run.stdout


def test_loader_handover_times_a_packed_batch_of_one_storage():
    out = _run("benchmarks/loader_handover.py", "--size", "tiny", "--rounds", "1")
    assert "packed (1 storage a batch)" in out and "ms a batch" in out


def test_batch_build_times_a_workers_batch_and_what_n_workers_give():
    out = _run("benchmarks/batch_build.py", "--size", "tiny", "--batches", "2")
    assert out.startswith("build: ") and "build + pack: " in out and "4 worker(s): a batch every" in out


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


def test_session_build_times_a_build_and_its_steps_or_a_numerics_request():
    cached = ("--size", "tiny", "--device", "cpu", "--set", "embedding_placement=cached", "--set",
              "embedding_grad_mode=fused", "--steps", "2", "--stacks", "0")
    out = _run("benchmarks/session_build.py", *cached)
    assert "built in" in out and "cache_warm_batches" in out and "2 steps, ms each:" in out
    out = _run("benchmarks/session_build.py", *cached, "--numerics")
    assert out.startswith("numerics run of 2 steps:") and "of which the build" in out


def test_cache_steady_times_the_prepares_of_full_or_filling_caches():
    out = _run("benchmarks/cache_steady.py", "--size", "small", "--batches", "2", "--max-warm", "40", "--threads", "1")
    assert out.count("a step's two prepares: median") == 2 and "bookkeeping on cpu" in out
    assert "the weights' prepare again" in out and "a later worker reads and adopts them" in out


def test_embed_host_lists_a_prefetching_steps_parts_per_thread():
    out = _run("benchmarks/embed_host.py", "--size", "tiny", "--set", "embedding_placement=cached", "--set",
               "embedding_grad_mode=fused", "--set", "embedding_cache_prefetch=true", "--steps", "3", "--warmup", "1")
    assert out.count("step, synchronised each: host") == 1
    rows = [line.split("|")[1:4] for line in out.splitlines() if line.startswith("| ") and "ms / step" not in line]
    threads = {label.strip(): thread.strip() for label, thread, _ in rows}
    assert threads["step"] == "MainThread" and threads["take the prefetched lookup (waits for it)"] == "MainThread"
    assert threads["decide (_assign)"] == "cache-prefetch" and threads["prepare"] == "cache-prefetch"


def test_embed_host_counts_each_parts_torch_operations_in_a_pass_of_its_own():
    out = _run("benchmarks/embed_host.py", "--size", "tiny", "--set", "embedding_placement=cached", "--set",
               "embedding_grad_mode=fused", "--steps", "2", "--warmup", "1", "--ops")
    rows = {line.split("|")[1].strip(): line.split("|")[3:6] for line in out.splitlines()
            if line.startswith("| ") and "ms / step" not in line}
    calls, ops = float(rows["decide (_assign)"][1]), float(rows["decide (_assign)"][2])
    assert calls == 1.0 and ops > 10  # the counting pass adds no calls to the timed ones; a prepare runs many ops
    summary = out.split("torch ops / step on the main thread: ")[1]
    total, outside = float(summary.split(",")[0]), float(summary.split("outside every part ")[1].split()[0])
    assert sum(float(r[2]) for r in rows.values()) + outside == total  # each op once, to its innermost part

