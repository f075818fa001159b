"""`--gpus N`: lanes, one candidate per lane at once, at most one winner per batch.

The bookkeeping test replaces validate and measure by functions that hand out given verdicts (what is
under test is which verdict becomes the incumbent, not the measurement); the end-to-end test runs real
workers, two lanes at once, on the CPU (a lane's GPU list only sets CUDA_VISIBLE_DEVICES).
"""

from __future__ import annotations

import functools
import json
import threading
import time

import pytest

from sg_opt.run_store import RunRequest
from state_machine import batch, graph, lanes, nodes
from state_machine.context import ProposerPolicy, RunContext
from state_machine.lanes import plan_lanes
from state_machine.state import Baseline, Candidate, Incumbent, Limits, RunState, Verdict, rejected
from targets.registry import resolve_target
from targets.fork_server import fixed_allocator_env
from targets.worker_client import device_env, scrubbed_env
from targets.worker_protocol import WorkerRequest
from validators.ab_result import ABResult, NoiseFloor

AGENT_TARGET = "tests.fixtures.agent_target:target"


def test_lanes_split_gpus_by_ranks_and_cpus_evenly():
    lanes = plan_lanes(4, 2, cpus=list(range(8)))
    assert [lane.gpus for lane in lanes] == [[0, 1], [2, 3]]
    assert [lane.cpus for lane in lanes] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert [lane.gpus for lane in plan_lanes(3, 1, cpus=[0, 1, 2])] == [[0], [1], [2]]
    assert len(plan_lanes(1, 2, cpus=[0])) == 1  # fewer GPUs than ranks: one lane, the whole machine


def test_a_lane_sees_only_its_gpus_as_the_caller_numbers_them(monkeypatch):
    req = WorkerRequest(target="t", size="s", mode="bench", gpus=[1])
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert device_env(req) == {"CUDA_VISIBLE_DEVICES": "1"}
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,6")
    assert device_env(req) == {"CUDA_VISIBLE_DEVICES": "6"}
    assert device_env(req.model_copy(update={"gpus": None})) == {}


def test_the_fastest_winner_of_a_batch_alone_becomes_the_incumbent(tmp_path, monkeypatch):
    ctx = RunContext(target=resolve_target("haste-rec"), policy=ProposerPolicy())
    cands = [Candidate(id=i, kind="knob", patch=patch, rationale="test", proposer="test")
             for i, patch in ((1, {"data_workers": 2}), (2, {"embedding_grad_mode": "fused"}),
                              (3, {"pin_memory": True}), (4, {"data_workers": 2}))]
    ratios = {1: 0.8, 2: 0.5, 3: None}  # 3 is rejected at validation; 4 duplicates 1 within the batch
    lanes_seen, overlap, active = {}, [], []

    def validate(state, _ctx):
        cid = state.current.candidate.id
        active.append(cid)
        time.sleep(0.2)
        overlap.append(len(active))
        active.remove(cid)
        lanes_seen[cid] = (state.lane.gpus, threading.current_thread().name)
        if ratios[cid] is None:
            return rejected(state, "validate", "numerics broken")
        return state.in_flight(verdict=None)

    def measure(state, _ctx):
        ratio = ratios[state.current.candidate.id]
        return state.in_flight(verdict=Verdict(accepted=True, stage="measure", reason="faster twice", ratio=ratio))

    monkeypatch.setattr(nodes, "validate", validate)
    monkeypatch.setattr(nodes, "measure", measure)
    state = RunState(run_id="t", run_dir=str(tmp_path), target="haste-rec", size="tiny", gpus=4, batch=cands,
                     next_id=5, limits=Limits(max_iters=10))
    out = batch.evaluate_batch(state, ctx)
    history = out["history"]
    assert [e.candidate.id for e in history][-1] == 2 and history[-1].verdict.accepted
    by_id = {e.candidate.id: e.verdict for e in history}
    assert not by_id[1].accepted and "candidate #2 of the same batch was faster" in by_id[1].reason
    assert not by_id[3].accepted and by_id[3].stage == "validate"
    assert not by_id[4].accepted and "duplicate of candidate #1" in by_id[4].reason
    assert out["incumbent"].from_candidate == 2 and out["incumbent"].config == {"embedding_grad_mode": "fused"}
    assert all(e.incumbent_id is None for e in history)  # all measured against the same incumbent
    assert [(c.id, c.patch) for c in out["queue"]] == [(5, {"data_workers": 2})] and out["next_id"] == 6
    assert sorted(gpus for gpus, _ in lanes_seen.values()) == [[0], [1], [2]]  # one lane each
    assert max(overlap) == 3  # the three validations ran at the same time


@pytest.mark.slow
def test_two_lanes_evaluate_real_candidates_at_once(tmp_path):
    """The agent test target on the CPU, 2 lanes: the graph batches, times each pair on its own CPUs, and
    records one winner per batch."""
    request = RunRequest(run_id="lanes", target=AGENT_TARGET, size="tiny", threads=1, gpus=2,
                         max_iters=2, plan={"blocks": 4, "block_steps": 3, "block_seconds": 0.0, "aa_repeats": 1,
                                            "aa_blocks": 4, "recalibrate_after": 0.0})
    ctx = RunContext(target=resolve_target(AGENT_TARGET), policy=ProposerPolicy())
    state = RunState(run_id=request.run_id, run_dir=str(tmp_path), target=AGENT_TARGET, size="tiny", threads=1,
                     gpus=2, limits=Limits(max_iters=2, max_minutes=10), plan=request.plan)
    if len(plan_lanes(2, 1)) < 2 or not plan_lanes(2, 1)[1].cpus:
        pytest.skip("this machine has a single CPU: two lanes would share it")
    final = graph.run(ctx, state, tmp_path, request.run_id)
    events = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    batches = [e for e in events if e["event"] == "batch"]
    assert batches and len(batches[0]["ids"]) == 2, batches
    assert final.evaluated >= 2 and final.stop_reason
    first = [e for e in final.history if e.candidate.id in batches[0]["ids"]]
    assert sum(e.verdict.accepted for e in first) <= 1
    assert any(e.verdict.accepted and e.candidate.patch == {"slow_loader": False} for e in final.history)
    calibration = json.loads((tmp_path / "baseline" / "calibration.json").read_text())
    assert "with 2 lanes timed at once" in final.plan.lanes_note
    if final.plan.concurrent_timing:
        assert "over 2 lanes timed at once" in calibration["rule"] and len(calibration["runs"]) == 2
    else:  # the lanes widened each other's floor: the lone lane's floor, and the timings took turns
        assert len(calibration["runs"]) == 1


@pytest.mark.parametrize("together,alone,at_once", [(0.3, 0.1, False), (0.12, 0.1, True)])
def test_lanes_time_at_once_only_while_that_keeps_the_noise_floor(tmp_path, monkeypatch, together, alone, at_once):
    calls = []

    def calibrate(spec, *args, **kwargs):
        calls.append(spec.gpus)
        assert kwargs["spares"] is (len(calls) > 2)  # no spare pair builds beside another lane's timed blocks
        floor = alone if len(calls) > 2 else together  # the two lanes at once first, then one alone
        return NoiseFloor(floor=floor, runs=[ABResult.model_construct(ratio=1.0, ci_low=1 - floor, ci_high=1 + floor)])

    monkeypatch.setattr(lanes, "calibrate_noise_floor", calibrate)
    monkeypatch.setattr(lanes, "floor_from", lambda runs: max(high - 1 for _, _, high in runs))
    state = RunState(run_id="t", run_dir=str(tmp_path), target="haste-rec", size="tiny", gpus=2)
    spec = WorkerRequest(target="haste-rec", size="tiny", mode="bench")
    noise, plan = lanes.noise_floor(state, spec, 4, 3, 60.0)
    assert sorted(calls[:2]) == [[0], [1]] and calls[2] == [0]
    assert plan["concurrent_timing"] is at_once and noise.floor == pytest.approx(together if at_once else alone)
    assert ("timed at once" if at_once else "timed one at a time") in plan["lanes_note"]


def test_timings_take_turns_when_the_lanes_may_not_time_at_once(tmp_path, monkeypatch):
    ctx = RunContext(target=resolve_target("haste-rec"), policy=ProposerPolicy())
    active = {"validate": [], "measure": []}
    peak = {"validate": 0, "measure": 0}

    overlaps = []

    def node(name, verdict):
        def run(state, _ctx):
            active[name].append(state.current.candidate.id)
            peak[name] = max(peak[name], len(active[name]))
            for _ in range(4):
                overlaps.append({k: list(v) for k, v in active.items()})
                time.sleep(0.05)
            active[name].remove(state.current.candidate.id)
            return state.in_flight(verdict=verdict)
        return run

    monkeypatch.setattr(nodes, "validate", node("validate", None))
    monkeypatch.setattr(nodes, "measure", node("measure", Verdict(accepted=False, stage="measure", reason="same",
                                                                  ratio=1.0)))
    cands = [Candidate(id=i, kind="knob", patch={"data_workers": w}, rationale="t", proposer="t")
             for i, w in ((1, 1), (2, 2))]
    state = RunState(run_id="t", run_dir=str(tmp_path), target="haste-rec", size="tiny", gpus=2, batch=cands,
                     next_id=3, plan={"concurrent_timing": False})
    out = batch.evaluate_batch(state, ctx)
    assert len(out["history"]) == 2 and peak == {"validate": 2, "measure": 1}
    assert not any(a["measure"] and a["validate"] for a in overlaps)  # a timing has the machine to itself


def test_a_run_killed_inside_a_batch_resumes_it_without_losing_a_decision(tmp_path, monkeypatch):
    """The graph with its worker-backed nodes replaced (what is under test is the checkpointing of a batch):
    a kill while the second batch is validating; the resumed run redoes that batch alone."""
    ctx = RunContext(target=resolve_target("haste-rec"), policy=ProposerPolicy())
    kill = {"armed": True}

    def baseline(state, _ctx):
        return {"baseline": Baseline(numerics_file="-", step_ms=10.0, noise_floor=0.02, calibration_file="-"),
                "incumbent": Incumbent(config=dict(state.baseline_config))}

    def validate(state, _ctx):
        if state.current.candidate.id >= 3 and kill["armed"]:
            kill["armed"] = False
            raise KeyboardInterrupt  # as a kill: nothing after the last checkpoint is written
        return state.in_flight(verdict=None)

    def measure(state, _ctx):
        accepted = state.current.candidate.id == 1
        return state.in_flight(verdict=Verdict(accepted=accepted, stage="measure", reason="timed",
                                               ratio=0.5 if accepted else 1.0))

    def nothing(state, _ctx):
        return {}

    for name, fake in (("setup", nothing), ("baseline", baseline), ("diagnose", nothing), ("validate", validate),
                       ("measure", measure), ("report", nothing)):
        named = functools.wraps(getattr(nodes, name))(functools.partial(fake))  # graph nodes go by their name
        monkeypatch.setattr(nodes, name, named)
    state = RunState(run_id="kill", run_dir=str(tmp_path), target="haste-rec", size="tiny", gpus=2,
                     limits=Limits(max_iters=4, max_minutes=10))
    with pytest.raises(KeyboardInterrupt):
        graph.run(ctx, state, tmp_path, "kill")
    final = graph.run(ctx, None, tmp_path, "kill")  # resume from the last checkpoint
    ids = [e.candidate.id for e in final.history]
    assert sorted(ids) == [1, 2, 3, 4] and len(set(ids)) == 4, ids  # each decided once
    assert final.incumbent.from_candidate == 1 and final.stop_reason.startswith("max-iters")
    batches = [json.loads(line)["ids"] for line in (tmp_path / "events.jsonl").read_text().splitlines()
               if json.loads(line)["event"] == "batch"]
    assert batches == [[1, 2], [3, 4], [3, 4]]  # the killed batch, and only it, ran again


def test_a_gpu_worker_keeps_glibcs_adaptive_allocator_unless_the_caller_chose(monkeypatch):
    """Fixed allocator thresholds are for CPU workers (their A/A offsets); a GPU worker is timed as a training job
    runs, unless the caller set the switch itself."""
    req = WorkerRequest(target="t", size="s", mode="bench", device="cuda")
    monkeypatch.delenv("SG_OPT_STATIC_MALLOC", raising=False)
    assert device_env(req) == {"SG_OPT_STATIC_MALLOC": "0"}
    assert fixed_allocator_env(scrubbed_env(device_env(req))) == scrubbed_env(device_env(req))  # nothing fixed
    assert device_env(req.model_copy(update={"device": "cpu"})) == {}
    assert "MALLOC_MMAP_THRESHOLD_" in fixed_allocator_env(scrubbed_env(device_env(req.model_copy(
        update={"device": "cpu"}))))
    monkeypatch.setenv("SG_OPT_STATIC_MALLOC", "1")
    assert device_env(req) == {}
