"""Workers started ahead of their measurement (on a GPU, while the candidate's numerics run is judged) are the
ones it times, only those, and never outlive a candidate that does not get there; a spare pair for the measurement
after it starts only where memory allows, is ready and held before the first one's timed blocks, and is the one
the second measurement times."""

from __future__ import annotations

import time

import pytest

import validators.started_ahead as started_ahead
import validators.timing_worker as timing_worker
from targets.worker_client import kill_tree
from targets.worker_protocol import WorkerRequest
from validators.started_ahead import discard, prestart
from validators.speedup import measure_ab

OK = WorkerRequest(target="tests.fixtures.faulty_target:target", size="tiny", mode="bench", warmup=0)
SLOW = OK.model_copy(update={"config": {"behaviour": "slow"}})


@pytest.fixture
def spawns(monkeypatch):
    """Every side a worker was started for, in order."""
    seen: list[str] = []
    real = timing_worker.spawn

    def counting(specs, labels, folder, cpus, roots, timeout_s, sides):
        seen.extend(labels[s] for s in sides)
        return real(specs, labels, folder, cpus, roots, timeout_s, sides)

    monkeypatch.setattr(timing_worker, "spawn", counting)
    yield seen
    discard()


def workers_ahead(key, pair: int = 0) -> dict:
    return started_ahead._prestarted[key][pair].workers


@pytest.fixture
def room(monkeypatch):
    """Workers seen so far were small, and the host has memory to spare: two pairs fit."""
    monkeypatch.setattr(timing_worker, "largest", {"host_rss": 1 << 20})
    monkeypatch.setattr(started_ahead, "memory_available", lambda: 1 << 40)


def test_on_a_cpu_nothing_is_started_ahead(spawns):
    assert prestart(OK, SLOW, 60) is None and spawns == []


def test_the_measurement_asking_for_them_times_the_workers_started_ahead(spawns):
    key = prestart(OK, SLOW, 60, force=True)
    ahead = list(workers_ahead(key).values())
    result = measure_ab(OK, SLOW, blocks=2, steps_per_block=2, timeout_s=60)
    assert result.failure is None and spawns == ["incumbent", "candidate"]  # none started afresh
    assert result.started_ahead
    assert key not in started_ahead._prestarted
    assert result.a.ready_s > 0 and result.b.ready_s > 0  # from the workers' own stamps
    assert all(w.proc.poll() is not None for w in ahead)  # those very workers, torn down with the measurement


def test_another_measurement_starts_its_own_and_discard_kills_the_ones_ahead(spawns):
    key = prestart(OK, SLOW, 60, force=True)
    ahead = list(workers_ahead(key).values())
    result = measure_ab(SLOW, OK, blocks=2, steps_per_block=2, timeout_s=60)  # the sides swapped: not the same
    assert result.failure is None and spawns == ["incumbent", "candidate", "incumbent", "candidate"]
    assert not result.started_ahead
    assert all(w.proc.poll() is None for w in ahead)  # still waiting for theirs
    discard(key)
    assert key not in started_ahead._prestarted and all(w.proc.poll() is not None for w in ahead)


def test_a_worker_that_died_ahead_is_replaced_by_a_fresh_pair(spawns):
    key = prestart(OK, SLOW, 60, force=True)
    victim = workers_ahead(key)["b"].proc
    kill_tree(victim.pid)
    victim.wait()
    result = measure_ab(OK, SLOW, blocks=2, steps_per_block=2, timeout_s=60)
    assert result.failure is None, result.failure
    assert spawns == ["incumbent", "candidate", "incumbent", "candidate"]


def test_the_switch_turns_it_off_on_a_gpu_too(spawns, monkeypatch):
    monkeypatch.setattr(timing_worker, "overlap_builds", lambda a, b: True)
    monkeypatch.setenv(started_ahead.PRESTART_SWITCH, "0")
    assert prestart(OK, SLOW, 60) is None and spawns == []
    monkeypatch.setenv(started_ahead.PRESTART_SWITCH, "1")
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


def test_a_spare_pair_is_ready_and_held_during_the_first_measurement_and_timed_by_the_second(spawns, room):
    key = prestart(OK, SLOW, 60, force=True, pairs=2)
    first, spare = (list(workers_ahead(key, pair).values()) for pair in (0, 1))
    result = measure_ab(OK, SLOW, blocks=2, steps_per_block=2, timeout_s=60)
    assert result.failure is None and result.started_ahead and spawns == ["incumbent", "candidate"] * 2
    assert all(w.proc.poll() is not None for w in first) and all(w.proc.poll() is None for w in spare)
    (waiting,) = started_ahead._prestarted[key]
    assert set(waiting.ready) == {"a", "b"}  # read while the first measurement's workers started: no build beside
    again = measure_ab(OK, SLOW, blocks=2, steps_per_block=2, timeout_s=60)  # the confirmation, say
    assert again.failure is None and again.started_ahead and spawns == ["incumbent", "candidate"] * 2
    assert key not in started_ahead._prestarted and all(w.proc.poll() is not None for w in spare)
    assert timing_worker.largest["host_rss"] > 1 << 20  # the workers' own footprints were read from their ready lines


def test_a_spare_no_measurement_came_to_is_killed_by_discard(spawns, room):
    key = prestart(OK, SLOW, 60, force=True, pairs=2)
    spare = list(workers_ahead(key, 1).values())
    assert measure_ab(OK, SLOW, blocks=2, steps_per_block=2, timeout_s=60).started_ahead  # rejected, say
    discard(key)
    assert key not in started_ahead._prestarted and all(w.proc.poll() is not None for w in spare)


def test_a_spare_that_died_while_it_waited_is_replaced_by_a_fresh_pair(spawns, room):
    key = prestart(OK, SLOW, 60, force=True, pairs=2)
    victim = workers_ahead(key, 1)["a"].proc
    kill_tree(victim.pid)
    victim.wait()
    assert measure_ab(OK, SLOW, blocks=2, steps_per_block=2, timeout_s=60).started_ahead
    assert key not in started_ahead._prestarted  # dropped, not kept for the next measurement
    again = measure_ab(OK, SLOW, blocks=2, steps_per_block=2, timeout_s=60)
    assert again.failure is None and not again.started_ahead and spawns == ["incumbent", "candidate"] * 3


def test_a_second_pair_starts_only_where_five_workers_fit(monkeypatch):
    monkeypatch.setattr(timing_worker, "largest", {})
    assert started_ahead.pairs_that_fit(2) == 1  # no worker seen yet
    gb = 1 << 30
    monkeypatch.setattr(started_ahead, "memory_available", lambda: 120 * gb)  # an H200 host with the agent running
    monkeypatch.setattr(timing_worker, "largest", {"host_rss": 16 * gb, "device_peak": 6 * gb, "device_total": 140 * gb})
    assert started_ahead.pairs_that_fit(2) == 2  # large-cached: 13.3 GB of host tables a worker
    monkeypatch.setattr(timing_worker, "largest", {"host_rss": 20 * gb, "device_peak": 6 * gb, "device_total": 140 * gb})
    assert started_ahead.pairs_that_fit(2) == 1  # 5 x 20 GB x 1.25 over the host's 120
    monkeypatch.setattr(timing_worker, "largest", {"host_rss": 4 * gb, "device_peak": 30 * gb, "device_total": 140 * gb})
    assert started_ahead.pairs_that_fit(2) == 1  # nor the device's
    monkeypatch.setattr(timing_worker, "largest", {"host_rss": 4 * gb, "device_peak": 6 * gb, "device_total": 140 * gb})
    monkeypatch.setenv(started_ahead.PAIRS_SWITCH, "1")
    assert started_ahead.pairs_that_fit(2) == 1


@pytest.mark.skipif(not __import__("pathlib").Path("/proc").is_dir(), reason="reads process states from /proc")
def test_a_spares_helper_processes_stay_stopped_until_its_measurement_adopts_it(spawns, room):
    """Each session starts a busy helper, as loader workers are: the spare's must not run beside the first
    measurement's timed blocks, and must run again once its own measurement has it."""
    from targets.worker_client import descendants
    from tests.validators.test_ab_workers import _states
    from validators.ab_runner import ABRunner
    helper = OK.model_copy(update={"config": {"behaviour": "helper"}})
    key = prestart(helper, helper, 120, force=True, pairs=2)
    with ABRunner(helper, helper, timeout_s=120) as runner:
        assert runner.started_ahead
        (spare,) = started_ahead._prestarted[key]
        helpers = [pid for worker in spare.workers.values() for pid in descendants(worker.proc.pid)]
        assert helpers and _states(helpers, stopped=True) == {"T"}
        runner.run("a", 2)
        assert _states(helpers, stopped=True) == {"T"}
    assert _states(helpers, stopped=True) == {"T"}  # still waiting for its measurement
    with ABRunner(helper, helper, timeout_s=120) as runner:
        assert runner.started_ahead and set(runner.workers.values()) == set(spare.workers.values())
        assert "T" not in _states(helpers)


def test_ranked_sides_get_no_spare_pair(monkeypatch, room):
    class Idle:
        def close(self, graceful):
            pass
    started = []
    monkeypatch.setattr(timing_worker, "spawn", lambda *args: started.append(args[-1]) or {"a": Idle(), "b": Idle()})
    ranked = OK.model_copy(update={"ranks": 2})
    key = prestart(ranked, ranked, 60, force=True, pairs=2)
    assert started == [("a", "b")] and len(started_ahead._prestarted[key]) == 1
    discard(key)


@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA device")
def test_on_a_gpu_a_spare_pair_built_beside_a_numerics_run_is_the_second_measurements(spawns, room):
    """The agent's order on a GPU with two pairs: both start, the numerics run beside them, the first measurement
    adopts the first pair and holds the spare, the second adopts the spare."""
    from targets.worker_client import run_worker
    incumbent = WorkerRequest(target="haste-rec", size="tiny", mode="bench", device="cuda", warmup=1,
                              config={"data_workers": 1})
    candidate = incumbent.model_copy(update={"config": {"data_workers": 1, "embedding_grad_mode": "fused"}})
    key = prestart(incumbent, candidate, 180, pairs=2)
    assert key is not None and spawns == ["incumbent", "candidate"] * 2
    numerics = run_worker(candidate.model_copy(update={"mode": "numerics", "steps": 5}), timeout_s=180)
    assert numerics.ok, numerics.failure
    for _ in range(2):
        result = measure_ab(incumbent, candidate, blocks=2, steps_per_block=3, timeout_s=180)
        assert result.failure is None, result.failure
        assert result.started_ahead and spawns == ["incumbent", "candidate"] * 2
    assert key not in started_ahead._prestarted


def test_a_spare_that_is_not_ready_in_time_is_dropped_without_failing_the_measurement(spawns, room, monkeypatch):
    """A spare that never answers costs the measurement before it SPARE_WAIT_S, not its own time limit (60 s)."""
    monkeypatch.setattr(started_ahead, "SPARE_WAIT_S", 1.0)
    key = prestart(OK, SLOW, 60, force=True, pairs=2)
    late = workers_ahead(key, 1)["b"]

    def silent(deadline, what):  # as a worker stuck in its build: nothing until the deadline, then the timeout
        time.sleep(max(0.0, deadline - time.monotonic()))
        raise timing_worker.SideFailed(late.label, "timeout", f"no {what} before the time limit")
    monkeypatch.setattr(late, "receive", silent)
    result = measure_ab(OK, SLOW, blocks=2, steps_per_block=2, timeout_s=60)
    assert result.failure is None and result.started_ahead and result.wall_s < 30
    assert key not in started_ahead._prestarted and late.proc.poll() is not None  # dropped and killed


def test_a_calibrations_later_a_a_runs_time_workers_started_with_the_first(spawns, room, monkeypatch):
    """On a GPU both A/A pairs start at once: the second run times the spare, held through the first run."""
    from validators.speedup import calibrate_noise_floor
    monkeypatch.setattr(timing_worker, "overlap_builds", lambda a, b: True)
    floor = calibrate_noise_floor(SLOW, blocks=2, steps_per_block=2, timeout_s=60, repeats=2)
    assert spawns == ["A1", "A2"] * 2  # both pairs at the start, none afresh
    assert [run.started_ahead for run in floor.runs] == [True, True]
    assert not started_ahead._prestarted


def test_a_calibration_whose_first_run_fails_kills_its_spare(spawns, room, monkeypatch):
    from validators.speedup import CalibrationFailed, calibrate_noise_floor
    monkeypatch.setattr(timing_worker, "overlap_builds", lambda a, b: True)
    crash = OK.model_copy(update={"config": {"behaviour": "crash"}})
    with pytest.raises(CalibrationFailed):
        calibrate_noise_floor(crash, blocks=2, steps_per_block=2, timeout_s=60, repeats=2)
    assert spawns == ["A1", "A2"] * 2 and not started_ahead._prestarted


def test_on_a_cpu_a_calibration_starts_each_runs_workers_for_it(spawns, room):
    from validators.speedup import calibrate_noise_floor
    floor = calibrate_noise_floor(SLOW, blocks=2, steps_per_block=2, timeout_s=60, repeats=2)
    assert spawns == ["A1", "A2"] * 2 and [run.started_ahead for run in floor.runs] == [False, False]


def test_the_baselines_own_timing_run_lets_the_first_calibration_start_its_spare(monkeypatch):
    """Before any timing worker has reported, one pair; the baseline's short timing run reports its footprint in its
    result, and the agent notes it (``nodes.baseline``), so the baseline's calibration may start two."""
    from targets.worker_client import run_worker
    monkeypatch.setattr(timing_worker, "largest", {})
    monkeypatch.setattr(started_ahead, "memory_available", lambda: 1 << 40)
    assert started_ahead.pairs_that_fit(2) == 1
    probe = run_worker(SLOW.model_copy(update={"steps": 2}), timeout_s=60)
    assert probe.ok, probe.failure
    timing_worker.note_footprint(probe.memory)
    assert started_ahead.pairs_that_fit(2) == 2
