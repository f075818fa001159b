"""The run reports and `sg-opt report`, on run directories of one real short agent run.

``agent_run`` is a real `sg-opt optimize` of the agent test target (one real win, one candidate
that segfaults), made once per session. ``rich_run`` is a copy of it given what a CPU offline run
never has: LLM calls in its ledger (written by the real ledger) and a fine profile section (a real
`sg-opt profile --fine` of haste-rec tiny on a CPU, test_report_fine.json), so the roofline and
spend parts are exercised on real records too.
"""

from __future__ import annotations

import json
import re
from html import escape
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from profilers.records import ProfileResult
from sg_opt.cli import app
from sg_opt import plots
from sg_opt.report import report_markdown, result_line
from sg_opt.report_html import render_html
from sg_opt.summary import SUMMARY_SCHEMA_VERSION, Summary
from sg_opt.summary_build import phase_breakdowns

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"

FINE = Path(__file__).with_name("test_report_fine.json")
WALL = re.compile(r"Wall time [0-9.]+ min[^\n<]*")  # the minutes and their split, to the end of the line
REPORT_FILES = ("report.md", "report.html", "summary.json", "best_config.toml")


def invoke(*args: str):
    return CliRunner().invoke(app, list(args))


def summary_of(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def test_a_run_writes_every_report_with_intervals_numerics_and_phases(agent_run):
    for name in (*REPORT_FILES, "ledger.jsonl"):
        assert (agent_run / name).is_file(), name
    s = summary_of(agent_run)
    assert s["version"] == SUMMARY_SCHEMA_VERSION == 2
    (win, crash) = s["candidates"]
    assert win["accepted"] and win["speedup"] > 1 and win["decided_at_s"] > 0
    assert 0 < win["step_ms"] < s["baseline_step_ms"] and crash["step_ms"] is None  # measured in its acceptance run
    assert not crash["accepted"] and "SIGSEGV" in crash["reason"]
    for side in ("baseline_step", "best_step"):
        t = s[side]
        assert t["ci_low_ms"] <= t["ms"] <= t["ci_high_ms"] and t["source"] == "final_ab.json"
    assert s["numerics"]["numerics_class"] == "exact" and s["numerics"]["candidate"] == win["id"]
    assert [p["label"] for p in s["phases"]] == ["baseline", f"after #{win['id']}"]
    assert set(s["phases"][0]["phases_ms"]) == {"data", "forward", "backward", "optimizer"}
    assert s["roofline"] is None and s["llm_calls"] == [] and s["environment"]["torch"]
    for profile in s["phases"]:  # the target's work model at this CPU's measured ceilings
        assert set(profile["floor_ms"]) == {"data", "forward", "backward", "optimizer"}
        assert 0 < profile["floor_step_ms"] < profile["unprofiled_step_ms"] and "the floor" in profile["floor_note"]
    assert s["phases"][0]["floor_bound"]["backward"] in ("compute", "memory")
    last = s["phases"][-1]  # the host side per phase (a CPU run: no kernel launches)
    assert set(last["host_ops"]) == set(last["host_work_ms"]) and last["host_ops"]["backward"] >= 1
    assert last["launches"] == {} and all(ms > 0 for ms in last["host_work_ms"].values())
    # where the run's minutes went, node by node (the report node's own time comes after its report)
    assert {"baseline", "diagnose", "validate", "measure", "decide"} <= set(s["node_s"])
    assert sum(s["node_s"].values()) == pytest.approx(s["wall_s"])
    # the win made the step over 4x faster, so its noise floor was calibrated again, on the new incumbent
    (again,) = s["recalibrations"]
    assert again["after_candidate"] == win["id"] and again["calibration_file"] == "candidates/001/calibration.json"
    assert again["step_ms"] < s["baseline_step_ms"] / 2

    md = (agent_run / "report.md").read_text()
    assert len(md) < 65_536  # a GitHub pull-request comment
    assert "95% CI" in md and "numerics | exact" in md and "SIGSEGV" in md and "No kernel-slot roofline" in md
    assert re.search(r"Wall time [0-9.]+ min: baseline [0-9.]+(, [a-z ]+ [0-9.]+)*\.", md)
    timing_shown = re.search(r"Wall time [0-9.]+ min: [^\n]*?(: |, )timing [0-9.]+", md) is not None
    assert timing_shown == (s["node_s"]["measure"] >= 3.0)
    # every timing worker of the run split its start-up: two in each of the A/A runs, the win's and the final A/B
    w = s["worker_startup"]
    assert w["workers"] >= 2 * 4 and w["start_s"] > 0 and w["build_s"] > 0 and w["warmup_s"] >= 0
    assert w["build_parts"] == {}  # the agent test target does not split its build (haste_rec's: test_ab_workers)
    assert re.search(rf"A timing worker got ready in [0-9.]+ s \(medians of {w['workers']}\): start and imports "
                     r"[0-9.]+, build [0-9.]+, warm-up [0-9.]+\.", md)
    assert "## Against the hardware floor" in md and "| backward |" in md and "reorder bands |" in md
    best_ms, floor_ms = s["best_step"]["ms"], s["phases"][-1]["floor_step_ms"]
    assert (f"the best configuration's step in the final side-by-side measurement, {best_ms:.2f} ms, is "
            f"x{best_ms / floor_ms:.1f} the floor ({floor_ms:.3f} ms)") in md
    assert re.search(r"Host side \(after #\d+, per step: ms of host work not waiting on the device / host operator "
                     r"calls\): data \d+\.\d\d / \d+,", md)
    page = (agent_run / "report.html").read_text()
    assert "No kernel-slot roofline" in page and "No LLM calls" in page and "Against the hardware floor" in page
    assert "Host side (after #" in page and "The best configuration&#x27;s step in the final side-by-side" in page
    assert f"calibrated again on faster incumbents: {100 * again['noise_floor']:.1f}% at" in md
    assert "calibrated again on faster incumbents" in page
    assert not re.search(r'<script|<link|@import|(src|href)="(https?:)?//|url\((https?:)?//', page)
    assert 'slow_loader = false' in (agent_run / "best_config.toml").read_text()
    # measured figures only: the final measurement is the headline, the plot draws measured step times
    assert f"**x{s['final']['speedup']:.2f} faster than the baseline, measured side by side" in md
    assert "estimate" not in md.lower() and "estimate" not in page.replace("the proposer&#x27;s estimate", "").lower()
    assert f"| {win['step_ms']:.2f} |" in md and "measured in its acceptance run" in page


def test_progress_is_drawn_from_measured_step_times_and_an_estimate_is_never_a_headline():
    """The `xl` run on an H200 whose accepted ratios multiply to x17.77 against its final measurement's x17.40: the
    best-so-far plot draws each incumbent's step as measured in its acceptance run, with the final measurement as
    its headline; without a final measurement the estimate is a labelled table row, not the result."""
    s = Summary.model_validate_json((FIXTURES / "h200_xl_s23_summary.json").read_text())
    accepted = [c.id for c in s.candidates if c.accepted]
    steps = {cid: ms for cid, ms in zip(accepted, (290.0, 76.9, 27.8, 27.2, 28.4))}
    s = s.model_copy(update={"candidates": [c.model_copy(update={"step_ms": steps.get(c.id)}) for c in s.candidates]})
    curve = s.measured_curve()
    assert curve[0] == s.baseline_step_ms and curve[-1] == 28.4
    assert [curve[n] for n, c in enumerate(s.candidates, start=1) if c.accepted] == [290.0, 76.9, 27.8, 27.2, 28.4]
    svg = plots.best_so_far([(s.run_id, s)])
    assert "final side by side against the baseline: x17.40" in _svg_text(svg)
    unfinished = s.model_copy(update={"final": None})
    for text in (report_markdown(unfinished), render_html(unfinished)):
        assert "no measured speedup" in text and "x17.77" in text
        assert "estimate (product of accepted ratios, not a measurement)" in text
    assert "x17.77" not in report_markdown(s) and "estimate" not in result_line(unfinished)


def _svg_text(svg: str) -> str:
    """The titles of a plot: matplotlib writes text as paths, and each text's words into a comment beside it."""
    return " ".join(re.findall(r"<!-- (.*?) -->", svg))


def test_report_rebuilds_the_same_files_from_a_moved_run_directory(agent_run, tmp_path):
    moved = tmp_path / "elsewhere" / agent_run.name
    shutil.copytree(agent_run, moved)
    for name in REPORT_FILES:
        (moved / name).unlink()
    done = invoke("report", str(moved), "--json")
    assert done.exit_code == 0, done.output
    rebuilt, written, original = json.loads(done.stdout), summary_of(moved), summary_of(agent_run)
    assert rebuilt["final"].pop("file") == written["final"].pop("file") == "final_ab.json"  # relative to the run
    original["final"].pop("file")
    # the run's own report was written inside its report node, with the time that node had spent so far (the
    # final A/B); the checkpoint read back afterwards has the whole node's
    assert rebuilt.pop("wall_s") == written.pop("wall_s") >= original.pop("wall_s")
    nodes = [d.pop("node_s") for d in (rebuilt, written, original)]  # likewise the report node's own entry
    assert nodes[0] == nodes[1] and 0 < nodes[2].pop("report") <= nodes[0].pop("report") and nodes[0] == nodes[2]
    assert rebuilt == written == original
    for name in ("report.md", "report.html", "best_config.toml"):
        rewritten, first = ((d / name).read_text() for d in (moved, agent_run))
        assert WALL.sub("", rewritten) == WALL.sub("", first), name


def test_the_runs_state_file_is_its_last_checkpoint_with_no_absolute_path(agent_run):
    from state_machine import graph
    from state_machine.context import RunContext
    from state_machine.state_file import read_saved, read_state, rooted

    text = (agent_run / "state.json").read_text()
    assert str(agent_run.resolve()) not in text and str(agent_run) not in text
    assert read_saved(agent_run).next == []  # the run ended
    app = graph.compile_graph(RunContext(target=None), agent_run)
    checkpointed = graph.current_state(app, graph.thread(summary_of(agent_run)["run_id"]))
    assert read_state(agent_run) == rooted(checkpointed, agent_run)
    assert read_state(agent_run).final.file == str(agent_run / "final_ab.json")


def test_report_of_a_directory_without_state_reads_summary_json(agent_run, tmp_path):
    copy = tmp_path / agent_run.name
    shutil.copytree(agent_run, copy, ignore=shutil.ignore_patterns("checkpoints.sqlite*", "state.json"))
    (copy / "report.md").unlink()
    done = invoke("report", str(copy))
    assert done.exit_code == 0, done.output
    assert (copy / "report.md").read_text() == (agent_run / "report.md").read_text()
    assert "x" in done.stdout and "written:" in done.stdout


def test_roofline_spend_and_cost_per_win_from_real_records(rich_run):
    s = summary_of(rich_run)
    fine = json.loads(FINE.read_text())
    assert [p["slot"] for p in s["roofline"]["points"]] == [slot["slot"] for slot in fine["slots"]]
    assert s["roofline"]["points"][0]["label"] == s["phases"][-1]["label"]
    assert set(s["spend_by_tier"]) == {"normal", "ultra"} and s["spend"]["calls"] == 4
    assert s["spend"]["failed_calls"] == 1 and len(s["llm_calls"]) == 4
    assert s["cost_per_win_usd"] == pytest.approx(s["spend"]["cost_usd"])
    page = (rich_run / "report.html").read_text()
    plots = re.findall(r'data-plot="([a-z-]+)"', page)
    assert plots == ["step-times", "best-so-far", "phases", "roofline", "spend"]
    ids = re.findall(r'\bid="([^"]+)"', page)
    assert len(ids) == len(set(ids)), "inline SVGs must not share element ids"
    assert "per accepted win" in (rich_run / "report.md").read_text()


def test_two_runs_side_by_side(agent_run, rich_run, tmp_path):
    out = tmp_path / "cmp"
    done = invoke("report", str(agent_run), str(rich_run), "--out", str(out), "--json")
    assert done.exit_code == 0, done.output
    comparison = json.loads(done.stdout)
    assert comparison["version"] == 1 and comparison["a"]["run_id"] == comparison["b"]["run_id"]
    metrics = {row["metric"]: (row["a"], row["b"]) for row in comparison["rows"]}
    assert metrics["LLM spend"][0].startswith("$0.0000") and "4 calls" in metrics["LLM spend"][1]
    assert comparison["notes"] == []  # same target, size and device
    assert sorted(p.name for p in out.iterdir()) == ["comparison.json", "report.html", "report.md"]
    assert re.findall(r'data-plot="([a-z-]+)"', (out / "report.html").read_text()) == [
        "step-times", "best-so-far", "spend"]

    table = invoke("report", str(agent_run), str(rich_run), "--out", str(out))
    assert table.exit_code == 0 and "speedup over its baseline" in table.stdout


def test_default_comparison_folder_is_named_after_both_runs(agent_run, rich_run, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert invoke("report", str(agent_run), str(rich_run)).exit_code == 0
    assert (tmp_path / f"report-{agent_run.name}-vs-{rich_run.name}" / "report.html").is_file()


@pytest.mark.parametrize("case", ["missing", "empty", "garbage", "newer", "three", "out-with-one"])
def test_bad_run_directories_are_one_sentence_and_exit_2(case, tmp_path):
    run_dir = tmp_path / "run"
    if case != "missing":
        run_dir.mkdir()
    if case == "garbage":
        (run_dir / "summary.json").write_text("{not json")
    if case == "newer":
        (run_dir / "summary.json").write_text(json.dumps({"version": 99}))
    args = {"three": [str(run_dir)] * 3, "out-with-one": [str(run_dir), "--out", "x"]}.get(case, [str(run_dir)])
    done = invoke("report", *args)
    assert done.exit_code == 2
    assert "Traceback" not in done.output and done.stderr.startswith("error:")
    assert len(done.stderr.strip().replace("\n", " ").split(". ")) <= 2


def test_help_shows_an_example():
    done = invoke("report", "--help")
    assert done.exit_code == 0 and "Example: sg-opt report runs/" in done.stdout


def test_a_ranked_profile_says_whose_phases_these_are_and_each_ranks_collective_share():
    from profilers.records import ProfileResult, RankProfile
    from sg_opt.summary_build import ranks_sentence

    ranks = [RankProfile(rank=r, step_s=0.04, unprofiled_step_s=0.03, phase_s={}, comm_s=c, comm_share=c / 0.04)
             for r, c in ((0, 0.002), (1, 0.006))]
    result = ProfileResult(ok=True, target="haste-rec", size="tiny", ranks=ranks, main_rank=0)
    assert ranks_sentence(result) == ("2 ranks; the phases are rank 0's (the most step time outside collectives); "
                                      "collectives in flight, waits included, per rank: 5.0% / 15.0% of the step")
    assert ranks_sentence(ProfileResult(ok=True, target="haste-rec", size="tiny")) is None


def test_the_host_lines_name_the_ops_the_host_worked_in():
    """A host-bound cached step (large-cached after #7, H200, 2026-12-02: 12.80 ms of host work in embed): the host
    line lists its largest host work by phase and op, and the host-bound note names the bound phase's."""
    from profilers.records import HostWork
    from sg_opt.report import host_line
    s = Summary.model_validate_json((FIXTURES / "h200_large_s13_summary.json").read_text())
    last = s.phases[-1]
    work = [HostWork(phase="backward", op="aten::index_copy_", self_s=1.2e-3, calls=2),
            HostWork(phase="optimizer", op="cudaLaunchKernel", self_s=0.4e-3, calls=19),
            HostWork(phase="backward", op="aten::nonzero", self_s=0.3e-3, calls=7)]
    s = s.model_copy(update={"phases": [*s.phases[:-1], last.model_copy(update={"host_work": work})]})
    assert ("Its largest host work: backward aten::index_copy_ 1.20 ms (2 calls), optimizer cudaLaunchKernel 0.40 ms "
            "(19 calls), backward aten::nonzero 0.30 ms (7 calls).") in host_line(s)
    assert "(most in backward: 2.59 ms; its largest: aten::index_copy_ 1.20 ms, aten::nonzero 0.30 ms)" in \
        report_markdown(s)


def test_the_host_line_names_the_ops_the_host_waited_on():
    """At `large` the backward phase waited 1.5 ms a step on the device (H200, 2026-11-30); the report says who made it."""
    from types import SimpleNamespace

    from profilers.records import HostWait
    from sg_opt.report import host_line
    from sg_opt.summary import PhaseBreakdown
    wait = HostWait(phase="backward", op="aten::_unique2", call="cudaStreamSynchronize", wait_s=1.5e-3, calls=1)
    last = PhaseBreakdown(label="after #8", profile="profiles/05.json", step_ms=10.39, unprofiled_step_ms=9.41,
                          phases_ms={"backward": 2.77}, other_ms=0.0, host_work_ms={"backward": 2.77},
                          host_ops={"backward": 28}, launches={"backward": 72}, host_waits=[wait])
    line = host_line(SimpleNamespace(phases=[last]))
    assert line.endswith("The host waited on the device in backward 1.50 ms (aten::_unique2, cudaStreamSynchronize).")
    assert host_line(SimpleNamespace(phases=[last.model_copy(update={"host_waits": []})])).endswith("ms step.")


def test_worker_startup_counts_each_worker_once(tmp_path):
    """The quoted final A/B is a copy of one of the two kept beside it: its workers are not counted twice."""
    from sg_opt.summary_build import read_worker_startup

    def result(*sides):
        return dict(zip("ab", sides))
    one = {"startup": {"start": 1.0, "build": 2.0, "warmup": 0.5}, "build_parts": {"tables": 1.5, "loader": 0.5}}
    two = {"startup": {"start": 1.2, "build": 2.4, "warmup": 0.4}, "build_parts": {"tables": 1.9, "loader": 0.5}}
    three = {"startup": {"start": 1.1, "build": 8.0, "warmup": 0.5}}
    four = {"startup": {"start": 1.3, "build": 2.2, "warmup": 0.6}}
    (tmp_path / "baseline").mkdir()
    (tmp_path / "baseline" / "calibration.json").write_text(json.dumps({"runs": [result(one, two)]}))
    (tmp_path / "final_ab_disturbed.json").write_text(json.dumps(result(three, four)))
    (tmp_path / "final_ab.json").write_text(json.dumps(result(three, four)))  # the quoted copy
    (tmp_path / "profile.json").write_text(json.dumps({"startup": {"start": 99.0, "build": 0.0, "warmup": 0.0}}))
    w = read_worker_startup(tmp_path)
    assert w.workers == 4 and w.start_s == pytest.approx(1.15) and w.build_s == pytest.approx(2.3)
    assert w.ready_s == pytest.approx((4.0 + 4.1) / 2)  # the median of the totals 3.5, 4.0, 9.6, 4.1
    assert w.close_s is None  # measurements made before it was recorded
    assert w.build_parts == {"tables": pytest.approx(1.7), "loader": 0.5}  # from the two workers that split it
    from types import SimpleNamespace

    from sg_opt.report import time_line
    tiny = w.model_copy(update={"build_parts": {**w.build_parts, "data": 0.01}})  # under 0.05 s: left out
    assert "build 2.3 (tables 1.7, loader 0.5), warm-up" in time_line(SimpleNamespace(wall_s=60.0, node_s={},
                                                                                         worker_startup=tiny))


def test_the_report_says_how_long_closing_a_measurements_workers_took(tmp_path):
    """An A/A run of `large-cached`'s incumbent after #6 on an H200 (2026-12-03) took 56 s, 14.6 s of it until its
    workers were ready and about 25 s in its timed blocks: its blocks and its close are now recorded apart. The
    quoted final A/B is a copy: counted once."""
    from types import SimpleNamespace

    from sg_opt.report import time_line
    from sg_opt.summary_build import read_worker_startup
    split = {"start": 0.3, "build": 12.0, "warmup": 1.5}
    sides = {"a": {"startup": split}, "b": {"startup": split}}
    (tmp_path / "baseline").mkdir()
    (tmp_path / "baseline" / "calibration.json").write_text(json.dumps({"runs": [
        {**sides, "wall_s": 56.2, "blocks_s": 30.1, "close_s": 9.0},
        {**sides, "wall_s": 55.2, "blocks_s": 30.0, "close_s": 8.0}]}))
    final = {**sides, "wall_s": 40.1, "blocks_s": 20.0, "close_s": 2.0}
    (tmp_path / "final_ab_repeat.json").write_text(json.dumps(final))
    (tmp_path / "final_ab.json").write_text(json.dumps(final))
    w = read_worker_startup(tmp_path)
    assert w.close_s == 8.0  # the median of 9, 8 and 2, the copy left out
    line = time_line(SimpleNamespace(wall_s=60.0, node_s={}, worker_startup=w))
    assert line.endswith("Closing a measurement's workers took 8.0 s.")


def test_a_host_bound_gpu_step_is_said_to_be_held_back_by_its_host_work():
    """The 2026-11-30 x13.88 `large` run on an H200: after #10 the host worked 10.05 ms of a 10.83 ms profiled step,
    so the tail's distance from its floor is not what holds the step back. The final side-by-side step is set
    against the same floor."""
    s = Summary.model_validate_json((FIXTURES / "h200_large_s13_summary.json").read_text())
    md = report_markdown(s)
    assert ("- after #10: the step is host-bound, 10.05 ms of host work not waiting on the device in a 10.83 ms "
            "profiled step, so it is the host work that holds it back, not a device phase (most in backward: "
            "2.59 ms).") in md
    assert "- the best configuration's step in the final side-by-side measurement, 7.86 ms, is x3.6 the floor" in md
    assert "After #10: the step is host-bound, 10.05 ms" in render_html(s)
    on_cpu = s.model_copy(update={"device": "cpu"})  # there the host is the device
    assert "host-bound" not in report_markdown(on_cpu)
    last = s.phases[-1]
    lighter = last.model_copy(update={"host_work_ms": {k: v / 2 for k, v in last.host_work_ms.items()}})
    assert "host-bound" not in report_markdown(s.model_copy(update={"phases": [*s.phases[:-1], lighter]}))


def test_the_report_counts_the_measurements_whose_workers_started_during_validation(tmp_path):
    from types import SimpleNamespace

    from sg_opt.report import time_line
    from sg_opt.summary_build import read_worker_startup
    split = {"start": 1.0, "build": 2.0, "warmup": 0.5}
    measured = {"a": {"startup": split}, "b": {"startup": split}}
    for cid, ahead in (("001", True), ("002", False), ("003", True)):
        (tmp_path / "candidates" / cid).mkdir(parents=True)
        (tmp_path / "candidates" / cid / "ab.json").write_text(json.dumps(
            {"runs": [{**measured, "started_ahead": ahead}, {**measured, "started_ahead": False}]}))
    w = read_worker_startup(tmp_path)
    assert w.started_ahead == 2
    line = time_line(SimpleNamespace(wall_s=60.0, node_s={}, worker_startup=w))
    assert line.endswith("2 measurement(s) found their workers started during the candidate's validation.")


def test_a_distorted_profile_is_named_and_not_read_as_host_work():
    """The 2026-12-03 x7.29 `large-cached` run on an H200: its profile after #12 ran its steps at 65.67 ms under the
    profiler against 24.66 ms without it, and its data phase's CPU ops 10-40x slower than the profile before.
    The report says so under the floor table, and does not call the step host-bound on that profile's word."""
    s = Summary.model_validate_json((FIXTURES / "h200_large_cached_s22_summary.json").read_text())
    assert [p.distortion_note is not None for p in s.phases] == [False] * (len(s.phases) - 1) + [True]
    sentence = ("after #12: the profiler made its steps x2.66 slower (65.67 against 24.66 ms without it), so its "
                "phase times overstate the step's")
    md, html = report_markdown(s), render_html(s)
    assert f"- {sentence}." in md and escape(sentence[0].upper() + sentence[1:]) in html
    assert "host-bound" not in md
    undistorted = s.phases[-1].model_copy(update={"distortion_note": None})
    assert "host-bound" in report_markdown(s.model_copy(update={"phases": [*s.phases[:-1], undistorted]}))


def test_a_disturbed_profile_is_named_and_not_read_as_host_work(tmp_path):
    """The 2026-12-03 `xl` run on an H200: its profile after #14 stepped at 31.54 ms even without the profiler where
    the run's measurements put the configuration at 17.62 ms (the final measurement: 17.99 ms), and the report
    called the step host-bound on its word. With that expectation recorded (as diagnose now records it), the
    report names the disturbance under the floor table and draws no host-bound verdict from it."""
    s = Summary.model_validate_json((FIXTURES / "h200_xl_s23_summary.json").read_text())
    assert "after #14: the step is host-bound" in report_markdown(s)  # as the run wrote it
    profile = ProfileResult.model_validate_json((FIXTURES / "h200_xl_s23_after_14.json").read_text())
    path = tmp_path / "05.json"
    path.write_text(profile.model_copy(update={"coarse": profile.coarse.model_copy(
        update={"expected_step_s": 0.01762, "slowdowns_tried": [1.79, 1.80]})}).model_dump_json())
    (last,) = phase_breakdowns([("after #14", path, ProfileResult.model_validate_json(path.read_text()))], tmp_path)
    md = report_markdown(s.model_copy(update={"phases": [*s.phases[:-1], last]}))
    assert ("- after #14: its steps took 31.54 ms even without the profiler, x1.79 the 17.62 ms the side-by-side "
            "measurements put this configuration at; the steadier of 2 profiles: other work slowed the machine "
            "while it ran, so its phase times overstate the step's.") in md
    assert "host-bound" not in md
