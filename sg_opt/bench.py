"""`sg-opt bench`: step time of one target config through the worker, as a table or JSON."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from profilers.stats import quantile
from sg_opt import saved_baseline
from targets.worker_client import run_worker
from targets.worker_protocol import WorkerRequest, WorkerResult


def bench(target: str, size: str, overrides: dict[str, Any], device: str, steps: int, warmup: int,
          phase_steps: int, timeout_s: float, threads: int | None = None, data: str | None = None,
          save: str | None = None, ranks: int = 1) -> WorkerResult:
    """One bench worker; with ``save``, a successful run and its numerics fingerprint are written to that
    file for `sg-opt gate --baseline` (``sg_opt.saved_baseline``; raises ``SaveFailed`` if the numerics
    run fails)."""
    req = WorkerRequest(target=target, size=size, mode="bench", config=overrides, device=device, steps=steps,
                        warmup=warmup, phase_steps=phase_steps, threads=threads, ranks=ranks,
                        data=str(Path(data).resolve()) if data and save else data)
    result = run_worker(req, timeout_s=timeout_s)
    if save is not None and result.ok:
        saved_baseline.save(save, req, result, timeout_s)
    return result


def step_summary(step_s: list[float]) -> dict[str, float]:
    return {"median_ms": 1e3 * statistics.median(step_s), "p10_ms": 1e3 * quantile(step_s, 0.1),
            "p90_ms": 1e3 * quantile(step_s, 0.9), "mean_ms": 1e3 * statistics.fmean(step_s)}


def render(result: WorkerResult, console: Console) -> None:
    """Step-time, phase and counter tables for a successful bench result."""
    data, env = result.bench, result.environment
    summary = step_summary(data.step_s)
    ranks = f", {env.ranks} ranks: each step's slowest" if env.ranks > 1 else ""
    head = Table(title=f"{result.target} @ {result.size} on {env.device} ({env.device_name}){ranks}")
    for col in ("median ms", "p10 ms", "p90 ms", "steps", "samples/s", "final loss"):
        head.add_column(col, justify="right")
    head.add_row(f"{summary['median_ms']:.2f}", f"{summary['p10_ms']:.2f}", f"{summary['p90_ms']:.2f}",
                 str(len(data.step_s)), f"{data.samples_per_step / (summary['median_ms'] / 1e3):,.0f}",
                 f"{data.final_loss:.4g}")
    console.print(head)
    if data.rank_median_s:
        console.print("median ms per rank: " + ", ".join(f"rank {r}: {1e3 * m:.2f}"
                                                          for r, m in enumerate(data.rank_median_s)))
    slowest = " (slowest rank)" if data.rank_median_s else ""
    phases = Table(title=f"time per phase (synchronised pass){slowest}")
    phases.add_column("phase")
    phases.add_column("ms / step", justify="right")
    phases.add_column("share", justify="right")
    total = sum(data.phase_s.values()) or 1.0
    for name, seconds in data.phase_s.items():
        phases.add_row(name, f"{1e3 * seconds:.2f}", f"{100 * seconds / total:.0f}%")
    console.print(phases)
    shown = {name: value for name, value in data.counters.items() if value}
    if shown:
        counters = Table(title="counters (non-zero)")
        counters.add_column("counter")
        counters.add_column("value", justify="right")
        for name, value in shown.items():
            counters.add_row(name, f"{value:,.4g}")
        console.print(counters)
