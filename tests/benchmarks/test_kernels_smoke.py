"""benchmarks/kernels.py --smoke: every implementation checked and timed at tiny shapes (on the CPU
through Triton's interpreter), a Markdown table per shape on stdout and the JSON it promises."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("triton")  # without a GPU, this package's __init__ has chosen the interpreter

from benchmarks.kernels import SMOKE, SMOKE_TUNE_GRID, main  # noqa: E402


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
