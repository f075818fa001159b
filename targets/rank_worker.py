"""One rank of a ranked worker: a request measured on a torch.distributed job, reported as one result.

    python -m torch.distributed.run --standalone --nproc_per_node N \\
        -m targets.rank_worker --request REQ.json --result RES.json

``targets.worker_client.run_worker`` starts this for a request with ``ranks`` > 1. Every rank joins
the job (``targets.ranks``), builds its session with the target's ``build_ranked`` and runs the same
measurement as the single-process worker (``targets.worker.measure``). Then:

* bench: every rank times its own steps; the result's ``step_s`` is, per step, the SLOWEST rank's
  time (a synchronous job goes at its slowest rank's pace), with each rank's times and median beside
  it, and the slowest rank's phases and counters;
* numerics and quality: the figures are the job's global ones (every rank holds them), rank 0's.

Rank 0 writes the result. A rank that fails writes its own failure, unless another rank's is there
first, and exits with status RANK_FAILED_EXIT, so that torchrun stops the job instead of leaving its
peers waiting (and the caller can tell it from a rank that crashed without a word). That protocol
(``serve_rank``) and joining the job (``join_job``) serve the ranked profiler too
(``profilers.rank_worker``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, TypeVar

import torch
import torch.distributed as dist
from pydantic import BaseModel

from targets.confinement import confine_worker
from targets.ranks import RankContext, join, leave
from targets.worker import answer_stack_requests, default_threads, failure_of, measure, write_result
from targets.worker_client import COLLECTIVE_TIMEOUT_ENV, RANK_FAILED_EXIT, cpu_count
from targets.worker_protocol import BenchData, Failure, WorkerRequest, WorkerResult

Q = TypeVar("Q", bound=WorkerRequest)
R = TypeVar("R", bound=BaseModel)

DEFAULT_COLLECTIVE_TIMEOUT_S = 1800.0  # when started by hand; run_worker passes its time limit


def per_step_max(rank_step_s: list[list[float]]) -> list[float]:
    """Each step's slowest rank: the job's step time, since every rank waits for the others each step."""
    return [max(times) for times in zip(*rank_step_s)]


def slowest_rank(benches: list[BenchData]) -> BenchData:
    """One BenchData for the job: per step the maximum over ranks, the per-rank times and medians beside it,
    and the slowest rank's (highest median) phases, counters and the rest."""
    medians = [statistics.median(b.step_s) if b.step_s else 0.0 for b in benches]
    slowest = benches[medians.index(max(medians))]
    rank_step_s = [b.step_s for b in benches]
    return slowest.model_copy(update={"step_s": per_step_max(rank_step_s), "rank_step_s": rank_step_s,
                                      "rank_median_s": medians})


def rank_threads(req: WorkerRequest) -> int:
    """CPU threads of one rank: the request's, else ``default_threads`` of this process's CPUs shared evenly
    by the node's ranks. (torchrun's default is 1 per rank, which starves a rank's host-side work, e.g.
    building its batch: at size large on two H200s the data phase took 24 ms per step against 7 ms in one
    process.)"""
    if req.threads:
        return req.threads
    return default_threads(req.device, cpu_count() // int(os.environ.get("LOCAL_WORLD_SIZE", "1")))


def join_job(req: WorkerRequest) -> RankContext:
    """Set the rank's CPU threads and join the job, with the caller's time limit as collective timeout."""
    torch.set_num_threads(rank_threads(req))
    return join(float(os.environ.get(COLLECTIVE_TIMEOUT_ENV, DEFAULT_COLLECTIVE_TIMEOUT_S)), req.device)


def run_rank(req: WorkerRequest) -> WorkerResult | None:
    """Measure on this rank; rank 0 returns the job's result, the others None. Exceptions propagate."""
    start = time.perf_counter()
    job = join_job(req)
    result = WorkerResult(ok=False, mode=req.mode, target=req.target, size=req.size)
    measure(req, job.device, result, job)
    if req.mode == "bench":
        benches: list[BenchData | None] = [None] * job.world_size
        dist.all_gather_object(benches, result.bench)
        result.bench = slowest_rank(benches)
    result.ok = True
    result.wall_s = time.perf_counter() - start
    return result if job.rank == 0 else None


def write_first(path: str, result: BaseModel) -> None:
    """Write a failure unless another rank's is there already: the first to fail is the cause, the others
    mostly fail because of it (a peer that closed its connections)."""
    tmp = Path(f"{path}.rank{os.environ.get('RANK', '0')}.tmp")
    tmp.write_text(result.model_dump_json(indent=1))
    try:
        os.link(tmp, path)  # atomic, and refuses to replace an existing file
    except FileExistsError:
        pass
    finally:
        tmp.unlink()


def rank_failure(exc: BaseException, ranks: int) -> Failure:
    """The structured failure of this rank, naming it unless it is a config error (which reads the same on
    every rank)."""
    failure = failure_of(exc)
    if failure.kind != "config":
        failure.message = f"rank {os.environ.get('RANK', '?')} of {ranks}: {failure.message}"
    return failure


def serve_rank(prog: str, request_type: type[Q], run: Callable[[Q], R | None],
               failed: Callable[[Q, Failure], R], argv: list[str] | None) -> int:
    """The command line every rank entry point shares (this module, ``profilers.rank_worker``): read
    --request, ``run`` this rank's part; rank 0's non-None result is written to --result. A rank whose
    ``run`` raises writes ``failed(request, failure)`` first (``write_first``) and exits with
    RANK_FAILED_EXIT at once."""
    answer_stack_requests()
    parser = argparse.ArgumentParser(prog=prog, description="runs one rank of a request under torchrun")
    parser.add_argument("--request", required=True, help=f"JSON file holding a {request_type.__name__}")
    parser.add_argument("--result", required=True, help="where rank 0 writes the result JSON")
    args = parser.parse_args(argv)
    req = request_type.model_validate_json(Path(args.request).read_text())
    confine_worker(argv, reexec=True)  # file system only: ranks talk over loopback
    try:
        result = run(req)
    except Exception as exc:  # noqa: BLE001 - any workload error is a structured failure
        write_first(args.result, failed(req, rank_failure(exc, req.ranks)))
        sys.stderr.flush()
        os._exit(RANK_FAILED_EXIT)  # no clean-up: a process group with a failed peer may block in its destructor
    leave()
    if result is not None:
        write_result(args.result, result)
    return 0


def main(argv: list[str] | None = None) -> int:
    return serve_rank("python -m targets.rank_worker", WorkerRequest, run_rank,
                      lambda req, failure: WorkerResult(ok=False, mode=req.mode, target=req.target, size=req.size,
                                                        failure=failure), argv)


if __name__ == "__main__":
    sys.exit(main())
