"""The `sg-opt` command line. Errors a user can cause end in one sentence and exit code 2."""

from __future__ import annotations

import contextlib
import json
import signal
import sys
from pathlib import Path
from typing import Optional

import typer
from rich.markup import escape
from rich.table import Table

from sg_opt.cli_common import (CONFIG_OPT, DATA_OPT, DEVICE_OPT, JSON_OPT, RANKS_OPT, SET_OPT, SIZE_OPT, TARGET_OPT,
                               THREADS_OPT, TIMEOUT_OPT, Working, check_result, console, err_console, fail,
                               fail_workload, global_options, inputs, verbosity)
from targets.machine_lease import run_presence
from targets.protocol import ConfigError, Target
from targets.registry import known_targets, resolve_target

PAUSED_EXIT = 3  # sg-opt optimize --pause-after: paused at a checkpoint, to be continued with --resume
MEASURING = ("optimize", "bench", "profile", "gate")  # the commands that time workloads on this machine

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="sg-opt: make sparse-model training faster without changing what it computes.")
app.callback()(global_options)


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


@app.command()
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


@app.command()
def bench(
    target: str = TARGET_OPT, size: str = SIZE_OPT, config: Optional[str] = CONFIG_OPT,
    set_: list[str] = SET_OPT, data: Optional[str] = DATA_OPT, device: str = DEVICE_OPT,
    steps: int = typer.Option(20, min=1, help="timed steps"),
    warmup: int = typer.Option(5, min=0, help="untimed steps first"),
    phase_steps: int = typer.Option(5, min=0, help="steps of the synchronised per-phase pass"),
    threads: Optional[int] = THREADS_OPT, ranks: int = RANKS_OPT, timeout: float = TIMEOUT_OPT,
    as_json: bool = JSON_OPT,
    vs: Optional[str] = typer.Option(None, "--vs", help="a second config (TOML) to measure side by side against "
                                                        "this one: interval and verdict"),
    blocks: int = typer.Option(20, min=2, help="--vs: interleaved blocks per side (even; as many as optimize's "
                                               "final measurement)"),
    block_steps: int = typer.Option(5, min=1, help="--vs: steps per block (at least)"),
    block_seconds: float = typer.Option(0.3, "--block-seconds", min=0.0, help="--vs: the least a block lasts, "
                                        "as in the agent's measurements (0: --block-steps alone)"),
    floor: Optional[float] = typer.Option(None, min=0.0, help="--vs: noise floor (default: A/A calibration)"),
    save: Optional[str] = typer.Option(None, "--save", help="also take the numerics fingerprint and save both, with "
                                                            "the environment, to this JSON file for "
                                                            "`sg-opt gate --baseline`"),
) -> None:
    """Time training steps of one target config in a worker process (or two, side by side, with --vs).

    Example: sg-opt bench --size small --set embedding_grad_mode=fused --vs examples/haste_rec_hand_tuned.toml
    """
    from sg_opt.bench import bench as run_bench, render
    from sg_opt.saved_baseline import SaveFailed, check_writable

    overrides = inputs(target, size, config, set_, data, ranks)
    if save is not None:
        if vs is not None:
            fail("--save keeps the figures of one config; drop --vs")
        try:
            check_writable(save)
        except ConfigError as exc:
            fail(str(exc))
    if vs is not None:
        _bench_vs(target, size, overrides, inputs(target, size, vs, [], data), data, device, warmup, threads,
                  ranks, timeout, blocks, block_steps, block_seconds, floor, as_json)
        return
    on = f"{ranks} ranks on {device}" if ranks > 1 else device
    with Working(f"benchmarking {target} @ {size} on {on} ..."):
        try:
            result = run_bench(target, size, overrides, device, steps, warmup, phase_steps, timeout, threads, data,
                               save, ranks)
        except SaveFailed as exc:
            fail(str(exc), code=1)
    if as_json:
        print(result.model_dump_json(indent=1))
    check_result(result)
    if not as_json:
        render(result, console)
        if save is not None:
            console.print(f"saved the step times, numerics fingerprint and environment to {save}")


def _bench_vs(target: str, size: str, incumbent: dict, candidate: dict, data: str | None, device: str, warmup: int,
              threads: int | None, ranks: int, timeout: float, blocks: int, block_steps: int, block_seconds: float,
              floor: float | None, as_json: bool) -> None:
    from sg_opt.compare import compare, render
    from targets.worker_protocol import WorkerRequest
    from validators.speedup import CalibrationFailed

    if blocks % 2:
        fail("--blocks must be even, so that each side runs first equally often")
    spec = dict(target=target, size=size, mode="bench", data=data, device=device, warmup=warmup, threads=threads,
                ranks=ranks)
    with Working("calibrating the noise floor (A/A), then measuring side by side ...") as working:
        try:
            result, noise = compare(WorkerRequest(config=incumbent, **spec), WorkerRequest(config=candidate, **spec),
                                    blocks, block_steps, timeout, floor, block_seconds,
                                    progress=working.note)
        except CalibrationFailed as exc:  # the incumbent itself failed during calibration
            if exc.failure is None:
                fail(str(exc), code=1)
            fail_workload("the noise floor could not be set", exc.failure)
        except RuntimeError as exc:  # e.g. a side that ran another spec than asked
            fail(str(exc), code=1)
    if as_json:
        print(result.model_dump_json(indent=1))
    if result.failure is not None:
        fail_workload("the comparison failed", result.failure)
    if not as_json:
        render(result, noise, console)


@app.command()
def profile(
    target: str = TARGET_OPT, size: str = SIZE_OPT, config: Optional[str] = CONFIG_OPT,
    set_: list[str] = SET_OPT, data: Optional[str] = DATA_OPT, device: str = DEVICE_OPT,
    fine: bool = typer.Option(False, "--fine", help="also time the kernel slots on the real shapes against "
                                                    "measured device ceilings"),
    trace: Optional[str] = typer.Option(None, "--trace", help="write the Chrome/Perfetto trace here"),
    steps: int = typer.Option(10, min=1, help="profiled steps (and as many unprofiled, before and after)"),
    warmup: int = typer.Option(5, min=0, help="untimed steps first"),
    threads: Optional[int] = THREADS_OPT, ranks: int = RANKS_OPT, timeout: float = TIMEOUT_OPT,
    as_json: bool = JSON_OPT,
) -> None:
    """Where the step time goes: phases, top ops, kernel slots on the roofline, ranked findings. With --ranks,
    every rank is profiled: the slowest rank's profile, each rank's phases and its share of collectives.

    Example: sg-opt profile --size large --device cuda --fine --trace trace.json
    Example: sg-opt profile --size tiny --ranks 2
    """
    from profilers.client import run_profile
    from profilers.records import ProfileRequest
    from sg_opt.profile_view import render

    overrides = inputs(target, size, config, set_, data, ranks)
    req = ProfileRequest(target=target, size=size, config=overrides, data=data, device=device, warmup=warmup,
                         threads=threads, ranks=ranks, profile_steps=steps, fine=fine,
                         trace=str(Path(trace).resolve()) if trace else None)
    on = f"{ranks} ranks on {device}" if ranks > 1 else device
    with Working(f"profiling {target} @ {size} on {on} ..."):
        result = run_profile(req, timeout_s=timeout)
    if as_json:
        print(result.model_dump_json(indent=1))
    check_result(result)
    if not as_json:
        render(result, console)


@app.command()
def optimize(
    target: str = TARGET_OPT, size: str = SIZE_OPT, config: Optional[str] = CONFIG_OPT,
    set_: list[str] = SET_OPT, data: Optional[str] = DATA_OPT, device: str = DEVICE_OPT,
    tier: str = typer.Option("offline", help="offline (rule catalog, no LLM, $0), normal or ultra"),
    search: str = typer.Option("rules", "--search", help="the offline tier's proposer: rules (the catalog) or "
                                                         "tpe (Optuna's TPE sampler over the knob space, the "
                                                         "oracle of benchmarks/search_vs_optuna.py; needs optuna)"),
    tiers: Optional[str] = typer.Option(None, "--tiers", help="a TOML file of tiers and prices merged over "
                                                               "the packaged ones"),
    base_url: Optional[str] = typer.Option(None, "--base-url", help="an OpenAI-compatible endpoint (vLLM, "
                                                                    "Ollama, Azure); default: OpenAI with "
                                                                    "OPENAI_API_KEY. With --resume: the same URL "
                                                                    "again if it held credentials (run.json keeps "
                                                                    "them blanked)"),
    model: Optional[str] = typer.Option(None, "--model", help="the LLM model (default: the tier's)"),
    llm_timeout: float = typer.Option(180.0, "--llm-timeout", min=0.1, help="seconds per LLM request before it "
                                                                            "is retried"),
    budget_usd: Optional[float] = typer.Option(None, "--budget-usd", min=0.0, help="LLM $ cap (default: the "
                                                                                   "tier's)"),
    max_iters: Optional[int] = typer.Option(None, "--max-iters", min=1, help="candidates to evaluate at most "
                                                                             "(default: the tier's)"),
    max_minutes: float = typer.Option(30.0, "--max-minutes", min=0.1, help="wall time of the whole run, resumes "
                                                                         "and the final measurement included"),
    out: str = typer.Option("runs", "--out", help="directory that holds run directories"),
    resume: Optional[str] = typer.Option(None, "--resume", help="continue this run id (or run directory) from "
                                                                "its last checkpoint"),
    on_another_machine: bool = typer.Option(False, "--on-another-machine", help="with --resume: go on although "
                                            "this machine differs from the one the run measured on (CPU or GPU "
                                            "models); its report says so"),
    pause_after: Optional[float] = typer.Option(None, "--pause-after", min=0.0, help="minutes this invocation may "
                                                "run: a step that would not fit in what is left does not start, and "
                                                "the run pauses (exit 3) to be continued with --resume"),
    allow_model_changes: bool = typer.Option(False, "--allow-model-changes", help="also try knobs that change "
                                                                                  "the model, judged by quality"),
    threads: Optional[int] = THREADS_OPT, ranks: int = RANKS_OPT,
    gpus: int = typer.Option(1, "--gpus", min=1, help="GPUs to use: evaluate gpus / ranks candidates at once, "
                                                      "each with its A/B pair on GPUs of its own (device cuda)"),
    timeout: float = typer.Option(1800.0, min=1.0, help="seconds any one worker may run before it is killed "
                                                       "(shortened to 8x the baseline's once that is known)"),
    blocks: int = typer.Option(6, min=2, help="interleaved timed blocks per side in each A/B measurement"),
    final_blocks: int = typer.Option(20, "--final-blocks", min=2, help="blocks per side of the final "
                                     "baseline-against-best measurement, at least --blocks (20: as bench --vs)"),
    aa_runs: int = typer.Option(2, "--aa-runs", min=1, help="A/A runs that set the noise floor (the floor is "
                                "the worst of them)"),
    aa_blocks: int = typer.Option(40, "--aa-blocks", min=2, help="blocks per side of each A/A run that sets the "
                                  "noise floor, at least --blocks (the floor is as loose as their interval)"),
    recalibrate_after: float = typer.Option(2.0, "--recalibrate-after", min=0.0, help="calibrate the noise floor "
                                            "again on an incumbent this many times faster than the step of the "
                                            "floor in force (0: never)"),
    block_steps: Optional[int] = typer.Option(None, "--block-steps", min=1, help="steps per block (default: "
                                              "enough for 0.3 s, on the baseline and on every faster incumbent)"),
    as_json: bool = typer.Option(False, "--json", help="print the run summary as JSON"),
) -> None:
    """Find a faster configuration of a target, prove it computes the same, and report what it cost.

    Example: sg-opt optimize --target haste-rec --size small --tier offline --max-minutes 5
    """
    from sg_opt import optimize as agent
    from sg_opt.run_store import RunRequest, new_run_id
    from state_machine.nodes import FinalMeasurementFailed, IncumbentFailed
    from state_machine.time_budget import Paused

    quiet = as_json or verbosity.quiet
    pause_s = None if pause_after is None else 60.0 * pause_after
    try:
        if resume is not None:
            final, summary = agent.resume(resume, out, console, quiet, pause_s, base_url,
                                           on_another_machine)
        elif on_another_machine:
            raise ConfigError("--on-another-machine goes with --resume: a new run measures on this machine only")
        else:
            odd = [name for name, n in (("--blocks", blocks), ("--final-blocks", final_blocks),
                                        ("--aa-blocks", aa_blocks)) if n % 2]
            if odd:
                raise ConfigError(f"{odd[0]} must be even, so that each side runs first equally often")
            overrides = inputs(target, size, config, set_, data, ranks)
            fixed_blocks = {"block_steps": block_steps, "block_seconds": 0.0} if block_steps else {}
            plan = {"blocks": blocks, "final_blocks": final_blocks, "aa_repeats": aa_runs, "aa_blocks": aa_blocks,
                    "timeout_s": timeout, "min_timeout_s": min(60.0, timeout), "recalibrate_after": recalibrate_after,
                    **fixed_blocks}
            run_id = new_run_id(target, size, f"{tier}-tpe" if search == "tpe" else tier)
            request = RunRequest(run_id=run_id, target=target, size=size,
                                 config=overrides, data=str(Path(data).resolve()) if data else None, device=device,
                                 threads=threads, ranks=ranks, gpus=gpus, tier=tier, search=search,
                                 tiers_file=tiers,
                                 base_url=base_url,
                                 model=model, llm_timeout_s=llm_timeout, budget_usd=budget_usd, max_iters=max_iters,
                                 max_minutes=max_minutes,
                                 allow_model_changes=allow_model_changes, plan=plan)
            final, summary = agent.start(request, out, console, quiet, pause_s)
    except ConfigError as exc:
        fail(str(exc))
    except Paused as exc:
        err_console.print(f"{exc}; continue with: sg-opt optimize --resume {exc.run_dir}", highlight=False,
                          soft_wrap=True, markup=False)
        raise typer.Exit(PAUSED_EXIT)
    except (IncumbentFailed, FinalMeasurementFailed) as exc:
        fail(str(exc), code=1)
    if as_json:
        print(summary.model_dump_json(indent=1))
    else:
        console.print(agent.final_table(summary))
        console.print(agent.result_sentence(summary))
        console.print(f"results: {final.run_dir}/ (report.md, report.html, summary.json, best_config.toml)")
    if (final.stop_reason or "").startswith("error:"):
        fail(final.stop_reason.removeprefix("error: "), code=1)


@app.command()
def gate(
    target: str = TARGET_OPT, size: str = SIZE_OPT, config: Optional[str] = CONFIG_OPT,
    set_: list[str] = SET_OPT, data: Optional[str] = DATA_OPT, device: str = DEVICE_OPT,
    ref: Optional[str] = typer.Option(None, "--ref", help="git revision to compare the working tree with (checked "
                                                          "out apart, timed interleaved)"),
    ref_tree: Optional[str] = typer.Option(None, "--ref-tree", help="a code tree to compare the working tree with, "
                                                                    "checked out already (e.g. a CI job's base "
                                                                    "checkout; timed interleaved, as --ref)"),
    baseline: Optional[str] = typer.Option(None, "--baseline", help="compare with figures saved by `sg-opt bench "
                                                                    "--save FILE` (same device only; its target, "
                                                                    "size and config are used)"),
    max_regression: float = typer.Option(0.05, "--max-regression", min=0.0, help="allowed slowdown, 0.05 = 5%"),
    numerics_class: str = typer.Option("reorder", "--numerics-class", help="exact, reorder or precision: how "
                                                                          "close B's numerics must stay to A's"),
    numerics_steps: int = typer.Option(10, "--numerics-steps", min=1, help="--ref: steps of the numerics "
                                                                           "fingerprint"),
    blocks: int = typer.Option(10, min=2, help="--ref: interleaved blocks per side (even)"),
    block_steps: int = typer.Option(10, "--block-steps", min=1, help="--ref: steps per block (at least)"),
    block_seconds: float = typer.Option(0.5, "--block-seconds", min=0.0, help="--ref: the least a block lasts "
                                                                              "(0: --block-steps alone)"),
    warmup: int = typer.Option(5, min=0, help="--ref: untimed steps first"),
    floor: Optional[float] = typer.Option(None, min=0.0, help="noise floor (default: A/A calibration with --ref, "
                                                              "the runs' spread with --baseline)"),
    aa_runs: int = typer.Option(3, "--aa-runs", min=1, help="--ref: A/A runs that calibrate the noise floor, and "
                                                            "again at each extension while it is too wide"),
    ab_runs: int = typer.Option(2, "--ab-runs", min=1, help="--ref: A/B runs, each in fresh workers, before the "
                                                            "first verdict, and again at each extension"),
    max_extensions: int = typer.Option(3, "--max-extensions", min=0, help="while the step time is inconclusive, "
                                                                          "measure more (fresh workers, blocks "
                                                                          "pooled) at most this many times"),
    allow_inconclusive: bool = typer.Option(False, "--allow-inconclusive", help="exit 0, with a warning, instead of "
                                                                                "3 when the step time stays "
                                                                                "inconclusive"),
    junit: Optional[str] = typer.Option(None, "--junit", help="write a JUnit XML report here"),
    threads: Optional[int] = THREADS_OPT,
    ranks: Optional[int] = typer.Option(None, "--ranks", min=1, help="measure both sides as this many processes "
                                                                     "of one torch.distributed job, as bench "
                                                                     "--ranks (default 1; with --baseline, the "
                                                                     "saved number, and another one is refused)"),
    timeout: float = TIMEOUT_OPT,
    as_json: bool = typer.Option(False, "--json", help="print the gate's result as JSON"),
) -> None:
    """CI regression gate: fail (exit 1) if the working tree is slower beyond --max-regression, with confidence,
    or computes differently; exit 3 if the step time stays inconclusive after --max-extensions more measurements
    (neither shown within --max-regression nor beyond it); exit 2 on usage or set-up errors. Markdown goes to
    $GITHUB_STEP_SUMMARY.

    Example: sg-opt gate --target haste-rec --size tiny --ref origin/main --junit gate.xml
    Example: sg-opt gate --baseline base.json --ranks 2
    """
    from sg_opt.gate import GateOptions
    from sg_opt.gate_baseline import gate_against_baseline
    from sg_opt.gate_side_by_side import gate_against_ref, gate_against_tree
    from sg_opt.gate_report import render, write_reports
    from targets.worker_protocol import WorkerRequest

    if sum(given is not None for given in (ref, ref_tree, baseline)) != 1:
        fail("give exactly one of --ref GIT_REV, --ref-tree DIR or --baseline FILE")
    if numerics_class not in ("exact", "reorder", "precision"):
        fail(f"--numerics-class must be exact, reorder or precision, not {numerics_class!r}")
    if blocks % 2:
        fail("--blocks must be even, so that each side runs first equally often")
    if floor is not None and floor > max_regression:
        fail(f"--floor {floor:g} is wider than --max-regression {max_regression:g}, so no measurement could pass: "
             f"raise --max-regression, or leave --floor out to calibrate it")
    options = GateOptions(max_regression=max_regression, numerics_class=numerics_class, numerics_steps=numerics_steps,
                          blocks=blocks, block_steps=block_steps, block_seconds=block_seconds, floor=floor,
                          aa_runs=aa_runs, ab_runs=ab_runs, timeout_s=timeout,
                          max_extensions=max_extensions, allow_inconclusive=allow_inconclusive)
    with Working("setting up the gate ...") as status:
        try:
            if baseline is not None:
                if config or set_ or data:
                    raise ConfigError("--baseline runs the saved target, size and config; drop --config, --set "
                                      "and --data")
                result = gate_against_baseline(baseline, options, status.update, ranks)
            else:
                overrides = inputs(target, size, config, set_, data, ranks or 1)
                spec = WorkerRequest(target=target, size=size, mode="bench", config=overrides, device=device,
                                     warmup=warmup, threads=threads, ranks=ranks or 1,
                                     data=str(Path(data).resolve()) if data else None)
                result = (gate_against_ref(spec, ref, options, status.update) if ref is not None
                          else gate_against_tree(spec, Path(ref_tree), options, status.update))
        except ConfigError as exc:
            fail(str(exc))
    write_reports(result, junit)
    if as_json:
        print(result.model_dump_json(indent=1))
    else:
        render(result, console)
    raise typer.Exit(result.exit_code)


@app.command()
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


class Stopped(BaseException):
    """Ctrl-C or SIGTERM (``timeout``, a batch system): unwinds the command so that every worker is asked where it
    was and killed on the way out (``targets.worker_client.run_child``) instead of running on, orphaned, beside the
    next command; a killed run's checkpoint is kept either way. Not a KeyboardInterrupt, which typer would turn
    into a silent exit."""


def _stop(signum: int, _frame) -> None:
    raise Stopped(signum)


def measuring(argv: list[str]) -> bool:
    """Whether the command measures on this machine (``MEASURING``): it then holds the presence lock for its life,
    so another run's measurements know they share the machine (``targets.machine_lease.run_presence``)."""
    command = next((arg for arg in argv if not arg.startswith("-")), None)
    return command in MEASURING


def main() -> None:
    for signum in (signal.SIGINT, signal.SIGTERM):
        if signal.getsignal(signum) is not signal.SIG_IGN:  # a shell's background job ignores SIGINT: keep that
            signal.signal(signum, _stop)
    try:
        with run_presence() if measuring(sys.argv[1:]) else contextlib.nullcontext():
            app()
    except Stopped as stop:
        name = signal.Signals(stop.args[0]).name
        err_console.print(f"stopped by {name} (a run resumes from its last checkpoint with --resume)")
        sys.exit(128 + stop.args[0])


if __name__ == "__main__":
    main()
