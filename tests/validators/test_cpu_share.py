"""The threads a timing worker gets beside a steady neighbour: the arithmetic, the requests left alone, a real busy
loop taking a CPU, and the gate timing both sides and its A/A runs on the threads left, saying so."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

import sg_opt.gate_side_by_side as side_by_side
import validators.cpu_share as cpu_share
from sg_opt.gate import GateOptions, NumericsCheck
from targets.machine_lease import machine_lease
from tests.fixtures.ab_results import measured
from targets.worker_protocol import WorkerRequest
from validators.cpu_share import share_cpus, threads_left
from validators.machine_load import LoadPolicy
from validators.ab_result import NoiseFloor

SPEC = WorkerRequest(target="tests.fixtures.faulty_target:target", size="tiny", mode="bench", warmup=1,
                     config={"behaviour": "ok"})
SHORT_WAIT = LoadPolicy(wait_s=0.5, sample_s=0.5)


@pytest.mark.parametrize("cpus,outside,threads", [
    (2, 0.95, 1), (2, 1.6, 1), (2, 0.4, 2), (2, 0.6, 1), (16, 1.0, 15), (16, 3.4, 13), (4, 9.0, 1),
])
def test_threads_left_are_the_cpus_less_the_outside_load_rounded_at_least_one(cpus, outside, threads):
    assert threads_left(cpus, outside) == threads


@pytest.mark.parametrize("update", [{"threads": 2}, {"device": "cuda"}, {"ranks": 2}])
def test_a_request_that_names_its_threads_or_is_no_single_cpu_process_is_left_alone_without_a_wait(update):
    spec = SPEC.model_copy(update=update)
    start = time.monotonic()
    share = share_cpus(spec, LoadPolicy(wait_s=30))
    assert share.spec == spec and share.note is None and time.monotonic() - start < 0.2


def test_a_quiet_machine_keeps_torchs_threads_and_the_caller_s_policy(monkeypatch):
    monkeypatch.setattr(cpu_share, "allowed_cpus", lambda: [0, 1])
    monkeypatch.setattr(cpu_share, "wait_for_quiet", lambda meter, gpus, policy: (0.1, None, 0.0))
    share = share_cpus(SPEC, SHORT_WAIT)
    assert share.spec.threads is None and share.note is None and share.policy == SHORT_WAIT


def test_a_steady_neighbour_that_outlasts_the_wait_leaves_the_threads_that_fit(monkeypatch):
    monkeypatch.setattr(cpu_share, "allowed_cpus", lambda: [0, 1])
    monkeypatch.setattr(cpu_share, "wait_for_quiet", lambda meter, gpus, policy: (0.97, None, 60.0))
    share = share_cpus(SPEC, SHORT_WAIT, who=lambda: "busiest others python (42) 0.97")
    assert share.spec.threads == 1 and share.policy.wait_s == 0.0  # waited out once: the runs start at once
    assert share.spec.model_copy(update={"threads": None}) == SPEC
    assert "0.97 of the 2 CPUs" in share.note and "python (42)" in share.note and "on 1 thread(s)" in share.note


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs a CPU to leave to the busy loop")
def test_a_real_busy_loop_takes_a_cpu_from_the_timing_worker():
    cpus = len(os.sched_getaffinity(0))
    with machine_lease("cpu", exclusive=True):  # the loop disturbs no one else's measurement
        busy = subprocess.Popen([sys.executable, "-c", "while 1: pass"])
        try:
            time.sleep(0.2)
            share = share_cpus(SPEC, SHORT_WAIT)
        finally:
            busy.kill()
            busy.wait()
    assert share.spec.threads is not None and share.spec.threads <= cpus - 1, share.note
    assert "busy after a wait" in share.note


def test_the_gate_times_every_run_on_the_threads_left_and_says_so(monkeypatch, tmp_path):
    same = [0.01, 0.0101, 0.0099, 0.01, 0.0101, 0.0099]
    seen = []

    def measure(a, b, *args, floor=0.01, **kwargs):
        seen.append((a.threads, b.threads, kwargs.get("load_policy")))
        return measured(same, same).model_copy(update={"floor": floor})

    def calibrate(spec, blocks, steps, timeout_s, repeats=2, load_policy=None, **kwargs):
        return NoiseFloor(floor=0.02, runs=[measure(spec, spec, load_policy=load_policy)
                                                        for _ in range(repeats)])
    later = LoadPolicy(wait_s=0.0)
    note = "other work kept 0.97 of the 2 CPUs busy after a wait of 60 s (x): both sides were timed on 1 thread(s)"
    monkeypatch.setattr(side_by_side, "share_cpus", lambda spec, **kw: cpu_share.CpuShare(
        spec.model_copy(update={"threads": 1}), later, note))
    monkeypatch.setattr(side_by_side, "measure_ab", measure)
    monkeypatch.setattr(side_by_side, "calibrate_noise_floor", calibrate)
    same_numerics = NumericsCheck(passed=True, numerics_class="reorder", steps=4, message="same")
    monkeypatch.setattr(side_by_side, "_numerics_pair", lambda *a, **k: (_Ran(), _Ran()))
    monkeypatch.setattr(side_by_side, "judge_numerics", lambda *a, **k: same_numerics)
    result = side_by_side.gate_against_tree(SPEC, tmp_path, GateOptions(), where=tmp_path)
    assert result.outcome == "pass" and note in result.warnings
    assert seen and all(t == (1, 1, later) for t in seen)  # the A/A runs too


class _Ran:
    ok, numerics, failure, environment = True, None, None, None
