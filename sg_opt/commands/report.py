"""`sg-opt report`: rewrite a run's reports from its directory, or compare two runs."""

from __future__ import annotations

from typing import Optional

import typer

from sg_opt.cli_common import console, fail
from targets.protocol import ConfigError

def report(
    run_dirs: list[str] = typer.Argument(..., metavar="RUN_DIR [RUN_DIR_B]",
                                         help="a run directory; give a second one to compare the two"),
    out: Optional[str] = typer.Option(None, "--out", help="with two runs: the folder for the comparison "
                                                          "(default ./report-<A>-vs-<B>/)"),
    as_json: bool = typer.Option(False, "--json", help="print the summary (or the comparison) as JSON"),
) -> None:
    """Rewrite a run's report.md, report.html, summary.json, best_config.toml and best_kernels/ from its
    directory alone (read from its state.json, nothing re-measured), or compare two runs side by side.

    Example: sg-opt report runs/20261129-121111-haste-rec-small-offline
    Example: sg-opt report runs/RUN_NORMAL runs/RUN_ULTRA --out normal-vs-ultra
    """
    from sg_opt.report import regenerate

    if len(run_dirs) > 2:
        fail("give one run directory, or two to compare")
    if out is not None and len(run_dirs) == 1:
        fail("--out is for comparisons; a run's own report is written into its directory")
    try:
        if len(run_dirs) == 2:
            from sg_opt.report_compare import compare_runs, default_out, rich_table, write_comparison

            comparison = compare_runs(*run_dirs)
            files = write_comparison(comparison, out or default_out(*run_dirs))
        else:
            summary = regenerate(run_dirs[0])
    except ConfigError as exc:
        fail(str(exc))
    if len(run_dirs) == 2:
        if as_json:
            print(comparison.model_dump_json(indent=1))
            return
        console.print(rich_table(comparison))
        for note in comparison.notes:
            console.print(f"[yellow]note:[/] {note}")
        console.print(f"written: {', '.join(files)}")
    elif as_json:
        print(summary.model_dump_json(indent=1))
    else:
        from sg_opt.optimize import final_table, result_sentence

        console.print(final_table(summary))
        console.print(result_sentence(summary))
        console.print(f"written: {run_dirs[0].rstrip('/')}/ (report.md, report.html, summary.json, best_config.toml)")
