"""benchmarks/kernels.py --smoke: every implementation checked and timed at tiny shapes (on the CPU
through Triton's interpreter), a Markdown table per shape on stdout and the JSON it promises."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("triton")  # without a GPU, this package's __init__ has chosen the interpreter

from benchmarks import fused_bce_sweep  # noqa: E402
from benchmarks.kernels import SMOKE, SMOKE_TUNE_GRID, _median_or_error, main, tune_markdown  # noqa: E402


@pytest.mark.slow
def test_smoke_run(tmp_path, capsys) -> None:
    out = tmp_path / "kernels.json"
    assert main(["--smoke", "--tune", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert len(report["configs"]) == len(SMOKE) and report["repeats"] == 2
    names = None
    for config in report["configs"]:
        assert config["failed_checks"] == [] and len(config["checks"]) == 16
        rows = {r["name"]: r for r in config["rows"]}
        names = names or set(rows)
        assert set(rows) == names and all(r["ms"] > 0 and r["repeats"] == 2 for r in rows.values())
        for fused in ("triton fused bce fwd+loss+bwd (positives as a list)",
                      "triton fused bce fwd+loss+bwd (positives as bits)"):
            assert rows[fused]["moved_bytes"] > rows[fused]["bytes"]
        assert [(t["block_b"], t["num_warps"], t["num_stages"]) for t in config["tune"]] == list(SMOKE_TUNE_GRID)
        assert all(t[k] > 0 for t in config["tune"] for k in ("tail_forward", "tail_forward_2gpp", "tail_backward_input",
                                                                   "tail_fused_bce_list", "tail_fused_bce_bits"))
        assert set(config["ratios"]) == {"per-label / group-shared fwd", "per-label / group-shared bwd",
                                         "group-shared fwd+bwd / dense FLOPs-matched fwd+bwd"}
    assert {"triton tail_forward", "triton tail_backward_input (atomicAdd)", "triton per-label bwd (both)",
            "torch group-shared autograd fwd+bwd", "dense FLOPs-matched fwd"} <= names
    printed = capsys.readouterr().out
    assert printed.count("| implementation |") == len(SMOKE) and "FAILED" not in printed
    assert printed.count("kernel knob sweep") == len(SMOKE)


def test_a_config_that_fails_is_a_result_of_the_sweep() -> None:
    """A tune cell whose kernel raises (fp32 tiles out of shared memory on the H200) is recorded by the
    error's name and printed as such; the best of each column is taken over the cells that ran."""
    def too_big():
        raise MemoryError("out of resource: shared memory")
    assert _median_or_error(too_big, torch.device("cpu"), 0, 1, None) == "MemoryError"
    assert isinstance(_median_or_error(lambda: torch.ones(2) * 2, torch.device("cpu"), 0, 2, None), float)
    table = tune_markdown([{"block_b": 32, "num_warps": 4, "num_stages": 1, "tail_forward": 2.0, "x": "MemoryError"},
                           {"block_b": 64, "num_warps": 4, "num_stages": 1, "tail_forward": 1.5, "x": "MemoryError"}])
    assert "| 64 | 4 | 1 | **1.500** | MemoryError |" in table and "| 32 | 4 | 1 | 2.000 | MemoryError |" in table


def test_fused_bce_sweep_smoke(tmp_path) -> None:
    out = tmp_path / "sweep.json"
    assert fused_bce_sweep.main(["--smoke", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["block_b"], r["num_warps"], r["num_stages"]) for r in rows] == list(fused_bce_sweep.SMOKE_GRID)
    assert all(isinstance(r[f], float) and r[f] > 0 for r in rows for f in fused_bce_sweep.FORMATS)
