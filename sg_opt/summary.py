"""The run summary: one versioned JSON record of what a run found, what it cost and why it stopped.

Built from the final state and the run directory alone (the ledger file included), so reports and
``sg-opt report`` can be regenerated at any time without re-running anything.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field

from sg_opt.ledger import TokenLedger
from state_machine.state import Evaluated, FinalMeasurement, RunState

SUMMARY_SCHEMA_VERSION = 1
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
    ratio: float | None = None
    ci_low: float | None = None
    ci_high: float | None = None


class Spend(BaseModel):
    calls: int = 0
    failed_calls: int = 0
    input_tokens: int = 0
    cached_input_tokens: int = 0
    output_tokens: int = 0
    reasoning_tokens: int = 0
    cost_usd: float = 0.0


class Summary(BaseModel):
    version: int = SUMMARY_SCHEMA_VERSION
    run_id: str
    target: str
    size: str
    device: str
    tier: str
    stop_reason: str | None
    baseline_step_ms: float | None
    noise_floor: float | None
    best_config: dict[str, Any]
    best_kernels: list[str]
    est_speedup: float = Field(description="product of the accepted side-by-side speedups")
    final: FinalMeasurement | None = Field(None, description="baseline vs best, re-measured side by side at the end")
    evaluated: int
    accepted: int
    candidates: list[CandidateRow]
    spend: Spend
    spend_by_tier: dict[str, Spend] = Field(default_factory=dict)
    cost_per_win_usd: float | None = None
    wall_s: float
    environment: dict[str, Any] = Field(default_factory=dict)


def describe_change(e: Evaluated) -> str:
    parts = [f"{k}={v}" for k, v in e.candidate.patch.items()]
    parts += [f"kernel {slot}" for slot in e.candidate.kernels]
    return ", ".join(parts) or "(nothing)"


def _row(e: Evaluated) -> CandidateRow:
    v = e.verdict
    return CandidateRow(id=e.candidate.id, kind=e.candidate.kind, change=describe_change(e),
                        proposer=e.candidate.proposer, rationale=e.candidate.rationale, accepted=v.accepted,
                        stage=v.stage, reason=v.reason, numerics_class=v.numerics_class, ratio=v.ratio,
                        ci_low=v.ci_low, ci_high=v.ci_high)


def _spend(run_dir: Path) -> tuple[Spend, dict[str, Spend]]:
    """Totals straight from the run's ledger file (read back by the ledger itself)."""
    totals = TokenLedger(run_dir, prices={}, budget_usd=0.0).totals()
    return (Spend(**vars(totals.overall)),
            {tier: Spend(**vars(total)) for tier, total in totals.by_tier.items()})


def build_summary(state: RunState) -> Summary:
    overall, by_tier = _spend(Path(state.run_dir))
    accepted = len(state.accepted)
    baseline = state.baseline
    return Summary(run_id=state.run_id, target=state.target, size=state.size, device=state.device, tier=state.tier,
                   stop_reason=state.stop_reason, baseline_step_ms=baseline.step_ms if baseline else None,
                   noise_floor=baseline.noise_floor if baseline else None, best_config=state.incumbent.config,
                   best_kernels=sorted(state.incumbent.kernels), est_speedup=state.incumbent.est_speedup,
                   final=state.final, evaluated=state.evaluated, accepted=accepted,
                   candidates=[_row(e) for e in state.history], spend=overall, spend_by_tier=by_tier,
                   cost_per_win_usd=overall.cost_usd / accepted if accepted else None, wall_s=state.elapsed_s,
                   environment=baseline.environment if baseline else {})
