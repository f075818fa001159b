"""What a CI system reads from `sg-opt gate`: a Markdown summary, JUnit XML, and the terminal view.

The Markdown goes to ``$GITHUB_STEP_SUMMARY`` when it is set (GitHub Actions shows it on the run's
page), its first line the outcome: pass, regression or inconclusive. The JUnit file (``--junit FILE``)
holds one testsuite with the testcases ``step-time`` and ``numerics``, so any CI that reads test reports
shows which half failed and why: a regression and an inconclusive step time are both failures (of types
``regression`` and ``inconclusive``), except that one let through by ``--allow-inconclusive`` is skipped,
its message still saying why.
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


def _step_status(step: StepTimeCheck) -> str:
    return {"pass": "pass", "regression": "REGRESSION", "inconclusive": "INCONCLUSIVE"}.get(step.verdict, "FAIL")


def headline(result: GateResult) -> str:
    """The outcome in a few words: 'pass', 'regression (step time, numerics)', 'inconclusive (...)'."""
    if result.outcome == "inconclusive":
        allowed = ", let through by --allow-inconclusive" if result.exit_code == 0 else ""
        return f"inconclusive (step time{allowed})"
    if result.outcome == "pass":
        return "pass"
    step = result.step_time
    failed = [{"regression": f"step time, {step.ratio - 1:+.1%}" if step.ratio else "step time",
               "failed": "the working tree's timed run failed"}.get(step.verdict)]
    failed.append(None if result.numerics.passed else "numerics")
    return f"regression ({', '.join(f for f in failed if f)})"


def markdown(result: GateResult) -> str:
    """The summary: the outcome first, both sides, one row per check, the rule, and any warnings."""
    step, numerics = result.step_time, result.numerics
    lines = [f"## sg-opt gate: {headline(result)}", "",
             f"`{result.target}` @ `{result.size}` on `{result.device}`"
             f"{f' x {result.ranks} ranks (each step the slowest rank)' if result.ranks > 1 else ''}"
             f"{', config ' + ', '.join(f'`{k}={v}`' for k, v in result.config.items()) if result.config else ''}",
             "", f"- A: {result.a_label}", f"- B: {result.b_label}", "",
             "| check | result | figures | detail |", "|---|---|---|---|",
             f"| step time | {_step_status(step)} | {_step_figures(step)} | {_cell(step.message)} |",
             f"| numerics ({numerics.numerics_class}, {numerics.steps} steps) | {_status(numerics.passed)} | "
             f"{_numerics_figures(numerics)} | {_cell(numerics.message)} |", "",
             f"Rule: {result.rule}; max_regression {step.max_regression:.2%}, floor {step.floor:.4f} "
             f"({step.floor_source}), 95% bootstrap interval; extended {step.extensions} time(s) of at most "
             f"{result.max_extensions}. Exit {result.exit_code}."]
    if result.warnings:
        lines += [""] + [f"> warning: {w}" for w in result.warnings]
    return "\n".join(lines) + "\n"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _numerics_figures(numerics: NumericsCheck) -> str:
    if numerics.verdict is None:
        return "-"
    return ", ".join(f"{k} {v:.2g}" for k, v in numerics.verdict.max_errors.items()) or "-"


def _step_case(result: GateResult) -> tuple[str | None, str]:
    """The step-time testcase's element (failure, skipped or none) and its type."""
    step = result.step_time
    if step.verdict == "failed":
        return "failure", step.failure.kind
    if step.verdict == "inconclusive":
        return ("skipped" if result.exit_code == 0 else "failure"), "inconclusive"
    return (None if step.passed else "failure"), step.verdict


def junit(result: GateResult) -> str:
    """One testsuite, testcases ``step-time`` and ``numerics``; a failed or skipped check carries its sentence."""
    numerics = result.numerics
    cases = (("step-time", *_step_case(result), result.step_time.message),
             ("numerics", None if numerics.passed else "failure",
              "numerics" if numerics.failure is None else numerics.failure.kind, numerics.message))
    suite = ET.Element("testsuite", name="sg-opt gate", tests="2", errors="0",
                       skipped=str(sum(tag == "skipped" for _, tag, _, _ in cases)),
                       failures=str(sum(tag == "failure" for _, tag, _, _ in cases)), time=f"{result.wall_s:.3f}")
    for name, tag, kind, message in cases:
        case = ET.SubElement(suite, "testcase", classname=f"sg-opt.gate.{result.target}.{result.size}", name=name)
        if tag is None:
            ET.SubElement(case, "system-out").text = message
        else:
            ET.SubElement(case, tag, message=message, type=kind).text = message
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
    step, numerics = result.step_time, result.numerics
    colour = {"pass": "green", "inconclusive": "bold yellow"}.get(step.verdict, "bold red")
    table.add_row("step time", f"[{colour}]{_step_status(step)}[/]", _step_figures(step), step.message)
    table.add_row(f"numerics ({numerics.numerics_class})", "[green]pass[/]" if numerics.passed else "[bold red]FAIL[/]",
                  _numerics_figures(numerics), numerics.message)
    console.print(table)
    for warning in result.warnings:
        console.print(f"[bold yellow]warning:[/] {warning}", highlight=False)
    console.print(f"rule: {result.rule}")
    colour = {"pass": "bold green", "inconclusive": "bold yellow"}.get(result.outcome, "bold red")
    console.print(f"[{colour}]{headline(result)}[/] (exit {result.exit_code})", highlight=False)
