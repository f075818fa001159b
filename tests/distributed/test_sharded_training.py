"""The distributed reference trainer in real gloo processes (torchrun, 2 ranks, size tiny).

Sharded training from the same seed follows the single-process trajectory within the reorder
numerics class: the global batch is the single-process batch split in halves, each rank's loss is
its share of the single-process loss, the dense gradients are summed, and each row gets one Adagrad
update with its gradient over the global batch. A rank that dies, or that stops answering, fails
the job with a non-zero exit status well within a minute instead of hanging it.
"""

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from targets.haste_rec.knobs import KNOB_SPACE
from targets.haste_rec.target import build
from targets.worker_protocol import NumericsData
from validators.numerics import compare

ROOT = Path(__file__).resolve().parents[2]
STEPS = 12


def torchrun(*args: str, timeout: float = 90) -> tuple[subprocess.CompletedProcess, float]:
    """The trainer under torchrun with 2 gloo ranks; (the finished launcher, its wall seconds)."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               "-m", "targets.haste_rec.distributed.train", "--size", "tiny", "--device", "cpu", *args]
    start = time.monotonic()
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    return done, time.monotonic() - start


def single_process_numerics(overrides: dict) -> NumericsData:
    """What the worker's numerics mode records for the single-process trainer (one thread)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        session = build(KNOB_SPACE.resolve(overrides), "tiny", {}, "cpu", 0)
        session.record_grad_norms = True
        losses, norms = [], []
        for _ in range(STEPS):
            losses.append(float(session.step()))
            norms.append(session.grad_norms())
        return NumericsData(losses=losses, grad_norms=norms, probe=session.probe(), digest=session.param_digest())
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("overrides", [{}, {"embedding_grad_mode": "fused"}],
                         ids=["dense-table-gradient", "fused-row-update"])
def test_sharded_training_follows_the_single_process_trajectory(tmp_path, overrides):
    out = tmp_path / "result.json"
    sets = [arg for name, value in overrides.items() for arg in ("--set", f"{name}={value}")]
    done, _ = torchrun("--steps", str(STEPS), "--numerics", "--timeout-s", "60", "--out", str(out), *sets)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())

    assert [(r["tables"], r["samples"]) for r in result["ranks"]] == [([0, 2], 16), ([1], 16)]
    for step, loss in enumerate(result["losses"]):  # the global loss is the sum of the ranks' shares
        assert loss == pytest.approx(sum(r["local_losses"][step] for r in result["ranks"]), rel=1e-6)
    assert all(len(r["step_s"]) == STEPS for r in result["ranks"])

    baseline = single_process_numerics(overrides)
    candidate = NumericsData(**{k: v for k, v in result["numerics"].items() if k != "counters"})
    verdict = compare(baseline, candidate, "reorder")
    assert verdict.ok, verdict.detail
    assert candidate.losses[-1] < 0.1 * candidate.losses[0]  # it trains


@pytest.mark.parametrize("fault,timeout_s", [("exit:1:3", "30"), ("hang:1:3", "5")], ids=["dies", "hangs"])
def test_a_failed_rank_fails_the_job_instead_of_hanging_it(tmp_path, fault, timeout_s):
    """exit: torchrun sees the dead worker and stops the job; hang: the other rank's collective times
    out (--timeout-s), it fails, and torchrun stops the silent one."""
    out = tmp_path / "result.json"
    done, seconds = torchrun("--steps", "20", "--fault", fault, "--timeout-s", timeout_s, "--out", str(out),
                             timeout=60)
    assert done.returncode != 0
    assert seconds < 60
    assert "ChildFailedError" in done.stderr and "exitcode  : 1" in done.stderr
    if fault.startswith("hang"):
        assert "Timed out" in done.stderr  # the collective timeout, not torchrun, ended it
    assert not out.exists()


def test_an_unbuilt_sharding_scheme_is_one_sentence_and_exit_status_2():
    done, _ = torchrun("--steps", "1", "--set", "embedding_sharding=row-wise", timeout=60)
    assert done.returncode != 0 and "exitcode  : 2" in done.stderr
    assert "error: embedding_sharding row-wise is not implemented yet" in done.stderr
