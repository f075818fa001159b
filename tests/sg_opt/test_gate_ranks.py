"""`sg-opt gate --ranks N`: both sides measured as N-rank torch.distributed jobs (gloo, haste-rec @ tiny), and a
saved baseline of another number of ranks refused in one sentence before anything runs."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from sg_opt import run_machine, saved_baseline
from sg_opt.cli import app
from sg_opt.gate import GateResult
from sg_opt.gate_report import markdown
from targets.worker import environment
from targets.worker_protocol import NumericsData, WorkerRequest
from tests.fixtures.gate_repo import worktrees

runner = CliRunner()


@pytest.mark.slow
def test_a_gate_on_two_ranks_runs_both_sides_on_two_ranks(repo):
    # haste-rec comes from the installed package on both sides; the gate's logic and its ranks are under
    # test. A wide --floor and --max-regression keep noise from failing it (and let its blocks be short, and one
    # A/A and one A/B run do: each is a pair of 2-rank jobs): the numerics must still hold.
    result = runner.invoke(app, ["gate", "--ref", "HEAD", "--target", "haste-rec", "--size", "tiny", "--ranks", "2",
                                 "--blocks", "2", "--block-steps", "2", "--block-seconds", "0.1", "--warmup", "1",
                                 "--numerics-steps", "3", "--aa-runs", "1", "--ab-runs", "1",
                                 "--floor", "0.5", "--max-regression", "10", "--timeout", "120", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["passed"] and report["ranks"] == 2 and report["environment"]["ranks"] == 2
    assert report["ab"]["a"]["spec"]["ranks"] == report["ab"]["b"]["spec"]["ranks"] == 2
    assert report["numerics"]["passed"] and report["step_time"]["ratio"] > 0
    assert "on `cpu` x 2 ranks (each step the slowest rank)" in markdown(GateResult.model_validate(report))
    assert worktrees(repo) == 1


def saved_on(ranks: int, path) -> str:
    """A baseline file as `sg-opt bench --ranks N --save` writes it, for this machine (figures made up)."""
    steps = [[0.010, 0.011, 0.010, 0.012]] * 2
    request = WorkerRequest(target="haste-rec", size="tiny", mode="bench", ranks=ranks)
    record = saved_baseline.SavedBaseline(
        created="2026-11-29T12:00:00+0000", request=request, numerics_steps=3,
        environment=environment(torch.device("cpu"), ranks), host=run_machine.host_info(), step_s=steps,
        block_medians=saved_baseline.block_medians(steps),
        numerics=NumericsData(losses=[1.0, 0.9, 0.8], grad_norms=[{}] * 3, probe={}, digest={}))
    path.write_text(record.model_dump_json())
    return str(path)


def test_a_baseline_of_another_number_of_ranks_is_refused_in_one_sentence(tmp_path):
    file = saved_on(2, tmp_path / "base.json")
    assert saved_baseline.load(file).ranks == 2
    result = runner.invoke(app, ["gate", "--baseline", file, "--ranks", "1"])
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    assert ("the baseline was measured on 2 ranks and this gate asks for 1 rank, which cannot be compared: save a "
            "baseline with sg-opt bench --ranks 1 --save FILE") in result.output
    assert saved_baseline.ranks_mismatch(saved_baseline.load(file), None) is None  # no --ranks: as saved
    assert saved_baseline.ranks_mismatch(saved_baseline.load(file), 2) is None
