"""Bad input ends at once in one sentence with exit code 2, before any worker starts or any file is made; the
global -v shows the traceback behind the sentence, -q drops progress output, --version answers."""

from __future__ import annotations

import io
import re
from pathlib import Path

import pytest
from rich.console import Console
from typer.testing import CliRunner

from profilers.records import ProfileResult
from sg_opt import __version__
from sg_opt.cli import app
from sg_opt.cli_common import console
from sg_opt.profile_view import render

runner = CliRunner()
FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"


def _one_sentence(result, *words: str) -> None:
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    said = " ".join(result.output.split())  # as one line, however the console wrapped it
    for word in words:
        assert word in said, said


@pytest.mark.parametrize("text, words", [
    ("data_workers = 2.0\n", ("knob data_workers", "not 2.0")),   # was a TypeError in the worker, exit 1
    ("data_workers = true\n", ("knob data_workers", "not True")),  # was run as 1 worker, exit 0
    ("[knobs]\ndata_workers = 2.5\n", ("knob data_workers",)),
])
def test_a_config_value_of_the_wrong_type_names_the_knob(tmp_path, text, words):
    config = tmp_path / "c.toml"
    config.write_text(text)
    _one_sentence(runner.invoke(app, ["bench", "--size", "tiny", "--config", str(config)]), *words)


def test_a_set_value_of_the_wrong_type_names_the_knob():
    _one_sentence(runner.invoke(app, ["bench", "--size", "tiny", "--set", "data_workers=2.0"]), "data_workers")


def test_a_config_file_that_is_not_utf8_is_one_sentence(tmp_path):
    config = tmp_path / "latin1.toml"
    config.write_bytes('precision = "fp32" # caf\xe9\n'.encode("latin-1"))
    _one_sentence(runner.invoke(app, ["bench", "--size", "tiny", "--config", str(config)]), "not UTF-8")


@pytest.fixture
def broken_module(tmp_path, monkeypatch):
    """A module:attr whose module raises at import, as a user's target with a bug does."""
    (tmp_path / "broken_target_mod.py").write_text("import os\n\nraise RuntimeError('no such dataset: /data/x')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    return "broken_target_mod:TARGET"


def test_a_target_that_raises_at_import_is_one_sentence_and_its_traceback_is_behind_verbose(broken_module):
    quiet = runner.invoke(app, ["bench", "--size", "tiny", "--target", broken_module])
    _one_sentence(quiet, "RuntimeError: no such dataset: /data/x", "broken_target_mod.py:3")
    assert len(quiet.output.strip().splitlines()) <= 3  # one sentence, wrapped at 80 columns
    verbose = runner.invoke(app, ["-v", "bench", "--size", "tiny", "--target", broken_module])
    assert verbose.exit_code == 2
    assert "Traceback" in verbose.output and "raise RuntimeError('no such dataset" in verbose.output


@pytest.mark.parametrize("device", ["tpu", "cuda:x", "cpu0"])
def test_optimize_on_an_unknown_device_exits_2_at_once_and_makes_nothing(tmp_path, device):
    out = tmp_path / "runs"
    result = runner.invoke(app, ["optimize", "--size", "tiny", "--device", device, "--out", str(out)])
    _one_sentence(result, "--device must be cpu, cuda or cuda:N")
    assert not out.exists()


@pytest.mark.parametrize("command", ["bench", "profile", "gate"])
def test_a_negative_timeout_is_a_usage_error(command):
    result = runner.invoke(app, [command, "--timeout", "-5"])
    assert result.exit_code == 2, result.output
    assert "--timeout" in result.output


@pytest.mark.parametrize("make", ["file", "under-a-file"])
def test_optimize_out_that_is_not_a_directory_is_one_sentence(tmp_path, make):
    a_file = tmp_path / "passwd"
    a_file.write_text("root:x:0:0\n")
    out = a_file if make == "file" else a_file / "runs"
    result = runner.invoke(app, ["optimize", "--size", "tiny", "--out", str(out)])
    _one_sentence(result, f"--out {out}")
    assert a_file.read_text() == "root:x:0:0\n" and list(tmp_path.iterdir()) == [a_file]


def test_version():
    result = runner.invoke(app, ["--version"])
    assert result.exit_code == 0 and result.output.strip() == f"sg-opt {__version__}"


def test_quiet_drops_the_progress_lines_and_keeps_the_error(broken_module):
    result = runner.invoke(app, ["-q", "bench", "--size", "tiny", "--target", broken_module])
    assert result.exit_code == 2 and "error:" in result.output and "benchmarking" not in result.output


def test_the_knob_table_keeps_every_column_at_80_columns(monkeypatch):
    monkeypatch.setattr(console, "_width", 80)  # as COLUMNS=80 gives a console made under it
    result = runner.invoke(app, ["targets"])
    assert result.exit_code == 0, result.output
    assert max(len(line) for line in result.stdout.splitlines()) <= 80
    for words in ("data_workers", "= 0", "0 | 1 | 2 | 4", "[exact]", "overlap batch building"):
        assert words in result.stdout, words


def test_the_profile_view_keeps_every_figure_at_80_columns():
    result = ProfileResult.model_validate_json((FIXTURES / "h200_xl_after_8.json").read_text())
    out = io.StringIO()
    render(result, Console(file=out, width=80, force_terminal=False))
    shown = out.getvalue()
    assert "…" not in shown and max(len(line) for line in shown.splitlines()) <= 80
    for figure in ("49.77", "4.4657", "1.89e+03", "x11.1", "compute", "optimizer"):
        assert f" {figure} " in shown, figure


def test_a_command_writes_its_progress_to_a_log_as_stamped_lines(tmp_path):
    """In a CI log (no terminal) a spinner shows nothing: each step is a line, as optimize's are."""
    missing = str(tmp_path / "base.json")
    logged = runner.invoke(app, ["gate", "--baseline", missing])
    assert logged.exit_code == 2 and re.search(r"\[\s+0 s\] setting up the gate", logged.output), logged.output
    quiet = runner.invoke(app, ["-q", "gate", "--baseline", missing])
    assert quiet.exit_code == 2 and "setting up" not in quiet.output and "error:" in quiet.output
