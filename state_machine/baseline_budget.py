"""What ``--max-minutes`` leaves the baseline: its A/A calibration is sized to fit a share of the run.

The baseline's numerics runs take what they take; its A/A calibration is the part that grows with the plan
(repeats x 2 sides x blocks x a block's seconds, plus a pair of worker start-ups per repeat). Left at its defaults,
a short run spent its whole limit there: a DLRM-style job at size small on a 2-core CPU took 4.9-6.6 minutes in its
baseline, so a 10-minute run had little left for candidates. So once a step's time is known the calibration
is cut to fit ``BASELINE_SHARE`` of the limit: fewer blocks per side (never fewer than a candidate's measurement),
then a single A/A run. A run already past its limit stops there.
"""

from __future__ import annotations

from state_machine.state import EvalPlan, RunState

BASELINE_SHARE = 0.35  # of --max-minutes, for the whole baseline
BLOCK_OVERHEAD = 1.3   # a timed block's wall time over its steps' (the hand-over between the sides, the spot checks)


def calibration_s(plan: EvalPlan, step_s: float, start_s: float) -> float:
    """The expected wall seconds of the A/A calibration under `plan`: per repeat, two workers started (in
    parallel, ``start_s``) and both sides' blocks."""
    block_s = max(plan.block_steps * step_s, plan.block_seconds) * BLOCK_OVERHEAD
    return plan.aa_repeats * (start_s + 2 * plan.calibration_blocks * block_s)


def fit_calibration(state: RunState, plan: EvalPlan, step_s: float, start_s: float,
                    spent_s: float) -> tuple[EvalPlan, str | None]:
    """The plan with its A/A calibration cut to what the baseline's share of --max-minutes leaves after
    ``spent_s`` seconds of baseline, and a sentence saying what was cut (None: nothing)."""
    budget_s = BASELINE_SHARE * 60.0 * state.limits.max_minutes - spent_s
    wanted = calibration_s(plan, step_s, start_s)
    if wanted <= budget_s:
        return plan, None
    fitted = plan
    while calibration_s(fitted, step_s, start_s) > budget_s and fitted.aa_blocks > plan.blocks:
        step = 2 * max(1, (fitted.aa_blocks - plan.blocks) // 4)  # a quarter of what is left to cut, even
        fitted = fitted.model_copy(update={"aa_blocks": max(plan.blocks, fitted.aa_blocks - step)})
    if calibration_s(fitted, step_s, start_s) > budget_s and fitted.aa_repeats > 1:
        fitted = fitted.model_copy(update={"aa_repeats": 1})
    note = (f"A/A calibration cut to {fitted.aa_repeats} run(s) of {fitted.calibration_blocks} blocks per side "
            f"(about {calibration_s(fitted, step_s, start_s):.0f} s, from {wanted:.0f} s) to fit "
            f"{BASELINE_SHARE:.0%} of --max-minutes {state.limits.max_minutes:g} in the baseline")
    return fitted, note
