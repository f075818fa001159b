"""Evaluation lanes of ``sg-opt optimize --gpus N``: which GPUs and CPUs each concurrent candidate gets.

A lane is ``ranks`` GPUs and a disjoint share of the host's CPUs; a run with N GPUs has N / ranks of
them (one lane, the whole machine, without --gpus). ``state_machine.batch`` evaluates one candidate
per lane at once. The A/A noise floor of such a run is calibrated the same way, on every lane at once,
the widest floor kept, so that it includes what the concurrent lanes do to each other's timings; and on
one lane alone: if the lanes widen the floor by more than CONCURRENT_TOLERANCE, candidates are still
validated at once but timed one at a time (``state_machine.batch``).
"""

from __future__ import annotations

import hashlib
import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

from state_machine.parts import save_sequence, saved_sequence
from state_machine.state import Lane, RunState
from targets.worker_client import allowed_cpus
from targets.worker_protocol import WorkerRequest
from validators.ab_stats import floor_from
from validators.ab_result import ABResult, NoiseFloor
from validators.speedup import calibrate_noise_floor

CONCURRENT_TOLERANCE = 1.5  # lanes may time at once while that widens the A/A floor at most this much


def lane_count(gpus: int, ranks: int) -> int:
    """How many candidates fit at once: ``ranks`` GPUs each, at least one (the whole machine)."""
    return max(1, gpus // ranks)


def plan_lanes(gpus: int, ranks: int, cpus: list[int] | None = None) -> list[Lane]:
    """``lane_count`` lanes of ``ranks`` consecutive GPUs each, the allowed CPUs split evenly between them
    (None where CPU affinity is unsupported); one lane of all GPUs when only one fits."""
    count = lane_count(gpus, ranks)
    if cpus is None:
        cpus = allowed_cpus()
    share = len(cpus) // count if cpus else 0
    return [Lane(index=i, gpus=list(range(i * ranks, (i + 1) * ranks)),
                 cpus=cpus[i * share:(i + 1) * share] if share else None) for i in range(count)]


def lanes_of(state: RunState) -> list[Lane]:
    return plan_lanes(state.gpus, state.ranks)


def concurrent(state: RunState) -> bool:
    """Whether this run evaluates candidates several at a time."""
    return lane_count(state.gpus, state.ranks) > 1


def batch_size(state: RunState) -> int:
    """Candidates to start together: one per lane, never more than the candidate budget has left."""
    return max(1, min(lane_count(state.gpus, state.ranks), state.limits.max_iters - state.evaluated))


def on_lanes(work: Callable[[Lane], Any], lanes: list[Lane]) -> list[Any]:
    """work(lane) for every lane at once, results in lane order (an exception in any is raised here)."""
    with ThreadPoolExecutor(max_workers=len(lanes), thread_name_prefix="sg-opt-lane") as pool:
        return list(pool.map(work, lanes))


def noise_floor(state: RunState, spec: WorkerRequest, blocks: int, block_steps: int,
                timeout_s: float) -> tuple[NoiseFloor, dict[str, Any]]:
    """The A/A noise floor, and the plan fields of --gpus (``concurrent_timing``, ``lanes_note``).

    One lane: the usual calibration. Several: an A/A run on every lane at once, and one on a lane alone.
    When timing the lanes at once makes the floor more than CONCURRENT_TOLERANCE times wider, a win would
    have to be that much larger to be seen, so candidates are then validated at once but timed one at a
    time (under the lone floor); else they are timed at once too (under the concurrent floor)."""
    def on(lane: Lane | None, beside_others: bool = False) -> NoiseFloor:
        lane_spec = spec if lane is None else spec.model_copy(update={"gpus": lane.gpus, "cpus": lane.cpus})
        seed = state.seed + (lane.index * 1000 if lane else 0)
        # each finished A/A run is kept, so a baseline killed half-way through its calibration redoes only the rest
        folder, name = Path(state.path("baseline")), f"aa-{lane.index if lane else 'one'}"
        key = hashlib.sha256(json.dumps([lane_spec.model_dump(mode="json"), blocks, block_steps, seed,
                                         state.plan.block_seconds]).encode()).hexdigest()
        kept = [ABResult.model_validate(item) for item in saved_sequence(folder, name, key)]

        def keep(run: ABResult) -> None:
            if run.failure is None:
                kept.append(run)
                save_sequence(folder, name, key, [r.model_dump(mode="json") for r in kept])
        done = list(kept)
        return calibrate_noise_floor(lane_spec, blocks, block_steps, timeout_s, repeats=state.plan.aa_repeats,
                                     seed=seed, block_seconds=state.plan.block_seconds, spares=not beside_others,
                                     on_run=keep, done=done)
    if not concurrent(state):
        return on(None), {}
    lanes = lanes_of(state)
    floors = on_lanes(lambda lane: on(lane, beside_others=True), lanes)
    runs = [run for floor in floors for run in floor.runs]
    together = NoiseFloor(floor=floor_from([(r.ratio, r.ci_low, r.ci_high) for r in runs]), runs=runs,
                          rule=floors[0].rule + f", over {len(floors)} lanes timed at once")
    alone = on(lanes[0])
    at_once = together.floor <= CONCURRENT_TOLERANCE * alone.floor
    note = (f"A/A floor {together.floor:.3f} with {len(lanes)} lanes timed at once, {alone.floor:.3f} on one lane "
            f"alone: candidates are validated at once and timed "
            + ("at once" if at_once else "one at a time"))
    return (together if at_once else alone), {"concurrent_timing": at_once, "lanes_note": note}
