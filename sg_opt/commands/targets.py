"""`sg-opt targets`: the targets sg-opt knows, with their sizes, kernel slots and knob tables (five columns,
or two on a narrow console)."""

from __future__ import annotations

import json
from typing import Optional

import typer
from rich.markup import escape
from rich.table import Table

from sg_opt.cli_common import console, err_console, fail
from targets.protocol import ConfigError, Target
from targets.registry import known_targets, resolve_target

WIDE_KNOB_TABLE = 140  # columns the five-column knob table needs; a narrower console (a CI log) gets two


def _narrow_knob_table(target: Target) -> Table:
    """The knob table for 80 columns: the name with its default, then domain, numerics and why, wrapped, so no
    column is squeezed away."""
    table = Table(title=f"{target.name}: {target.description}")
    table.add_column("knob = default", no_wrap=True, style="bold")
    table.add_column("domain \\[numerics]: why", ratio=1, overflow="fold")
    for category in dict.fromkeys(knob.category for knob in target.knob_space):
        table.add_section()
        table.add_row(f"[italic]{category}[/]", "")
        for knob in (k for k in target.knob_space if k.category == category):
            table.add_row(f"{knob.name}\n[not bold dim]= {escape(str(knob.default))}[/]",
                          f"{escape(knob.domain())} [dim]\\[{escape(knob.numerics_text())}][/]: {escape(knob.why)}")
    return table


def _knob_table(target: Target) -> Table:
    """Knobs grouped by category; the reason column wraps, the names never do."""
    if console.width < WIDE_KNOB_TABLE:
        return _narrow_knob_table(target)
    table = Table(title=f"{target.name}: {target.description}")
    table.add_column("knob", no_wrap=True, style="bold")
    table.add_column("default", no_wrap=True)
    table.add_column("domain", max_width=28)
    table.add_column("numerics", no_wrap=True)
    table.add_column("why", ratio=1, min_width=24)
    by_category: dict[str, list] = {}
    for knob in target.knob_space:
        by_category.setdefault(knob.category, []).append(knob)
    for category, knobs in by_category.items():
        table.add_section()
        table.add_row(f"[italic]{category}[/]", "", "", "", "")
        for knob in knobs:
            table.add_row(knob.name, str(knob.default), knob.domain(), knob.numerics_text(), knob.why)
    return table


def target_record(t: Target) -> dict:
    """A target as `sg-opt targets --json` lists it."""
    return {"name": t.name, "description": t.description, "sizes": list(t.sizes), "default_size": t.default_size,
            "phases": list(t.phases), "kernel_slots": [s.name for s in t.kernel_slots],
            "data_formats": list(t.data_formats), "rules": [r.name for r in t.rules],
            "quality_metrics": [m.describe() for m in t.quality_metrics],
            "knobs": [k.to_dict() for k in t.knob_space]}


def targets(
    target: Optional[str] = typer.Option(None, "--target", help="show this one only: an installed target's name or "
                                                                "module:attr (a user's job, say)"),
    as_json: bool = typer.Option(False, "--json", help="machine-readable output"),
) -> None:
    """List the targets sg-opt knows (or the one --target names), with their sizes, kernel slots and knobs.

    Example: sg-opt targets --target examples.dlrm.job:target
    """
    found = []
    if target is not None:
        try:
            found.append(resolve_target(target))
        except ConfigError as exc:
            fail(str(exc))
    for name in [] if target is not None else known_targets():
        try:
            found.append(resolve_target(name))
        except ConfigError as exc:
            err_console.print(f"[yellow]skipped:[/] {exc}")
    if as_json:
        print(json.dumps([target_record(t) for t in found], indent=1))
        return
    for t in found:
        console.print(_knob_table(t))
        quality = ", ".join(m.describe() for m in t.quality_metrics) or "none declared (no model changes)"
        console.print(f"sizes: {', '.join(t.sizes)}   kernel slots: {', '.join(s.name for s in t.kernel_slots) or '-'}"
                      f"   own rules: {len(t.rules)}   quality: {quality}\n", highlight=False)
