"""The run's state in a file of its own, ``state.json`` in the run directory: what reports read, instead of the
internals of LangGraph's checkpoint.

The graph writes it after each node's checkpoint (``graph.run``), atomically, so it is never newer than the checkpoint
a resume starts from, nor torn. Every path under the run directory is stored relative to it (``state.RunPath``, and
the run directory's own path in free text such as a verdict's reason), so a moved, archived or copied run directory
reads the same: ``read_state`` roots the paths at wherever the directory is now.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Sequence

from pydantic import BaseModel, Field, ValidationError

from state_machine.portable import portable
from state_machine.state import RUN_DIR, RunState

STATE_FILE = "state.json"
STATE_FILE_VERSION = 1


class SavedState(BaseModel):
    """What state.json holds."""

    version: int = STATE_FILE_VERSION
    next: list[str] | None = Field(None, description="the nodes the graph runs next ([]: the run has ended; None: "
                                                     "not known, converted from a checkpoint without the graph)")
    state: dict[str, Any] = Field(description="the RunState, its paths relative to the run directory")


def _relative(state: RunState) -> dict[str, Any]:
    dumped = state.model_dump(mode="json", context={RUN_DIR: state.run_dir}, fallback=str)
    return portable(dumped, state.run_dir, traces=False)  # the run directory in free text too


def rooted(state: RunState, run_dir: str | Path) -> RunState:
    """``state`` with its paths under ``run_dir`` instead of its own run directory, as its state.json reads back
    there: a run directory that has moved since the state was saved."""
    return RunState.model_validate(_relative(state), context={RUN_DIR: str(run_dir)})


def write_state(state: RunState, next_nodes: Sequence[str] | None = None, run_dir: str | Path | None = None) -> Path:
    """Write state.json into ``run_dir`` (None: the state's), replacing the old one only once the new one is whole.
    Its paths are made relative to the state's own run directory, where a checkpoint of a run that has moved since
    still places them."""
    path = Path(run_dir if run_dir is not None else state.run_dir) / STATE_FILE
    tmp = path.with_name(f".{STATE_FILE}.{os.getpid()}.tmp")
    saved = SavedState(next=list(next_nodes) if next_nodes is not None else None, state=_relative(state))
    tmp.write_text(saved.model_dump_json(indent=1), encoding="utf-8")
    os.replace(tmp, path)
    return path


class StateFileError(ValueError):
    """state.json exists but cannot be read as a run's state (torn by hand, written by a newer sg-opt)."""


def read_saved(run_dir: str | Path) -> SavedState | None:
    """The run directory's state.json as written (paths relative), or None without one."""
    path = Path(run_dir) / STATE_FILE
    if not path.is_file():
        return None
    try:
        saved = SavedState.model_validate_json(path.read_text(encoding="utf-8"))
    except (OSError, ValidationError) as exc:
        raise StateFileError(f"{path} is not a state sg-opt can read ({_first_line(exc)})") from None
    if saved.version > STATE_FILE_VERSION:
        raise StateFileError(f"{path} was written by a newer sg-opt (state file version {saved.version}, this one "
                             f"reads up to {STATE_FILE_VERSION})")
    return saved


def read_state(run_dir: str | Path) -> RunState | None:
    """The run's state from its state.json, every path under wherever ``run_dir`` is now; None without the file."""
    saved = read_saved(run_dir)
    if saved is None:
        return None
    try:
        return RunState.model_validate(saved.state, context={RUN_DIR: str(run_dir)})
    except ValidationError as exc:
        raise StateFileError(f"{Path(run_dir) / STATE_FILE} is not a state sg-opt can read "
                             f"({_first_line(exc)})") from None


def _first_line(exc: Exception) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__

