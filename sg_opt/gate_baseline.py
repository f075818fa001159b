"""`sg-opt gate --baseline FILE`: the figures ``sg-opt bench --save`` kept against the saved request run again on
the working tree, unpaired (``sg_opt.saved_baseline``), extended while inconclusive (the rules: ``sg_opt.gate``)."""

from __future__ import annotations

import statistics
import time
from pathlib import Path

from sg_opt import run_machine, saved_baseline
from sg_opt.gate import (GateOptions, GateResult, GateSetupError, Progress, StepTimeCheck, failed_timing,
                         gate_result, holds_a_bound, judge_numerics, judge_step_time, unless_numerics_failed,
                         until_clear, working_tree_label)
from targets.worker_client import run_worker
from targets.worker_protocol import Environment, WorkerResult


def _unpaired_step_time(saved: saved_baseline.SavedBaseline, runs: list[WorkerResult],
                        options: GateOptions) -> StepTimeCheck:
    """The working tree's runs so far against the saved ones; failed when the last of them failed."""
    floor = options.floor
    if not runs[-1].ok:
        return failed_timing(runs[-1].failure, floor or 0.0, "none: the run failed", options)
    current_s = [run.bench.step_s for run in runs]
    if floor is None:
        floor = saved_baseline.unpaired_floor(saved.block_medians, saved_baseline.block_medians(current_s))
        source = (f"unpaired: {saved_baseline.UNPAIRED_MIN_FLOOR:.0%} + the spreads of the block medians of "
                  f"{len(saved.step_s)} saved and {len(current_s)} new runs")
    else:
        source = "given with --floor"
    ratio, low, high = saved_baseline.unpaired_ratio(saved.step_s, current_s)
    medians = [1e3 * statistics.median(s for run in side for s in run) for side in (saved.step_s, current_s)]
    return judge_step_time(ratio, low, high, floor, source, options.max_regression, *medians)


def gate_against_baseline(path: str, options: GateOptions, progress: Progress = lambda _: None,
                          ranks: int | None = None) -> GateResult:
    """Side A = the figures saved in ``path``, side B = the saved request run again on the working tree, on
    the saved number of ranks (``ranks``, when given, must be that number)."""
    start, saved, host = time.monotonic(), saved_baseline.load(path), run_machine.host_info()
    spec = saved.request
    a_label = f"baseline {Path(path).name} ({saved.created}{', ' + saved.commit[:12] if saved.commit else ''})"
    b_label = working_tree_label(Path.cwd())
    for mismatch in (saved_baseline.ranks_mismatch(saved, ranks),
                     saved_baseline.machine_mismatch(saved, _this_cpu(saved), host)):
        if mismatch:
            raise GateSetupError(mismatch)
    progress(f"timing the working tree ({len(saved.step_s)} runs of {spec.steps} steps, as saved) ...")
    runs = saved_baseline.more_runs(spec, [], len(saved.step_s), options.timeout_s)
    bench = runs[-1]
    if bench.environment and (mismatch := saved_baseline.machine_mismatch(saved, bench.environment, host)):
        raise GateSetupError(mismatch)
    if not bench.ok and bench.failure.kind == "config":
        raise GateSetupError(f"the saved request cannot run here: {bench.failure.message}")
    progress("numerics fingerprint of the working tree ...")
    numerics_run = run_worker(saved_baseline.numerics_request(spec, saved.numerics_steps), timeout_s=options.timeout_s)
    numerics = judge_numerics(saved.numerics, numerics_run, options, saved.numerics_steps)
    warnings = saved_baseline.environment_warnings(saved, bench.environment, host) if bench.environment else []

    def one_more_run(check: StepTimeCheck) -> str | None:
        if not holds_a_bound(check):
            return ("the unpaired floor is wider than the allowed regression, and more runs do not narrow it "
                    "(--ref measures side by side)")
        runs[:] = saved_baseline.more_runs(spec, runs, len(runs) + 1, options.timeout_s)
        return None

    step = until_clear(lambda: _unpaired_step_time(saved, runs, options),
                       unless_numerics_failed(numerics, one_more_run), options, progress)
    return gate_result("baseline", spec, a_label, b_label, step, numerics, warnings, start, options,
                       environment=bench.environment)


def _this_cpu(saved: saved_baseline.SavedBaseline) -> Environment | None:
    """This machine's environment where it is known without a worker (CPU runs), else None."""
    if saved.request.device != "cpu":
        return None
    import torch

    from targets.worker import environment
    return environment(torch.device("cpu"))

