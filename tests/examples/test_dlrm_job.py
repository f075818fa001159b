"""The DLRM-style example: a plain PyTorch job optimized through the job adapter, in under 30 lines of glue."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from examples.dlrm.job import job, target
from sg_opt.cli import app
from tests.fixtures.quick_measurement import quick_measurement

ROOT = Path(__file__).resolve().parents[2]
GLUE = ROOT / "examples" / "dlrm" / "job.py"


def test_the_glue_is_under_30_lines_of_code():
    tree = ast.parse(GLUE.read_text())
    body = tree.body[1:] if ast.get_docstring(tree) else tree.body  # the docstring is not glue
    lines = {n for node in body for n in range(node.lineno, node.end_lineno + 1)}
    assert len(lines) < 30
    assert target.name == "dlrm" and job.target() is target


def test_the_example_trains_and_keeps_exact_changes_exact():
    plain = target.build(target.knob_space.resolve({}), "tiny", {}, "cpu", 0)
    workers = target.build(target.knob_space.resolve({"data_workers": 1}), "tiny", {}, "cpu", 0)
    a, b = [float(plain.step()) for _ in range(8)], [float(workers.step()) for _ in range(8)]
    assert a == b and plain.param_digest()["sha256"] == workers.param_digest()["sha256"]


def _optimize(tmp_path, monkeypatch, *more: str) -> dict:
    monkeypatch.chdir(ROOT)  # in this process: its workers come from this process's fork server
    done = CliRunner().invoke(app, ["optimize", "--target", "examples.dlrm.job:target", "--size", "tiny",
                                    "--threads", "1", "--max-iters", "1", *quick_measurement(), "--out",
                                    str(tmp_path), "--json", *more])
    assert done.exit_code == 0, done.output + done.stderr
    return json.loads(done.stdout)


@pytest.mark.slow
def test_sg_opt_optimizes_the_example_with_generic_knobs(tmp_path, monkeypatch):
    summary = _optimize(tmp_path, monkeypatch)
    (row,) = summary["candidates"]
    assert row["change"].split("=")[0] in {k.name for k in target.knob_space} and row["reason"]
    assert row["numerics_class"] in ("exact", "reorder") and row["stage"] == "measure"


@pytest.mark.slow
def test_model_changes_get_a_real_quality_run_and_a_band(tmp_path, monkeypatch):
    summary = _optimize(tmp_path, monkeypatch, "--allow-model-changes", "--set", "optimizer_impl=fused")
    assert set(summary["baseline_quality"]) == {"heldout_loss"}  # trained quality_steps, not 0
    report = next(Path(tmp_path).glob("*/report.md")).read_text()
    assert "## Quality (model changes)" in report
    for row in summary["candidates"]:  # the sparse gradients' SparseAdam, first here: judged within its band
        if row["numerics_class"] == "model":
            assert "heldout_loss" in row["numerics_detail"] and "band 0.0100" in row["numerics_detail"]


def test_targets_shows_a_users_job_by_module_attr(monkeypatch):
    monkeypatch.chdir(ROOT)
    done = CliRunner().invoke(app, ["targets", "--target", "examples.dlrm.job:target", "--json"])
    assert done.exit_code == 0, done.output
    (shown,) = json.loads(done.stdout)
    assert shown["name"] == "dlrm" and shown["quality_metrics"] == ["heldout_loss (lower is better, band 0.01)"]
    assert {"optimizer_impl", "data_workers", "metrics_every", "sparse_embedding_grads"} <= {
        k["name"] for k in shown["knobs"]}
    missing = CliRunner().invoke(app, ["targets", "--target", "examples.dlrm.job:nope"])
    assert missing.exit_code == 2 and "has no attribute" in " ".join(missing.stderr.split())
