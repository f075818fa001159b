"""The worker on a torch.distributed job: ``WorkerRequest.ranks`` > 1 (gloo, 2 ranks, size tiny).

A ranked bench reports, per step, the slowest rank's time (checked on the job whose table
tests/test_cli.py::test_bench_on_two_ranks_prints_the_slowest_ranks_step_times reads: each of a job's
processes spends seconds importing torch); a ranked numerics fingerprint matches the single-process one
within the reorder class; a rank that dies or hangs ends in a structured failure (never a hang of the
caller, never a process left behind); a target without ``build_ranked`` and ``ranks`` < 1 are
one-sentence config errors.
"""

import time
import uuid
from pathlib import Path

import pytest

from targets.protocol import ConfigError
from targets.rank_worker import per_step_max, slowest_rank
from targets.registry import resolve_target
from targets.worker_client import lost_rank, run_worker
from targets.worker_protocol import BenchData, WorkerRequest
from validators.numerics import compare
from validators.ab_result import spec_digest
from validators.speedup import measure_ab

TINY = dict(target="haste-rec", size="tiny", warmup=2)


def request(mode: str, ranks: int = 2, **fields) -> WorkerRequest:
    return WorkerRequest(mode=mode, ranks=ranks, **{**TINY, **fields})


def processes_with(marker: str) -> list[int]:
    """Our processes whose environment holds ``marker`` (every process a worker started inherits it)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and marker.encode() in (entry / "environ").read_bytes():
                found.append(int(entry.name))
        except OSError:
            pass
    return found


def test_slowest_rank_takes_each_steps_maximum_and_the_slowest_ranks_phases():
    fast = BenchData(step_s=[1.0, 5.0, 1.0], phase_s={"a": 1.0}, samples_per_step=8, final_loss=0.5)
    slow = BenchData(step_s=[2.0, 2.0, 2.0], phase_s={"a": 2.0}, samples_per_step=8, final_loss=0.5)
    job = slowest_rank([fast, slow])
    assert job.step_s == [2.0, 5.0, 2.0] == per_step_max([fast.step_s, slow.step_s])
    assert job.rank_step_s == [fast.step_s, slow.step_s] and job.rank_median_s == [1.0, 2.0]
    assert job.phase_s == {"a": 2.0}


@pytest.mark.slow
def test_the_numerics_fingerprint_of_two_ranks_matches_one_within_reorder():
    one, two = (run_worker(request("numerics", ranks, steps=8), timeout_s=120) for ranks in (1, 2))
    assert one.ok and two.ok, (one.failure, two.failure)
    verdict = compare(one.numerics, two.numerics, "reorder")
    assert verdict.ok, verdict.detail
    assert two.numerics.losses != one.numerics.losses  # it really ran sharded: summed in another order


@pytest.mark.slow
def test_a_rank_that_dies_is_a_crash_naming_it_quickly():
    start = time.monotonic()
    result = run_worker(request("bench", steps=20), timeout_s=60, env={"SG_OPT_RANK_FAULT": "exit:1:3"})
    assert time.monotonic() - start < 30
    assert not result.ok and result.failure.kind == "crash"
    assert "rank 1 exited with code 1" in result.failure.message  # not rank 0, whose peer only went away


@pytest.mark.slow
def test_a_rank_that_hangs_is_killed_at_the_time_limit_with_the_whole_job():
    marker = f"SG_OPT_TEST_MARK={uuid.uuid4().hex}"
    start = time.monotonic()
    result = run_worker(request("bench", steps=20), timeout_s=8,
                        env={"SG_OPT_RANK_FAULT": "hang:1:3", "SG_OPT_TEST_MARK": marker.split("=")[1]})
    assert time.monotonic() - start < 20
    assert not result.ok and result.failure.kind == "timeout"
    time.sleep(0.2)
    assert processes_with(marker) == []  # torchrun's ranks, each in a session of its own, went too


def test_torchruns_summary_names_the_rank_that_crashed_not_the_ones_that_failed_cleanly():
    summary = ("[0]:\n  rank      : 0 (local_rank: 0)\n  exitcode  : 3 (pid: 10)\n"
               "[1]:\n  rank      : 1 (local_rank: 1)\n  exitcode  : -9 (pid: 11)\n"
               "[2]:\n  rank      : 2 (local_rank: 2)\n  exitcode  : -15 (pid: 12)\n")
    assert lost_rank(summary) == "rank 1 was killed by SIGKILL (often the kernel's out-of-memory killer) " \
                                 "without a result"
    assert lost_rank(summary.replace("-9", "3")) is None


@pytest.mark.slow
def test_a_config_error_on_every_rank_is_one_config_failure():
    result = run_worker(request("bench", config={"tail_backend": "triton-fused-loss"}), timeout_s=60)
    assert not result.ok and result.failure.kind == "config"
    assert result.failure.message.startswith("tail_backend = 'triton-fused-loss' runs on one process only")


def test_ranks_need_a_ranked_builder_and_at_least_one():
    with pytest.raises(ConfigError, match="runs on one process only"):
        resolve_target("tests.fixtures.faulty_target:target").check_ranks(2)
    with pytest.raises(ConfigError, match="at least 1"):
        resolve_target("haste-rec").check_ranks(0)
    with pytest.raises(ValueError):
        request("bench", ranks=0)


@pytest.mark.slow
def test_ranked_sides_measure_side_by_side():
    a, b = request("bench"), request("bench", config={"embedding_grad_mode": "fused"})
    result = measure_ab(a, b, blocks=2, steps_per_block=2, timeout_s=120)
    assert result.failure is None and result.verdict != "failed"
    assert len(result.a.block_medians) == len(result.b.block_medians) == 2
    assert result.a.digest == spec_digest(a) != spec_digest(a.model_copy(update={"ranks": 1}))


def test_an_agent_run_keeps_its_ranks_for_every_worker_and_across_resume(tmp_path):
    from sg_opt.optimize import build_context
    from sg_opt.run_store import RunRequest, create_run, find_run
    from state_machine.specs import baseline_request

    run_dir = create_run(tmp_path, RunRequest(run_id="ranked", target="haste-rec", size="tiny", ranks=2))
    _, request = find_run(tmp_path, "ranked")  # what --resume reads
    _, state = build_context(request, run_dir)
    assert state.ranks == 2 and baseline_request(state, "bench").ranks == 2
    with pytest.raises(ConfigError, match="runs on one process only"):
        build_context(request.model_copy(update={"target": "tests.fixtures.faulty_target:target"}), run_dir)
