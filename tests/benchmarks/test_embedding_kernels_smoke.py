"""benchmarks.embedding_kernels --smoke: tiny shapes on the CPU under Triton's interpreter, in a fresh
process (TRITON_INTERPRET must be set before triton is imported). Checks the run, the table and the JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(__import__("torch").cuda.is_available(),
                    reason="the smoke run is for machines without a GPU; on a GPU run the benchmark itself "
                           "(triton 3.6's interpreter also fails on it there: 0-d array conversion)")
def test_smoke_run_writes_table_and_json(tmp_path: Path) -> None:
    out = tmp_path / "embedding_kernels.json"
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT), CUDA_VISIBLE_DEVICES="")
    run = subprocess.run([sys.executable, "-m", "benchmarks.embedding_kernels", "--smoke", "--out", str(out)],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "| shape | group | implementation | median ms |" in run.stdout
    record = json.loads(out.read_text())
    assert record["smoke"] and record["timing"] == "perf_counter" and record["shape"]["T"] == 3
    assert max(record["checks"].values()) <= 1e-5
    names = {r["name"] for r in record["results"]}
    assert {"nn.EmbeddingBag forward", "triton pooled forward",
            "triton pooled fwd + fused bwd + row-wise Adagrad"} <= names
    assert all(r["repeats"] == 3 and r["median_ms"] > 0 for r in record["results"])
    assert {r["shape"] for r in record["results"]} == {"T3 B16 P4 R200 D24 Q40", "T3 B16 P4 R200 D24 Q1"}
