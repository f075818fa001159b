"""Workers started ahead of their measurement (on a GPU, while the candidate's numerics run is judged) are the
ones it times, only those, and never outlive a candidate that does not get there."""

from __future__ import annotations

import pytest

import validators.ab_runner as ab_runner
from targets.worker_client import kill_tree
from targets.worker_protocol import WorkerRequest
from validators.ab_runner import discard, prestart
from validators.speedup import measure_ab

OK = WorkerRequest(target="tests.fixtures.faulty_target:target", size="tiny", mode="bench", warmup=0)
SLOW = OK.model_copy(update={"config": {"behaviour": "slow"}})


@pytest.fixture
def spawns(monkeypatch):
    """Every side a worker was started for, in order."""
    seen: list[str] = []
    real = ab_runner._spawn

    def counting(specs, labels, folder, cpus, roots, timeout_s, sides):
        seen.extend(labels[s] for s in sides)
        return real(specs, labels, folder, cpus, roots, timeout_s, sides)

    monkeypatch.setattr(ab_runner, "_spawn", counting)
    yield seen
    discard()


def started_ahead(key) -> dict:
    return ab_runner._prestarted[key].workers


def test_on_a_cpu_nothing_is_started_ahead(spawns):
    assert prestart(OK, SLOW, 60) is None and spawns == []


def test_the_measurement_asking_for_them_times_the_workers_started_ahead(spawns):
    key = prestart(OK, SLOW, 60, force=True)
    ahead = list(started_ahead(key).values())
    result = measure_ab(OK, SLOW, blocks=2, steps_per_block=2, timeout_s=60)
    assert result.failure is None and spawns == ["incumbent", "candidate"]  # none started afresh
    assert result.started_ahead
    assert key not in ab_runner._prestarted
    assert result.a.ready_s > 0 and result.b.ready_s > 0  # from the workers' own stamps
    assert all(w.proc.poll() is not None for w in ahead)  # those very workers, torn down with the measurement


def test_another_measurement_starts_its_own_and_discard_kills_the_ones_ahead(spawns):
    key = prestart(OK, SLOW, 60, force=True)
    ahead = list(started_ahead(key).values())
    result = measure_ab(SLOW, OK, blocks=2, steps_per_block=2, timeout_s=60)  # the sides swapped: not the same
    assert result.failure is None and spawns == ["incumbent", "candidate", "incumbent", "candidate"]
    assert not result.started_ahead
    assert all(w.proc.poll() is None for w in ahead)  # still waiting for theirs
    discard(key)
    assert key not in ab_runner._prestarted and all(w.proc.poll() is not None for w in ahead)


def test_a_worker_that_died_ahead_is_replaced_by_a_fresh_pair(spawns):
    key = prestart(OK, SLOW, 60, force=True)
    victim = started_ahead(key)["b"].proc
    kill_tree(victim.pid)
    victim.wait()
    result = measure_ab(OK, SLOW, blocks=2, steps_per_block=2, timeout_s=60)
    assert result.failure is None, result.failure
    assert spawns == ["incumbent", "candidate", "incumbent", "candidate"]


def test_the_switch_turns_it_off_on_a_gpu_too(spawns, monkeypatch):
    monkeypatch.setattr(ab_runner, "overlap_builds", lambda a, b: True)
    monkeypatch.setenv(ab_runner.PRESTART_SWITCH, "0")
    assert prestart(OK, SLOW, 60) is None and spawns == []
    monkeypatch.setenv(ab_runner.PRESTART_SWITCH, "1")
    assert prestart(OK, SLOW, 60) is not None and spawns == ["incumbent", "candidate"]


@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA device")
def test_on_a_gpu_workers_started_beside_a_numerics_run_are_the_ones_timed(spawns):
    """The agent's order on a GPU: the timing workers start, the candidate's numerics run beside them on the same
    device, then the measurement adopts them."""
    from targets.worker_client import run_worker
    incumbent = WorkerRequest(target="haste-rec", size="tiny", mode="bench", device="cuda", warmup=1)
    candidate = incumbent.model_copy(update={"config": {"embedding_grad_mode": "fused"}})
    key = prestart(incumbent, candidate, 180)
    assert key is not None and spawns == ["incumbent", "candidate"]
    numerics = run_worker(candidate.model_copy(update={"mode": "numerics", "steps": 5}), timeout_s=180)
    assert numerics.ok, numerics.failure
    result = measure_ab(incumbent, candidate, blocks=2, steps_per_block=3, timeout_s=180)
    assert result.failure is None, result.failure
    assert result.started_ahead and spawns == ["incumbent", "candidate"]
