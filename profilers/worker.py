"""The profiling worker: builds one config of a target in this (child) process and profiles it.

``python -m profilers.worker --request REQ.json --result RES.json`` reads a ProfileRequest, runs
the coarse profile, then (when asked) the fine profile of the kernel slots against the device's
ceilings, derives the ranked findings and writes a ProfileResult. As in ``targets.worker``, the
workload never shares a process with the caller: every failure it raises is written as a
structured Failure, and a crash or hang is caught by ``profilers.client``. A request on several
ranks runs under torchrun instead (``profilers.rank_worker``), with the pieces defined here.
"""

from __future__ import annotations

import sys
import time

import torch

from profilers.ceilings import get_ceilings
from profilers.coarse import profile_session
from profilers.fine import profile_slots
from profilers.findings import findings
from profilers.floor import step_floor
from profilers.op_timing import time_top_ops
from profilers.records import CoarseProfile, FineProfile, ProfileRequest, ProfileResult, StepFloor
from targets.protocol import ConfigError, PhaseWork, Session, Target
from targets.worker import build_session, environment, failure_of, open_device, serve_request_file


TOP_OPS_TIMED = 8  # the coarse profile's busiest ops, timed per call in situ


def fine_profile(req: ProfileRequest, target: Target, kernels: dict, session: Session, device: torch.device,
                 result: ProfileResult) -> FineProfile | None:
    """The kernel slots on the session's shapes against the ceilings, and its top ops timed per call. It runs
    steps of the session on its own, so a ranked profile calls it on a single-process session."""
    if target.slot_shapes is None or target.slot_dtype is None:  # it does not say where its slots run
        result.notes.append(f"fine profile skipped: slot shapes of target {target.name} are unknown")
        return None
    ceilings = get_ceilings(device, quick=req.quick_ceilings)
    fine = profile_slots(target, target.slot_shapes(session), device, target.slot_dtype(session), kernels,
                         req.fine_repeats, ceilings=ceilings, coarse=result.coarse,
                         slot_phases=dict(target.slot_phases), seed=req.seed)
    top = [op.name for op in result.coarse.top_ops[:TOP_OPS_TIMED]]
    fine.op_timings = time_top_ops(session, device, req.profile_steps, top, ceilings)
    return fine


def step_work(session: Session, coarse: CoarseProfile) -> dict[str, PhaseWork] | None:
    """Each phase's least work, when the session has a work model (see profilers.floor)."""
    work_model = getattr(session, "work_model", None)
    if work_model is None:
        return None
    return work_model((coarse.session_bytes_h2d_per_step or 0.0) + (coarse.session_bytes_d2h_per_step or 0.0))


def floor_of(req: ProfileRequest, work: dict[str, PhaseWork] | None, device: torch.device,
             coarse: CoarseProfile) -> StepFloor | None:
    """The step's roofline floor at this device's ceilings (measured here, so in one process at a time)."""
    if work is None:
        return None
    return step_floor(work, get_ceilings(device, quick=req.quick_ceilings), coarse)


def execute(req: ProfileRequest) -> ProfileResult:
    """Profile the request's config; every failure the workload raises becomes a structured result."""
    start = time.perf_counter()
    result = ProfileResult(ok=False, target=req.target, size=req.size)
    try:
        if req.ranks > 1:
            raise ConfigError(f"ranks {req.ranks} are profiled under torchrun (profilers.rank_worker), not in "
                              f"this worker")
        device = open_device(req)
        result.environment = environment(device)
        target, result.config, kernels, session = build_session(req, device)
        result.coarse = profile_session(session, device, req.warmup, req.profile_steps, req.trace)
        result.counters = session.counters()
        result.fine = fine_profile(req, target, kernels, session, device, result) if req.fine else None
        result.floor = floor_of(req, step_work(session, result.coarse), device, result.coarse)
        result.findings = findings(result.coarse, result.fine, result.counters, result.config, target)
        result.ok = True
    except Exception as exc:  # noqa: BLE001 - any workload error is a structured failure
        result.failure = failure_of(exc)
    result.wall_s = time.perf_counter() - start
    return result


def main(argv: list[str] | None = None) -> int:
    return serve_request_file("python -m profilers.worker", ProfileRequest, execute, argv)


if __name__ == "__main__":
    sys.exit(main())
