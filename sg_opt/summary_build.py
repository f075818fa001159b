"""Building the run summary (``sg_opt.summary``) from the final state and the run directory alone: profiles,
A/B files, events and the ledger, so that every report can be regenerated without re-running anything."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from profilers.floor import floor_sentence
from profilers.records import ProfileResult
from sg_opt import run_machine
from sg_opt.ledger import TokenLedger, Total as Spend
from sg_opt.summary import (CandidateRow, LLMCall, NumericsVerdict, PhaseBreakdown, Roofline, RooflinePoint, StepTime,
                            Summary, WorkerStartup)
from state_machine import events
from state_machine.events import read_events
from state_machine.state import Evaluated, RunState, Verdict
from targets.confinement import Confinement
from validators.ab_result import ABResult, NoiseFloor

BOOTSTRAP_RESAMPLES = 2000  # the step times' medians and their intervals (median_with_interval)


def _decided_at(run_dir: Path) -> dict[int, float]:
    """Candidate id -> seconds from the run's setup to its decision, from events.jsonl (lines it cannot read are
    skipped: ``state_machine.events.read_events``)."""
    logged = read_events(run_dir)
    start = next((e.t for e in logged if isinstance(e, events.Setup)), None)
    if start is None:
        return {}
    return {e.id: e.t - start for e in logged if isinstance(e, events.Decide)}


def _candidate_step_ms(v: Verdict) -> float | None:
    """An accepted candidate's step in the measurement that accepted it: as its verdict recorded it, or, from runs
    whose verdicts did not record it yet, the last run of its ab.json (None where neither holds it)."""
    if v.step_ms is not None or not v.accepted or "ab" not in v.artifacts:
        return v.step_ms
    try:
        medians = json.loads(Path(v.artifacts["ab"]).read_text(encoding="utf-8"))["runs"][-1]["b"]["block_medians"]
        return 1e3 * float(np.median(medians)) if medians else None
    except (OSError, ValueError, KeyError, IndexError, TypeError):
        return None


def _row(e: Evaluated, decided_at: dict[int, float]) -> CandidateRow:
    v = e.verdict
    return CandidateRow(id=e.candidate.id, kind=e.candidate.kind, change=e.candidate.change(),
                        proposer=e.candidate.proposer, rationale=e.candidate.rationale, accepted=v.accepted,
                        stage=v.stage, reason=v.reason, numerics_class=v.numerics_class,
                        numerics_detail=v.numerics_detail, ratio=v.ratio, ci_low=v.ci_low, ci_high=v.ci_high,
                        speedup=1.0 / v.ratio if v.ratio else None, step_ms=_candidate_step_ms(v),
                        expected_gain=e.candidate.expected_gain,
                        wall_s=v.wall_s, decided_at_s=decided_at.get(e.candidate.id))


def _spend(run_dir: Path) -> tuple[Spend, dict[str, Spend], list[LLMCall]]:
    """Totals and calls straight from the run's ledger file (read back by the ledger itself)."""
    ledger = TokenLedger(run_dir, prices={}, budget_usd=0.0)
    totals = ledger.totals()
    calls = [LLMCall.model_validate({k: v for k, v in row.items() if k in LLMCall.model_fields}) for row in ledger.rows]
    return (totals.overall, dict(totals.by_tier),
            calls)


def median_with_interval(values: list[float], seed: int = 0) -> tuple[float, float, float]:
    """Median and its bootstrap 95% percentile interval (resamples of the values, fixed seed)."""
    data = np.asarray(values, dtype=float)
    rng = np.random.default_rng(seed)
    boots = np.median(data[rng.integers(0, len(data), size=(BOOTSTRAP_RESAMPLES, len(data)))], axis=1)
    return float(np.median(data)), float(np.quantile(boots, 0.025)), float(np.quantile(boots, 0.975))


def _step_time(medians_s: list[float], source: str) -> StepTime | None:
    if not medians_s:
        return None
    mid, low, high = median_with_interval(medians_s)
    return StepTime(ms=1e3 * mid, ci_low_ms=1e3 * low, ci_high_ms=1e3 * high, blocks=len(medians_s), source=source)


def _relative(run_dir: Path, path: Path) -> str:
    try:
        return str(path.relative_to(run_dir))
    except ValueError:
        return str(path)


def trust_lines(ab: ABResult) -> list[str]:
    """What kept a measurement honest, in sentences: its clock, its workers' confinement, the machine beside it."""
    lines = [f"Timed by the parent's clock; the workers' own step times agreed within "
             f"{max(abs(1 - r) for r in agreements):.1%}." if (agreements := [
                 side.clock_agreement for side in (ab.a, ab.b) if side.clock_agreement]) else
             "Timed by the parent's clock."]
    if ab.b.confinement is not None:
        said = Confinement.model_validate(ab.b.confinement).sentence()
        lines.append(said[:1].upper() + said[1:] + ".")
    else:
        lines.append("The workers did not say whether they ran confined.")
    load = ab.load_note()
    lines.append(f"Machine: {'clean' if ab.clean else 'NOT clean'}{'; ' + load if load else ''}.")
    return lines


def _step_times(state: RunState, run_dir: Path, notes: list[str], trust: list[str]
                ) -> tuple[StepTime | None, StepTime | None]:
    if state.final is not None and Path(state.final.file).is_file():
        final = Path(state.final.file)
        ab = ABResult.model_validate_json(final.read_text())
        source = _relative(run_dir, final)
        if state.final.note:
            notes.append(state.final.note)
        trust.extend(trust_lines(ab))
        return _step_time(ab.a.block_medians, source), _step_time(ab.b.block_medians, source)
    if state.baseline is not None and Path(state.baseline.calibration_file).is_file():
        calibration = Path(state.baseline.calibration_file)
        noise = NoiseFloor.model_validate_json(calibration.read_text())
        if state.accepted:
            notes.append("the final side-by-side measurement of baseline against best is missing")
        return _step_time(noise.block_medians, _relative(run_dir, calibration)), None
    return None, None


def _numerics(state: RunState) -> NumericsVerdict | None:
    if not state.accepted:
        return None
    last = state.accepted[-1]
    return NumericsVerdict(numerics_class=last.verdict.numerics_class or "exact",
                           detail=last.verdict.numerics_detail or "validated against the baseline",
                           candidate=last.candidate.id)


def read_profiles(state: RunState, run_dir: Path, notes: list[str]) -> list[tuple[str, Path, ProfileResult]]:
    """Each profile with its label: profile k > 0 was taken after the k-th accepted candidate."""
    accepted = state.accepted
    out = []
    for index, path in enumerate(state.profiles):
        if index == 0:
            label = "baseline"
        elif index <= len(accepted):
            label = f"after #{accepted[index - 1].candidate.id}"
        else:
            label = f"profile {index}"
        local = Path(path)
        try:
            out.append((label, local, ProfileResult.model_validate_json(local.read_text())))
        except (OSError, ValueError):
            notes.append(f"profile {_relative(run_dir, local)} is missing or unreadable")
    if accepted and accepted[-1].candidate.proposer == "tpe":
        notes.append("the TPE search does not profile each new incumbent: it reads no findings (nodes.diagnose)")
    elif accepted and len(state.profiles) <= len(accepted):
        notes.append(f"the best configuration (#{accepted[-1].candidate.id}) was not profiled: the run stopped "
                     "before its next diagnosis")
    return out


def ranks_sentence(result: ProfileResult) -> str | None:
    """Whose profile a ranked profile shows, and each rank's time in collectives (None for one process)."""
    if len(result.ranks) < 2:
        return None
    shares = " / ".join("-" if r.comm_share is None else f"{100 * r.comm_share:.1f}%" for r in result.ranks)
    return (f"{len(result.ranks)} ranks; the phases are rank {result.main_rank}'s (the most step time outside "
            f"collectives); collectives in flight, waits included, per rank: {shares} of the step")


def phase_breakdowns(profiles: list[tuple[str, Path, ProfileResult]], run_dir: Path) -> list[PhaseBreakdown]:
    """Each (label, file, result) profile of a run as the summary's row: phase times, host side, floor, notes."""
    rows = []
    for label, path, result in profiles:
        coarse = result.coarse
        if coarse is None:
            continue
        phases = {name: 1e3 * p.share * coarse.step_s for name, p in coarse.phases.items()}
        floor = result.floor
        floors = {} if floor is None else {
            "floor_ms": {name: 1e3 * p.floor_s for name, p in floor.phases.items()},
            "floor_bound": {name: p.bound for name, p in floor.phases.items()},
            "floor_step_ms": 1e3 * floor.floor_s, "floor_note": floor_sentence(floor)}
        host = {"host_work_ms": {name: 1e3 * (p.host_s - p.host_wait_s) for name, p in coarse.phases.items()},
                "host_ops": {name: p.ops for name, p in coarse.phases.items()},
                "launches": {name: p.launches for name, p in coarse.phases.items() if p.launches is not None},
                "host_waits": coarse.host_waits, "host_work": coarse.host_work}
        rows.append(PhaseBreakdown(label=label, profile=_relative(run_dir, path), step_ms=1e3 * coarse.step_s,
                                   unprofiled_step_ms=1e3 * coarse.unprofiled_step_s, phases_ms=phases, **host,
                                   other_ms=max(1e3 * coarse.step_s - sum(phases.values()), 0.0),
                                   ranks_note=ranks_sentence(result), distortion_note=coarse.distortion_note(),
                                   **floors))
    return rows


# The files that hold a run's side-by-side measurements (A/A calibrations, candidates, the final A/B).
MEASUREMENT_FILES = ("baseline/calibration.json", "candidates/*/calibration.json", "candidates/*/ab.json",
                     "final_ab*.json")


def _records(found: Any) -> Iterator[dict[str, Any]]:
    """Every JSON object inside a measurement file's JSON, nested ones included."""
    if isinstance(found, list):
        for item in found:
            yield from _records(item)
    elif isinstance(found, dict):
        yield found
        for value in found.values():
            yield from _records(value)


def read_worker_startup(run_dir: Path) -> WorkerStartup | None:
    """Medians over every timing worker of the run. The quoted final A/B is a copy of one of the runs kept beside
    it, so each worker's split (three wall-clock differences) is counted once."""
    splits: dict[tuple[float, float, float], dict[str, float]] = {}  # each split's build parts
    closes: dict[tuple[float, float], None] = {}  # (wall_s, close_s): a copied measurement counted once
    ahead = 0
    for pattern in MEASUREMENT_FILES:
        for path in sorted(run_dir.glob(pattern)):
            try:
                records = list(_records(json.loads(path.read_text(encoding="utf-8"))))
            except (OSError, json.JSONDecodeError):
                continue  # a file torn by a kill
            found = [(r["startup"], r.get("build_parts") or {}) for r in records if isinstance(r.get("startup"), dict)]
            splits.update({(x["start"], x["build"], x["warmup"]): parts for x, parts in found
                           if all(isinstance(x.get(k), (int, float)) for k in ("start", "build", "warmup"))})
            ahead += sum(1 for r in records if r.get("started_ahead") is True and "final_ab" not in path.name)
            closes.update({(r.get("wall_s"), r["close_s"]): None for r in records
                           if isinstance(r.get("close_s"), (int, float)) and r["close_s"] > 0})
    if not splits:
        return None
    start, build, warmup = (np.array(column) for column in zip(*splits))
    names = list(dict.fromkeys(name for parts in splits.values() for name in parts))
    return WorkerStartup(workers=len(splits), ready_s=float(np.median(start + build + warmup)),
                         start_s=float(np.median(start)), build_s=float(np.median(build)),
                         warmup_s=float(np.median(warmup)), started_ahead=ahead,
                         close_s=float(np.median([c for _, c in closes])) if closes else None,
                         build_parts={name: float(np.median([p[name] for p in splits.values() if name in p]))
                                      for name in names})


def _roofline(profiles: list[tuple[str, Path, ProfileResult]]) -> Roofline | None:
    with_fine = [(label, result.fine) for label, _, result in profiles if result.fine is not None]
    if not with_fine:
        return None  # the reports say why
    shown = [with_fine[0]] + ([with_fine[-1]] if len(with_fine) > 1 else [])  # baseline's and the latest
    points = [RooflinePoint(label=label, slot=s.slot, implementation=s.implementation, dtype=s.dtype, shape=s.shape,
                            median_us=1e6 * s.median_s, intensity=s.intensity,
                            achieved_flops_per_s=s.achieved_flops_per_s,
                            attainable_flops_per_s=s.attainable_flops_per_s, roofline_fraction=s.roofline_fraction,
                            bound=s.bound)
              for label, fine in shown for s in fine.slots]
    return Roofline(ceilings=shown[-1][1].ceilings, points=points)


def build_summary(state: RunState) -> Summary:
    run_dir = Path(state.run_dir)
    notes: list[str] = []
    trust: list[str] = []
    overall, by_tier, calls = _spend(run_dir)
    accepted = len(state.accepted)
    baseline = state.baseline
    baseline_step, best_step = _step_times(state, run_dir, notes, trust)
    profiles = read_profiles(state, run_dir, notes)
    decided_at = _decided_at(run_dir)
    notes += run_machine.move_notes(run_dir)
    return Summary(run_id=state.run_id, target=state.target, size=state.size, device=state.device, tier=state.tier,
                   stop_reason=state.stop_reason, finished=state.stop_reason is not None,
                   baseline_step_ms=baseline.step_ms if baseline else None,
                   noise_floor=baseline.noise_floor if baseline else None,
                   recalibrations=[r.model_copy(update={"calibration_file": _relative(run_dir,
                                                                                      Path(r.calibration_file))})
                                   for r in state.recalibrations],
                   baseline_step=baseline_step,
                   reorder_scale=baseline.reorder.scale if baseline else None,
                   reorder_calibration=baseline.reorder.detail if baseline else None,
                   baseline_quality=baseline.quality if baseline else None,
                   best_step=best_step, numerics=_numerics(state), best_config=state.incumbent.config,
                   best_kernels=sorted(state.incumbent.kernels), est_speedup=state.incumbent.est_speedup,
                   final=state.final, evaluated=state.evaluated, accepted=accepted,
                   candidates=[_row(e, decided_at) for e in state.history], phases=phase_breakdowns(profiles, run_dir),
                   roofline=_roofline(profiles), spend=overall, spend_by_tier=by_tier, llm_calls=calls,
                   cost_per_win_usd=overall.cost_usd / accepted if accepted else None, wall_s=state.elapsed_s,
                   node_s=state.node_s, worker_startup=read_worker_startup(run_dir),
                   environment=baseline.environment if baseline else {}, gpus=state.gpus,
                   lanes_note=state.plan.lanes_note, notes=notes, trust=trust)
