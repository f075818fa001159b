"""`sg-opt bench --vs` output: a figure measured beside another sg-opt run says it is not clean."""

from __future__ import annotations

import io

from rich.console import Console

from sg_opt.compare import render
from targets.worker_protocol import WorkerRequest
from validators.ab_stats import block_order
from validators.machine_load import LoadRecord
from validators.ab_result import ABResult, SideSummary


def result(load: LoadRecord | None) -> ABResult:
    spec = WorkerRequest(target="haste-rec", size="tiny", mode="bench")
    sides = [SideSummary(label=label, digest=label, spec=spec, block_medians=[ms / 1e3] * 4)
             for label, ms in (("incumbent", 100.0), ("candidate", 25.0))]
    return ABResult(a=sides[0], b=sides[1], ratio_definition="candidate_time / incumbent_time", ratio=0.25,
                    speedup=4.0, ci_low=0.24, ci_high=0.26, floor=0.02, verdict="faster", order=block_order(4),
                    blocks=4, steps_per_block=3, load=load)


def shown(measured: ABResult) -> str:
    out = io.StringIO()
    render(measured, 0.02, Console(file=out, width=200, force_terminal=False))
    return out.getvalue()


def test_a_measurement_beside_another_run_says_it_is_not_clean():
    said = shown(result(LoadRecord(beside_runs=2)))
    assert "not a clean measurement: 2 other sg-opt run(s) shared the machine" in said
    assert "not a clean measurement" not in shown(result(LoadRecord())) + shown(result(None))
