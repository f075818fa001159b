"""`sg-opt optimize`: start, resume or pause the agent on a target, and print its result."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from sg_opt.cli_common import (CONFIG_OPT, DATA_OPT, DEVICE_OPT, RANKS_OPT, SET_OPT, SIZE_OPT, TARGET_OPT, THREADS_OPT,
                               console, err_console, fail, inputs, verbosity)
from targets.protocol import ConfigError

PAUSED_EXIT = 3  # --pause-after: paused at a checkpoint, to be continued with --resume

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
    final_pairs: int = typer.Option(3, "--final-pairs", min=1, help="fresh worker pairs the final measurement's "
                                    "blocks are spread over and pooled (identical workers differ by offsets of "
                                    "their own; each pair costs a worker start a side)"),
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
            plan = {"blocks": blocks, "final_blocks": final_blocks, "final_pairs": final_pairs,
                    "aa_repeats": aa_runs, "aa_blocks": aa_blocks,
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
