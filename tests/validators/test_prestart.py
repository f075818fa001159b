"""Workers started ahead of their measurement (on a GPU, while the candidate's numerics run is judged) are the
ones it times, only those, and never outlive a candidate that does not get there nor the pool they wait in; a spare
pair for the measurement after it starts only where memory allows, is ready and held before the first one's timed
blocks, and is the one the second measurement times."""

from __future__ import annotations

import time

import pytest

import validators.started_ahead as started_ahead
import validators.timing_worker as timing_worker
from targets.worker_client import kill_tree
from targets.worker_protocol import WorkerRequest
from validators.started_ahead import WorkerPool
from validators.speedup import measure_ab

OK = WorkerRequest(target="tests.fixtures.faulty_target:target", size="tiny", mode="bench", warmup=0)
SLOW = OK.model_copy(update={"config": {"behaviour": "slow"}})


class Spawns(list):
    """Every side a worker was started for, in order; ``workers``: the workers themselves."""

    def __init__(self):
        super().__init__()
        self.workers = []


@pytest.fixture
def pool():
    with WorkerPool() as made:
        yield made


@pytest.fixture
def spawns(monkeypatch, pool):
    seen = Spawns()
    real = timing_worker.spawn

    def counting(specs, labels, folder, cpus, roots, timeout_s, sides):
        seen.extend(labels[s] for s in sides)
        workers = real(specs, labels, folder, cpus, roots, timeout_s, sides)
        seen.workers.extend(workers.values())
        return workers

    monkeypatch.setattr(timing_worker, "spawn", counting)
    return seen


def workers_ahead(pool, key, pair: int = 0) -> dict:
    return pool.waiting(key)[pair].workers


@pytest.fixture
def room(monkeypatch):
    """Workers seen so far were small, and the host has memory to spare: two pairs fit."""
    monkeypatch.setattr(timing_worker, "largest", {"host_rss": 1 << 20})
    monkeypatch.setattr(started_ahead, "memory_available", lambda: 1 << 40)


def test_on_a_cpu_nothing_is_started_ahead(spawns, pool):
    assert pool.prestart(OK, SLOW, 60) is None and spawns == []


def test_the_measurement_asking_for_them_times_the_workers_started_ahead(spawns, pool):
    key = pool.prestart(OK, SLOW, 60, force=True)
    ahead = list(workers_ahead(pool, key).values())
    result = measure_ab(OK, SLOW, blocks=2, steps_per_block=2, timeout_s=60, pool=pool)
    assert result.failure is None and spawns == ["incumbent", "candidate"]  # none started afresh
    assert result.started_ahead
    assert not pool.waiting(key)
    assert result.a.ready_s > 0 and result.b.ready_s > 0  # from the workers' own stamps
    assert all(w.proc.poll() is not None for w in ahead)  # those very workers, torn down with the measurement


def test_another_measurement_starts_its_own_and_discard_kills_the_ones_ahead(spawns, pool):
    key = pool.prestart(OK, SLOW, 60, force=True)
    ahead = list(workers_ahead(pool, key).values())
    result = measure_ab(SLOW, OK, blocks=2, steps_per_block=2, timeout_s=60, pool=pool)  # the sides swapped
    assert result.failure is None and spawns == ["incumbent", "candidate", "incumbent", "candidate"]
    assert not result.started_ahead
    assert all(w.proc.poll() is None for w in ahead)  # still waiting for theirs
    pool.discard(key)
    assert not pool.waiting(key) and all(w.proc.poll() is not None for w in ahead)


def test_a_worker_that_died_ahead_is_replaced_by_a_fresh_pair(spawns, pool):
    key = pool.prestart(OK, SLOW, 60, force=True)
    victim = workers_ahead(pool, key)["b"].proc
    kill_tree(victim.pid)
    victim.wait()
    result = measure_ab(OK, SLOW, blocks=2, steps_per_block=2, timeout_s=60, pool=pool)
    assert result.failure is None, result.failure
    assert spawns == ["incumbent", "candidate", "incumbent", "candidate"]


@pytest.mark.slow
def test_the_switch_turns_it_off_on_a_gpu_too(spawns, monkeypatch, pool):
    monkeypatch.setattr(timing_worker, "overlap_builds", lambda a, b: True)
    monkeypatch.setenv(started_ahead.PRESTART_SWITCH, "0")
    assert pool.prestart(OK, SLOW, 60) is None and spawns == []
    monkeypatch.setenv(started_ahead.PRESTART_SWITCH, "1")
    assert pool.prestart(OK, SLOW, 60) is not None and spawns == ["incumbent", "candidate"]


@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA device")
def test_on_a_gpu_workers_started_beside_a_numerics_run_are_the_ones_timed(spawns, pool):
    """The agent's order on a GPU: the timing workers start, the candidate's numerics run beside them on the same
    device, then the measurement adopts them."""
    from targets.worker_client import run_worker
    incumbent = WorkerRequest(target="haste-rec", size="tiny", mode="bench", device="cuda", warmup=1)
    candidate = incumbent.model_copy(update={"config": {"embedding_grad_mode": "fused"}})
    key = pool.prestart(incumbent, candidate, 180)
    assert key is not None and spawns == ["incumbent", "candidate"]
    numerics = run_worker(candidate.model_copy(update={"mode": "numerics", "steps": 5}), timeout_s=180)
    assert numerics.ok, numerics.failure
    result = measure_ab(incumbent, candidate, blocks=2, steps_per_block=3, timeout_s=180, pool=pool)
    assert result.failure is None, result.failure
    assert result.started_ahead and spawns == ["incumbent", "candidate"]


@pytest.mark.slow
def test_a_spare_pair_is_ready_and_held_during_the_first_measurement_and_timed_by_the_second(spawns, room, pool):
    key = pool.prestart(OK, SLOW, 60, force=True, pairs=2)
    first, spare = (list(workers_ahead(pool, key, pair).values()) for pair in (0, 1))
    result = measure_ab(OK, SLOW, blocks=2, steps_per_block=2, timeout_s=60, pool=pool)
    assert result.failure is None and result.started_ahead and spawns == ["incumbent", "candidate"] * 2
    assert all(w.proc.poll() is not None for w in first) and all(w.proc.poll() is None for w in spare)
    (waiting,) = pool.waiting(key)
    assert set(waiting.ready) == {"a", "b"}  # read while the first measurement's workers started: no build beside
    again = measure_ab(OK, SLOW, blocks=2, steps_per_block=2, timeout_s=60, pool=pool)  # the confirmation, say
    assert again.failure is None and again.started_ahead and spawns == ["incumbent", "candidate"] * 2
    assert not pool.waiting(key) and all(w.proc.poll() is not None for w in spare)
    assert timing_worker.largest["host_rss"] > 1 << 20  # the workers' own footprints were read from their ready lines


def test_a_spare_no_measurement_came_to_is_killed_by_discard(spawns, room, pool):
    key = pool.prestart(OK, SLOW, 60, force=True, pairs=2)
    spare = list(workers_ahead(pool, key, 1).values())
    assert measure_ab(OK, SLOW, blocks=2, steps_per_block=2, timeout_s=60, pool=pool).started_ahead  # rejected, say
    pool.discard(key)
    assert not pool.waiting(key) and all(w.proc.poll() is not None for w in spare)


@pytest.mark.slow
def test_a_spare_that_died_while_it_waited_is_replaced_by_a_fresh_pair(spawns, room, pool):
    key = pool.prestart(OK, SLOW, 60, force=True, pairs=2)
    victim = workers_ahead(pool, key, 1)["a"].proc
    kill_tree(victim.pid)
    victim.wait()
    assert measure_ab(OK, SLOW, blocks=2, steps_per_block=2, timeout_s=60, pool=pool).started_ahead
    assert not pool.waiting(key)  # dropped, not kept for the next measurement
    again = measure_ab(OK, SLOW, blocks=2, steps_per_block=2, timeout_s=60, pool=pool)
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
def test_a_spares_helper_processes_stay_stopped_until_its_measurement_adopts_it(spawns, room, pool):
    """Each session starts a busy helper, as loader workers are: the spare's must not run beside the first
    measurement's timed blocks, and must run again once its own measurement has it."""
    from targets.worker_client import descendants
    from tests.validators.test_ab_workers import _states
    from validators.ab_runner import ABRunner
    helper = OK.model_copy(update={"config": {"behaviour": "helper"}})
    key = pool.prestart(helper, helper, 120, force=True, pairs=2)
    with ABRunner(helper, helper, timeout_s=120, pool=pool) as runner:
        assert runner.started_ahead
        (spare,) = pool.waiting(key)
        helpers = [pid for worker in spare.workers.values() for pid in descendants(worker.proc.pid)]
        assert helpers and _states(helpers, stopped=True) == {"T"}
        runner.run("a", 2)
        assert _states(helpers, stopped=True) == {"T"}
    assert _states(helpers, stopped=True) == {"T"}  # still waiting for its measurement
    with ABRunner(helper, helper, timeout_s=120, pool=pool) as runner:
        assert runner.started_ahead and set(runner.workers.values()) == set(spare.workers.values())
        assert "T" not in _states(helpers)


def test_ranked_sides_get_no_spare_pair(monkeypatch, room, pool):
    class Idle:
        def close(self, graceful):
            pass
    started = []
    monkeypatch.setattr(timing_worker, "spawn", lambda *args: started.append(args[-1]) or {"a": Idle(), "b": Idle()})
    ranked = OK.model_copy(update={"ranks": 2})
    key = pool.prestart(ranked, ranked, 60, force=True, pairs=2)
    assert started == [("a", "b")] and len(pool.waiting(key)) == 1
    pool.discard(key)


@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA device")
def test_on_a_gpu_a_spare_pair_built_beside_a_numerics_run_is_the_second_measurements(spawns, room, pool):
    """The agent's order on a GPU with two pairs: both start, the numerics run beside them, the first measurement
    adopts the first pair and holds the spare, the second adopts the spare."""
    from targets.worker_client import run_worker
    incumbent = WorkerRequest(target="haste-rec", size="tiny", mode="bench", device="cuda", warmup=1,
                              config={"data_workers": 1})
    candidate = incumbent.model_copy(update={"config": {"data_workers": 1, "embedding_grad_mode": "fused"}})
    key = pool.prestart(incumbent, candidate, 180, pairs=2)
    assert key is not None and spawns == ["incumbent", "candidate"] * 2
    numerics = run_worker(candidate.model_copy(update={"mode": "numerics", "steps": 5}), timeout_s=180)
    assert numerics.ok, numerics.failure
    for _ in range(2):
        result = measure_ab(incumbent, candidate, blocks=2, steps_per_block=3, timeout_s=180, pool=pool)
        assert result.failure is None, result.failure
        assert result.started_ahead and spawns == ["incumbent", "candidate"] * 2
    assert not pool.waiting(key)


@pytest.mark.slow
def test_a_spare_that_is_not_ready_in_time_is_dropped_without_failing_the_measurement(spawns, room, monkeypatch, pool):
    """A spare that never answers costs the measurement before it SPARE_WAIT_S, not its own time limit (60 s)."""
    monkeypatch.setattr(started_ahead, "SPARE_WAIT_S", 1.0)
    key = pool.prestart(OK, SLOW, 60, force=True, pairs=2)
    late = workers_ahead(pool, key, 1)["b"]

    def silent(deadline, what):  # as a worker stuck in its build: nothing until the deadline, then the timeout
        time.sleep(max(0.0, deadline - time.monotonic()))
        raise timing_worker.SideFailed(late.label, "timeout", f"no {what} before the time limit")
    monkeypatch.setattr(late, "receive", silent)
    result = measure_ab(OK, SLOW, blocks=2, steps_per_block=2, timeout_s=60, pool=pool)
    assert result.failure is None and result.started_ahead and result.wall_s < 30
    assert not pool.waiting(key) and late.proc.poll() is not None  # dropped and killed


@pytest.mark.slow
def test_a_calibrations_later_a_a_runs_time_workers_started_with_the_first(spawns, room, monkeypatch, pool):
    """On a GPU both A/A pairs start at once: the second run times the spare, held through the first run."""
    from validators.speedup import calibrate_noise_floor
    monkeypatch.setattr(timing_worker, "overlap_builds", lambda a, b: True)
    floor = calibrate_noise_floor(SLOW, blocks=2, steps_per_block=2, timeout_s=60, repeats=2, pool=pool)
    assert spawns == ["A1", "A2"] * 2  # both pairs at the start, none afresh
    assert [run.started_ahead for run in floor.runs] == [True, True]
    assert len(pool) == 0


def test_a_calibration_whose_first_run_fails_kills_its_spare(spawns, room, monkeypatch, pool):
    from validators.speedup import CalibrationFailed, calibrate_noise_floor
    monkeypatch.setattr(timing_worker, "overlap_builds", lambda a, b: True)
    crash = OK.model_copy(update={"config": {"behaviour": "crash"}})
    with pytest.raises(CalibrationFailed):
        calibrate_noise_floor(crash, blocks=2, steps_per_block=2, timeout_s=60, repeats=2, pool=pool)
    assert spawns == ["A1", "A2"] * 2 and len(pool) == 0


@pytest.mark.slow
def test_on_a_cpu_a_calibration_starts_each_runs_workers_for_it(spawns, room, pool):
    from validators.speedup import calibrate_noise_floor
    floor = calibrate_noise_floor(SLOW, blocks=2, steps_per_block=2, timeout_s=60, repeats=2, pool=pool)
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


def test_closing_the_pool_kills_and_reaps_every_pair_still_waiting_under_every_key(spawns, room, pool):
    pool.prestart(OK, SLOW, 60, force=True, pairs=2)
    pool.prestart(SLOW, OK, 60, force=True)
    assert len(pool) == 3 and len(spawns.workers) == 6
    pool.close()
    assert len(pool) == 0 and all(w.proc.poll() is not None for w in spawns.workers)


@pytest.mark.slow
def test_a_measurement_takes_workers_only_from_the_pool_it_is_given(spawns, pool):
    key = pool.prestart(OK, SLOW, 60, force=True)
    alone = measure_ab(OK, SLOW, blocks=2, steps_per_block=2, timeout_s=60)  # no pool: it starts its own
    assert alone.failure is None and not alone.started_ahead and len(pool.waiting(key)) == 1
    given = measure_ab(OK, SLOW, blocks=2, steps_per_block=2, timeout_s=60, pool=pool)
    assert given.failure is None and given.started_ahead and not pool.waiting(key)
    assert spawns == ["incumbent", "candidate"] * 2


def test_a_calibration_given_no_pool_leaves_no_worker_behind(spawns, room, monkeypatch):
    """The gate and `bench --vs` calibrate without a run: the spare pair lives in a pool of the calibration's own."""
    from validators.speedup import CalibrationFailed, calibrate_noise_floor
    monkeypatch.setattr(timing_worker, "overlap_builds", lambda a, b: True)
    crash = OK.model_copy(update={"config": {"behaviour": "crash"}})
    with pytest.raises(CalibrationFailed):
        calibrate_noise_floor(crash, blocks=2, steps_per_block=2, timeout_s=60, repeats=2)
    assert spawns == ["A1", "A2"] * 2 and all(w.proc.poll() is not None for w in spawns.workers)
