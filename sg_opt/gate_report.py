"""What a CI system reads from `sg-opt gate`: a Markdown summary, JUnit XML, and the terminal view.

The Markdown goes to ``$GITHUB_STEP_SUMMARY`` when it is set (GitHub Actions shows it on the run's
page); the JUnit file (``--junit FILE``) holds one testsuite with the testcases ``step-time`` and
``numerics``, so any CI that reads test reports shows which half failed and why.
"""

from __future__ import annotations

import os
import xml.etree.ElementTree as ET
from pathlib import Path

from rich.console import Console
from rich.table import Table

from sg_opt.gate import GateResult, NumericsCheck, StepTimeCheck


def _step_figures(step: StepTimeCheck) -> str:
    if step.ratio is None:
        return "-"
    return (f"{step.a_ms:.3f} ms -> {step.b_ms:.3f} ms, B/A {step.ratio:.4f} "
            f"[{step.ci_low:.4f}, {step.ci_high:.4f}]")


def _status(passed: bool) -> str:
    return "pass" if passed else "FAIL"


def markdown(result: GateResult) -> str:
    """The summary: verdict, both sides, one row per check, the rule, and any warnings."""
    step, numerics = result.step_time, result.numerics
    lines = [f"## sg-opt gate: {'passed' if result.passed else 'FAILED'}", "",
             f"`{result.target}` @ `{result.size}` on `{result.device}`"
             f"{f' x {result.ranks} ranks (each step the slowest rank)' if result.ranks > 1 else ''}"
             f"{', config ' + ', '.join(f'`{k}={v}`' for k, v in result.config.items()) if result.config else ''}",
             "", f"- A: {result.a_label}", f"- B: {result.b_label}", "",
             "| check | result | figures | detail |", "|---|---|---|---|",
             f"| step time | {_status(step.passed)} | {_step_figures(step)} | {_cell(step.message)} |",
             f"| numerics ({numerics.numerics_class}, {numerics.steps} steps) | {_status(numerics.passed)} | "
             f"{_numerics_figures(numerics)} | {_cell(numerics.message)} |", "",
             f"Rule: {result.rule}; max_regression {step.max_regression:.2%}, floor {step.floor:.4f} "
             f"({step.floor_source}), 95% bootstrap interval."]
    if result.warnings:
        lines += [""] + [f"> warning: {w}" for w in result.warnings]
    return "\n".join(lines) + "\n"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _numerics_figures(numerics: NumericsCheck) -> str:
    if numerics.verdict is None:
        return "-"
    return ", ".join(f"{k} {v:.2g}" for k, v in numerics.verdict.max_errors.items()) or "-"


def junit(result: GateResult) -> str:
    """One testsuite, testcases ``step-time`` and ``numerics``; a failed check carries its sentence."""
    cases = (("step-time", result.step_time.passed, result.step_time.message,
              "regression" if result.step_time.failure is None else result.step_time.failure.kind),
             ("numerics", result.numerics.passed, result.numerics.message,
              "numerics" if result.numerics.failure is None else result.numerics.failure.kind))
    suite = ET.Element("testsuite", name="sg-opt gate", tests="2", errors="0", skipped="0",
                       failures=str(sum(not passed for _, passed, _, _ in cases)), time=f"{result.wall_s:.3f}")
    for name, passed, message, kind in cases:
        case = ET.SubElement(suite, "testcase", classname=f"sg-opt.gate.{result.target}.{result.size}", name=name)
        if not passed:
            ET.SubElement(case, "failure", message=message, type=kind).text = message
        else:
            ET.SubElement(case, "system-out").text = message
    if result.warnings:
        ET.SubElement(suite, "system-err").text = "\n".join(result.warnings)
    ET.indent(suite)
    return '<?xml version="1.0" encoding="utf-8"?>\n' + ET.tostring(suite, encoding="unicode") + "\n"


def write_reports(result: GateResult, junit_file: str | None) -> None:
    """JUnit to ``junit_file`` when given; Markdown appended to ``$GITHUB_STEP_SUMMARY`` when set."""
    if junit_file:
        Path(junit_file).write_text(junit(result))
    summary = os.environ.get("GITHUB_STEP_SUMMARY")
    if summary:
        with open(summary, "a") as out:
            out.write(markdown(result))


def render(result: GateResult, console: Console) -> None:
    table = Table(title=f"sg-opt gate: B = {result.b_label} vs A = {result.a_label}")
    for col in ("check", "result", "figures", "detail"):
        table.add_column(col, overflow="fold")
    for name, check, figures in (("step time", result.step_time, _step_figures(result.step_time)),
                                 (f"numerics ({result.numerics.numerics_class})", result.numerics,
                                  _numerics_figures(result.numerics))):
        table.add_row(name, "[green]pass[/]" if check.passed else "[bold red]FAIL[/]", figures, check.message)
    console.print(table)
    for warning in result.warnings:
        console.print(f"[yellow]warning:[/] {warning}", highlight=False)
    console.print(f"rule: {result.rule}")
    console.print(f"[bold]{'passed' if result.passed else 'FAILED'}[/] (exit {result.exit_code})")
