"""What the end of a run needs out of ``--max-minutes``, so that the whole run ends inside it.

``--max-minutes`` is the run's wall time, and after the last candidate come the final side-by-side
measurement of baseline against best and the report. A run that only stops proposing once the limit is
reached overruns it by a candidate and that measurement: `xl` on an H200 (2026-11-30) had used 20.2 of
its 20 minutes with its 14th candidate still being timed and the final measurement still to come. So a
new candidate starts only while what it is expected to take (the run's own median so far) and the final
measurement (sized on the baseline's A/A runs) both fit in what is left. A candidate's cost is its own
evaluation, plus the profile that follows an accepted one when the run is about to take it: not the one-off
noise-floor calibrations, which `large-cached` on an H200 (2026-12-03) spread as 23 s over each of its 9
candidates, stopping it with 114 s left where a candidate took 56 s and the final measurement 39.

``--pause-after`` bounds one invocation instead, for a run split over jobs of limited length (a batch
system's, or a machine lent 10 minutes at a time): a node starts only while what it is expected to take fits
in what is left of it; else the run pauses at its last checkpoint, to be resumed. A job's hard limit then stops
no node midway: at `large-cached` on an H200 (2026-12-02) the 10-minute limit of two calls killed a noise-floor
calibration 211 s and 112 s into it, and each resume began it again.
"""

from __future__ import annotations

import json
import statistics
from functools import lru_cache
from pathlib import Path

from state_machine.state import RunState
from validators.confirmation import blocks_per_pair
from validators.ab_result import ABResult

CANDIDATE_NODES = ("propose", "check", "validate", "measure", "decide", "evaluate_batch")  # a candidate's own


def own_s(state: RunState) -> float:
    """The seconds booked so far to candidates' own nodes."""
    return sum(state.node_s.get(name, 0.0) for name in CANDIDATE_NODES)


def candidate_s(state: RunState) -> float:
    """The median wall seconds of a candidate's own evaluation in this run (proposed, checked, validated, timed),
    0 before the first; of those past the check node where there are any; the mean where the run has not marked
    each candidate's (``RunState.candidate_marks``: batched lanes, a checkpoint from before the marks). One
    candidate measured again and again (an extension, a confirmation in workers started after it) costs two or
    three typical ones: in the 2026-12-04 `large-cached` run #3's 133 s lifted the mean of seven to 65 s where the
    last four took 39-47 s, and the run stopped with 102 s left, enough for the median candidate (46.5 s) and the
    final measurement (41 s)."""
    if not state.evaluated:
        return 0.0
    marks = state.candidate_marks
    if len(marks) != state.evaluated:
        return own_s(state) / state.evaluated
    costs = [after - before for before, after in zip([0.0] + marks[:-1], marks)]
    # a candidate the check node turned away costs next to nothing; the next one may well go through
    timed = [cost for cost, e in zip(costs, state.history) if e.verdict.stage != "check"]
    return statistics.median(timed or costs)


def profile_s(state: RunState) -> float:
    """The mean wall seconds of this run's diagnoses less their noise-floor calibrations (0 before the first), plus
    a calibration when the next diagnose will calibrate again (``expected_node_s``'s)."""
    diagnosed = len(state.profiles)
    calibrating = sum(_calibration_s(r.calibration_file) for r in state.recalibrations)
    mean = max(0.0, state.node_s.get("diagnose", 0.0) - calibrating) / diagnosed if diagnosed else 0.0
    return mean + (_calibration_s(_floor_file(state)) if state.recalibration_due else 0.0)


@lru_cache(maxsize=8)
def _calibration_runs(path: str) -> tuple[dict, ...]:
    """The A/A runs of a calibration file, read once (a finished calibration file is never rewritten)."""
    return tuple(json.loads(Path(path).read_text(encoding="utf-8")).get("runs", []))


@lru_cache(maxsize=8)
def _final_from_calibration(path: str, blocks: int, pairs: int = 1) -> float:
    """Per A/A run: its fixed cost (workers started, built, warmed up: wall time less its timed blocks) once per
    fresh worker pair, plus each pair's share of ``blocks`` (``blocks_per_pair``) pairs of its mean block; the
    median over the runs. The best side's blocks are no longer than the baseline's, so this bounds a final
    measurement that is not repeated."""
    estimates = []
    for run in map(ABResult.model_validate, _calibration_runs(path)):
        waited = run.waited_s + (run.load.waited_s if run.load is not None else 0.0)  # the machine's, not the work's
        fixed, block = max(0.0, run.wall_s - waited - run.medians_s), run.medians_s / max(1, run.blocks)
        estimates.append(pairs * (fixed + blocks_per_pair(blocks, pairs) * block))
    return statistics.median(estimates) if estimates else 0.0


def final_measurement_s(state: RunState) -> float:
    """The expected wall seconds of the final measurement (0 when there is nothing to measure: no accepted change
    yet, or no baseline calibration to size it on)."""
    if not state.accepted or state.baseline is None or not Path(state.baseline.calibration_file).is_file():
        return 0.0
    try:
        return _final_from_calibration(state.baseline.calibration_file,
                                       max(state.plan.blocks, state.plan.final_blocks), state.plan.final_pairs)
    except (OSError, ValueError, KeyError, TypeError):
        return 0.0


def out_of_time(state: RunState, profile_next: bool = False) -> str | None:
    """Why ``--max-minutes`` allows no further candidate, or None. ``profile_next``: the run would profile its
    incumbent first (after an accepted candidate), so that profile must fit too."""
    limit_s = 60.0 * state.limits.max_minutes
    used = f"{state.elapsed_s / 60:.1f} minutes used of {state.limits.max_minutes:g}"
    if state.elapsed_s >= limit_s:
        return f"max-minutes: {used}"
    need, final = candidate_s(state), final_measurement_s(state)
    profile = profile_s(state) if profile_next else 0.0
    if state.elapsed_s + profile + need + final > limit_s:
        first = f"a profile of the incumbent about {profile:.0f} s, " if profile_next else ""
        return (f"max-minutes: {used}; {first}a candidate takes {need:.0f} s here and the final measurement about "
                f"{final:.0f} s, which would not fit")
    return None


class Paused(Exception):
    """The run stopped before a node that would not fit in what --pause-after leaves; its checkpoint is the last
    node's, so ``--resume`` starts that node."""

    def __init__(self, node: str, reason: str, run_dir: str):
        super().__init__(f"paused before {node}: {reason}")
        self.node, self.reason, self.run_dir = node, reason, run_dir


def _floor_file(state: RunState) -> str:
    """The calibration file of the noise floor in force: the last recalibration's, else the baseline's."""
    if state.recalibrations:
        return state.recalibrations[-1].calibration_file
    return state.baseline.calibration_file if state.baseline is not None else ""


def _calibration_s(path: str) -> float:
    """Wall seconds of the A/A runs of a calibration file (0 when it cannot be read): what calibrating the noise
    floor it set again is expected to take."""
    try:
        return float(sum(run["wall_s"] - run.get("waited_s", 0.0) - ((run.get("load") or {}).get("waited_s") or 0.0)
                         for run in _calibration_runs(path)))
    except (OSError, ValueError, KeyError, TypeError):
        return 0.0


def expected_node_s(state: RunState, node: str) -> float:
    """What `node` is expected to take next: its longest call in this run so far (0 before its first), plus a
    noise-floor calibration for a diagnose that will calibrate again, and the final measurement for the report.
    A diagnose whose longest call held a calibration is counted with two: the pause comes early, not late."""
    expected = state.node_max_s.get(node, 0.0)
    if node == "diagnose" and state.recalibration_due:
        expected += _calibration_s(_floor_file(state))
    if node == "report" and state.final is None:
        expected += final_measurement_s(state)
    return expected


def pause_reason(state: RunState, node: str, left_s: float) -> str | None:
    """Why `node` must not start with `left_s` seconds of --pause-after left, or None."""
    need = expected_node_s(state, node)
    if need <= left_s:
        return None
    if left_s <= 0:
        return "the time --pause-after gave this invocation is used up"
    return f"it is expected to take {need:.0f} s and {left_s:.0f} s of --pause-after are left"
