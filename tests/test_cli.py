"""The CLI as a user meets it: tables, JSON, and one-sentence errors with exit code 2."""

import json

import pytest
import torch
from typer.testing import CliRunner

from sg_opt.cli import app
from targets.registry import entry_point_targets

runner = CliRunner()


def test_targets_json_lists_knobs_with_reasons():
    result = runner.invoke(app, ["targets", "--json"])
    assert result.exit_code == 0, result.output
    listed = {t["name"]: t for t in json.loads(result.stdout)}
    knobs = {k["name"]: k for k in listed["haste-rec"]["knobs"]}
    assert knobs["precision"]["default"] == "fp32" and knobs["precision"]["numerics"] == "precision"
    assert all(k["why"] for k in knobs.values())
    assert "tail_forward" in listed["haste-rec"]["kernel_slots"]


def test_targets_table():
    result = runner.invoke(app, ["targets"], env={"COLUMNS": "160"})
    assert result.exit_code == 0, result.output
    for word in ("embedding_placement", "embedding_opt_state_cache_fraction", "precision", "sizes: tiny"):
        assert word in result.stdout


def test_haste_rec_is_an_installed_entry_point():
    assert entry_point_targets().get("haste-rec") == "targets.haste_rec.target:TARGET"


@pytest.mark.parametrize("args,words", [
    (["--target", "nope"], "unknown target"),
    (["--size", "huge"], "no size"),
    (["--set", "precision=fp8"], "precision"),
    (["--set", "bogus=1"], "unknown knob"),
    (["--config", "/no/such/file.toml"], "does not exist"),
    pytest.param(["--size", "tiny", "--device", "cuda"], "cuda",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is present here")),
])
def test_bench_bad_input_is_one_sentence_exit_2(args, words):
    result = runner.invoke(app, ["bench", *args])
    assert result.exit_code == 2, result.output
    assert words in result.output and "Traceback" not in result.output


def test_bench_tiny_prints_tables():
    result = runner.invoke(app, ["bench", "--size", "tiny", "--steps", "3", "--warmup", "1", "--phase-steps", "1",
                                 "--threads", "1"])
    assert result.exit_code == 0, result.output
    for word in ("median ms", "embed", "tail", "optimizer"):
        assert word in result.stdout
