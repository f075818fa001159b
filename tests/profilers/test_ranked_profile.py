"""The profiler on a torch.distributed job (gloo, 2 ranks, size tiny): every rank profiled, the slowest
rank's profile in full with each rank in brief and its share of collectives, the fine profile in one
process; a rank that dies is a failure naming it; a communication-bound profile becomes a finding that
the offline proposer answers with the sharding knobs."""

import time
from pathlib import Path

import pytest
from rich.console import Console
from typer.testing import CliRunner

from profilers.client import run_profile
from profilers.findings import COMM_THRESHOLD, findings
from profilers.records import ProfileRequest
from profilers.worker import execute
from sg_opt.cli import app
from sg_opt.profile_view import render
from state_machine.context import ProposerPolicy, RunContext
from state_machine.proposers.offline import NO_FINDING_GAIN, propose_offline
from state_machine.state import RunState
from targets.registry import resolve_target
from tests.profilers.test_findings import coarse

TINY = dict(target="haste-rec", size="tiny", warmup=1, profile_steps=2)
EXCHANGES = {"input_dist", "output_dist", "loss_sync"}


@pytest.mark.slow
def test_every_rank_is_profiled_and_the_slowest_is_the_main_profile(tmp_path):
    trace = tmp_path / "trace.json"
    req = ProfileRequest(ranks=2, trace=str(trace), fine=True, fine_repeats=2, quick_ceilings=True, **TINY)
    result = run_profile(req, timeout_s=120, env={"XDG_CACHE_HOME": str(tmp_path / "cache")})
    assert result.ok, result.failure
    assert result.environment.ranks == 2 and [r.rank for r in result.ranks] == [0, 1]
    busy = [r.step_s - r.comm_s for r in result.ranks]  # the rank the other waits for in its collectives
    assert result.main_rank == busy.index(max(busy))
    assert result.coarse.step_s == result.ranks[result.main_rank].step_s
    assert EXCHANGES <= set(result.coarse.phases) and all(EXCHANGES <= set(r.phase_s) for r in result.ranks)
    assert 0 < result.coarse.comm_share < 1 and all(0 < r.comm_share < 1 for r in result.ranks)
    assert result.coarse.comm_share == result.ranks[result.main_rank].comm_share
    assert any(op.name.startswith("c10d::") for op in result.coarse.top_ops)  # gloo's collectives, as ops
    assert [r.trace_path for r in result.ranks] == [str(tmp_path / f"trace.rank{rank}.json") for rank in (0, 1)]
    assert all(Path(r.trace_path).stat().st_size > 0 for r in result.ranks)
    # the fine profile in one process after the job: shown, kept out of the findings
    assert [s.slot for s in result.fine.slots] == ["tail_forward", "tail_backward_weight", "tail_backward_input"]
    categories = {f.category for f in result.findings}
    assert categories and not {"memory-bound kernel", "compute-bound kernel"} & categories
    assert any("timed in one process" in note for note in result.notes)

    console = Console(record=True, width=200)
    render(result, console)
    text = console.export_text()
    for words in ("2 ranks on cpu", f"rank {result.main_rank} *", "collectives in flight", "input_dist"):
        assert words in text


def test_profile_on_ranks_needs_a_target_that_runs_on_ranks():
    result = CliRunner().invoke(app, ["profile", "--size", "tiny", "--ranks", "2", "--target",
                                      "tests.fixtures.faulty_target:target"])
    assert result.exit_code == 2 and "runs on one process only" in result.output, result.output


@pytest.mark.slow
def test_a_rank_that_dies_is_a_failure_naming_it_not_a_hang():
    start = time.monotonic()
    fault = {"SG_OPT_RANK_FAULT": "exit:1:4"}  # before its first profiled step
    result = run_profile(ProfileRequest(ranks=2, **TINY), timeout_s=60, env=fault)
    assert time.monotonic() - start < 30
    assert not result.ok and result.failure.kind == "crash" and result.coarse is None
    assert "rank 1 exited with code 1" in result.failure.message


def test_the_single_process_worker_refuses_ranks():
    result = execute(ProfileRequest(ranks=2, **TINY))
    assert not result.ok and result.failure.kind == "config" and "torchrun" in result.failure.message


def test_collectives_over_the_threshold_are_a_communication_finding_the_sharding_knobs_answer():
    quiet, busy = (coarse({"optimizer": 0.3}).model_copy(update={"comm_s": share * 0.01, "comm_share": share})
                   for share in (COMM_THRESHOLD / 2, 0.5))
    assert "communication" not in {f.category for f in findings(quiet, None, {}, {})}
    (found,) = [f for f in findings(busy, None, {}, {}) if f.category == "communication"]
    assert found.share == 0.5 and "5.00 ms" in found.evidence and found.amdahl_gain > 1
    ctx = RunContext(target=resolve_target("haste-rec"), policy=ProposerPolicy(kinds=("knob",)))
    state = RunState(run_id="t", run_dir="unused", target="haste-rec", size="tiny", ranks=2, findings=[found])
    def promising(s):
        return [p for p in propose_offline(s, ctx, limit=200) if p.expected_gain > NO_FINDING_GAIN]
    assert {k for p in promising(state) for k in p.patch} == {"embedding_sharding", "tail_sharding"}
    single = state.model_copy(update={"ranks": 1})  # one process ignores a sharding plan: only the last sweeps
    assert promising(single) == []
