"""`sg-opt bench --vs OTHER.toml`: incumbent vs candidate, side by side, with an interval and a verdict.

The noise floor comes from an A/A calibration of the incumbent on this machine (unless given), and
the result names which side is which and the ratio's direction, so it can never be read backwards.
"""

from __future__ import annotations

import itertools
from typing import Callable

from rich.console import Console
from rich.table import Table

from targets.worker_protocol import WorkerRequest
from validators.confirmation import PROCESS_PAIRS, across_process_pairs
from validators.ab_result import ABResult, NoiseFloor
from validators.speedup import calibrate_noise_floor, measure_ab
from validators.steadiness import block_spread, steadier_of_two


def compare(incumbent: WorkerRequest, candidate: WorkerRequest, blocks: int, block_steps: int, timeout_s: float,
            floor: float | None, block_seconds: float = 0.0,
            progress: Callable[[str], None] = lambda line: None,
            pairs: int = PROCESS_PAIRS) -> tuple[ABResult, NoiseFloor | float]:
    """A/A-calibrate the incumbent (when no floor is given), then measure candidate against it, in blocks of
    at least ``block_steps`` steps and ``block_seconds``, spread over ``pairs`` fresh worker pairs and pooled
    (``validators.confirmation.across_process_pairs``); a disturbed measurement is repeated once and the
    steadier run quoted, as the agent's final measurement is (its ``note`` says so). ``progress`` gets a
    line as each measurement ends, so a run stopped from outside still shows how far it got."""
    aa_run = itertools.count(1)
    noise: NoiseFloor | float = floor if floor is not None else calibrate_noise_floor(
        incumbent, blocks, block_steps, timeout_s, block_seconds=block_seconds,
        on_run=lambda run: progress(f"A/A run {next(aa_run)} of the incumbent: {measured(run)}"))

    def timed(repeat: int) -> ABResult:  # its blocks spread over fresh worker pairs, pooled, as the agent's final
        result = across_process_pairs(lambda seed, n: measure_ab(
            incumbent, candidate, n, block_steps, timeout_s, floor=noise, seed=seed, block_seconds=block_seconds),
            blocks, pairs, seed=100 * repeat)
        progress(f"{'repeated ' if repeat else ''}candidate against incumbent: {measured(result)}")
        return result

    result, _ = steadier_of_two(timed)
    return result, noise


def measured(result: ABResult) -> str:
    """One measurement in a line: its ratio and interval (or failure), its wall time and the workers' start-up."""
    ready = max((s.ready_s for s in (result.a, result.b) if s.ready_s is not None), default=None)
    head = (f"failed ({result.failure.kind}): {result.failure.message}" if result.failure is not None
            else f"ratio {result.ratio:.4f} ({result.ci_low:.4f}-{result.ci_high:.4f}), block spread "
                 f"{block_spread(result):.0%}")
    line = head + f"; {result.wall_s:.0f} s" + (f", the workers ready after {ready:.0f} s" if ready is not None else "")
    if result.blocks_s:
        line += f", its blocks {result.blocks_s:.0f} s, closing {result.close_s:.0f} s"
    stalls = result.stalls()
    return line + (f"; {stalls}" if stalls else "")


def render(result: ABResult, noise: NoiseFloor | float, console: Console) -> None:
    floor_note = (f"calibrated by {len(noise.runs)} A/A runs of the incumbent" if isinstance(noise, NoiseFloor)
                  else "given with --floor")
    table = Table(title=f"{result.b.label} vs {result.a.label}: {result.ratio_definition}")
    for col in ("side", "config", "median step ms (per block)"):
        table.add_column(col, overflow="fold")
    for side in (result.a, result.b):
        blocks = ", ".join(f"{1e3 * m:.2f}" for m in side.block_medians)
        table.add_row(side.label, str(side.spec.config or "defaults"), blocks)
    console.print(table)
    console.print(f"ratio {result.ratio:.4f} (speedup x{result.speedup:.3f}), {100 * result.confidence:.0f}% interval "
                  f"[{result.ci_low:.4f}, {result.ci_high:.4f}], noise floor {result.floor:.4f} ({floor_note}) "
                  f"-> [bold]{result.verdict}[/]")
    if result.note:
        console.print(f"note: {result.note}")
    if not result.quotable:
        console.print(f"[bold]not a clean measurement[/]: {result.load_note()}; measure again on a quiet machine")
