"""The files every run leaves behind: summary.json, report.md, best_config.toml and best_kernels/.

``write_report(state, target)`` is what the agent's report node calls (through the context), and
what ``sg-opt report RUN_DIR`` calls again from a saved state. report.md is short enough for a
pull-request comment: the result with its interval, then every candidate with its verdict.
"""

from __future__ import annotations

import difflib
import inspect
import shutil
from pathlib import Path

from sg_opt.summary import SUMMARY_FILE, Summary, build_summary
from state_machine.state import RunState
from targets.protocol import Target

REPORT_MD = "report.md"
BEST_CONFIG = "best_config.toml"
BEST_KERNELS = "best_kernels"


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


def _result_line(s: Summary) -> str:
    if s.final is not None and s.final.speedup is not None:
        f = s.final
        return (f"**x{f.speedup:.2f} faster** than the baseline, measured side by side at the end: step time ratio "
                f"{f.ratio:.3f} (95% interval {f.ci_low:.3f}-{f.ci_high:.3f}, best/baseline), verdict {f.verdict}.")
    if s.accepted:
        return f"estimated x{s.est_speedup:.2f} faster (product of the accepted side-by-side speedups)."
    return "no candidate was accepted: the baseline stays."


def report_markdown(s: Summary) -> str:
    spend = s.spend
    lines = [f"# sg-opt run {s.run_id}", "",
             f"{s.target} @ {s.size} on {s.device}, tier **{s.tier}**. Stopped: {s.stop_reason}.", "",
             _result_line(s), ""]
    if s.baseline_step_ms is not None:
        lines.append(f"Baseline step {s.baseline_step_ms:.2f} ms (median of the A/A calibration blocks); noise "
                     f"floor {100 * (s.noise_floor or 0):.1f}%.")
    lines += [f"Candidates evaluated: {s.evaluated}, accepted: {s.accepted}. LLM spend: ${spend.cost_usd:.4f} in "
              f"{spend.calls} calls ({spend.input_tokens} input, {spend.output_tokens} output tokens)"
              + (f", ${s.cost_per_win_usd:.4f} per accepted win" if s.cost_per_win_usd is not None else "")
              + f". Wall time {s.wall_s / 60:.1f} min.", "", "## Best configuration", ""]
    lines += [f"- `{k} = {v!r}`" for k, v in sorted(s.best_config.items())] or ["- the baseline's"]
    lines += [f"- kernel `{k}` replaced (see best_kernels/)" for k in s.best_kernels]
    lines += ["", "## Candidates", "", "| # | change | proposer | verdict | ratio (95% CI) | why |",
              "|---|---|---|---|---|---|"]
    for c in s.candidates:
        ratio = f"{c.ratio:.3f} ({c.ci_low:.3f}-{c.ci_high:.3f})" if c.ratio is not None else "-"
        verdict = "**accepted**" if c.accepted else f"rejected ({c.stage})"
        lines.append(f"| {c.id} | {c.change} | {c.proposer} | {verdict} | {ratio} | {c.reason.replace('|', '/')} |")
    return "\n".join(lines) + "\n"


def write_report(state: RunState, target: Target) -> list[str]:
    run_dir = Path(state.run_dir)
    summary = build_summary(state)
    (run_dir / SUMMARY_FILE).write_text(summary.model_dump_json(indent=1))
    (run_dir / BEST_CONFIG).write_text(best_config_toml(summary))
    (run_dir / REPORT_MD).write_text(report_markdown(summary))
    _write_kernels(state, target, run_dir / BEST_KERNELS)
    return [str(run_dir / name) for name in (REPORT_MD, SUMMARY_FILE, BEST_CONFIG)]
