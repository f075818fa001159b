"""The CLI reference in Markdown, generated from the CLI itself so the documentation cannot drift.

    python -m sg_opt.cli_reference > docs/CLI.md

A test regenerates it and compares it with the committed ``docs/CLI.md``.
"""

from __future__ import annotations

import inspect

import typer
import typer.main

from sg_opt.cli import app


def _flags(param) -> str:
    if param.param_type_name == "argument":
        return param.name.upper()
    names = list(param.opts) + [f"{o}" for o in param.secondary_opts]
    return ", ".join(f"`{n}`" for n in names)


def _default(param) -> str:
    if param.param_type_name == "argument" or param.default is None or getattr(param, "is_flag", False):
        return ""
    default = param.default
    if isinstance(default, (list, tuple)):
        return "" if not default else ", ".join(map(str, default))
    return f"`{default}`"


def _type(param) -> str:
    if getattr(param, "is_flag", False):
        return "flag"
    annotation = getattr(getattr(param, "type_descriptor", None), "annotation", None)
    return getattr(annotation, "__name__", None) or "text"


def _options_table(params) -> list[str]:
    lines = ["| option | type | default | meaning |", "|---|---|---|---|"]
    for param in params:
        if param.name == "help":
            continue
        meaning = (getattr(param, "help", None) or "").replace("|", "/").replace("\n", " ")
        lines.append(f"| {_flags(param)} | {_type(param)} | {_default(param)} | {meaning} |")
    return lines


def command_markdown(name: str, command) -> str:
    doc = inspect.cleandoc(command.help or "")
    return "\n".join([f"## `sg-opt {name}`", "", doc, "", *_options_table(command.params)]) + "\n"


def reference() -> str:
    group = typer.main.get_command(app)
    parts = ["# sg-opt command reference", "",
             "Generated from the CLI by `python -m sg_opt.cli_reference`; every command also answers `--help`.", "",
             "## Global options", "", "Before the command: `sg-opt -v optimize ...`.", "",
             *_options_table(group.params), ""]
    for name in sorted(group.commands):
        parts.append(command_markdown(name, group.commands[name]))
    return "\n".join(parts)


if __name__ == "__main__":
    print(reference(), end="")
