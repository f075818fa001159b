"""`sg-opt report A B`: two runs side by side (say normal vs ultra on one target), read-only.

Both runs are read the way ``sg-opt report`` reads one (``report.read_run``: the last checkpoint,
else summary.json) and neither directory is written to. The comparison (a versioned JSON record
holding both summaries and the table), its report.md and its self-contained report.html go to a
directory of the user's choosing. Runs of different targets, sizes or devices are compared all the
same, with a note saying their speedups are not measured against one baseline.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel
from rich.table import Table

from sg_opt.report import read_run
from sg_opt.report_text import ESTIMATE, ratio_text, result_line, spend_line, step_text
from sg_opt.summary import Summary

COMPARISON_SCHEMA_VERSION = 1
COMPARISON_FILE = "comparison.json"


class Row(BaseModel):
    metric: str
    a: str
    b: str


class Comparison(BaseModel):
    version: int = COMPARISON_SCHEMA_VERSION
    run_dirs: list[str]
    a: Summary
    b: Summary
    rows: list[Row]
    notes: list[str]


def default_out(a: str | Path, b: str | Path) -> Path:
    return Path(f"report-{Path(a).resolve().name}-vs-{Path(b).resolve().name}")


def _speedup(s: Summary) -> str:
    f = s.final
    if f is not None and f.speedup is not None:
        return f"x{f.speedup:.2f} (ratio {ratio_text(f.ratio, f.ci_low, f.ci_high)}, {f.verdict})"
    return f"no final measurement; {ESTIMATE}: x{s.est_speedup:.2f}" if s.accepted else "x1.00 (nothing accepted)"


def _config(s: Summary) -> str:
    changes = [f"{k}={v}" for k, v in sorted(s.best_config.items())] + [f"kernel {k}" for k in s.best_kernels]
    return ", ".join(changes) or "the baseline's"


def _rows(a: Summary, b: Summary) -> list[Row]:
    def row(metric: str, get) -> Row:
        return Row(metric=metric, a=str(get(a)), b=str(get(b)))

    return [row("run", lambda s: s.run_id), row("target", lambda s: f"{s.target} @ {s.size} on {s.device}"),
            row("machine", lambda s: s.environment.get("device_name", "not recorded")),
            row("tier", lambda s: s.tier), row("stopped", lambda s: s.stop_reason or "did not finish"),
            row("baseline step time", lambda s: step_text(s.baseline_step)),
            row("best step time", lambda s: step_text(s.best_step)),
            row("speedup over its baseline", _speedup),
            row("numerics", lambda s: f"{s.numerics.numerics_class} (validated with #{s.numerics.candidate})"
                if s.numerics else "unchanged (baseline)"),
            row("candidates", lambda s: f"{s.evaluated} evaluated, {s.accepted} accepted"),
            row("LLM spend", lambda s: f"${s.spend.cost_usd:.4f} in {s.spend.calls} calls"),
            row("$ per accepted win", lambda s: f"${s.cost_per_win_usd:.4f}" if s.cost_per_win_usd is not None
                else "-"),
            row("wall time", lambda s: f"{s.wall_s / 60:.1f} min"), row("best configuration", _config)]


def _notes(a: Summary, b: Summary) -> list[str]:
    differ = [name for name in ("target", "size", "device") if getattr(a, name) != getattr(b, name)]
    notes = [f"the runs differ in {', '.join(differ)}: each speedup is against its own baseline"] if differ else []
    if a.baseline_step and b.baseline_step and not differ:
        gap = abs(a.baseline_step.ms / b.baseline_step.ms - 1)
        if gap > max(a.noise_floor or 0, b.noise_floor or 0):
            notes.append(f"the two baselines differ by {100 * gap:.0f}% (beyond either run's noise floor): the "
                         "machine was not in the same state for both runs")
    return notes


def compare_runs(a: str | Path, b: str | Path) -> Comparison:
    """Both runs read (ConfigError when either is not a readable run directory); nothing written."""
    sa, _ = read_run(a)
    sb, _ = read_run(b)
    return Comparison(run_dirs=[str(a), str(b)], a=sa, b=sb, rows=_rows(sa, sb), notes=_notes(sa, sb))


def markdown(c: Comparison) -> str:
    lines = [f"# sg-opt: {c.a.run_id} vs {c.b.run_id}", "", f"- A: {result_line(c.a)}", f"- B: {result_line(c.b)}",
             "", "| | A | B |", "|---|---|---|"]
    lines += [f"| {r.metric} | {r.a.replace('|', '/')} | {r.b.replace('|', '/')} |" for r in c.rows]
    lines += ["", f"- A: {spend_line(c.a)}.", f"- B: {spend_line(c.b)}."]
    for note in c.notes:
        lines += ["", f"> note: {note}"]
    return "\n".join(lines) + "\n"


def html(c: Comparison) -> str:
    from sg_opt import plots
    from sg_opt.report_html import BEST_SO_FAR, figure, page, para, section, table

    runs = [(f"A ({c.a.tier})", c.a), (f"B ({c.b.tier})", c.b)]
    header = "<h1>sg-opt: two runs side by side</h1>" + para(f"A = {c.a.run_id}; B = {c.b.run_id}", "meta")
    return page(f"sg-opt {c.a.run_id} vs {c.b.run_id}", [
        header,
        section("table", "Side by side", para(f"A: {result_line(c.a)}"), para(f"B: {result_line(c.b)}"),
                table(["", "A", "B"], [(r.metric, r.a, r.b) for r in c.rows]), *(para(n, "note") for n in c.notes)),
        section("step-times", "Step times", figure(plots.step_times(runs), "Each run's baseline and best step "
                "time with 95% intervals.", "neither run measured a step time.")),
        section("progress", "Best so far", figure(plots.best_so_far(runs), BEST_SO_FAR,
                                                  "neither run evaluated a candidate.")),
        section("cost", "LLM cost", para(f"A: {spend_line(c.a)}. B: {spend_line(c.b)}."),
                figure(plots.spend(runs), "Cumulative dollars after each LLM call, per run and tier.",
                       "Neither run made an LLM call ($0).")),
    ])


def write_comparison(c: Comparison, out: str | Path) -> list[str]:
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    files = {COMPARISON_FILE: c.model_dump_json(indent=1), "report.md": markdown(c), "report.html": html(c)}
    for name, text in files.items():
        (folder / name).write_text(text, encoding="utf-8")
    return [str(folder / name) for name in files]


def rich_table(c: Comparison) -> Table:
    table = Table(title="sg-opt: two runs side by side")
    table.add_column("", style="bold", no_wrap=True)
    table.add_column("A", overflow="fold")
    table.add_column("B", overflow="fold")
    for r in c.rows:
        table.add_row(r.metric, r.a, r.b)
    return table
