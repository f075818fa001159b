"""A baseline killed half-way through its A/A calibration keeps the runs it finished: the resumed calibration runs
only the rest (``state_machine.lanes.noise_floor`` with ``state_machine.parts``)."""

from __future__ import annotations

from state_machine import lanes
from state_machine.state import RunState
from targets.worker_protocol import WorkerRequest
from validators.ab_result import ABResult, SideSummary, spec_digest


def _run(spec: WorkerRequest, ratio: float) -> ABResult:
    side = SideSummary(label="A1", digest=spec_digest(spec), spec=spec, block_medians=[0.01, 0.01])
    return ABResult(a=side, b=side.model_copy(update={"label": "A2"}), ratio_definition="A2/A1", ratio=ratio,
                    speedup=1 / ratio, ci_low=ratio - 0.01, ci_high=ratio + 0.01, floor=0.01, verdict="no-difference",
                    order=["a", "b", "b", "a"], blocks=2, steps_per_block=3)


def test_a_killed_calibration_resumes_with_the_runs_it_finished(tmp_path, monkeypatch):
    state = RunState(run_id="t", run_dir=str(tmp_path), target="haste-rec", size="tiny")
    spec = WorkerRequest(target="haste-rec", size="tiny", mode="bench")
    made = []

    def calibrate(spec, blocks, block_steps, timeout_s, repeats, *, on_run, done, **_):
        runs = list(done)
        for r in range(len(runs), repeats):
            if len(made) == 1 and not done:
                raise KeyboardInterrupt  # killed after its first run
            made.append(r)
            runs.append(_run(spec, 1.0 + r / 100))
            on_run(runs[-1])
        return runs

    monkeypatch.setattr(lanes, "calibrate_noise_floor", calibrate)
    try:
        lanes.noise_floor(state, spec, 4, 3, 60.0)
    except KeyboardInterrupt:
        pass
    assert made == [0]
    runs, _ = lanes.noise_floor(state, spec, 4, 3, 60.0)
    assert made == [0, 1] and [r.ratio for r in runs] == [1.0, 1.01]  # the first kept, only the second run again
    other, _ = lanes.noise_floor(state, spec.model_copy(update={"size": "small"}), 4, 3, 60.0)
    assert made == [0, 1, 0, 1]  # another spec keeps nothing of these
