"""The validate node: a candidate's replaced kernels against their references, then its training trajectory (or,
under class model, its quality) against the baseline's, while its timing workers start on a GPU.

Split from ``nodes`` (one function per node) because validation is the node with most of its own work: the
numerics run, its retry without the workers started ahead, and the verdict. ``nodes.validate`` is this one.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from state_machine import events
from state_machine.context import RunContext
from state_machine.specs import candidate_request, incumbent_request, write_json
from state_machine.state import Candidate, RunState, rejected
from targets.worker_client import run_worker
from targets.worker_protocol import WorkerRequest, WorkerResult
from validators.kernel import KernelVerdict, spot_check_spec
from validators.kernel_file import validate_kernel_file
from validators.numerics import compare
from validators.started_ahead import PrestartKey

# The share of replaced kernels' calls checked against their references during the (untimed) numerics or quality
# run: a kernel that turns wrong after the kernel check's dozen calls is caught there, at calls it cannot predict.
# At one half, a kernel wrong from its third call on escapes a 20-step run's forward calls with odds 2^-18.
NUMERICS_SPOT_CHECK_RATE = 0.5
# Pairs of timing workers started during a candidate's validation: the first measurement's and a spare for the one
# after it, where memory allows (``started_ahead.WorkerPool.prestart``).
PRESTARTED_PAIRS = 2


def _kernel_verdicts(state: RunState, ctx: RunContext, cand: Candidate) -> tuple[dict[str, Any] | None, str | None]:
    """Each replaced slot against its torch reference in every dtype of the plan, each in a subprocess on inputs
    drawn fresh now; the checks run side by side (each is mostly a process start and imports: on the CPU a slot's
    float32 and float16 checks take about as long as one). Returns (the rejection, naming the slot, the dtype and
    the check, or None; the file recording every verdict and the dtypes left unchecked and why, or None)."""
    if not cand.kernels:
        return None, None
    folder = state.path("candidates", f"{cand.id:03d}")
    jobs = [(slot, path, dtype) for slot, path in cand.kernels.items() for dtype in state.plan.kernel_dtypes]

    def check(job: tuple[str, str, str]) -> KernelVerdict:
        slot, path, dtype = job
        return validate_kernel_file(state.target, slot, path, state.device, dtype, state.plan.timeout_s)

    with ThreadPoolExecutor(min(len(jobs), os.cpu_count() or 1)) as pool:
        verdicts = list(pool.map(check, jobs))
    summary: dict[str, Any] = {"checked": {}, "skipped": state.plan.kernel_dtypes_skipped}
    for (slot, _, dtype), verdict in zip(jobs, verdicts):
        write_json(folder / f"kernel-{slot}-{dtype}.json", verdict)
        summary["checked"].setdefault(slot, {})[dtype] = verdict.check if not verdict.ok else "ok"
    path = write_json(folder / "kernel_checks.json", summary)
    for (slot, _, dtype), verdict in zip(jobs, verdicts):  # the first failure in the plan's order
        if not verdict.ok:
            return rejected(state, "validate", f"kernel {slot} ({dtype}) failed its {verdict.check} check: "
                                               f"{verdict.reason}", artifacts={"kernel_checks": path}), path
    return None, path


def validate(state: RunState, ctx: RunContext) -> dict[str, Any]:
    """Kernels against their references, then the training trajectory against the baseline's. On a GPU the
    candidate's timing workers start meanwhile, in the run's pool (``ctx.pool``, ``started_ahead.WorkerPool``), unless
    another lane's timing needs the machine to itself; with one lane, also the second measurement's where memory
    allows (PRESTARTED_PAIRS); a rejected candidate's are killed."""
    cand = state.current.candidate
    kernel_failure, kernel_checks = _kernel_verdicts(state, ctx, cand)
    if kernel_failure is not None:
        return kernel_failure
    ahead = None
    if state.lane is None or state.plan.concurrent_timing:
        ahead = ctx.pool.prestart(incumbent_request(state, "bench"), candidate_request(state, cand, "bench"),
                                  state.plan.timeout_s, pairs=PRESTARTED_PAIRS if state.lane is None else 1)
    updates = _numerics_verdict(state, ctx, ahead)
    found = updates["current"]
    if found.verdict is not None and ahead is not None:
        ctx.pool.discard(ahead)
    if kernel_checks is not None and found.verdict is None:
        updates["current"] = found.model_copy(update={"artifacts": {**found.artifacts, "kernel_checks": kernel_checks}})
    return updates


def _numerics_run(state: RunState, ctx: RunContext, request: WorkerRequest, ahead: PrestartKey | None) -> WorkerResult:
    """The candidate's numerics (or quality) run; one that fails beside workers started ahead runs once more
    without them (it may have run out of device memory beside their builds), unless it ran out of time: their
    builds take a minute at most, so a run past the limit is slow on its own, and a second try would only
    double what it costs (at large-cached on an H200, 2026-12-01, two tries of 511 s each ate a 19-minute run).
    Nor is a config error tried again: the config says it, not the machine (12 of the first 24 TPE trials at
    large-cached on an H200, 2026-12-04, asked for more device memory than the embedding budget, each twice), nor
    a failed spot check (a kernel caught computing wrong values; a second try would only sample it again).
    A failed try is kept in the candidate's folder (``<mode>_failed*.json``), with the stacks a hung worker left."""
    folder = state.path("candidates", f"{state.current.candidate.id:03d}")
    if request.kernels_dir:
        request = request.model_copy(update={"spot_check": spot_check_spec(NUMERICS_SPOT_CHECK_RATE)})
    result = run_worker(request, timeout_s=state.plan.timeout_s)
    if not result.ok:
        write_json(folder / f"{request.mode}_failed.json", result)
    if not result.ok and ahead is not None and result.failure.kind not in ("timeout", "config", "spot-check"):
        ctx.event(state.run_dir, events.NumericsRetry(id=state.current.candidate.id, kind=result.failure.kind,
                                                      reason=result.failure.message))
        ctx.pool.discard(ahead)
        result = run_worker(request, timeout_s=state.plan.timeout_s)
        if not result.ok:
            write_json(folder / f"{request.mode}_failed_again.json", result)
    return result


def _numerics_verdict(state: RunState, ctx: RunContext, ahead: PrestartKey | None) -> dict[str, Any]:
    cand, cls = state.current.candidate, state.current.numerics_class
    folder = state.path("candidates", f"{cand.id:03d}")
    base = WorkerResult.model_validate_json(Path(state.baseline.numerics_file).read_text())
    if cls == "model":
        steps = state.plan.quality_steps or ctx.target.steps_for_quality(state.size)
        request = candidate_request(state, cand, "quality", steps)
        result = _numerics_run(state, ctx, request, ahead)
        if not result.ok:
            return rejected(state, "validate", f"the candidate's quality run failed ({result.failure_text()})",
                            numerics_class=cls)
        # Under class model only the quality metrics are compared (the trajectories may differ by design).
        verdict = compare(base.numerics, base.numerics, "model", quality_baseline=state.baseline.quality,
                          quality_candidate=result.quality.metrics,
                          quality_metrics=ctx.target.quality_metrics or None)
    else:
        result = _numerics_run(state, ctx, candidate_request(state, cand, "numerics"), ahead)
        if not result.ok:
            return rejected(state, "validate", f"the candidate's numerics run failed ({result.failure_text()})",
                            numerics_class=cls)
        verdict = compare(base.numerics, result.numerics, cls, reorder=state.baseline.reorder)
    path = write_json(folder / "numerics.json", {"verdict": verdict.model_dump(), "result": result.model_dump()})
    if not verdict.ok:
        return rejected(state, "validate", f"numerics ({cls}) broken: {verdict.detail}", numerics_class=cls,
                        numerics_detail=verdict.detail, artifacts={"numerics": path})
    ctx.event(state.run_dir, events.Validated(id=cand.id, numerics_class=cls, detail=verdict.detail,
                                              wall_s=result.wall_s, build_s=result.build_s,
                                              stage_s=result.numerics.stage_s if result.numerics is not None else {},
                                              **_kernel_coverage(state, cand, result)))
    return state.in_flight(numerics_detail=verdict.detail, artifacts={"numerics": path})


def _kernel_coverage(state: RunState, cand: Candidate, result: WorkerResult) -> dict[str, Any]:
    """What the validated event says of a candidate's kernels: the dtypes they were checked in, those left
    unchecked on this device and why, and how many of their calls the numerics run checked."""
    if not cand.kernels:
        return {}
    return {"kernel_dtypes": state.plan.kernel_dtypes, "kernel_dtypes_skipped": state.plan.kernel_dtypes_skipped,
            "spot_checks": result.numerics.spot_checks if result.numerics is not None else None}
