"""The run's graph and its checkpoints: what a resumed run finds."""

from __future__ import annotations

import shutil

from state_machine import graph
from state_machine.state import Baseline


def test_a_run_moved_to_another_folder_resumes_with_its_files_there(state, ctx, tmp_path):
    """On 2026-12-01 a run carried to another folder stopped at resume: its checkpoint named the baseline's numerics
    file under the old folder. Relocated, every path under the old folder names the new one and the next node
    is the same."""
    old = tmp_path / "runs" / "r1"
    old.mkdir(parents=True)
    start = state.model_copy(update={
        "run_dir": str(old), "baseline": Baseline(numerics_file=str(old / "baseline" / "numerics.json"), step_ms=1.0,
                                                  noise_floor=0.01, calibration_file=str(old / "baseline" / "c.json")),
        "baseline_config": {"note": f"{old}x is not under it"}})
    app = graph.compile_graph(ctx, old)
    for node in ("setup", "baseline"):  # checkpoints as a run writes them: each after a node, the node its parent's task
        app.update_state(graph.thread("r1"), start, as_node=node)
    assert app.get_state(graph.thread("r1")).next == ("diagnose",)
    del app
    new = tmp_path / "carried" / "r1"
    shutil.move(old, new)

    assert graph.relocate(ctx, new, "r1")
    app = graph.compile_graph(ctx, new)
    moved = graph.current_state(app, graph.thread("r1"))
    assert moved.run_dir == str(new) and moved.baseline.numerics_file == str(new / "baseline" / "numerics.json")
    assert moved.baseline.calibration_file == str(new / "baseline" / "c.json")
    assert moved.baseline_config == {"note": f"{old}x is not under it"}
    assert app.get_state(graph.thread("r1")).next == ("diagnose",)
    assert not graph.relocate(ctx, new, "r1")  # where it is now: nothing to do
