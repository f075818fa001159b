"""What every `sg-opt` command shares: the two consoles, the one-sentence errors and their exit codes (2 for
what the user asked, 1 for a workload that failed, with a hang's stacks), the checked inputs, and the options
several commands take."""

from __future__ import annotations

import re
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.markup import escape

from targets.protocol import ConfigError
from targets.registry import default_target, resolve_target

console = Console()
err_console = Console(stderr=True)

EXIT_USAGE = 2
DEVICE = re.compile(r"^(cpu|cuda(:\d+)?)$")


@dataclass
class Verbosity:
    """The global -v/-q: -v adds the traceback behind a one-sentence error, -q drops progress output."""

    verbose: bool = False
    quiet: bool = False


verbosity = Verbosity()


def say_error(message: str) -> None:
    """The one-sentence error on stderr, with the chain behind it under --verbose."""
    err_console.print(f"[bold red]error:[/] {escape(message)}", highlight=False)  # a message's [brackets] are text
    handling = sys.exc_info()[1]
    if verbosity.verbose and handling is not None:  # the chain behind the sentence (e.g. a target's import error)
        err_console.print("".join(traceback.format_exception(handling)), highlight=False, markup=False, end="",
                          soft_wrap=True)


def fail(message: str, code: int = EXIT_USAGE) -> None:
    say_error(message)
    raise typer.Exit(code)


class Working:
    """What a command is doing while its workers run: a spinner on a terminal; on a log (CI, a file) one
    stamped line per step, as optimize writes, so a log shows how far a stopped command got; nothing under -q."""

    def __init__(self, text: str):
        self.start, self.spinner = time.monotonic(), None
        if verbosity.quiet:
            return
        if err_console.is_terminal:
            self.spinner = err_console.status(text)
        else:
            self.update(text)

    def update(self, text: str) -> None:
        """What it does now: the spinner's text, or a line in a log."""
        if self.spinner is not None:
            self.spinner.update(text)
        else:
            self.note(text)

    def note(self, text: str) -> None:
        """A line that stays (a result on the way), above the spinner on a terminal."""
        if not verbosity.quiet:
            stamp = "" if err_console.is_terminal else f"[{time.monotonic() - self.start:6.0f} s] "
            err_console.print(f"{stamp}{text}", highlight=False, soft_wrap=True, markup=False)

    def __enter__(self) -> "Working":
        if self.spinner is not None:
            self.spinner.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.spinner is not None:
            self.spinner.__exit__(*exc)


def check_device(device: str) -> str:
    """An Option callback: cpu, cuda or cuda:N where torch sees that GPU; exit 2 at once otherwise, before a
    worker starts or a run directory is made."""
    if not DEVICE.match(device):
        fail(f"--device must be cpu, cuda or cuda:N, not {device!r}")
    if device.startswith("cuda"):
        import torch

        visible = torch.cuda.device_count()  # NVML where it can: no CUDA context in this process
        index = int(device.partition(":")[2] or 0)
        if index >= visible:
            fail(f"--device {device}: torch sees {visible} CUDA device(s) here" if visible
                 else f"--device {device}: no CUDA device is visible here (use --device cpu)")
    return device


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
    elif verbosity.verbose and failure.detail:  # the workload's traceback or stderr, behind the sentence
        err_console.print(failure.detail, highlight=False, markup=False)
    fail(f"{what} ({failure.kind}): {failure.message}", code=1)


TARGET_OPT = typer.Option(default_target(), help="an installed target's name (sg-opt targets) or module:attr")
SIZE_OPT = typer.Option("small", help="size preset of the target")
CONFIG_OPT = typer.Option(None, "--config", help="TOML file of knob values")
SET_OPT = typer.Option([], "--set", help="knob=value, repeatable")
DATA_OPT = typer.Option(None, "--data", help="train on this file, in a format the target reads (sg-opt targets "
                                             "lists them), instead of synthetic data")
DEVICE_OPT = typer.Option("cpu", callback=check_device, help="cpu, cuda or cuda:N")
THREADS_OPT = typer.Option(None, min=1, help="torch CPU threads in the worker (default: torch's own on cpu; one per "
                                             "CPU it may use, at most 16, on cuda)")
RANKS_OPT = typer.Option(1, "--ranks", help="run every worker as this many processes of one torch.distributed job "
                                            "(torchrun, one device each; a rank takes --threads, else its share of "
                                            "the CPUs; step times are the slowest rank's); the target needs a "
                                            "build_ranked")
TIMEOUT_OPT = typer.Option(1800.0, min=1.0, help="seconds before the worker is killed")
JSON_OPT = typer.Option(False, "--json", help="print the worker's JSON result")


def _version(shown: bool) -> None:
    if shown:
        from sg_opt import __version__

        print(f"sg-opt {__version__}")
        raise typer.Exit()


def global_options(
    verbose: bool = typer.Option(False, "--verbose", "-v", help="after a one-sentence error, also its traceback "
                                                                "(a target's import error, a workload's)"),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="no progress output: results and errors only"),
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                 help="print the version and exit"),
) -> None:
    """sg-opt: make sparse-model training faster without changing what it computes."""
    verbosity.verbose, verbosity.quiet = verbose, quiet
