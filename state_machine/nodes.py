"""One plain function per node of the agent's graph: ``node(state, ctx) -> dict of state updates``.

Each node reads the typed state, does its one job through sg-opt's own workers and validators
(never through anything a candidate can change), writes its bulky records under the run directory
and returns the fields it changed. None of them knows about LangGraph, so each is unit-tested by
calling it with a state and a context. ``graph.py`` wires them together.
"""

from __future__ import annotations

import math
import statistics
import time
from pathlib import Path
from typing import Any

from profilers.client import run_profile
from profilers.records import ProfileRequest
from state_machine import events
from state_machine.baseline_budget import fit_calibration
from state_machine.context import RunContext
from state_machine.lanes import batch_size, concurrent, noise_floor
from state_machine.parts import saved_part
from state_machine.llm_interfaces import BudgetExceeded, DeadlineReached, LLMError
from state_machine.proposers import Proposal
from state_machine.proposers.registry import proposer_for
from state_machine.specs import (baseline_request, candidate_config, candidate_kernels, candidate_request,
                                 config_digest, incumbent_request, numerics_class, write_json)
from state_machine.steady_profile import expected_step_ms, steadiest_profile
from state_machine.state import (Baseline, Candidate, Evaluated, FinalMeasurement, InFlight, Incumbent,
                                 Recalibration, RunState, Verdict, rejected)
from state_machine.time_budget import out_of_time, own_s
from state_machine.validation import validate  # noqa: F401 (a node: graph and batch call nodes.validate)
from targets.protocol import ConfigError
from targets.worker_client import run_worker
from validators.started_ahead import prestart_key
from validators.timing_worker import note_footprint
from validators.numerics import calibrate_reorder
from validators.source import check_source
from validators.confirmation import across_process_pairs, confirm_win
from validators.ab_result import ABResult
from validators.speedup import CalibrationFailed, measure_ab
from validators.steadiness import steadier_of_two

PROBE_STEPS = 5           # steps of the short timing that sizes the A/B blocks
MIN_BLOCK_STEPS, MAX_BLOCK_STEPS = 3, 100
TIMEOUT_FACTOR = 8.0      # a candidate's worker may take this many times the baseline's before it is killed
MAX_LLM_FAILURES = 3      # consecutive failed proposals before the run stops


# ----------------------------------------------------------------------------- setup and baseline

def setup(state: RunState, ctx: RunContext) -> dict[str, Any]:
    """Check the request against the target before any worker starts; a bad one stops the run."""
    state.path("candidates").mkdir(parents=True, exist_ok=True)
    try:
        ctx.target.check_size(state.size)
        ctx.target.knob_space.resolve(state.baseline_config)
    except ConfigError as exc:
        return {"stop_reason": f"error: {exc}"}
    ctx.event(state.run_dir, events.Setup(target=state.target, size=state.size, tier=state.tier, device=state.device))
    return {}


def _baseline_part(state: RunState, name: str, request: Any) -> Any:
    """One worker of the baseline, or its result saved by an attempt killed before the baseline's checkpoint."""
    return saved_part(state.path("baseline"), name, request, lambda r: run_worker(r, timeout_s=state.plan.timeout_s))


def _stage(state: RunState, ctx: RunContext, stage: str, cut: str | None = None) -> None:
    """A line of progress through the baseline (it runs for minutes before anything else shows)."""
    ctx.event(state.run_dir, events.BaselineStage(stage=stage, cut=cut))


def baseline(state: RunState, ctx: RunContext) -> dict[str, Any]:
    """Numerics fingerprint (and quality when model changes are allowed) of the baseline, then A/A, sized to fit
    its share of --max-minutes (``baseline_budget``)."""
    start, plan = time.monotonic(), state.plan
    _stage(state, ctx, f"numerics fingerprint ({plan.numerics_steps} steps)")
    numerics = _baseline_part(state, "numerics", baseline_request(state, "numerics"))
    if not numerics.ok:
        return {"stop_reason": f"error: the baseline failed its numerics run ({numerics.failure_text()})"}
    numerics_file = write_json(state.path("baseline", "numerics.json"), numerics)
    _stage(state, ctx, "numerics once more, reassociated (the reorder bands)")
    reordered = _baseline_part(state, "reordered",
                               baseline_request(state, "numerics").model_copy(update={"reassociate": True}))
    if not reordered.ok:
        return {"stop_reason": f"error: the baseline failed its reassociated numerics run ({reordered.failure_text()})"}
    reorder = calibrate_reorder(numerics.numerics, reordered.numerics)
    write_json(state.path("baseline", "reorder_calibration.json"), {"calibration": reorder.model_dump(),
                                                                      "result": reordered.model_dump()})
    quality = None
    if state.allow_model_changes:
        steps = plan.quality_steps or ctx.target.steps_for_quality(state.size)
        metrics = ", ".join(m.name for m in ctx.target.quality_metrics)
        _stage(state, ctx, f"quality: {steps} training steps, then {metrics}")
        result = _baseline_part(state, "quality", baseline_request(state, "quality", steps))
        if not result.ok:
            return {"stop_reason": f"error: the baseline failed its quality run ({result.failure_text()})"}
        quality = result.quality.metrics
    if (reason := out_of_time(state.model_copy(update={"elapsed_s": state.elapsed_s + time.monotonic() - start}))):
        return {"stop_reason": f"{reason}, in the baseline"}
    step_s, start_s = numerics.numerics.stage_s.get("steps", 0.0) / max(1, plan.numerics_steps), numerics.wall_s
    if plan.block_steps is None:
        _stage(state, ctx, f"a short timing ({PROBE_STEPS} steps) to size the blocks")
        probe = _baseline_part(state, "probe", baseline_request(state, "bench", steps=PROBE_STEPS))
        if not probe.ok:
            return {"stop_reason": f"error: the baseline failed to run ({probe.failure_text()})"}
        note_footprint(probe.memory)  # a timing worker's: the first calibration's spare pair may start
        step_s, start_s = statistics.median(probe.bench.step_s), probe.wall_s
        plan = plan.model_copy(update={"block_steps": max(MIN_BLOCK_STEPS, min(MAX_BLOCK_STEPS, math.ceil(
            plan.block_seconds / max(step_s, 1e-6))))})
    plan, cut = fit_calibration(state, plan, step_s, start_s, state.elapsed_s + time.monotonic() - start)
    _stage(state, ctx, f"A/A noise floor: {plan.aa_repeats} run(s) of {plan.calibration_blocks} blocks per side, "
                       f"{plan.block_steps} steps each", cut=cut)
    try:
        noise, lanes = noise_floor(state.model_copy(update={"plan": plan}), baseline_request(state, "bench"),
                                   plan.calibration_blocks, plan.block_steps, plan.timeout_s)
    except CalibrationFailed as exc:
        return {"stop_reason": f"error: the baseline could not be timed ({exc})"}
    calibration = write_json(state.path("baseline", "calibration.json"), noise)
    longest = max([numerics.wall_s] + [run.wall_s for run in noise.runs])
    plan = plan.model_copy(update={"timeout_s": min(plan.timeout_s, max(plan.min_timeout_s,
                                                                          TIMEOUT_FACTOR * longest)), **lanes})
    record = Baseline(numerics_file=numerics_file, quality=quality,
                      step_ms=noise.step_ms, noise_floor=noise.floor,
                      calibration_file=calibration, resolved_config=numerics.config, reorder=reorder,
                      environment=numerics.environment.model_dump() if numerics.environment else {},
                      wall_s=time.monotonic() - start)
    ctx.event(state.run_dir, events.Baseline(step_ms=record.step_ms, noise_floor=noise.floor, timeout_s=plan.timeout_s,
                                             reorder_scale=reorder.scale, reorder=reorder.detail,
                                             lanes=plan.lanes_note))
    return {"baseline": record, "plan": plan, "incumbent": Incumbent(config=dict(state.baseline_config))}


# ----------------------------------------------------------------------------- diagnose and propose

def _recalibrated(state: RunState, ctx: RunContext) -> dict[str, Any]:
    """A new A/A noise floor on the incumbent, once the run has made it ``plan.recalibrate_after`` times faster
    (estimated) than the step the floor in force was calibrated on. A floor set on the baseline says how
    far two identical processes drift there; at `large` the baseline is a device-bound 110 ms step, the
    tuned incumbent a host-bound 10 ms one whose block medians spread by 23-70% within one measurement
    (2026-11-30), and its candidates were still judged against the baseline's 1%. A failed A/A keeps the
    floor in force."""
    if not state.recalibration_due:
        return {}
    plan, cid = state.plan, state.incumbent.from_candidate
    try:
        noise, lanes = noise_floor(state, incumbent_request(state, "bench"), plan.calibration_blocks,
                                   plan.block_steps, plan.timeout_s)
    except CalibrationFailed as exc:
        ctx.event(state.run_dir, events.RecalibrateFailed(after=cid, reason=str(exc)))
        return {}
    path = write_json(state.path("candidates", f"{cid:03d}", "calibration.json"), noise)
    record = Recalibration(after_candidate=cid, step_ms=noise.step_ms, noise_floor=noise.floor,
                           calibration_file=path)
    ctx.event(state.run_dir, events.Recalibrate(after=cid, step_ms=record.step_ms, noise_floor=noise.floor,
                                                was=state.noise_floor, lanes=lanes.get("lanes_note")))
    return {"recalibrations": state.recalibrations + [record], "plan": plan.model_copy(update=lanes)}


def diagnose(state: RunState, ctx: RunContext) -> dict[str, Any]:
    """Profile the incumbent (after calibrating the noise floor again on it, when it has become much faster:
    ``_recalibrated``); its ranked findings are what the proposers attack next."""
    updates = _recalibrated(state, ctx)
    proposer = proposer_for(ctx.policy)
    if not proposer.reads_findings and state.profiles:
        # e.g. TPE: past the baseline's profile (the report's first column), profiling each new incumbent costs the
        # oracle a fresh worker's build and steps for nothing it uses (25-53 s each at `large-cached`, H200,
        # 2026-12-04). Its noise floor is still calibrated again: that judges its candidates.
        ctx.event(state.run_dir, events.DiagnoseSkipped(reason=f"the {proposer.name} search reads no findings"))
        return updates
    spec = incumbent_request(state, "bench")
    req = ProfileRequest(**spec.model_dump(exclude={"version", "mode"}), profile_steps=state.plan.profile_steps,
                         fine=state.plan.fine_profile)

    def disturbed(slowdown: float) -> None:
        ctx.event(state.run_dir, events.ProfileDisturbed(
            slowdown=slowdown,
            reason=f"its steps ran x{slowdown:.2f} slower without the profiler than measured; profiled again"))
    expected = expected_step_ms(state, updates.get("recalibrations", state.recalibrations))
    result = steadiest_profile(lambda: run_profile(req, timeout_s=state.plan.timeout_s), expected, disturbed)
    path = write_json(state.path("profiles", f"{len(state.profiles):02d}.json"), result)
    if not result.ok:
        ctx.event(state.run_dir, events.DiagnoseFailed(reason=result.failure_text()))
        return {**updates, "findings": [], "profiles": state.profiles + [path]}
    ctx.event(state.run_dir, events.Diagnose(
        findings=[f"{f.category}: {f.evidence}" for f in result.findings[:5]],
        distorted=result.coarse.distortion_note() if result.coarse is not None else None))
    return {**updates, "findings": result.findings, "profiles": state.profiles + [path]}


def limit_reason(state: RunState, profile_next: bool = False) -> str | None:
    """Why the run must stop now, or None (``profile_next``: it would profile its incumbent before the next
    candidate)."""
    if state.stop_reason:
        return state.stop_reason
    if state.evaluated >= state.limits.max_iters:
        return f"max-iters: {state.evaluated} candidates evaluated"
    return out_of_time(state, profile_next)  # --max-minutes, the final measurement included


def _to_candidate(state: RunState, proposal: Proposal, cid: int) -> Candidate:
    files = {}
    for slot, source in proposal.kernel_sources.items():
        path = state.path("candidates", f"{cid:03d}", "kernels", f"{slot}.py")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(source, encoding="utf-8")
        files[slot] = str(path)
    return Candidate(id=cid, kind=proposal.kind, patch=proposal.patch, kernels=files, rationale=proposal.rationale,
                     proposer=proposal.proposer, expected_gain=proposal.expected_gain, repair_of=proposal.repair_of)


def _ask(state: RunState, ctx: RunContext) -> tuple[list[Proposal], dict[str, Any]]:
    """Proposals from the run's proposer (``proposers.registry``), as many as can be evaluated at once (one per lane
    of --gpus), or the updates that stop the run when none can come (an LLM's budget, deadline or failures)."""
    try:
        return proposer_for(ctx.policy).propose(state, ctx, batch_size(state)), {"proposer_failures": []}
    except BudgetExceeded as exc:
        return [], {"stop_reason": f"budget: {exc}"}
    except DeadlineReached as exc:
        return [], {"stop_reason": f"max-minutes: {exc}"}
    except LLMError as exc:
        if getattr(exc, "fatal", False):
            return [], {"stop_reason": f"error: {exc}"}
        failures = state.proposer_failures + [str(exc)]
        ctx.event(state.run_dir, events.ProposalFailed(reason=str(exc)))
        if len(failures) >= MAX_LLM_FAILURES:
            return [], {"stop_reason": f"error: {len(failures)} proposals in a row failed; last: {exc}",
                        "proposer_failures": failures}
        return [], {"proposer_failures": failures}


def propose(state: RunState, ctx: RunContext) -> dict[str, Any]:
    """Take the next queued candidate (the next batch, one per lane, under --gpus), asking the proposer for
    more when the queue is empty."""
    if (reason := limit_reason(state)) is not None:
        return {"stop_reason": reason, "current": None}
    queue, updates = list(state.queue), {"proposal_rounds": state.proposal_rounds}
    if not queue:
        proposals, updates = _ask(state, ctx)
        updates["proposal_rounds"] = state.proposal_rounds + 1
        queue = [_to_candidate(state, p, state.next_id + i) for i, p in enumerate(proposals)]
        updates["next_id"] = state.next_id + len(queue)
        failed = len(updates.get("proposer_failures", [])) > len(state.proposer_failures)
        if not queue and not failed and "stop_reason" not in updates:
            updates["stop_reason"] = "converged: the proposer has no promising candidate left to try"
        if not queue:  # stopped, or a failed LLM proposal that the next round retries
            return {**updates, "queue": [], "current": None}
    take = batch_size(state)  # 1 without --gpus
    for cand in queue[:take]:
        ctx.event(state.run_dir, events.Propose(id=cand.id, kind=cand.kind, patch=cand.patch,
                                                kernels=list(cand.kernels), rationale=cand.rationale,
                                                proposer=cand.proposer))
    if concurrent(state):
        return {**updates, "queue": queue[take:], "batch": queue[:take], "current": None}
    return {**updates, "queue": queue[1:], "current": InFlight(candidate=queue[0])}


# ----------------------------------------------------------------- check and measure (validate: validation.py)

def _coerce_patch(ctx: RunContext, patch: dict[str, Any]) -> dict[str, Any]:
    space = ctx.target.knob_space
    return {name: space[name].parse(value) if isinstance(value, str) else space[name].validate(value)
            for name, value in patch.items()}


def check(state: RunState, ctx: RunContext) -> dict[str, Any]:
    """Static checks: allowed kind, knob names, values and constraints, kernel source safety, duplicates."""
    cand, space = state.current.candidate, ctx.target.knob_space
    if cand.kind not in ctx.policy.kinds:
        return rejected(state, "check", f"tier {ctx.policy.tier} does not allow {cand.kind} candidates")
    if not cand.patch and not cand.kernels:
        return rejected(state, "check", "the candidate changes nothing")
    try:
        patch = _coerce_patch(ctx, cand.patch)
        resolved = space.resolve({**state.incumbent.config, **patch})
        space.check_ranks(resolved, state.ranks)
        if ctx.target.check_config is not None and state.ranks == 1 and state.data is None:
            ctx.target.check_config(resolved, state.size)  # what would fail its build, before a worker starts
    except ConfigError as exc:
        return rejected(state, "check", str(exc))
    cand = cand.model_copy(update={"patch": patch})
    current = space.resolve(state.incumbent.config)
    settings = [n for n in patch if space[n].user_setting and resolved[n] != current[n]]
    if settings:
        return rejected(state, "check", f"{', '.join(settings)} is the user's own setting (a limit), not a tuning "
                                        "knob")
    model_knobs = [n for n in patch if space[n].numerics == "model" and resolved[n] != current[n]]
    if model_knobs and not state.allow_model_changes:
        return rejected(state, "check", f"{', '.join(model_knobs)} change the model (numerics class model); "
                                        "pass --allow-model-changes to allow that")
    for slot_name, path in cand.kernels.items():
        try:
            unused = ctx.target.slot(slot_name).unused_reason(resolved)
        except ConfigError as exc:
            return rejected(state, "check", str(exc))
        if unused is not None:
            return rejected(state, "check", unused)
        verdict = check_source(Path(path).read_text(encoding="utf-8"), slot_name)
        if not verdict.ok:
            return rejected(state, "check", verdict.message)
    kernels = candidate_kernels(state, cand)
    digest = config_digest(resolved, kernels)
    seen = {e.digest: f"candidate #{e.candidate.id}" for e in state.history if e.digest}
    seen[config_digest(current, state.incumbent.kernels)] = "the incumbent"
    if digest in seen:
        return rejected(state, "check", f"a duplicate of {seen[digest]}")
    return state.in_flight(candidate=cand, digest=digest,
                           numerics_class=numerics_class(state, space, resolved, kernels))


class IncumbentFailed(RuntimeError):
    """The incumbent's own worker failed while timed beside a candidate: no candidate can be judged against it, and
    rejecting this one would blame it (the TPE oracle would learn a false failure). The run stops with the
    candidate undecided, its last checkpoint before the measurement, so ``--resume`` measures it again once
    the cause is fixed."""


def measure(state: RunState, ctx: RunContext) -> dict[str, Any]:
    """Side by side against the incumbent; a win must clear the noise floor twice, in fresh processes."""
    cand, plan = state.current.candidate, state.plan
    incumbent, candidate = incumbent_request(state, "bench"), candidate_request(state, cand, "bench")
    # its measurements adopt the workers validate started for them
    confirmation = confirm_win(incumbent, candidate, state.noise_floor, plan.blocks, plan.block_steps, plan.timeout_s,
                               seed=state.seed + 100 * cand.id, block_seconds=plan.block_seconds, pool=ctx.pool)
    if not confirmation.clean:  # a busy machine judged nothing: measure once more, then refuse in one sentence
        ctx.event(state.run_dir, events.MachineBusy(id=cand.id, reason=confirmation.reason))
        confirmation = confirm_win(incumbent, candidate, state.noise_floor, plan.blocks, plan.block_steps,
                                   plan.timeout_s, seed=state.seed + 100 * cand.id + 1,
                                   block_seconds=plan.block_seconds, pool=ctx.pool)
    ctx.pool.discard(prestart_key(incumbent, candidate))  # a spare pair no measurement came to
    path = write_json(state.path("candidates", f"{cand.id:03d}", "ab.json"), confirmation)
    last = confirmation.runs[-1]
    fields = dict(numerics_class=state.current.numerics_class, numerics_detail=state.current.numerics_detail,
                  ratio=last.ratio, ci_low=last.ci_low, ci_high=last.ci_high, step_ms=last.step_ms("b"),
                  artifacts={**state.current.artifacts, "ab": path})
    if last.failure is not None and last.failed_side == last.a.label:  # side a is the incumbent
        ctx.event(state.run_dir, events.IncumbentFailed(id=cand.id, kind=last.failure.kind,
                                                        reason=last.failure.message))
        raise IncumbentFailed(f"the incumbent's worker failed while timed beside candidate #{cand.id} "
                              f"({last.failure.kind}: {last.failure.message}); the run stopped with #{cand.id} "
                              f"undecided (details in {path}): resume it with --resume once the cause is fixed")
    if last.failure is not None:
        return rejected(state, "measure", f"the candidate failed while timed ({last.failure.kind}: "
                                          f"{last.failure.message})", **fields)
    return state.in_flight(verdict=Verdict(accepted=confirmation.accepted, stage="measure", reason=confirmation.reason,
                                           **fields))


# ----------------------------------------------------------------------------- decide and report

class FinalMeasurementFailed(RuntimeError):
    """The final side-by-side measurement failed twice (a timeout, a crash): the run stops before its report's
    checkpoint, with the report written to say so and the accepted changes kept, so that ``--resume`` measures
    again instead of a report that quietly proves nothing."""


def final_failed_note(state: RunState, result: ABResult) -> str:
    return (f"the final measurement of the baseline against the best failed twice ({result.failure.kind}: "
            f"{result.failure.message}); the {len(state.accepted)} accepted change(s) stand, unproven, in "
            f"best_config.toml: `sg-opt optimize --resume {state.run_dir}` measures again")


def decide(state: RunState, ctx: RunContext) -> dict[str, Any]:
    """Record the verdict; an accepted candidate becomes the incumbent."""
    cand, verdict = state.current.candidate, state.current.verdict
    record = Evaluated(candidate=cand, verdict=verdict, incumbent_id=state.incumbent.from_candidate,
                       config=candidate_config(state, cand), digest=state.current.digest)  # None unless check passed
    ctx.event(state.run_dir, events.Decide(id=cand.id, accepted=verdict.accepted, stage=verdict.stage,
                                           reason=verdict.reason, ratio=verdict.ratio))
    updates: dict[str, Any] = {"history": state.history + [record], "current": None,
                               "candidate_marks": state.candidate_marks + [own_s(state)]}
    if verdict.accepted:
        updates["incumbent"] = Incumbent(config=candidate_config(state, cand), kernels=candidate_kernels(state, cand),
                                         from_candidate=cand.id,
                                         est_speedup=state.incumbent.est_speedup / (verdict.ratio or 1.0))
    return updates


def report(state: RunState, ctx: RunContext) -> dict[str, Any]:
    """Baseline against the best, side by side, once more; then the report files, whose wall time includes that
    measurement (the graph adds a node's time only once it returns: the reports of the 2026-12-03 x12.37 `large-cached`
    run said 17.1 minutes where the run took 18.5 with its final measurement's 85 s)."""
    start = time.monotonic()
    updates: dict[str, Any] = {}
    if state.accepted and state.baseline is not None and state.final is None:
        plan, floor = state.plan, state.baseline.noise_floor

        def final_ab(repeat: int) -> ABResult:  # its blocks spread over fresh worker pairs, pooled
            return across_process_pairs(lambda seed, blocks: measure_ab(
                baseline_request(state, "bench"), incumbent_request(state, "bench"), blocks, plan.block_steps,
                plan.timeout_s, "baseline", "best", floor=floor, seed=seed, block_seconds=plan.block_seconds),
                max(plan.blocks, plan.final_blocks), plan.final_pairs, seed=state.seed + 7 + 100 * repeat)
        result, runs = steadier_of_two(final_ab)  # stalled blocks: measured once more, the steadier quoted
        if result.failure is not None:  # a worker that timed out or crashed drops no accepted change: again
            ctx.event(state.run_dir, events.FinalRetry(kind=result.failure.kind, reason=result.failure.message))
            write_json(state.path("final_ab_failed.json"), result)
            result, runs = steadier_of_two(lambda repeat: final_ab(repeat + 2))
        note = result.note
        if result.failure is not None:
            note = final_failed_note(state, result)
        if len(runs) > 1:
            for run, name in zip(runs, ("final_ab_disturbed.json", "final_ab_repeat.json")):
                write_json(state.path(name), run)
            note += " (final_ab_disturbed.json and final_ab_repeat.json keep both)"
        path = write_json(state.path("final_ab.json"), result)
        updates["final"] = FinalMeasurement(ratio=result.ratio, speedup=result.speedup, ci_low=result.ci_low,
                                            ci_high=result.ci_high, verdict=result.verdict, file=path, note=note,
                                            clean=result.quotable,
                                            load=None if result.quotable else result.load_note())
    finished = state.model_copy(update={**updates, **state.spent_in("report", time.monotonic() - start)})
    if ctx.write_report is not None:
        updates["report_files"] = ctx.write_report(finished)
    if "final" in updates and updates["final"].ratio is None and updates["final"].note:
        raise FinalMeasurementFailed(updates["final"].note)  # no checkpoint: --resume measures again
    ctx.event(state.run_dir, events.Report(stop_reason=state.stop_reason, files=updates.get("report_files", [])))
    return updates
