"""The run's pool of timing workers started ahead is closed when the run ends, however it ends."""

from __future__ import annotations

import io

import pytest
from rich.console import Console

from sg_opt import optimize
from sg_opt.run_store import RunRequest
from state_machine.context import RunContext
from state_machine.time_budget import Paused
from validators.started_ahead import WorkerPool


class CountingPool(WorkerPool):
    def __init__(self):
        super().__init__()
        self.closed = 0

    def close(self) -> None:
        self.closed += 1
        super().close()


@pytest.mark.parametrize("ends", ["finished", "paused"])
def test_the_run_closes_its_pool_when_it_finishes_or_stops(monkeypatch, tmp_path, ends):
    ctx = RunContext(target=None, pool=CountingPool())

    def run(ctx, state, run_dir, run_id, on_update=None):
        assert ctx.pool.closed == 0  # open while the graph runs
        if ends == "paused":
            raise Paused("measure", "no time left", str(run_dir))
        return state

    monkeypatch.setattr(optimize.graph, "run", run)
    monkeypatch.setattr(optimize, "build_summary", lambda state: None)
    request = RunRequest(run_id="r", target="t", size="tiny")
    console = Console(file=io.StringIO())
    if ends == "paused":
        with pytest.raises(Paused):
            optimize._drive(ctx, None, request, tmp_path, console, quiet=True)
    else:
        optimize._drive(ctx, None, request, tmp_path, console, quiet=True)
    assert ctx.pool.closed == 1
