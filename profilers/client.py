"""Runs the profiling worker in a subprocess and always returns a ProfileResult.

The child is started by ``targets.worker_client.run_one_or_ranked``, like every sg-opt worker: a scrubbed
environment (no keys or tokens), its own process group and a time limit; a hang is killed with its
whole group and reported as ``timeout``, a crash as ``crash`` with the tail of its stderr. A request on
several ranks is started under torchrun (``profilers.rank_worker``) as ``run_worker`` starts a ranked
worker: the same launcher, collective timeout and naming of a rank that died.
"""

from __future__ import annotations

from profilers.records import ProfileRequest, ProfileResult
from targets.worker_client import run_one_or_ranked
from targets.worker_protocol import Failure

DEFAULT_TIMEOUT_S = 900.0


def run_profile(req: ProfileRequest, timeout_s: float = DEFAULT_TIMEOUT_S,
                env: dict[str, str] | None = None) -> ProfileResult:
    """Profile one config in a fresh process (or ``req.ranks`` of them); return its result or a structured
    failure."""
    def failed(kind: str, message: str, detail: str) -> ProfileResult:
        return ProfileResult(ok=False, target=req.target, size=req.size,
                             failure=Failure(kind=kind, message=message, detail=detail))

    return run_one_or_ranked(("profilers.worker", "profilers.rank_worker"), req, ProfileResult, timeout_s, failed,
                             env, what="profiler")
