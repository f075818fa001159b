"""The custom-target example: a user's own model through the protocol, benchmarked and optimized."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from examples.custom_target import target
from examples.custom_target.model import ClickLog, SIZES, interaction
from sg_opt.cli import app
from tests.fixtures.quick_measurement import quick_measurement
from validators.kernel import check_kernel

ROOT = Path(__file__).resolve().parents[2]


def test_both_batch_builders_return_the_same_tensors():
    loop, vectorized = ClickLog(SIZES["tiny"], 3), ClickLog(SIZES["tiny"], 3)
    for _ in range(3):
        a, b = loop.batch_loop(), vectorized.batch_vectorized()
        assert torch.equal(a[0], b[0]) and torch.equal(a[2], b[2])
        assert all(torch.equal(x, y) for x, y in zip(a[1], b[1]))


def test_sessions_train_and_sparse_grads_keep_the_numerics():
    runs = {}
    for sparse in (False, True):
        config = target.knob_space.resolve({"sparse_embedding_grads": sparse})
        session = target.build(config, "tiny", {}, "cpu", 0)
        runs[sparse] = [float(session.step()) for _ in range(5)]
    assert runs[False][-1] < runs[False][0] + 0.05
    assert all(abs(a - b) <= 1e-5 * abs(a) for a, b in zip(runs[False], runs[True]))


def test_the_interaction_reference_passes_the_kernel_validator():
    verdict = check_kernel(target.slot("interaction"), interaction, torch.device("cpu"), torch.float32, seed=5)
    assert verdict.ok, verdict.reason


@pytest.mark.slow
def test_sg_opt_optimize_runs_the_example(tmp_path, monkeypatch):
    # in this process, as from the repository's root: its workers are forked by this process's fork server,
    # already up where an earlier test started it (a `python -m sg_opt.cli` would start one of its own)
    monkeypatch.chdir(ROOT)
    done = CliRunner().invoke(app, ["optimize", "--target", "examples.custom_target:target", "--size", "tiny",
                                    "--threads", "1", "--max-iters", "1", *quick_measurement(),
                                    "--out", str(tmp_path), "--json"])
    assert done.exit_code == 0, done.output + done.stderr
    summary = json.loads(done.stdout)
    (row,) = summary["candidates"]
    assert row["change"] in ("batch_build=vectorized", "sparse_embedding_grads=True") and row["reason"]
    assert row["stage"] == "measure"  # it passed its numerics check (exact or reorder) and was timed


def test_the_local_endpoint_tiers_file_loads_and_prices_local_models_at_zero():
    from sg_opt.tiers import load_tiers

    tiers = load_tiers(ROOT / "examples" / "tiers-local-endpoint.toml")
    assert tiers.tier("normal").model.startswith("Qwen/") and tiers.tier("ultra").candidates_per_iteration == 4
    assert tiers.price(tiers.tier("normal").model).output == 0.0
