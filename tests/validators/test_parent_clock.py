"""The parent's clock judges every block: a worker whose clocks were tampered with (a candidate's code runs in it)
fails the measurement as ``clock`` instead of winning, and an honest worker's own times agree with the parent's."""

from __future__ import annotations

import time
from typing import Callable

import pytest
import torch

from targets.protocol import Target
from targets.worker_protocol import WorkerRequest
from tests.fixtures.faulty_target import target as faulty
from validators.ab_runner import CLOCK_OVER, CLOCK_UNDER, clock_disagreement, events_disagreement
from validators.machine_load import LoadPolicy
from validators.speedup import measure_ab

HONEST = WorkerRequest(target="tests.fixtures.faulty_target:target", size="tiny", mode="bench", warmup=1,
                       config={"behaviour": "slow"})  # steps of about 1 ms
HONEST_GPU = HONEST.model_copy(update={"device": "cuda"})  # timed by CUDA events in the worker
NO_WAIT = LoadPolicy(wait_s=0)
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")


def _tampered(name: str, patch: Callable[[], None]) -> Target:
    """The faulty target, whose session build first runs `patch` in its worker, as a candidate's kernel module
    could at import."""
    def build(config, size, kernels, device, seed=0):
        patch()
        return faulty.build(config, size, kernels, device, seed)
    return Target(name=name, description="tampers with the worker's clock (tests only)", knob_space=faulty.knob_space,
                  sizes=faulty.sizes, build=build, phases=faulty.phases)


def _perf_counter_at(rate: float) -> Callable[[], None]:
    def patch():
        real = time.perf_counter
        time.perf_counter = lambda: real() * rate
    return patch


def _cuda_events_at(rate: float) -> Callable[[], None]:
    def patch():
        real = torch.cuda.Event.elapsed_time
        torch.cuda.Event.elapsed_time = lambda start, end: real(start, end) * rate
    return patch


SLOW_CLOCK = _tampered("slow-clock", _perf_counter_at(0.1))
FAST_CLOCK = _tampered("fast-clock", _perf_counter_at(10.0))
SLOW_EVENTS = _tampered("slow-events", _cuda_events_at(0.1))


def test_a_sum_of_step_times_must_fit_the_parents_window():
    assert clock_disagreement(0.098, 0.100) is None  # the exchange: a little below
    assert clock_disagreement(0.0005, 0.015) is None  # a tiny block in a slow exchange: within the absolute slack
    assert clock_disagreement(0.100 * (1 + CLOCK_OVER[0]) + CLOCK_OVER[1] * 0.9, 0.100) is None
    over = clock_disagreement(0.150, 0.100)
    assert "150.0 ms" in over and "100.0 ms" in over and "more time than passed" in over
    assert "more than its own window" in events_disagreement([0.06, 0.06], 0.100)
    assert events_disagreement([0.001, 0.001], 0.100) is None  # events may fall short of the window
    under = clock_disagreement(0.010, 0.100)
    assert "10.0 ms" in under and "100.0 ms" in under and "runs slow" in under
    assert clock_disagreement(0.100 * (1 - CLOCK_UNDER[0]) - CLOCK_UNDER[1] * 0.9, 0.100) is None


@pytest.mark.parametrize("clock", ["SLOW_CLOCK", "FAST_CLOCK"])
def test_a_candidate_that_tampers_with_the_workers_clock_fails_as_clock(clock):
    """A perf_counter slowed tenfold made the worker's own times say 10x faster; the parent's clock says otherwise."""
    tampered = HONEST.model_copy(update={"target": f"tests.validators.test_parent_clock:{clock}"})
    result = measure_ab(HONEST, tampered, blocks=2, steps_per_block=2, timeout_s=120, block_seconds=0.1,
                        floor=0.01, load_policy=NO_WAIT)
    assert result.verdict == "failed" and result.verdict != "faster"
    assert result.failure.kind == "clock" and result.failed_side == "candidate"
    assert result.failure.message.startswith("candidate: the worker timed its steps at ")
    assert ("more time than passed" if clock == "FAST_CLOCK" else "runs slow") in result.failure.message


@needs_cuda
def test_a_candidate_that_slows_cuda_events_gains_nothing():
    """On a GPU a worker's per-step times are CUDA events', which a candidate can scale as easily; they may fall
    short of the worker's window (work on another stream), so only the window is checked, and the verdict is the
    parent's clock: the tampered side is not found faster. Two blocks of identical work differ by up to 27% on an
    H100 (2026-12-06), so the floor is 0.5: a verdict on the events (ratio 0.1) would still say faster."""
    tampered = HONEST_GPU.model_copy(update={"target": "tests.validators.test_parent_clock:SLOW_EVENTS"})
    result = measure_ab(HONEST_GPU, tampered, blocks=2, steps_per_block=2, timeout_s=120, block_seconds=0.1,
                        floor=0.5, load_policy=NO_WAIT)
    assert result.verdict != "faster" and result.failed_side != "incumbent" and (result.ratio or 1.0) > 0.5


@pytest.mark.parametrize("honest", [HONEST, pytest.param(HONEST_GPU, marks=needs_cuda)])
def test_an_honest_workers_times_agree_with_the_parents_clock(honest):
    result = measure_ab(honest, honest, blocks=2, steps_per_block=2, timeout_s=120, block_seconds=0.05,
                        load_policy=NO_WAIT)
    assert result.failure is None and result.clock == "parent"
    for side in (result.a, result.b):  # its steps ran inside the parent's window, timed on the same clock
        assert 0 < side.clock_agreement <= 1.0
    # each block's sample is the parent's wall time over its steps: the timed blocks' walls sum to medians_s,
    # within the blocks' own wall seconds (which also hold the settling blocks)
    assert 0 < result.medians_s <= result.blocks_s
