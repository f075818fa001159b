"""The files every run leaves behind: summary.json, report.md, report.html, best_config.toml, best_kernels/.

``write_report(state, target)`` is what the agent's report node calls (through the context), and
what ``sg-opt report RUN_DIR`` calls again through ``regenerate``. report.md is short enough for a
pull-request comment: the result with its interval, then every candidate with its verdict.

How ``regenerate`` reads a run: the last checkpoint's RunState straight from the run's SQLite file
(the graph's own checkpointer and serializer; no graph is compiled and no target is built, so a
run whose target module is gone still reports), re-rooted to wherever the directory now lives.
From that state everything is rebuilt exactly as at the end of the run, nothing is re-measured.
A directory without a checkpoint (copied without it) is reported from its summary.json alone;
then best_kernels/ is kept as it is.
"""

from __future__ import annotations

import difflib
import inspect
import json
import shutil
import sqlite3
from pathlib import Path
from typing import Any

from sg_opt.summary import SUMMARY_FILE, SUMMARY_SCHEMA_VERSION, StepTime, Summary, build_summary
from state_machine.portable import portable
from state_machine.state import RunState
from targets.protocol import ConfigError, Target

REPORT_MD = "report.md"
REPORT_HTML = "report.html"
BEST_CONFIG = "best_config.toml"
BEST_KERNELS = "best_kernels"
REQUEST_FILE = "run.json"
CHECKPOINT_FILE = "checkpoints.sqlite"
NO_ROOFLINE = ("No kernel-slot roofline: no profile of this run has a fine section (kernel slots timed against "
               "measured ceilings). The agent takes one when its plan asks for fine profiles, usually on CUDA; "
               "`sg-opt profile --fine` takes one on any device.")


# ----------------------------------------------------------------------------- wording shared by md and html

def step_text(t: StepTime | None) -> str:
    return f"{t.ms:.2f} ms (95% CI {t.ci_low_ms:.2f}-{t.ci_high_ms:.2f}, {t.blocks} blocks)" if t else "-"


ESTIMATE = "estimate (product of accepted ratios, not a measurement)"


def result_line(s: Summary) -> str:
    """The run's outcome in one sentence, without markup: a measured figure or none, never an estimate."""
    if s.final is not None and s.final.speedup is not None:
        f = s.final
        if not f.clean:
            return (f"could not measure cleanly: the final side-by-side measurement ran beside other load "
                    f"({f.load or 'outside load'}), so its ratio {f.ratio:.3f} is not quoted as a result.")
        return (f"x{f.speedup:.2f} faster than the baseline, measured side by side at the end: step time ratio "
                f"{f.ratio:.3f} (95% interval {f.ci_low:.3f}-{f.ci_high:.3f}, best/baseline), verdict {f.verdict}.")
    if s.accepted:
        return (f"{s.accepted} change(s) accepted, but best and baseline were not measured side by side at the end: "
                f"no measured speedup.")
    return "no candidate was accepted: the baseline stays."


def estimate_rows(s: Summary) -> list[tuple[str, str]]:
    """The estimate, labelled as one, where no final measurement says better (a run that stopped before it)."""
    if s.accepted and (s.final is None or s.final.speedup is None):
        return [(ESTIMATE, f"x{s.est_speedup:.2f}")]
    return []


def step_ms_text(ms: float | None) -> str:
    return f"{ms:.2f}" if ms is not None else "-"


def numerics_line(s: Summary) -> str:
    if s.numerics is None:
        return "unchanged: the best configuration is the baseline."
    n = s.numerics
    return f"{n.numerics_class} (validated with candidate #{n.candidate}): {n.detail}"


def verdict_text(accepted: bool, stage: str) -> str:
    return "accepted" if accepted else f"rejected at {stage}"


# What a run's minutes went to, by the nodes that spent them (the rest: setup, propose, decide).
TIME_GROUPS = (("baseline", ("baseline",)), ("profiling and noise floors", ("diagnose",)),
               ("validation", ("check", "validate")), ("timing", ("measure",)),
               ("validation and timing on lanes", ("evaluate_batch",)), ("final measurement", ("report",)))


def time_line(s: Summary) -> str:
    """'Wall time 16.3 min: baseline 1.7, ...' (the split only when the run recorded one)."""
    line = f"Wall time {s.wall_s / 60:.1f} min"
    parts = [(name, sum(s.node_s.get(node, 0.0) for node in nodes)) for name, nodes in TIME_GROUPS]
    parts = [(name, seconds) for name, seconds in parts if seconds >= 0.05 * 60]
    if parts:
        rest = s.wall_s - sum(seconds for _, seconds in parts)
        line += ": " + ", ".join(f"{name} {seconds / 60:.1f}" for name, seconds in parts)
        line += f", other {rest / 60:.1f}" if rest >= 0.05 * 60 else ""
    line += "."
    if (w := s.worker_startup) is not None:
        parts = ", ".join(f"{name} {seconds:.1f}" for name, seconds in w.build_parts.items() if seconds >= 0.05)
        line += (f" A timing worker got ready in {w.ready_s:.1f} s (medians of {w.workers}): "
                 f"start and imports {w.start_s:.1f}, build {w.build_s:.1f}" + (f" ({parts})" if parts else "")
                 + f", warm-up {w.warmup_s:.1f}.")
        if w.started_ahead:
            line += (f" {w.started_ahead} measurement(s) found their workers started during the candidate's "
                     f"validation.")
        if w.close_s is not None:
            line += f" Closing a measurement's workers took {w.close_s:.1f} s."
    return line


def floor_text(s: Summary) -> str:
    """The baseline's A/A noise floor, then each one calibrated again on a faster incumbent."""
    if s.noise_floor is None:
        return "-"
    text = f"{100 * s.noise_floor:.1f}% (A/A on this machine)"
    if s.recalibrations:
        text += "; calibrated again on faster incumbents: " + ", ".join(
            f"{100 * r.noise_floor:.1f}% at {r.step_ms:.2f} ms (after #{r.after_candidate})" for r in s.recalibrations)
    return text


def ratio_text(ratio: float | None, low: float | None, high: float | None) -> str:
    return f"{ratio:.3f} ({low:.3f}-{high:.3f})" if ratio is not None and low is not None else "-"


def spend_line(s: Summary) -> str:
    spend = s.spend
    per_win = f", ${s.cost_per_win_usd:.4f} per accepted win" if s.cost_per_win_usd is not None else ""
    repairs = (f", {spend.reply_repairs} reply and {spend.kernel_repairs} kernel repair turns"
               if spend.reply_repairs or spend.kernel_repairs else "")
    return (f"LLM spend ${spend.cost_usd:.4f} in {spend.calls} calls ({spend.input_tokens} input, "
            f"{spend.output_tokens} output tokens){per_win}{repairs}")


def machine_rows(env: dict[str, Any]) -> list[tuple[str, str]]:
    """The baseline worker's environment; what it did not record is said, not guessed."""
    known = [("device", "device"), ("device_name", "device name"), ("driver", "driver"), ("cuda", "CUDA"),
             ("torch", "torch"), ("triton", "triton"), ("python", "python"), ("threads", "threads")]
    rows = [(label, str(env[key]) if env.get(key) is not None else "not recorded") for key, label in known]
    rows += [(key, str(value)) for key, value in env.items() if key not in dict(known)]
    return rows


def status_line(s: Summary) -> str:
    stop = s.stop_reason or "the run did not finish (no report node ran): this is its state at the last checkpoint"
    lanes = f" ({s.gpus} GPUs; {s.lanes_note or 'candidates evaluated at once'})" if s.gpus > 1 else ""
    return f"{s.target} @ {s.size} on {s.device}{lanes}, tier {s.tier}. Stopped: {stop}."


# ----------------------------------------------------------------------------- the files

def _toml_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    return '"' + str(value).replace("\\", "\\\\").replace('"', '\\"') + '"'


def best_config_toml(summary: Summary) -> str:
    lines = [f"# best configuration of run {summary.run_id} ({summary.target} @ {summary.size}, {summary.device})",
             "# use with: sg-opt bench --config best_config.toml", "[knobs]"]
    lines += [f"{name} = {_toml_value(value)}" for name, value in sorted(summary.best_config.items())]
    return "\n".join(lines) + "\n"


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


def host_line(s: Summary) -> str | None:
    """The last profile's host side per phase: what a host-bound step spends its time on (None before
    profiles recorded host operator calls)."""
    last = s.phases[-1] if s.phases else None
    if last is None or not any(last.host_ops.values()):
        return None
    parts = [f"{name} {ms:.2f} / {last.host_ops.get(name, 0):.0f}"
             + (f" / {last.launches[name]:.0f}" if name in last.launches else "")
             for name, ms in last.host_work_ms.items()]
    what = ("ms of host work not waiting on the device / host operator calls"
            + (" / kernel launches" if last.launches else ""))
    line = (f"Host side ({last.label}, per step: {what}): " + ", ".join(parts)
            + f"; {sum(last.host_work_ms.values()):.2f} ms of host work in a {last.step_ms:.2f} ms step.")
    if last.host_work:
        line += " Its largest host work: " + ", ".join(
            f"{w.phase} {w.op} {1e3 * w.self_s:.2f} ms ({w.calls:.0f} calls)" for w in last.host_work[:4]) + "."
    if last.host_waits:
        line += " The host waited on the device in " + ", ".join(
            f"{w.phase} {1e3 * w.wait_s:.2f} ms ({w.op}, {w.call})" for w in last.host_waits[:3]) + "."
    return line


def over_floor_text(measured: float | None, floor: float | None) -> str:
    return f"x{measured / floor:.1f}" if measured is not None and floor else "-"


def floor_columns(s: Summary) -> list:
    """The first and the last profile that have a roofline floor (one if they are the same; none if none)."""
    with_floor = [p for p in s.phases if p.floor_ms]
    return with_floor[:1] if len(with_floor) <= 1 else [with_floor[0], with_floor[-1]]


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


def floor_notes(s: Summary) -> list[str]:
    """The sentences under the floor table: each column's step against its floor and, where the profiler distorted
    it, that; then the final step against the floor and whether the host holds the step back."""
    notes = []
    for p in floor_columns(s):
        notes += [f"{p.label}: {note}" for note in (p.floor_note, p.distortion_note) if note]
    return notes + [note for note in (final_over_floor(s), host_bound_note(s)) if note is not None]


HOST_BOUND_SHARE = 0.9  # host work (not waiting on the device) over this share of the step: the host sets its pace


def host_bound_note(s: Summary) -> str | None:
    """On a GPU, when the last floor profile's host is busy for nearly all of the step: no device phase's
    distance from its floor is what holds the step back, the host work is (None otherwise)."""
    cols = floor_columns(s)
    last = cols[-1] if cols else None
    if last is None or not s.device.startswith("cuda") or not last.host_work_ms or not last.step_ms:
        return None
    if last.distortion_note:  # the profiler's own slowdown would read as host work
        return None
    host = sum(last.host_work_ms.values())
    if host < HOST_BOUND_SHARE * last.step_ms:
        return None
    most = max(last.host_work_ms, key=last.host_work_ms.get)
    ops = [w for w in last.host_work if w.phase == most][:2]
    named = "; its largest: " + ", ".join(f"{w.op} {1e3 * w.self_s:.2f} ms" for w in ops) if ops else ""
    return (f"{last.label}: the step is host-bound, {host:.2f} ms of host work not waiting on the device in a "
            f"{last.step_ms:.2f} ms profiled step, so it is the host work that holds it back, not a device phase "
            f"(most in {most}: {last.host_work_ms[most]:.2f} ms{named})")


def final_over_floor(s: Summary) -> str | None:
    """The best configuration's step from the final side-by-side measurement (no profiler running) over the
    last profile's floor: the same floor, the step measured the careful way."""
    cols = floor_columns(s)
    if not cols or s.best_step is None or not cols[-1].floor_step_ms or s.accepted == 0:
        return None
    floor_ms = cols[-1].floor_step_ms
    return (f"the best configuration's step in the final side-by-side measurement, {s.best_step.ms:.2f} ms, is "
            f"x{s.best_step.ms / floor_ms:.1f} the floor ({floor_ms:.3f} ms)")


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

def _rerooted(value: Any, old: str, new: str) -> Any:
    if isinstance(value, str):
        return new + value[len(old):] if value == old or value.startswith(old + "/") else value
    if isinstance(value, dict):
        return {k: _rerooted(v, old, new) for k, v in value.items()}
    if isinstance(value, list):
        return [_rerooted(v, old, new) for v in value]
    return value


def _rooted(state: RunState, run_dir: Path) -> RunState:
    """The state with every path under its old run directory moved to where the directory is now."""
    old, new = state.run_dir.rstrip("/"), str(run_dir.resolve())
    if old == new:
        return state
    return RunState.model_validate(_rerooted(state.model_dump(), old, new))


def load_state(run_dir: Path) -> RunState | None:
    """The last checkpoint's RunState, or None when the directory has no readable checkpoint."""
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
    values = {k: v for k, v in saved.checkpoint["channel_values"].items() if k in RunState.model_fields}
    try:
        return _rooted(RunState.model_validate(values), run_dir)
    except ValueError:
        return None


def load_summary(run_dir: Path) -> Summary:
    path = run_dir / SUMMARY_FILE
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        raise ConfigError(f"{run_dir} has neither a readable checkpoint nor a readable {SUMMARY_FILE}") from None
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
    """A run directory's summary, rebuilt from its last checkpoint when it has one; writes nothing."""
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
