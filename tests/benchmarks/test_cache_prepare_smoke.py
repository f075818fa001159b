"""benchmarks/cache_prepare.py at a tiny size: it runs, the two cache implementations agree on every batch
(the script asserts it), and it prints a time for each."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_smoke_run_compares_both_and_prints_their_times():
    run = subprocess.run([sys.executable, "benchmarks/cache_prepare.py", "--tables", "3", "--rows", "2000",
                          "--capacity", "300", "--ids", "200", "--batches", "12", "--timed", "4"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert run.returncode == 0, run.stderr[-2000:]
    assert "miss rate" in run.stdout
    assert "TableCaches:" in run.stdout and "one RowCache per table:" in run.stdout
