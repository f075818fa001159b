"""Run directories: where one `sg-opt optimize` run keeps everything, and how a killed run is found again.

``runs/<run-id>/run.json`` holds the request as the user made it (never a key, token or URL credentials), so
``--resume <run-id>`` rebuilds the same target, tier, client and ledger and continues the graph from
its last SQLite checkpoint in the same directory.
"""

from __future__ import annotations

import contextlib
import os
import re
import sqlite3
import time
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field, field_serializer

from sg_opt.redact import redact_url
from targets.protocol import ConfigError

RUN_SCHEMA_VERSION = 1
REQUEST_FILE = "run.json"
RUN_ID = re.compile(r"^[A-Za-z0-9._-]+$")


class RunRequest(BaseModel):
    """What the user asked for; with the run directory, enough to resume."""

    version: int = RUN_SCHEMA_VERSION
    run_id: str
    target: str
    size: str
    config: dict[str, Any] = Field(default_factory=dict, description="the baseline's knob overrides")
    data: str | None = None
    device: str = "cpu"
    threads: int | None = None
    ranks: int = Field(1, ge=1, description="processes of the torch.distributed job every worker runs as")
    gpus: int = Field(1, ge=1, description="GPUs the run may use: gpus / ranks candidates are evaluated at once")
    seed: int = 0
    tier: str = "offline"
    search: str = Field("rules", description="the offline tier's proposer: rules or tpe")
    tiers_file: str | None = None
    base_url: str | None = Field(None, description="an OpenAI-compatible endpoint (never a key)")
    model: str | None = Field(None, description="overrides the tier's model")
    llm_timeout_s: float = Field(180.0, description="seconds before one LLM request is abandoned (and retried)")
    budget_usd: float | None = None
    max_iters: int | None = None
    max_minutes: float = 30.0
    allow_model_changes: bool = False
    plan: dict[str, Any] = Field(default_factory=dict, description="EvalPlan overrides")
    created: float = Field(default_factory=time.time)

    @field_serializer("base_url")
    def _without_secrets(self, url: str | None) -> str | None:
        """Credentials in the URL are blanked wherever a request is written; a resume gets them again."""
        return redact_url(url)


def new_run_id(target: str, size: str, tier: str) -> str:
    safe = re.sub(r"[^A-Za-z0-9._-]+", "-", target).strip("-") or "target"
    return f"{time.strftime('%Y%m%d-%H%M%S')}-{safe}-{size}-{tier}"


def _out_folder(out: str | Path) -> Path:
    """``--out``, made if missing; ConfigError where it is a file or cannot be made."""
    folder = Path(out)
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise ConfigError(f"--out {out} is a file, not a directory to hold run directories") from None
    except NotADirectoryError:
        raise ConfigError(f"--out {out} lies under a file, not a directory") from None
    except OSError as exc:
        raise ConfigError(f"--out {out} cannot be made ({exc.strerror or exc})") from None
    if not folder.is_dir():
        raise ConfigError(f"--out {out} is not a directory")
    return folder


def create_run(out: str | Path, request: RunRequest) -> Path:
    """The run's own new directory: made atomically (mkdir fails on one that exists), so runs started together
    with the same --out each get one of their own, numbered .2, .3 ... within the same second."""
    folder, base, suffix = _out_folder(out), request.run_id, 1
    while True:
        run_dir = folder / request.run_id
        try:
            run_dir.mkdir()
            break
        except FileExistsError:  # another run of the same second took it
            suffix += 1
            request.run_id = f"{base}.{suffix}"
        except OSError as exc:
            raise ConfigError(f"cannot make the run directory {run_dir} ({exc.strerror or exc})") from None
    write_atomically(run_dir / REQUEST_FILE, request.model_dump_json(indent=1))
    return run_dir


def write_atomically(path: Path, text: str) -> None:
    """A file that is either the old one or the whole new one, whenever the writer is killed."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def find_run(out: str | Path, run_id: str) -> tuple[Path, RunRequest]:
    """The directory and request of an earlier run; one clear sentence when there is none."""
    path = Path(run_id)
    run_dir = path if (path / REQUEST_FILE).is_file() else Path(out) / run_id
    if not RUN_ID.match(run_dir.name) or not (run_dir / REQUEST_FILE).is_file():
        raise ConfigError(f"no run {run_id!r} under {out}/ (a run directory holds {REQUEST_FILE})")
    try:
        return run_dir, RunRequest.model_validate_json((run_dir / REQUEST_FILE).read_text())
    except ValueError as exc:
        raise ConfigError(f"{run_dir / REQUEST_FILE} is not a run request sg-opt can read ({exc})") from None


CHECKPOINT_FILE = "checkpoints.sqlite"  # state_machine.graph's, named here without importing langgraph
RESULTS = ("baseline", "candidates", "profiles", "summary.json", "final_ab.json")  # what a started run wrote


def check_checkpoint(run_dir: Path) -> None:
    """ConfigError, in one sentence, where the run's checkpoint file is not a sound SQLite database (truncated,
    overwritten): resuming it would end in a DatabaseError deep inside LangGraph; or where it is missing or empty
    and the run has results (``refuse_restart``)."""
    path = run_dir / CHECKPOINT_FILE
    if not path.is_file() or path.stat().st_size == 0:  # a run that never checkpointed, or an emptied file:
        refuse_restart(run_dir)  # decided here, before anything opens (and so creates) the database
        return
    try:
        with contextlib.closing(sqlite3.connect(str(path))) as conn:
            verdict = conn.execute("PRAGMA quick_check").fetchall()
    except sqlite3.DatabaseError as exc:
        verdict = [(str(exc),)]
    if verdict != [("ok",)]:
        raise ConfigError(f"run {run_dir.name} cannot be resumed: its checkpoint {path.name} is damaged "
                          f"({verdict[0][0]}); `sg-opt report {run_dir}` still writes its report from what the "
                          f"run directory holds")


def refuse_restart(run_dir: Path) -> None:
    """ConfigError where a run with no checkpoint already holds results: starting it afresh would overwrite its
    baseline/ and candidates/ (an emptied checkpoint file read as a run that never started)."""
    found = [name for name in RESULTS if (run_dir / name).is_file()
             or (run_dir / name).is_dir() and any((run_dir / name).iterdir())]
    if found:
        raise ConfigError(f"run {run_dir.name} cannot be resumed: its checkpoint holds no state, yet it has "
                          f"results ({', '.join(found)}) that starting over would overwrite; `sg-opt report "
                          f"{run_dir}` still writes its report, and a new run starts without --resume")
