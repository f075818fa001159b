"""The run summary: one versioned JSON record of what a run found, what it cost and why it stopped.

Built from the final state and the run directory alone (profiles, A/B files, events, the ledger),
so every report (markdown, HTML, comparisons) is a pure function of this record and can be
regenerated at any time without re-running or re-measuring anything.

Schema history: 1 = result, candidates and spend; 2 = adds step times with intervals, the numerics
verdict of the best, per-profile phase breakdowns, roofline points, the ledger's calls and notes.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field

from profilers.records import Ceilings, HostWait, HostWork
from sg_opt.ledger import Total as Spend
from state_machine.state import FinalMeasurement, Recalibration

SUMMARY_SCHEMA_VERSION = 2
SUMMARY_FILE = "summary.json"


class CandidateRow(BaseModel):
    id: int
    kind: str
    change: str
    proposer: str
    rationale: str
    accepted: bool
    stage: str
    reason: str
    numerics_class: str | None = None
    numerics_detail: str | None = None
    ratio: float | None = None
    ci_low: float | None = None
    ci_high: float | None = None
    speedup: float | None = Field(None, description="1 / ratio: above 1 is faster than the incumbent")
    step_ms: float | None = Field(None, description="the candidate's own step time in its A/B measurement (the "
                                                    "median of its block medians, ms; None: not recorded)")
    expected_gain: float | None = None
    wall_s: float = 0.0
    decided_at_s: float | None = Field(None, description="seconds from the run's start to its verdict")


class LLMCall(BaseModel):
    """One row of ledger.jsonl, as much as the reports need."""

    timestamp: str = ""
    node: str = "?"
    tier: str = "?"
    model: str = "?"
    input_tokens: int = 0
    output_tokens: int = 0
    cost_usd: float = 0.0
    latency_s: float = 0.0
    ok: bool = True


class StepTime(BaseModel):
    """A median step time with its bootstrap 95% interval, from the block medians of one side."""

    ms: float
    ci_low_ms: float
    ci_high_ms: float
    blocks: int
    source: str = Field(description="the file the block medians come from")


class WorkerStartup(BaseModel):
    """How long the run's timing workers took to get ready, medians over every one that reported its stamps:
    what each side-by-side measurement pays before its first timed block."""

    workers: int
    ready_s: float = Field(description="the whole start-up (start + build + warm-up of one worker)")
    start_s: float = Field(description="interpreter start and imports")
    build_s: float = Field(description="building the session (model, data, kernels)")
    warmup_s: float = Field(description="the warm-up steps")
    started_ahead: int = Field(0, description="measurements whose two workers were started during the candidate's "
                                              "validation (validators.started_ahead.WorkerPool)")
    close_s: float | None = Field(None, description="after a measurement's last block, until both its workers had "
                                                    "exited (median over the measurements that recorded it)")
    build_parts: dict[str, float] = Field(default_factory=dict, description="the build split into the parts the "
                                          "session timed, each the median over the workers that reported it, in "
                                          "the order the first of them reported")


class NumericsVerdict(BaseModel):
    numerics_class: str = Field(description="the loosest class allowed for the best configuration")
    detail: str
    candidate: int | None = Field(None, description="the accepted candidate whose validation this is")


class PhaseBreakdown(BaseModel):
    """One profile's step split into its phases (ms per step, under the profiler)."""

    label: str = Field(description="'baseline' or 'after #<candidate id>'")
    profile: str = Field(description="file under the run directory")
    step_ms: float
    unprofiled_step_ms: float
    phases_ms: dict[str, float] = Field(description="phase -> share x profiled step time")
    other_ms: float = Field(description="the step time no named phase accounts for (0 when phases overlap)")
    host_work_ms: dict[str, float] = Field(default_factory=dict, description="phase -> host time not blocked on "
                                                                             "the device, ms per step")
    host_ops: dict[str, float] = Field(default_factory=dict, description="phase -> host operator calls per step")
    launches: dict[str, float] = Field(default_factory=dict, description="phase -> kernel launches per step (CUDA)")
    host_waits: list[HostWait] = Field(default_factory=list, description="the largest host waits on the device, "
                                                                         "each with the op that made it (CUDA)")
    host_work: list[HostWork] = Field(default_factory=list, description="the largest host self times by phase "
                                                                        "and op: what the host works on")
    floor_ms: dict[str, float] = Field(default_factory=dict, description="phase -> its roofline floor (least work "
                                                                         "at the measured ceilings)")
    floor_bound: dict[str, str] = Field(default_factory=dict, description="phase -> compute, memory, bus or none")
    floor_step_ms: float | None = Field(None, description="the step's floor: the sum of the phases' floors")
    floor_note: str | None = Field(None, description="the step against its floor, and the phase furthest from it")
    ranks_note: str | None = Field(None, description="a profile of several ranks: whose profile this is, and each "
                                                     "rank's share of the step in collectives")
    distortion_note: str | None = Field(None, description="the profiler slowed this profile's steps past "
                                        "profilers.records.DISTORTED_OVERHEAD: its phase times overstate the step's")


class RooflinePoint(BaseModel):
    label: str = Field(description="the profile the timing comes from")
    slot: str
    implementation: str
    dtype: str
    shape: dict[str, int]
    median_us: float
    intensity: float
    achieved_flops_per_s: float
    attainable_flops_per_s: float
    roofline_fraction: float
    bound: str


class Roofline(BaseModel):
    ceilings: Ceilings
    points: list[RooflinePoint]


class Summary(BaseModel):
    version: int = SUMMARY_SCHEMA_VERSION
    run_id: str
    target: str
    size: str
    device: str
    tier: str
    stop_reason: str | None
    finished: bool = Field(True, description="whether the run reached its report node")
    baseline_step_ms: float | None
    noise_floor: float | None
    recalibrations: list[Recalibration] = Field(default_factory=list, description="noise floors calibrated again "
                                                "on faster incumbents during the run (files relative to the run)")
    reorder_scale: float | None = Field(None, description="the reorder bands' calibrated multiplier (1: fixed bands)")
    reorder_calibration: str | None = Field(None, description="how the baseline drifted from itself, reassociated")
    baseline_quality: dict[str, float] | None = Field(None, description="the baseline's held-out quality metrics "
                                                      "(runs that allow model changes)")
    baseline_step: StepTime | None = Field(None, description="baseline step time, side by side with the best "
                                                             "when one was accepted, else from the A/A blocks")
    best_step: StepTime | None = Field(None, description="best step time from the final side-by-side A/B")
    numerics: NumericsVerdict | None = None
    best_config: dict[str, Any]
    best_kernels: list[str]
    est_speedup: float = Field(description="an estimate (product of accepted ratios, not a measurement): the "
                                           "accepted side-by-side speedups multiplied; ``final`` is the measured "
                                           "figure")
    final: FinalMeasurement | None = Field(None, description="baseline vs best, re-measured side by side at the end")
    evaluated: int
    accepted: int
    candidates: list[CandidateRow]
    phases: list[PhaseBreakdown] = Field(default_factory=list, description="one per profile, baseline first")
    roofline: Roofline | None = None
    spend: Spend
    spend_by_tier: dict[str, Spend] = Field(default_factory=dict)
    llm_calls: list[LLMCall] = Field(default_factory=list)
    cost_per_win_usd: float | None = None
    wall_s: float
    node_s: dict[str, float] = Field(default_factory=dict, description="wall_s by node of the agent's graph")
    worker_startup: WorkerStartup | None = Field(None, description="the timing workers' start-up (None: no "
                                                 "measurement recorded one)")
    environment: dict[str, Any] = Field(default_factory=dict)
    gpus: int = Field(1, description="GPUs of the run (--gpus): gpus / ranks candidates were evaluated at once")
    lanes_note: str | None = Field(None, description="--gpus: whether candidates were timed at once, and why")
    notes: list[str] = Field(default_factory=list, description="what a report could not show, and why")
    trust: list[str] = Field(default_factory=list, description="how the final measurement was made safe: the "
                             "candidate workers' confinement and the machine's other work beside it")

    def measured_curve(self) -> list[float | None]:
        """The incumbent's step time in ms after 0, 1, 2, ... candidates, each as measured: the baseline's in its A/A
        calibration, each accepted candidate's in its acceptance run (None where that was not recorded). Products of
        ratios drift from what is measured (one run's reached x34 where its final measurement said x18.99), so the
        reports plot these."""
        levels = [self.baseline_step_ms]
        for c in self.candidates:
            levels.append(c.step_ms if c.accepted else levels[-1])
        return levels

    def est_curve(self) -> list[float]:
        """The incumbent's estimated speedup after 0, 1, 2, ... candidates: an estimate (product of accepted ratios,
        not a measurement), as the agent's own incumbent keeps it (the oracle comparison of
        benchmarks/search_vs_optuna.py reads it; the reports plot ``measured_curve``)."""
        levels = [1.0]
        for c in self.candidates:
            levels.append(levels[-1] * (c.speedup if c.accepted and c.speedup else 1.0))
        return levels
