"""The files every run leaves behind: summary.json, report.md, report.html, best_config.toml, best_kernels/.

``write_report(state, target)`` is what the agent's report node calls (through the context), and
what ``sg-opt report RUN_DIR`` calls again through ``regenerate``. report.md is short enough for a
pull-request comment: the result with its interval, then every candidate with its verdict.

How ``regenerate`` reads a run: its RunState from the run's own state file, ``state.json``
(``state_machine.state_file``: paths relative to the run directory, read back under wherever it now lives; no
target is built, so a run whose target module is gone still reports). A run directory written before state files
existed has its last checkpoint read once and converted into one. From that state everything is rebuilt exactly as
at the end of the run, nothing is re-measured. A directory with neither (copied without them) is reported from its
summary.json alone; then best_kernels/ is kept as it is.

The wording report.md shares with report.html and the comparison is ``report_text``'s.
"""

from __future__ import annotations

import difflib
import inspect
import json
import shutil
import sqlite3
from pathlib import Path

from sg_opt.report_text import (NO_ROOFLINE, best_config_toml, estimate_rows, floor_columns, floor_notes, floor_text,
                                host_line, machine_rows, numerics_line, over_floor_text, ratio_text, result_line,
                                spend_line, status_line, step_ms_text, step_text, time_line, verdict_text)
from sg_opt.run_store import CHECKPOINT_FILE, REQUEST_FILE
from sg_opt.summary import SUMMARY_FILE, SUMMARY_SCHEMA_VERSION, Summary
from sg_opt.summary_build import build_summary
from state_machine.portable import portable
from state_machine.state import FLAT_IN_FLIGHT, RunState
from state_machine.state_file import StateFileError, read_state, rooted, write_state
from targets.protocol import ConfigError, Target

REPORT_MD = "report.md"
REPORT_HTML = "report.html"
BEST_CONFIG = "best_config.toml"
BEST_KERNELS = "best_kernels"


# ----------------------------------------------------------------------------- the files

def _write_kernels(state: RunState, target: Target, folder: Path) -> None:
    """Each accepted kernel source, and a unified diff against the slot's torch reference."""
    shutil.rmtree(folder, ignore_errors=True)
    if not state.incumbent.kernels:
        return
    folder.mkdir(parents=True)
    for slot_name, path in sorted(state.incumbent.kernels.items()):
        source = Path(path).read_text(encoding="utf-8")
        (folder / f"{slot_name}.py").write_text(source, encoding="utf-8")
        try:
            reference = inspect.getsource(target.slot(slot_name).reference)
        except (OSError, TypeError):
            reference = ""
        diff = difflib.unified_diff(reference.splitlines(keepends=True), source.splitlines(keepends=True),
                                    f"reference/{slot_name}.py", f"best/{slot_name}.py")
        (folder / f"{slot_name}.diff").write_text("".join(diff), encoding="utf-8")


def kernel_diffs(run_dir: Path) -> dict[str, str]:
    """slot -> unified diff of the best kernel against the baseline's, as written in best_kernels/."""
    folder = run_dir / BEST_KERNELS
    return {p.stem: p.read_text(encoding="utf-8") for p in sorted(folder.glob("*.diff"))} if folder.is_dir() else {}


def _phase_line(s: Summary) -> str | None:
    if not s.phases:
        return None
    first, last = s.phases[0], s.phases[-1]
    if first is last:
        return "Phases (ms per profiled step): " + ", ".join(f"{k} {v:.2f}" for k, v in first.phases_ms.items())
    names = dict.fromkeys([*first.phases_ms, *last.phases_ms])
    return (f"Phases (ms per profiled step, baseline -> {last.label}): "
            + ", ".join(f"{k} {first.phases_ms.get(k, 0):.2f} -> {last.phases_ms.get(k, 0):.2f}" for k in names))


def floor_lines(s: Summary) -> list[str]:
    """The phases of the first and last profile against their roofline floors (Markdown), or nothing."""
    cols = floor_columns(s)
    if not cols:
        return []
    last = cols[-1]
    lines = ["## Against the hardware floor", "",
             "Each phase's floor is its least work (FLOPs, device bytes, host<->device bytes) at the measured "
             "ceilings; the measured time is phase share x profiled step.", "",
             "| phase | bound | " + " | ".join(f"{p.label} ms (floor ms, over floor)" for p in cols) + " |",
             "|---|---|" + "---|" * len(cols)]
    for name in last.floor_ms:
        cells = [f"{p.phases_ms.get(name, 0.0):.2f} ({p.floor_ms.get(name, 0.0):.4f}, "
                 f"{over_floor_text(p.phases_ms.get(name), p.floor_ms.get(name))})" for p in cols]
        lines.append(f"| {name} | {last.floor_bound.get(name, '-')} | " + " | ".join(cells) + " |")
    lines += [""] + [f"- {note}." for note in floor_notes(s)]
    return lines


def quality_lines(s: Summary) -> list[str]:
    """The baseline's held-out quality and each model change's against it, band included (runs that allow model
    changes)."""
    if s.baseline_quality is None:
        return []
    metrics = ", ".join(f"{name} {value:.4f}" for name, value in sorted(s.baseline_quality.items()))
    lines = ["", "## Quality (model changes)", "", f"Baseline: {metrics}."]
    for c in s.candidates:
        if c.numerics_class == "model" and c.numerics_detail:
            lines.append(f"- #{c.id} {c.change} ({verdict_text(c.accepted, c.stage)}): {c.numerics_detail}")
    return lines


def report_markdown(s: Summary) -> str:
    f = s.final
    rows = [("baseline step time", step_text(s.baseline_step)), ("best step time", step_text(s.best_step)),
            ("ratio best/baseline (95% CI)", ratio_text(f.ratio, f.ci_low, f.ci_high) if f else "-"),
            *estimate_rows(s),
            ("numerics", numerics_line(s)),
            ("noise floor", floor_text(s)),
            ("reorder bands", s.reorder_calibration or "-")]
    lines = [f"# sg-opt run {s.run_id}", "", status_line(s), "", f"**{result_line(s)}**", "", "| | |", "|---|---|"]
    lines += [f"| {k} | {v.replace('|', '/')} |" for k, v in rows]
    lines += ["", f"Candidates evaluated: {s.evaluated}, accepted: {s.accepted}. {spend_line(s)}. "
                  f"{time_line(s)}", "", "## Best configuration", ""]
    lines += [f"- `{k} = {v!r}`" for k, v in sorted(s.best_config.items())] or ["- the baseline's"]
    lines += [f"- kernel `{k}` replaced (see best_kernels/)" for k in s.best_kernels]
    lines += ["", "## Candidates", "", "Ratio: candidate over the incumbent of the time, side by side; step ms: the "
              "candidate's step in that measurement.", "",
              "| # | kind | change | proposer | verdict | ratio (95% CI) | step ms | why |",
              "|---|---|---|---|---|---|---|---|"]
    for c in s.candidates:
        verdict = "**accepted**" if c.accepted else f"rejected ({c.stage})"
        lines.append(f"| {c.id} | {c.kind} | {c.change} | {c.proposer} | {verdict} | "
                     f"{ratio_text(c.ratio, c.ci_low, c.ci_high)} | {step_ms_text(c.step_ms)} | "
                     f"{c.reason.replace('|', '/')} |")
    lines += quality_lines(s)
    env = dict(machine_rows(s.environment))
    ranks = [f"Ranks ({p.label}): {p.ranks_note}." for p in s.phases if p.ranks_note][-1:]
    for paragraph in (_phase_line(s), host_line(s), *ranks, None if s.roofline else NO_ROOFLINE.split(". ")[0] + "."):
        lines += ["", paragraph] if paragraph else []
    if floor := floor_lines(s):
        lines += [""] + floor
    lines += ["", f"Machine: {env['device name']} ({env['device']}), driver {env['driver']}, torch {env['torch']}, "
              f"triton {env['triton']}. Plots: report.html."]
    if s.trust:
        lines += ["", "Trust: " + " ".join(s.trust)]
    for note in s.notes:
        lines += ["", f"> note: {note}"]
    return "\n".join(lines) + "\n"


def write_summary_files(summary: Summary, run_dir: Path) -> list[str]:
    """summary.json, best_config.toml, report.md and report.html from a summary (no state needed)."""
    from sg_opt.report_html import render_html  # matplotlib is imported only when a report is drawn

    (run_dir / SUMMARY_FILE).write_text(json.dumps(portable(summary.model_dump(mode="json"), run_dir), indent=1))
    (run_dir / BEST_CONFIG).write_text(best_config_toml(summary))
    (run_dir / REPORT_MD).write_text(report_markdown(summary))
    (run_dir / REPORT_HTML).write_text(render_html(summary, kernel_diffs(run_dir)), encoding="utf-8")
    return [str(run_dir / name) for name in (REPORT_MD, REPORT_HTML, SUMMARY_FILE, BEST_CONFIG)]


def write_report(state: RunState, target: Target | None, summary: Summary | None = None) -> list[str]:
    """Everything from the state; with no target (it cannot be imported) best_kernels/ stays as it is."""
    run_dir = Path(state.run_dir)
    if target is not None:
        _write_kernels(state, target, run_dir / BEST_KERNELS)
    return write_summary_files(summary or build_summary(state), run_dir)


# ----------------------------------------------------------------------------- reading a run directory back

def load_state(run_dir: Path) -> RunState | None:
    """The run's state from its state.json, every path under where the directory is now; from its last checkpoint
    where it has no readable state.json (written before state files, or killed before its first one), converted into
    one (``_from_checkpoint``); None when it holds neither."""
    try:
        state = read_state(run_dir.resolve())
    except StateFileError:
        state = None
    return state if state is not None else _from_checkpoint(run_dir)


def _from_checkpoint(run_dir: Path) -> RunState | None:
    """The last checkpoint's RunState under where the directory is now, also written to its state.json so that the
    checkpoint is read once; None when the directory has no readable checkpoint. The checkpoint's raw values are
    read, older states' fields included (``RunState`` maps them), through the graph's own checkpointer and
    serializer, without compiling the graph."""
    from state_machine.graph import open_checkpointer, thread  # langgraph only when it is needed

    if not (run_dir / CHECKPOINT_FILE).is_file():
        return None
    try:
        run_id = json.loads((run_dir / REQUEST_FILE).read_text())["run_id"]
    except (OSError, ValueError, KeyError, TypeError):
        run_id = run_dir.name
    try:
        saved = open_checkpointer(run_dir).get_tuple(thread(run_id))
    except sqlite3.Error:
        return None
    if saved is None:
        return None
    fields = RunState.model_fields.keys() | FLAT_IN_FLIGHT.keys()
    try:
        state = RunState.model_validate({k: v for k, v in saved.checkpoint["channel_values"].items() if k in fields})
    except ValueError:
        return None
    try:
        write_state(state, None, run_dir)  # which node runs next is the graph's to say: not known here
    except OSError:
        pass  # a directory it may not write into still reports
    return rooted(state, run_dir.resolve())


def load_summary(run_dir: Path) -> Summary:
    path = run_dir / SUMMARY_FILE
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        raise ConfigError(f"{run_dir} has neither a readable state (state.json, a checkpoint) nor a readable "
                          f"{SUMMARY_FILE}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path} is not a summary sg-opt can read")
    if not isinstance(data.get("version"), int) or data["version"] > SUMMARY_SCHEMA_VERSION:
        raise ConfigError(f"{path} was written by another sg-opt (summary schema {data.get('version')!r}, "
                          f"this one reads up to {SUMMARY_SCHEMA_VERSION})")
    try:  # an older schema lacks only fields that have defaults
        return Summary.model_validate({**data, "version": SUMMARY_SCHEMA_VERSION})
    except ValueError as exc:
        raise ConfigError(f"{path} is not a summary sg-opt can read ({_first_line(exc)})") from None


def _first_line(exc: Exception) -> str:
    return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__


def read_run(run_dir: str | Path) -> tuple[Summary, RunState | None]:
    """A run directory's summary, rebuilt from its state when it has one (``load_state``: the only file it may write
    is the state.json of a run directory written before state files)."""
    path = Path(run_dir)
    if not path.is_dir():
        raise ConfigError(f"{run_dir} is not a directory (a run directory holds {REQUEST_FILE} and {SUMMARY_FILE})")
    state = load_state(path)
    if state is None:
        return load_summary(path), None
    try:
        return build_summary(state), state
    except (OSError, ValueError) as exc:  # a file the state names is gone or torn
        raise ConfigError(f"{run_dir} holds a run whose files cannot be read ({_first_line(exc)})") from None


def regenerate(run_dir: str | Path) -> Summary:
    """Rewrite every report file of a run directory from what it holds; ConfigError if it holds no run."""
    from targets.registry import resolve_target

    summary, state = read_run(run_dir)
    if state is not None:
        try:
            target = resolve_target(state.target)
        except ConfigError:  # the target cannot be imported here: keep best_kernels/ as the run wrote it
            target = None
        write_report(state, target, summary)
    else:
        write_summary_files(summary, Path(run_dir))
    return Summary.model_validate_json((Path(run_dir) / SUMMARY_FILE).read_text())  # as written: paths relative
