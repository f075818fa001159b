"""One rank of a ranked profile: every rank of a torch.distributed job profiled, reported as one result.

    python -m torch.distributed.run --standalone --nproc_per_node N \\
        -m profilers.rank_worker --request REQ.json --result RES.json

``profilers.client.run_profile`` starts this for a ProfileRequest with ``ranks`` > 1. Every rank joins
the job and builds its session as the ranked bench worker does (``targets.rank_worker.join_job``,
``targets.worker.build_session`` with the job), then runs the coarse profile on it
(``profilers.coarse.profile_session``: the ranks profile the same steps at once, collectives included).
The ranks' profiles are gathered to rank 0, which writes one ProfileResult:

* its main profile (coarse, floor, counters, findings) is the SLOWEST rank's: the one with the most
  step time outside collectives (the others wait for it in one), since a synchronous job goes at that
  rank's pace; ``main_rank`` says which;
* ``ranks`` holds every rank in brief: step time, each phase's time, and the share of the step that
  collectives take (``CoarseProfile.comm_share``);
* the fine profile, when asked, stays single-process: once the job is over, rank 0 times the kernel
  slots in a single-process session of the same config (as ``profilers.worker`` does). Its shapes
  are the whole batch's, not a rank's, so it is shown but left out of the findings (a note says so).

Failures follow the ranked worker's protocol (``targets.rank_worker.serve_rank``): the first rank to
fail writes its failure, naming itself, and the job stops; a rank that dies is named by the client.
"""

from __future__ import annotations

import gc
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from profilers.coarse import profile_session
from profilers.findings import findings
from profilers.records import CoarseProfile, ProfileRequest, ProfileResult, RankProfile
from profilers.worker import fine_profile, floor_of, step_work
from targets.protocol import PhaseWork
from targets.rank_worker import join_job, serve_rank
from targets.ranks import RankContext, inject_fault, leave
from targets.registry import resolve_target
from targets.worker import build_session, environment


@dataclass
class RankOutcome:
    """What one rank sends to rank 0: its coarse profile and what the main profile needs from its session."""

    coarse: CoarseProfile
    counters: dict[str, float]
    config: dict
    work: dict[str, PhaseWork] | None  # for the floor, which rank 0 computes alone (it measures ceilings)


def rank_trace(path: str | None, rank: int) -> str | None:
    """Where this rank writes its trace: ``trace.json`` -> ``trace.rank1.json``."""
    if path is None:
        return None
    where = Path(path)
    return str(where.with_name(f"{where.stem}.rank{rank}{where.suffix}"))


def profile_rank(req: ProfileRequest, job: RankContext) -> RankOutcome:
    """Build this rank's session and profile it (collective: every rank calls it together)."""
    _, config, _, session = build_session(req, job.device, job)
    inject_fault(session, job.rank)
    coarse = profile_session(session, job.device, req.warmup, req.profile_steps, rank_trace(req.trace, job.rank))
    return RankOutcome(coarse=coarse, counters=session.counters(), config=config, work=step_work(session, coarse))


def slowest(outcomes: list[RankOutcome]) -> int:
    """The rank that holds the job up: the most step time outside collectives (every rank's step ends at the
    same collective, so step times tie; the others' extra time is spent waiting in one). Then the longest
    step, then the lowest rank."""
    def busy(rank: int) -> tuple[float, float, int]:
        coarse = outcomes[rank].coarse
        return coarse.step_s - (coarse.comm_s or 0.0), coarse.step_s, -rank
    return max(range(len(outcomes)), key=busy)


def single_process_fine(req: ProfileRequest, device: torch.device, result: ProfileResult) -> None:
    """The fine profile of the request's config in this process alone, once the job is over."""
    gc.collect()  # the ranked session's memory goes before the single-process session comes
    if device.type == "cuda":
        torch.cuda.empty_cache()
    target, _, kernels, session = build_session(req, device)
    for _ in range(req.warmup):
        session.step()
    result.fine = fine_profile(req, target, kernels, session, device, result)
    if result.fine is not None:
        result.notes.append(f"fine profile: timed in one process after the {req.ranks}-rank job, on the single-"
                            f"process session's shapes (the whole batch), so its kernels are not in the findings")


def run_rank(req: ProfileRequest) -> ProfileResult | None:
    """Profile this rank; rank 0 returns the job's result, the others None. Exceptions propagate."""
    start = time.perf_counter()
    job = join_job(req)
    outcome = profile_rank(req, job)
    outcomes: list[RankOutcome | None] = [None] * job.world_size
    dist.all_gather_object(outcomes, outcome)
    if job.rank != 0:
        return None
    leave()  # the last collective: what follows is rank 0's alone
    main = slowest(outcomes)
    chosen = outcomes[main]
    result = ProfileResult(ok=False, target=req.target, size=req.size, config=chosen.config,
                           environment=environment(job.device, job.world_size), coarse=chosen.coarse,
                           counters=chosen.counters, main_rank=main,
                           ranks=[RankProfile.of(rank, o.coarse) for rank, o in enumerate(outcomes)])
    result.floor = floor_of(req, chosen.work, job.device, chosen.coarse)
    if req.fine:
        single_process_fine(req, job.device, result)
    result.findings = findings(chosen.coarse, None, chosen.counters, chosen.config, resolve_target(req.target))
    result.ok = True
    result.wall_s = time.perf_counter() - start
    return result


def main(argv: list[str] | None = None) -> int:
    return serve_rank("python -m profilers.rank_worker", ProfileRequest, run_rank,
                      lambda req, failure: ProfileResult(ok=False, target=req.target, size=req.size,
                                                         failure=failure), argv)


if __name__ == "__main__":
    sys.exit(main())
