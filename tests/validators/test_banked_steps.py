"""A timed window never steps on input a session banked while it was not stepping (loader workers keep
building batches while the other side of a side-by-side measurement runs its block)."""

from __future__ import annotations

import time

import pytest
import torch

from profilers.coarse import profile_session
from targets.haste_rec.knobs import KNOB_SPACE
from targets.haste_rec.target import build
from targets.protocol import PhaseTimer
from targets.worker import banked_steps
from targets.worker_protocol import WorkerRequest
from validators.ab_worker import drain_bank, run_block

CPU = torch.device("cpu")
FAST_S, SLOW_S = 0.001, 0.02


class BankingSession:
    """A step is fast while a batch built ahead is waiting, slow when it must wait for one to be built; idle
    time refills the bank up to `depth` batches, as loader workers do."""

    phase_names = ("data",)
    record_grad_norms = False

    def __init__(self, depth: int):
        self.banked_steps = depth
        self.bank = depth
        self.timer = PhaseTimer(CPU)
        self.steps = 0

    def idle(self) -> None:
        self.bank = self.banked_steps

    def step(self) -> torch.Tensor:
        self.steps += 1
        if self.bank:
            self.bank -= 1
            time.sleep(FAST_S)
        else:
            time.sleep(SLOW_S)
        return torch.tensor(1.0)

    def counters(self) -> dict[str, float]:
        return {}


@pytest.mark.parametrize("apart", [True, False])
def test_a_block_after_idle_time_times_the_steady_rate_not_the_bank(apart):
    """Drained in a command of its own (outside the window the parent times), or by an older runner's run."""
    session = BankingSession(depth=4)
    session.idle()  # the other side's block ran meanwhile
    if apart:
        assert drain_bank(session, CPU) == {"drained": 4}
    block = run_block(session, CPU, steps=3, drain=not apart)
    assert session.steps == 4 + 3 and block["drained"] == (0 if apart else 4)
    assert len(block["step_s"]) == 3 and min(block["step_s"]) > SLOW_S * 0.9
    # the worker's own window holds the timed steps (and not the drain before them), and little else
    assert sum(block["step_s"]) <= block["timed_s"] < sum(block["step_s"]) + 0.25 * SLOW_S


def test_a_block_without_a_drain_times_the_bank():
    """Why the runner skips the drain only for a side whose loaders it held while the other side ran."""
    session = BankingSession(depth=4)
    session.idle()
    block = run_block(session, CPU, steps=3)
    assert session.steps == 3 and block["drained"] == 0 and max(block["step_s"]) < SLOW_S * 0.5


@pytest.mark.slow
@pytest.mark.parametrize("older", [False, True])  # varies fastest: each change of the switch starts a fork server
@pytest.mark.parametrize("hold", ["1", "0"])
def test_a_held_side_drains_before_its_first_block_only(monkeypatch, hold, older):
    """A held side's loaders were stopped while the other side ran: only its first block follows idle building
    (its warm-up's wait). A side that is not held drains before every block. A worker of an older code tree (no
    drain command in its ready line) drains the same steps through run commands."""
    from validators.ab_runner import HOLD_SWITCH, ABRunner
    monkeypatch.setenv(HOLD_SWITCH, hold)
    spec = WorkerRequest(target="tests.fixtures.faulty_target:target", size="tiny", mode="bench", warmup=0,
                         config={"behaviour": "banked"})
    with ABRunner(spec, spec, timeout_s=120) as runner:
        assert all("drain" in ready["commands"] for ready in runner.ready.values())
        if older:
            for ready in runner.ready.values():
                del ready["commands"]
        for side in ("a", "b", "b", "a", "a", "b"):
            runner.run(side, 2)
    assert runner.drained == ({"a": 3, "b": 3} if hold == "1" else {"a": 9, "b": 9})
    assert runner.banked == ({"a": 3, "b": 3} if older else {})


def test_a_profile_drains_the_bank_before_its_window():
    session = BankingSession(depth=6)
    profile = profile_session(session, CPU, warmup=1, steps=2)
    assert profile.unprofiled_step_s > SLOW_S * 0.9  # the profiled window saw no banked batch either


def test_the_trainer_banks_what_its_loader_builds_ahead():
    def banked(**knobs) -> int:
        return banked_steps(build(KNOB_SPACE.resolve(knobs), "tiny", {}, "cpu", 0))
    assert banked() == 0  # batches are built in the step
    assert banked(data_workers=2) == 8  # four a worker
    assert banked(data_workers=1, pin_memory=True, prefetch_to_device=True) == 4  # no side stream without CUDA
