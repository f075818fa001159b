"""The `sg-opt` command line: the app, its commands (``sg_opt.commands``, one module each) registered in the order
`--help` lists them, and the signals that stop a command. Errors a user can cause end in one sentence and exit
code 2."""

from __future__ import annotations

import contextlib
import signal
import sys

import typer

from sg_opt.cli_common import EXIT_USAGE, err_console, global_options, say_error
from sg_opt.commands import bench, gate, optimize, profile, report, targets
from targets.machine_lease import run_presence
from targets.protocol import ConfigError

MEASURING = ("optimize", "bench", "profile", "gate")  # the commands that time workloads on this machine

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="sg-opt: make sparse-model training faster without changing what it computes.")
app.callback()(global_options)
for command in (targets.targets, bench.bench, profile.profile, optimize.optimize, gate.gate, report.report):
    app.command()(command)


class Stopped(BaseException):
    """Ctrl-C or SIGTERM (``timeout``, a batch system): unwinds the command so that every worker is asked where it
    was and killed on the way out (``targets.worker_client.run_child``) instead of running on, orphaned, beside the
    next command; a killed run's checkpoint is kept either way. Not a KeyboardInterrupt, which typer would turn
    into a silent exit."""


def _stop(signum: int, _frame) -> None:
    raise Stopped(signum)


def _command(argv: list[str]) -> str | None:
    return next((arg for arg in argv if not arg.startswith("-")), None)


def measuring(argv: list[str]) -> bool:
    """Whether the command measures on this machine (``MEASURING``): it then holds the presence lock for its life,
    so another run's measurements know they share the machine (``targets.machine_lease.run_presence``)."""
    return _command(argv) in MEASURING


def stop_message(signum: int, argv: list[str]) -> str:
    """What a stopped command says: only `optimize` keeps a checkpoint to resume from; the others start over."""
    text = f"stopped by {signal.Signals(signum).name}"
    if _command(argv) == "optimize":
        text += " (the run resumes from its last checkpoint with --resume)"
    return text


def main() -> None:
    for signum in (signal.SIGINT, signal.SIGTERM):
        if signal.getsignal(signum) is not signal.SIG_IGN:  # a shell's background job ignores SIGINT: keep that
            signal.signal(signum, _stop)
    try:
        with run_presence() if measuring(sys.argv[1:]) else contextlib.nullcontext():
            app()
    except Stopped as stop:
        err_console.print(stop_message(stop.args[0], sys.argv[1:]))
        sys.exit(128 + stop.args[0])
    except ConfigError as exc:  # one found where no command catches it, e.g. a bad SG_OPT_* setting
        say_error(str(exc))
        sys.exit(EXIT_USAGE)


if __name__ == "__main__":
    main()
