"""Run directories: where one `sg-opt optimize` run keeps everything, and how a killed run is found again.

``runs/<run-id>/run.json`` holds the request as the user made it (never a key, token or URL credentials), so
``--resume <run-id>`` rebuilds the same target, tier, client and ledger and continues the graph from
its last SQLite checkpoint in the same directory.
"""

from __future__ import annotations

import re
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


def create_run(out: str | Path, request: RunRequest) -> Path:
    base, suffix = request.run_id, 1
    run_dir = Path(out) / base
    while run_dir.exists():  # two runs in the same second
        suffix += 1
        request.run_id = f"{base}.{suffix}"
        run_dir = Path(out) / request.run_id
    run_dir.mkdir(parents=True)
    (run_dir / REQUEST_FILE).write_text(request.model_dump_json(indent=1))
    return run_dir


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
