"""What every `sg-opt` command shares: the two consoles, the one-sentence errors and their exit codes (2 for
what the user asked, 1 for a workload that failed, with a hang's stacks), the checked inputs, and the options
several commands take."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console
from rich.markup import escape

from targets.protocol import ConfigError
from targets.registry import resolve_target

console = Console()
err_console = Console(stderr=True)

EXIT_USAGE = 2


def fail(message: str, code: int = EXIT_USAGE) -> None:
    err_console.print(f"[bold red]error:[/] {escape(message)}", highlight=False)  # a message's [brackets] are text
    raise typer.Exit(code)


def inputs(target: str, size: str, config: str | None, sets: list[str], data: str | None, ranks: int = 1) -> dict:
    """Resolve and check what the user asked for before any worker starts; exit 2 on bad input."""
    from sg_opt.config import build_overrides

    try:
        resolved = resolve_target(target)
        resolved.check_size(size)
        resolved.check_ranks(ranks)
        overrides = build_overrides(resolved.knob_space, config, sets)
        resolved.knob_space.check_ranks(resolved.knob_space.resolve(overrides), ranks)
        if data is not None and not resolved.data_formats:
            raise ConfigError(f"target {resolved.name} reads no data files; drop --data")
        if data is not None and not Path(data).is_file():
            raise ConfigError(f"data file {data} does not exist")
    except ConfigError as exc:
        fail(str(exc))
    return overrides


def check_result(result) -> None:
    """Map a worker failure to the CLI's exit codes: 2 for the user's config, 1 for the workload."""
    if result.ok:
        return
    failure = result.failure
    if failure.kind == "config":
        fail(failure.message)
    fail_workload("the workload failed", failure)


def fail_workload(what: str, failure) -> None:
    """Exit 1 with the failure's sentence; a hang also gets the stacks its processes wrote before the kill."""
    if failure.kind == "timeout" and failure.detail:
        err_console.print(f"where each process waited:\n{failure.detail}", highlight=False, markup=False)
    fail(f"{what} ({failure.kind}): {failure.message}", code=1)


TARGET_OPT = typer.Option("haste-rec", help="built-in name, entry point name, or module:attr")
SIZE_OPT = typer.Option("small", help="size preset of the target")
CONFIG_OPT = typer.Option(None, "--config", help="TOML file of knob values")
SET_OPT = typer.Option([], "--set", help="knob=value, repeatable")
DATA_OPT = typer.Option(None, "--data", help="train on this file (haste-rec: extreme-classification text format) "
                                             "instead of synthetic data")
DEVICE_OPT = typer.Option("cpu", help="cpu or cuda")
THREADS_OPT = typer.Option(None, min=1, help="torch CPU threads in the worker (default: torch's own on cpu; one per "
                                             "CPU it may use, at most 16, on cuda)")
RANKS_OPT = typer.Option(1, "--ranks", help="run every worker as this many processes of one torch.distributed job "
                                            "(torchrun, one device each; a rank takes --threads, else its share of "
                                            "the CPUs; step times are the slowest rank's); the target needs a "
                                            "build_ranked")
TIMEOUT_OPT = typer.Option(1800.0, help="seconds before the worker is killed")
JSON_OPT = typer.Option(False, "--json", help="print the worker's JSON result")
