"""Running the coarse profiler's steps: a profiled window between as many unprofiled steps before and after it, whose
mean is the profiler's overhead's denominator (a drifting step time cancels out), and a distorted window profiled
again (``least_distorted_window``); ``profilers.coarse`` reads the kept window's events."""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile, record_function

from profilers.records import DISTORTED_OVERHEAD
from targets.protocol import Session
from targets.worker import NonFiniteLoss

STEP_RANGE = "sg-opt/profiled-step"  # marks each timed step in the trace; the window the analysis reads
# A distorted window (records.DISTORTED_OVERHEAD) is profiled again, up to this many windows in all, and the
# least distorted kept.
PROFILE_TRIES = 3


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed_steps(session: Session, steps: int, device: torch.device,
                 label: str | None = None) -> tuple[float, list[torch.Tensor]]:
    """Wall seconds for ``steps`` steps, the device drained at the end, and their losses."""
    losses = []
    start = time.perf_counter()
    for _ in range(steps):
        with record_function(label) if label else contextlib.nullcontext():
            losses.append(session.step())
    sync(device)
    return time.perf_counter() - start, losses


@dataclass
class _Tried:
    """One profiled window and the unprofiled steps around it."""

    prof: profile
    profiled_s: float
    unprofiled_s: float
    losses: list[float]
    before: dict[str, float]
    after: dict[str, float]

    @property
    def overhead(self) -> float:
        return self.profiled_s / self.unprofiled_s


def _profiled_window(session: Session, device: torch.device, steps: int) -> _Tried:
    """``steps`` profiled steps between ``steps`` unprofiled ones before and after; inside the profiler one more
    untimed step lets it settle (CUPTI set-up on CUDA) before the timed window."""
    on_cuda = device.type == "cuda"
    unprofiled_before, _ = _timed_steps(session, steps, device)
    if on_cuda:
        torch.cuda.reset_peak_memory_stats(device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_cuda else [])
    with profile(activities=activities) as prof:
        _timed_steps(session, 1, device)
        before = session.counters()
        profiled_s, losses = _timed_steps(session, steps, device, label=STEP_RANGE)
        after = session.counters()
    values = [float(loss) for loss in losses]
    bad = [i for i, v in enumerate(values) if not math.isfinite(v)]
    if bad:
        raise NonFiniteLoss(f"loss is {values[bad[0]]} at profiled step {bad[0]}")
    unprofiled_after, _ = _timed_steps(session, steps, device)
    return _Tried(prof, profiled_s, (unprofiled_before + unprofiled_after) / 2, values, before, after)


def _worst_over_ranks(value: float, device: torch.device) -> float:
    """The largest ``value`` over the ranks of a torch.distributed job (``value`` itself in one process): the ranks
    profile the same steps, collectives included, so they must agree on profiling another window."""
    if not (dist.is_available() and dist.is_initialized()):
        return value
    worst = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    return float(worst.item())


def least_distorted_window(session: Session, device: torch.device, steps: int,
                           tries: int = PROFILE_TRIES) -> tuple[_Tried, list[float]]:
    """A profiled window whose overhead is at most DISTORTED_OVERHEAD, or the least distorted of ``tries``;
    with the overhead of every window tried, in order. On several ranks a window counts as distorted when it is
    on any rank, and every rank keeps the same window."""
    kept, kept_worst, overheads = None, float("inf"), []
    for _ in range(max(1, tries)):
        tried = _profiled_window(session, device, steps)
        overheads.append(tried.overhead)
        worst = _worst_over_ranks(tried.overhead, device)
        if worst < kept_worst:
            kept, kept_worst = tried, worst
        if kept_worst <= DISTORTED_OVERHEAD:
            break
    return kept, overheads
