"""--max-minutes covers the baseline: its A/A calibration is cut to fit its share of the run, never below a
candidate's measurement, and a short run says so."""

from __future__ import annotations

from state_machine.baseline_budget import BASELINE_SHARE, calibration_s, fit_calibration
from state_machine.state import EvalPlan, Limits, RunState


def state(minutes: float) -> RunState:
    return RunState(run_id="r", run_dir="unused", target="t", size="s", limits=Limits(max_minutes=minutes))


PLAN = EvalPlan(block_steps=10, blocks=6, aa_blocks=40, aa_repeats=2)


def test_a_long_run_keeps_its_calibration():
    plan, cut = fit_calibration(state(60), PLAN, step_s=0.03, start_s=5.0, spent_s=20.0)
    assert plan == PLAN and cut is None


def test_a_short_run_cuts_blocks_then_repeats_to_fit_its_share():
    plan, cut = fit_calibration(state(3), PLAN, step_s=0.03, start_s=5.0, spent_s=20.0)
    assert calibration_s(plan, 0.03, 5.0) <= BASELINE_SHARE * 180 - 20 and cut and "--max-minutes 3" in cut
    assert plan.aa_blocks % 2 == 0 and plan.blocks <= plan.aa_blocks < PLAN.aa_blocks
    tight, _ = fit_calibration(state(1), PLAN, step_s=0.03, start_s=5.0, spent_s=20.0)
    assert (tight.aa_blocks, tight.aa_repeats) == (PLAN.blocks, 1)  # the least it can be
