"""Kernels that pass a static reading and a few checked calls, then cheat at run time: each is rejected with a
reason naming what it did. Wrong only in bfloat16: by the kernel check in bfloat16, which the plan includes
wherever a run can train in it. Wrong after the kernel check's calls (stale after 120 calls, or after two calls
per shape): by the spot checks of the numerics run, or of a forced step between timed blocks."""

from __future__ import annotations

import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from state_machine.state import Candidate, EvalPlan, RunState
from state_machine.validation import _kernel_verdicts
from targets.spot_check import SpotCheckFailed, checked_step
from targets.worker import build_session
from targets.worker_client import run_worker
from targets.worker_protocol import WorkerRequest
from validators.kernel import spot_check_spec
from validators.kernel_file import validate_kernel_file
from validators.source import check_source

KERNELS = Path(__file__).parent / "kernels"
CHEATS = ("runtime_cached_after_120", "runtime_bf16_only_wrong", "runtime_honest_twice_per_shape")
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _kernels_dir(tmp_path: Path, cheat: str) -> str:
    folder = tmp_path / cheat
    folder.mkdir()
    shutil.copyfile(KERNELS / f"{cheat}.py", folder / "tail_forward.py")
    return str(folder)


def _numerics(kernels_dir: str, steps: int, spot_rate: float | None) -> WorkerRequest:
    """The bundled tiny trainer's numerics run, its tail through the slots, the cheat in tail_forward."""
    return WorkerRequest(target="haste-rec", size="tiny", mode="numerics", steps=steps, threads=1,
                         config={"tail_backend": "slots"}, kernels_dir=kernels_dir,
                         spot_check=None if spot_rate is None else spot_check_spec(spot_rate))


@pytest.mark.parametrize("cheat", CHEATS)
def test_each_cheat_passes_the_static_check(cheat):
    verdict = check_source((KERNELS / f"{cheat}.py").read_text(), "tail_forward")
    assert verdict.ok, verdict.message


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every subprocess at once (each is mostly a torch import; two cores run them side by side)."""
    tmp = tmp_path_factory.mktemp("cheats")
    stale, twice = _kernels_dir(tmp, "runtime_cached_after_120"), _kernels_dir(tmp, "runtime_honest_twice_per_shape")
    jobs = {
        "stale kernel check": lambda: validate_kernel_file("haste-rec", "tail_forward", f"{stale}/tail_forward.py",
                                                           "cpu", "float32", 120.0),
        "twice kernel check": lambda: validate_kernel_file("haste-rec", "tail_forward", f"{twice}/tail_forward.py",
                                                           "cpu", "float32", 120.0),
        "stale unchecked": lambda: run_worker(_numerics(stale, 125, None), timeout_s=120),
        "stale spot-checked": lambda: run_worker(_numerics(stale, 125, 1.0), timeout_s=120),
        "twice spot-checked": lambda: run_worker(_numerics(twice, 20, 1.0), timeout_s=120),
    }
    with ThreadPoolExecutor(2) as pool:
        futures = {name: pool.submit(job) for name, job in jobs.items()}
        return {name: future.result() for name, future in futures.items()}


# ----------------------------------------------------------------------------- wrong only in bfloat16

def test_the_plan_checks_kernels_in_bfloat16_wherever_a_run_can_train_in_it():
    cuda = RunState(run_id="t", run_dir="unused", target="haste-rec", size="tiny", device="cuda")
    assert cuda.plan.kernel_dtypes == ["float32", "bfloat16", "float16"] and cuda.plan.kernel_dtypes_skipped == {}
    cpu = RunState(run_id="t", run_dir="unused", target="haste-rec", size="tiny")
    assert cpu.plan.kernel_dtypes == ["float32", "float16"]
    assert "interpreter computes bfloat16 wrongly" in cpu.plan.kernel_dtypes_skipped["bfloat16"]


@pytest.mark.slow
def test_the_validate_node_rejects_the_bf16_cheat_naming_dtype_shape_and_error(tmp_path):
    """On the CPU too where asked: this cheat is plain torch, which computes bfloat16 right without Triton's
    interpreter. Its float32 and float16 checks pass."""
    path = str(KERNELS / "runtime_bf16_only_wrong.py")
    cand = Candidate(id=1, kind="kernel", kernels={"tail_forward": path}, rationale="t", proposer="test")
    state = RunState(run_id="t", run_dir=str(tmp_path), target="haste-rec", size="tiny", current=cand,
                     plan=EvalPlan(kernel_dtypes=["float32", "float16", "bfloat16"], timeout_s=120.0))
    rejection, summary = _kernel_verdicts(state, None, cand)
    reason = rejection["current"].verdict.reason
    assert reason.startswith("kernel tail_forward (bfloat16) failed its accuracy check: tail_forward is inaccurate "
                             "in bfloat16 at shape {'B': 64, 'Ht': 96, 'K': 50, 'G': 7, 'F': 13, 'bias': 1} (call 1")
    assert "relative error" in reason and "worst element off by" in reason
    assert Path(summary).read_text().count('"ok"') == 2  # float32 and float16


@CUDA
def test_the_bf16_cheat_fails_its_bfloat16_check_on_cuda():
    path = str(KERNELS / "runtime_bf16_only_wrong.py")
    verdicts = {dtype: validate_kernel_file("haste-rec", "tail_forward", path, "cuda", dtype, 300.0)
                for dtype in ("float32", "float16", "bfloat16")}
    assert verdicts["float32"].ok and verdicts["float16"].ok, (verdicts["float32"].reason, verdicts["float16"].reason)
    assert verdicts["bfloat16"].check == "accuracy" and "inaccurate in bfloat16 at shape" in verdicts["bfloat16"].reason


# ----------------------------------------------------------------------------- wrong after the kernel check's calls

@pytest.mark.slow
def test_the_stale_and_twice_per_shape_cheats_pass_the_kernel_check(runs):
    """The hole spot checks close: a dozen checked calls cannot see what happens at call 121, or at a shape's third."""
    for name in ("stale kernel check", "twice kernel check"):
        assert runs[name].ok, runs[name].reason


@pytest.mark.slow
def test_the_stale_cheat_fails_the_spot_checked_numerics_run_at_its_first_stale_call(runs):
    assert runs["stale unchecked"].ok, runs["stale unchecked"].failure  # unchecked, its stale calls train on
    result = runs["stale spot-checked"]
    assert not result.ok and result.failure.kind == "spot-check"
    assert result.failure.message.startswith("slot tail_forward call 121 (float32, h [32, 32]")
    assert "differs from its reference: relative error" in result.failure.message


@pytest.mark.slow
def test_the_twice_per_shape_cheat_fails_the_spot_checked_numerics_run_at_its_third_call(runs):
    result = runs["twice spot-checked"]
    assert not result.ok and result.failure.kind == "spot-check"
    assert result.failure.message.startswith("slot tail_forward call 3 (float32")


def test_a_checked_step_between_timed_blocks_catches_the_stale_cheat(tmp_path):
    """What a timing worker does: its blocks run unchecked (rate 0); the step it checks between two blocks fails."""
    request = _numerics(_kernels_dir(tmp_path, "runtime_cached_after_120"), 1, 0.0).model_copy(update={"mode": "bench"})
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        _, _, kernels, session = build_session(request, torch.device("cpu"))
        assert checked_step(session) == 1  # honest so far: a block of 119 steps follows
        for _ in range(119):
            session.step()
        with pytest.raises(SpotCheckFailed, match="slot tail_forward call 121 .* differs from its reference"):
            checked_step(session)
        assert kernels["tail_forward"].calls == 121
    finally:
        torch.set_num_threads(threads)


# ----------------------------------------------------------------------------- honest, then cached, while timed

@pytest.mark.slow
def test_the_stale_cheat_is_caught_between_timed_blocks(tmp_path):
    """Timed beside the incumbent, the candidate's replaced kernels are checked in untimed steps drawn at random
    between its blocks and once after its last: the kernel that turns stale after 120 calls fails the measurement
    as ``spot-check`` instead of being timed as a win."""
    from validators.speedup import measure_ab

    def bench(kernels_dir: str | None) -> WorkerRequest:
        return WorkerRequest(target="haste-rec", size="tiny", mode="bench", warmup=2, threads=1,
                             config={"tail_backend": "slots"}, kernels_dir=kernels_dir,
                             spot_check=spot_check_spec(0.0) if kernels_dir else None)

    result = measure_ab(bench(None), bench(_kernels_dir(tmp_path, "runtime_cached_after_120")), blocks=4,
                        steps_per_block=40, timeout_s=300)
    assert result.verdict == "failed" and result.failure.kind == "spot-check", result.failure
    assert result.failed_side == "candidate" and "differs from its reference" in result.failure.message
