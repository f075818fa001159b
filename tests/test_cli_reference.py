"""docs/CLI.md is generated from the CLI; this fails when a command changed and the file was not regenerated."""

from pathlib import Path

from sg_opt.cli_reference import reference

DOC = Path(__file__).resolve().parents[1] / "docs" / "CLI.md"


def test_cli_reference_is_up_to_date():
    assert DOC.read_text() == reference(), "regenerate with: python -m sg_opt.cli_reference > docs/CLI.md"


def test_every_command_is_documented_with_an_example():
    text = reference()
    for command in ("bench", "gate", "optimize", "profile", "report", "targets"):
        assert f"## `sg-opt {command}`" in text
    assert text.count("Example") >= 3
