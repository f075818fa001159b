"""The run's own log, ``events.jsonl``: one typed record a line, each kind its own model.

A line is ``{"t": ..., "event": "<kind>", <fields>}``; ``event`` tells the kinds apart (``Event``, a union
discriminated on it), so an emitter cannot misspell a kind or a field and a reader gets typed fields instead of string
keys. Fields that later versions added have defaults, so lines written before them still parse.

Reading (``parse_event``, ``read_events``) skips what it cannot type: a line torn by a kill, a kind this version
does not know (written by a newer sg-opt), or a known kind whose fields do not validate. A log is a report's
decoration, never its source of truth, so a line it cannot read must not stop the report.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, Field, TypeAdapter, ValidationError

EVENTS_FILE = "events.jsonl"


class _Event(BaseModel):
    t: float = Field(default_factory=time.time, description="wall-clock time of the event (time.time())")


# ----------------------------------------------------------------------------- setup, baseline, diagnose

class Setup(_Event):
    event: Literal["setup"] = "setup"
    target: str
    size: str
    tier: str
    device: str


class BaselineStage(_Event):
    """Progress through the baseline, which runs for minutes before anything else shows."""

    event: Literal["baseline-stage"] = "baseline-stage"
    stage: str
    cut: str | None = Field(None, description="why the A/A calibration was cut to fit --max-minutes")


class Baseline(_Event):
    event: Literal["baseline"] = "baseline"
    step_ms: float
    noise_floor: float
    timeout_s: float | None = None
    reorder_scale: float | None = None
    reorder: str | None = None
    lanes: str | None = None


class Recalibrate(_Event):
    event: Literal["recalibrate"] = "recalibrate"
    after: int = Field(description="the accepted candidate the incumbent came from")
    step_ms: float
    noise_floor: float
    was: float | None = None
    lanes: str | None = None


class RecalibrateFailed(_Event):
    event: Literal["recalibrate-failed"] = "recalibrate-failed"
    after: int | None
    reason: str


class DiagnoseSkipped(_Event):
    event: Literal["diagnose-skipped"] = "diagnose-skipped"
    reason: str


class ProfileDisturbed(_Event):
    event: Literal["profile-disturbed"] = "profile-disturbed"
    slowdown: float
    reason: str


class DiagnoseFailed(_Event):
    event: Literal["diagnose-failed"] = "diagnose-failed"
    reason: str


class Diagnose(_Event):
    event: Literal["diagnose"] = "diagnose"
    findings: list[str] = Field(default_factory=list, description="the top findings, 'category: evidence'")
    distorted: str | None = None


# ----------------------------------------------------------------------------- proposals and the LLM

class ProposalFailed(_Event):
    event: Literal["proposal-failed"] = "proposal-failed"
    reason: str


class Propose(_Event):
    event: Literal["propose"] = "propose"
    id: int
    kind: str
    patch: dict[str, Any] = Field(default_factory=dict)
    kernels: list[str] = Field(default_factory=list, description="the slots the candidate replaces")
    rationale: str = ""
    proposer: str = ""


class KernelRepair(_Event):
    event: Literal["kernel-repair"] = "kernel-repair"
    of: int = Field(description="the candidate whose kernels go back to the LLM")
    slots: list[str] = Field(default_factory=list)
    stage: str | None = None
    reason: str


class LLMCall(_Event):
    event: Literal["llm-call"] = "llm-call"
    tier: str
    model: str
    purpose: str
    turn: int = 0
    usage: dict[str, Any] = Field(default_factory=dict)
    cost_usd: float | None = None
    latency_s: float | None = None
    attempts: int | None = None
    reused: bool = False
    notes: list[str] = Field(default_factory=list)
    prompt_chars: int | None = None
    reply: str = Field("", description="the reply's start")


class LLMReplyInvalid(_Event):
    event: Literal["llm-reply-invalid"] = "llm-reply-invalid"
    turn: int
    reason: str


class LLMWarning(_Event):
    event: Literal["llm-warning"] = "llm-warning"
    reason: str


# ----------------------------------------------------------------------------- one candidate

class Batch(_Event):
    event: Literal["batch"] = "batch"
    ids: list[int]
    lanes: dict[int, list[int]] = Field(default_factory=dict, description="candidate id -> its lane's GPUs")


class NumericsRetry(_Event):
    event: Literal["numerics-retry"] = "numerics-retry"
    id: int
    kind: str
    reason: str


class Validated(_Event):
    event: Literal["validated"] = "validated"
    id: int
    numerics_class: str | None
    detail: str | None = None
    wall_s: float | None = None
    build_s: float | None = None
    stage_s: dict[str, float] = Field(default_factory=dict)
    kernel_dtypes: list[str] | None = None
    kernel_dtypes_skipped: dict[str, str] | None = None
    spot_checks: int | None = None


class MachineBusy(_Event):
    event: Literal["machine-busy"] = "machine-busy"
    id: int
    reason: str


class IncumbentFailed(_Event):
    event: Literal["incumbent-failed"] = "incumbent-failed"
    id: int
    kind: str
    reason: str


class Decide(_Event):
    event: Literal["decide"] = "decide"
    id: int
    accepted: bool
    stage: str
    reason: str
    ratio: float | None = None


# ----------------------------------------------------------------------------- the run as a whole

class FinalRetry(_Event):
    event: Literal["final-retry"] = "final-retry"
    kind: str
    reason: str


class Report(_Event):
    event: Literal["report"] = "report"
    stop_reason: str | None = None
    files: list[str] = Field(default_factory=list)


class Paused(_Event):
    event: Literal["paused"] = "paused"
    node: str
    reason: str


class LostTime(_Event):
    event: Literal["lost-time"] = "lost-time"
    node: str
    seconds: float
    reason: str = ""


Event = Annotated[Union[Setup, BaselineStage, Baseline, Recalibrate, RecalibrateFailed, DiagnoseSkipped,
                        ProfileDisturbed, DiagnoseFailed, Diagnose, ProposalFailed, Propose, KernelRepair, LLMCall,
                        LLMReplyInvalid, LLMWarning, Batch, NumericsRetry, Validated, MachineBusy, IncumbentFailed,
                        Decide, FinalRetry, Report, Paused, LostTime],
                  Field(discriminator="event")]
EVENT_ADAPTER: TypeAdapter[Event] = TypeAdapter(Event)


def parse_event(record: str | dict[str, Any]) -> Event | None:
    """One line (or its parsed dict) as its typed event; None for a torn line, an unknown kind or fields that do
    not validate (see the module's docstring)."""
    try:
        if isinstance(record, str):
            return EVENT_ADAPTER.validate_json(record)
        return EVENT_ADAPTER.validate_python(record)
    except (ValidationError, ValueError):
        return None


def read_events(run_dir: str | Path) -> list[Event]:
    """Every line of a run's events.jsonl that parses, in order; [] without the file."""
    path = Path(run_dir) / EVENTS_FILE
    if not path.is_file():
        return []
    return [e for line in path.read_text(encoding="utf-8").splitlines() if (e := parse_event(line)) is not None]


def event_line(record: Event) -> dict[str, Any]:
    """The record as the JSON object its line holds: ``t``, ``event``, then its fields."""
    return json.loads(record.model_dump_json(fallback=str))
