"""The incumbent's profile, held against what the run has measured of the same configuration.

A profile is one fresh process stepping a few times; the side-by-side measurements are many blocks in fresh
processes. When the profile's steps run far slower than those measured even without the profiler, something else
kept the machine busy while it ran (profilers.records.DISTURBED_SLOWDOWN), and its phase times, the findings the
proposers act on and the report's floor table would describe that disturbance, not the step. Such a profile is
taken once more and the steadier of the two kept; one that stays disturbed says so (``distortion_note``).
"""

from __future__ import annotations

from typing import Callable

from profilers.records import DISTURBED_SLOWDOWN, ProfileResult
from state_machine.state import Recalibration, RunState

PROFILE_TRIES_WHEN_DISTURBED = 2  # profiles in all when the first is disturbed


def expected_step_ms(state: RunState, recalibrations: list[Recalibration]) -> float | None:
    """The incumbent's step as the run has measured it: an A/A calibration on it where there is one (the baseline's,
    or a recalibration after its candidate); else its own blocks in the measurement that accepted it; else the
    baseline's step over the accepted ratios' product.

    A ratio is a comparison, not a clock: in the 2026-12-04 `large-cached` run #3 was accepted at 0.687 against an
    incumbent that ran 79-221 ms a block in those measurements, where its calibration had put it at 47.7, so the
    product said 29.0 ms for a configuration whose own blocks there ran at a median of 63.5 ms (and at 41-93 ms as
    the next candidate's incumbent). Its profile, at 76.0 ms, was taken as disturbed (x2.62) and taken again."""
    if state.baseline is None:
        return None
    cid = state.incumbent.from_candidate
    on_it = [r.step_ms for r in recalibrations if cid is not None and r.after_candidate == cid]
    if on_it:
        return on_it[-1]
    return _accepted_blocks_ms(state, cid) or state.est_step_ms


def _accepted_blocks_ms(state: RunState, cid: int | None) -> float | None:
    """Candidate `cid`'s own step in the measurement whose ratio accepted it (``Verdict.step_ms``); None where none
    was recorded (the baseline, a checkpoint from before the field)."""
    verdicts = [e.verdict for e in state.history if e.candidate.id == cid and e.verdict.accepted]
    return verdicts[-1].step_ms if verdicts else None


def _expecting(result: ProfileResult, expected_ms: float) -> ProfileResult | None:
    """``result`` with the expected step recorded on its coarse profile (None: no profile came back)."""
    if not result.ok or result.coarse is None:
        return None
    coarse = result.coarse.model_copy(update={"expected_step_s": expected_ms / 1e3})
    return result.model_copy(update={"coarse": coarse})


def steadiest_profile(profile: Callable[[], ProfileResult], expected_ms: float | None,
                      on_disturbed: Callable[[float], None] = lambda slowdown: None) -> ProfileResult:
    """``profile()``, taken once more when its steps ran over DISTURBED_SLOWDOWN times ``expected_ms`` without the
    profiler (``on_disturbed`` hears the slowdown); the kept profile records the expectation and every slowdown."""
    first = profile()
    if not expected_ms or (kept := _expecting(first, expected_ms)) is None:
        return first
    tried = [kept]
    while tried[-1].coarse.slowdown > DISTURBED_SLOWDOWN and len(tried) < PROFILE_TRIES_WHEN_DISTURBED:
        on_disturbed(tried[-1].coarse.slowdown)
        if (again := _expecting(profile(), expected_ms)) is None:
            break  # a failed retry: keep what came back
        tried.append(again)
    kept = min(tried, key=lambda r: r.coarse.slowdown)
    coarse = kept.coarse.model_copy(update={"slowdowns_tried": [r.coarse.slowdown for r in tried]})
    return kept.model_copy(update={"coarse": coarse})
