"""haste-rec with a real, injected slowdown, to check that the A/B benchmark detects one.

``benchmarks.slowed_target:TARGET`` is the reference trainer plus one knob, ``slowdown``: every step
measures its real work, then busy-waits ``slowdown`` x the median of the last ``WINDOW`` measurements,
so ``slowdown = 0.1`` adds 10% to every step and leaves the numerics untouched. On the CPU the work
and the wait are both counted in process CPU time, so the injected cost is 10% more *work*, exactly
what a slower kernel would add, and a neighbour's load (which stretches wall time, not CPU time)
cannot inflate it; busy-waiting keeps the core occupied the way real compute would. On CUDA the
step is synchronised and both are counted on the wall clock, so the wait cannot hide behind queued
kernels.
"""

from __future__ import annotations

import collections
import dataclasses
import statistics
import time
from typing import Any, Callable, Mapping

import torch

from targets.haste_rec.target import TARGET as HASTE_REC
from targets.protocol import Knob, KnobSpace, PhaseTimer, Session, Target

WINDOW = 25

SLOWDOWN = Knob("slowdown", "float", 0.0, category="kernel", numerics="exact", low=0.0, high=1.0,
                why="benchmarks only: busy-wait this share of the median recent step time inside every step")


class SlowedSession:
    """Delegates everything to a haste-rec session; its step ends with the injected wait."""

    def __init__(self, inner: Session, slowdown: float, device: torch.device):
        self.inner, self.slowdown, self.device = inner, slowdown, device
        self.phase_names = (*inner.phase_names, "injected_delay")
        self.recent: collections.deque[float] = collections.deque(maxlen=WINDOW)

    @property
    def timer(self) -> PhaseTimer:  # the worker flips timing on the inner session's timer
        return self.inner.timer

    def step(self) -> torch.Tensor:
        if self.slowdown <= 0:
            return self.inner.step()
        clock = time.perf_counter if self.device.type == "cuda" else time.process_time
        start = clock()
        loss = self.inner.step()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        now = clock()
        self.recent.append(now - start)
        with self.timer("injected_delay"):
            end = now + self.slowdown * statistics.median(self.recent)
            while clock() < end:
                pass
        return loss

    def __getattr__(self, name: str) -> Any:  # probe, grad_norms, param_digest, quality, counters, batch_size
        return getattr(self.inner, name)


def build(config: Mapping[str, Any], size: str, kernels: Mapping[str, Callable], device: torch.device | str,
          seed: int = 0, data: str | None = None) -> SlowedSession:
    inner_config = {k: v for k, v in config.items() if k != SLOWDOWN.name}
    device = torch.device(device)
    inner = HASTE_REC.build(inner_config, size, kernels, device, seed, data=data)
    return SlowedSession(inner, float(config[SLOWDOWN.name]), device)


TARGET: Target = dataclasses.replace(
    HASTE_REC, name="haste-rec-slowed", description="haste-rec with an injected busy-wait (benchmarks only)",
    knob_space=KnobSpace(HASTE_REC.knob_space.knobs + (SLOWDOWN,), HASTE_REC.knob_space.constraints),
    build=build, phases=(*HASTE_REC.phases, "injected_delay"))
