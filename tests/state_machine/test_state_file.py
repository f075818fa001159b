"""The run's state: the candidate in flight as one sub-model, and state.json, the file reports read instead of the
checkpoint, with paths relative to the run directory; states and checkpoints written before both still read."""

from __future__ import annotations

import functools
import json
import shutil
from pathlib import Path

import pytest

from sg_opt.report import load_state, read_run
from state_machine import graph, nodes
from state_machine.context import ProposerPolicy, RunContext
from state_machine.state import (Baseline, Candidate, FinalMeasurement, InFlight, Incumbent, Limits, RunState,
                                 Verdict)
from state_machine.state_file import STATE_FILE, read_saved, read_state, write_state
from targets.registry import resolve_target
from tests.fixtures.old_run import OLD_RUN_ID



def cand(cid: int = 1, **kw) -> Candidate:
    return Candidate(id=cid, kind="knob", rationale="t", proposer="t", **kw)


def test_a_state_with_the_flat_fields_of_schema_1_loads_into_the_candidate_in_flight():
    verdict = Verdict(accepted=False, stage="validate", reason="broken")
    old = {"version": 1, "run_id": "r", "run_dir": "runs/r", "target": "t", "size": "tiny",
           "current": cand(3, patch={"a": 1}).model_dump(), "current_verdict": verdict.model_dump(),
           "current_digest": "d", "current_numerics_class": "reorder", "current_numerics_detail": None,
           "current_artifacts": {"numerics": "runs/r/candidates/003/numerics.json"}}
    state = RunState.model_validate(old)
    assert state.version == 2 and state.current == InFlight(
        candidate=cand(3, patch={"a": 1}), verdict=verdict, digest="d", numerics_class="reorder",
        artifacts={"numerics": "runs/r/candidates/003/numerics.json"})
    decided = RunState.model_validate({**old, "current": None, "current_verdict": None, "current_digest": None})
    assert decided.current is None  # what decide left behind is not a candidate in flight
    assert RunState(run_id="r", run_dir="d", target="t", size="tiny", current=cand(2)).current.candidate.id == 2


def test_decide_clears_the_candidate_in_flight_as_a_whole(state, ctx):
    found = InFlight(candidate=cand(1, patch={"data_workers": 2}), digest="d", numerics_class="exact",
                     numerics_detail="bitwise", artifacts={"ab": "ab.json"},
                     verdict=Verdict(accepted=False, stage="measure", reason="slower", ratio=1.1))
    after = state.model_copy(update=nodes.decide(state.model_copy(update={"current": found}), ctx))
    assert after.current is None and after.history[-1].digest == "d"
    proposed = after.model_copy(update=nodes.propose(after.model_copy(update={"queue": [cand(2)]}), ctx))
    assert proposed.current == InFlight(candidate=cand(2))  # nothing of #1 carried over


def test_state_json_keeps_paths_relative_and_reads_them_back_where_the_directory_is_now(tmp_path):
    run_dir = tmp_path / "runs" / "r1"
    (run_dir / "candidates" / "001").mkdir(parents=True)
    outside = tmp_path / "elsewhere" / "data.xc"
    state = RunState(
        run_id="r1", run_dir=str(run_dir), target="t", size="tiny",
        baseline=Baseline(numerics_file=str(run_dir / "baseline" / "numerics.json"), step_ms=1.0, noise_floor=0.01,
                          calibration_file=str(run_dir / "baseline" / "calibration.json")),
        incumbent=Incumbent(kernels={"k": str(run_dir / "candidates" / "001" / "kernels" / "k.py")}),
        current=InFlight(candidate=cand(2, kernels={"k": str(outside)}), artifacts={"ab": str(run_dir / "ab.json")},
                         verdict=Verdict(accepted=False, stage="measure", reason=f"details in {run_dir}/ab.json")),
        profiles=[str(run_dir / "profiles" / "00.json")], report_files=[str(run_dir / "report.md")],
        final=FinalMeasurement(verdict="faster", file=str(run_dir / "final_ab.json")))
    write_state(state, ["report"])
    text = (run_dir / STATE_FILE).read_text()
    assert str(run_dir) not in text and str(tmp_path / "runs") not in text
    saved = json.loads(text)
    assert saved["next"] == ["report"] and saved["state"]["run_dir"] == "."
    assert saved["state"]["baseline"]["numerics_file"] == "baseline/numerics.json"
    assert saved["state"]["current"]["candidate"]["kernels"] == {"k": str(outside)}  # not under it: kept absolute

    moved = tmp_path / "carried" / "r1"
    shutil.move(run_dir, moved)
    back = read_state(moved)
    assert back.run_dir == str(moved) and back.baseline.numerics_file == str(moved / "baseline" / "numerics.json")
    assert back.incumbent.kernels == {"k": str(moved / "candidates" / "001" / "kernels" / "k.py")}
    assert back.current.artifacts == {"ab": str(moved / "ab.json")} and back.final.file == str(moved / "final_ab.json")
    assert back.profiles == [str(moved / "profiles" / "00.json")] and back.report_files == [str(moved / "report.md")]
    assert back.current.candidate.kernels == {"k": str(outside)}
    assert back.current.verdict.reason == "details in ab.json"  # free text: relative, as in events.jsonl
    assert read_state(tmp_path) is None


def test_the_graph_writes_state_json_after_each_checkpoint(tmp_path, monkeypatch):
    """The graph with its worker-backed nodes replaced: killed in a node, state.json holds the last checkpoint's
    state and the node to run next; once the run has ended, the final state and no next node."""
    ctx = RunContext(target=resolve_target("haste-rec"), policy=ProposerPolicy())
    kill = {"armed": True}

    def baseline(state, _ctx):
        folder = Path(state.run_dir) / "baseline"
        return {"baseline": Baseline(numerics_file=str(folder / "numerics.json"), step_ms=10.0, noise_floor=0.02,
                                     calibration_file=str(folder / "calibration.json")),
                "incumbent": Incumbent(config=dict(state.baseline_config))}

    def validate(state, _ctx):
        if state.current.candidate.id == 2 and kill["armed"]:
            kill["armed"] = False
            raise KeyboardInterrupt  # as a kill: nothing after the last checkpoint is written
        return state.in_flight(verdict=None, numerics_detail="bitwise")

    def measure(state, _ctx):
        return state.in_flight(verdict=Verdict(accepted=False, stage="measure", reason="timed", ratio=1.0))

    def nothing(state, _ctx):
        return {}

    for name, fake in (("setup", nothing), ("baseline", baseline), ("diagnose", nothing), ("validate", validate),
                       ("measure", measure), ("report", nothing)):
        monkeypatch.setattr(nodes, name, functools.wraps(getattr(nodes, name))(functools.partial(fake)))
    start = RunState(run_id="k", run_dir=str(tmp_path), target="haste-rec", size="tiny",
                     limits=Limits(max_iters=3, max_minutes=10))
    with pytest.raises(KeyboardInterrupt):
        graph.run(ctx, start, tmp_path, "k")
    app = graph.compile_graph(ctx, tmp_path)
    checkpointed = graph.current_state(app, graph.thread("k"))
    assert read_saved(tmp_path).next == ["validate"]
    assert read_state(tmp_path) == checkpointed and checkpointed.current.candidate.id == 2
    final = graph.run(ctx, None, tmp_path, "k")
    assert read_saved(tmp_path).next == [] and read_state(tmp_path) == final and len(final.history) == 3
    assert json.loads((tmp_path / STATE_FILE).read_text())["state"]["baseline"]["numerics_file"] == \
        "baseline/numerics.json"


def test_a_run_directory_from_before_state_files_is_reported_from_its_checkpoint_once(old_run):
    assert not (old_run / STATE_FILE).exists()
    state = load_state(old_run)
    assert state.current.candidate.id == 3 and state.current.digest == "092239091ca0c0ae"
    assert state.current.numerics_class == "precision"  # held by a flat field of schema 1
    assert state.run_dir == str(old_run.resolve())
    assert state.baseline.numerics_file == str(old_run.resolve() / "baseline" / "numerics.json")
    assert read_saved(old_run).next is None  # converted without the graph: which node is next is not known here
    (old_run / STATE_FILE).write_text('{"version": 1, "state": {"run_id"')  # torn: converted again
    assert load_state(old_run) == state and read_state(old_run) == state
    (old_run / "checkpoints.sqlite").unlink()  # from now on the run reads its state file
    assert load_state(old_run) == state
    summary, _ = read_run(old_run)
    assert summary.evaluated == 2 and summary.baseline_step_ms > 0


def test_resuming_a_checkpoint_from_before_the_candidate_in_flight_keeps_what_its_flat_fields_held(old_run):
    ctx = RunContext(target=resolve_target("haste-rec"))
    assert graph.upgrade(ctx, old_run, OLD_RUN_ID)
    assert not graph.upgrade(ctx, old_run, OLD_RUN_ID)  # upgraded once
    assert graph.relocate(ctx, old_run, OLD_RUN_ID)
    app = graph.compile_graph(ctx, old_run)
    assert app.get_state(graph.thread(OLD_RUN_ID)).next == ("validate",)  # the node to run next is the same
    resumed = graph.current_state(app, graph.thread(OLD_RUN_ID))
    assert resumed.current.numerics_class == "precision" and resumed.current.digest == "092239091ca0c0ae"
    assert resumed.baseline.numerics_file == str(old_run / "baseline" / "numerics.json")
    assert read_state(old_run) == resumed
