"""benchmarks.embedding_kernels --smoke --tune: tiny shapes on the CPU under Triton's interpreter, in a fresh
process (TRITON_INTERPRET must be set before triton is imported). Checks the run, the tables and the JSON,
and how the knob sweep records a point that fails."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")  # without a GPU, tests/conftest.py has chosen the interpreter

from benchmarks.embedding_kernels import (SMOKE, SMOKE_TUNE_GRID, TUNE_KEYS, TUNE_OPS, WRONG, Bench,  # noqa: E402
                                          tune, tune_table)

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(),
                    reason="the smoke run is for machines without a GPU; on a GPU run the benchmark itself "
                           "(triton 3.6's interpreter also fails on it there: 0-d array conversion)")
def test_smoke_run_writes_table_and_json(tmp_path: Path) -> None:
    out = tmp_path / "embedding_kernels.json"
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT), CUDA_VISIBLE_DEVICES="")
    run = subprocess.run([sys.executable, "-m", "benchmarks.embedding_kernels", "--smoke", "--tune",
                          "--out", str(out)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "| shape | group | implementation | median ms |" in run.stdout
    record = json.loads(out.read_text())
    assert record["smoke"] and record["timing"] == "perf_counter" and record["shape"]["T"] == 2
    assert max(record["checks"].values()) <= 1e-5
    names = {r["name"] for r in record["results"]}
    assert {"nn.EmbeddingBag forward", "triton pooled forward",
            "triton pooled fwd + fused bwd + row-wise Adagrad"} <= names
    assert all(r["repeats"] == 3 and r["median_ms"] > 0 for r in record["results"])
    assert {r["shape"] for r in record["results"]} == {"T2 B5 P8 R200 D24 Q12", "T2 B5 P8 R200 D24 Q1"}
    # the knob sweep: every point of the smoke grid checked and timed, a table with the best of each column in bold
    assert [tuple(t[k] for k in TUNE_KEYS) for t in record["tune"]] == list(SMOKE_TUNE_GRID)
    assert all(t["max_rel_error"] <= 1e-5 and all(t[op] > 0 for op in TUNE_OPS) for t in record["tune"])
    assert "embedding kernel knob sweep at T2 B5 P8 R200 D24 Q12" in run.stdout
    assert "| tile_elements | num_warps | num_stages | triton pooled forward ms |" in run.stdout
    assert run.stdout.count("**") >= 2 * len(TUNE_OPS)  # the best of each column (more on a tie)


def test_a_failing_tune_point_is_a_result_of_the_sweep(monkeypatch) -> None:
    """A point the kernels reject (or cannot launch) is recorded by the error's name and printed as such;
    a point whose results disagree with torch is marked, not timed; the best is taken over those that ran."""
    from benchmarks import embedding_kernels
    bench = Bench(dict(SMOKE, B=2, P=2, Q=2), torch.device("cpu"), repeats=1, warmup=0)
    rows = tune(bench, ((100, 4, 1), (1024, 3, "auto")))
    assert [{k: r[k] for k in ("pool_forward", "forward_fused_update", "max_rel_error")} for r in rows] == \
        [{"pool_forward": "ValueError", "forward_fused_update": "ValueError", "max_rel_error": None}] * 2
    monkeypatch.setattr(embedding_kernels, "check", lambda b, config=None: {"pool_forward_max_rel_error": 0.5})
    assert tune(bench, ((1024, 2, 1),)) == [{"tile_elements": 1024, "num_warps": 2, "num_stages": 1,
                                             "max_rel_error": 0.5, "pool_forward": WRONG,
                                             "forward_fused_update": WRONG}]
    table = tune_table(rows + [{"tile_elements": 4096, "num_warps": 4, "num_stages": "auto", "max_rel_error": 0.5,
                                "pool_forward": WRONG, "forward_fused_update": WRONG},
                               {"tile_elements": 2048, "num_warps": 2, "num_stages": 1, "max_rel_error": 1e-7,
                                "pool_forward": 2.0, "forward_fused_update": 3.0},
                               {"tile_elements": 1024, "num_warps": 2, "num_stages": 1, "max_rel_error": 0.0,
                                "pool_forward": 1.5, "forward_fused_update": 4.0}], "tiny")
    assert "| 100 | 4 | 1 | ValueError | ValueError | - |" in table
    assert f"| 4096 | 4 | auto | {WRONG} | {WRONG} | 0.5 |" in table
    assert "| 2048 | 2 | 1 | 2.000 | **3.000** | 1e-07 |" in table
    assert "| 1024 | 2 | 1 | **1.500** | 4.000 | 0 |" in table
