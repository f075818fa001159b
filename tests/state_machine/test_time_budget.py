"""--max-minutes is the whole run: a candidate starts only when it and the final measurement still fit."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

from state_machine import nodes
from state_machine.state import Baseline, Evaluated, InFlight, Limits, RunState, Verdict
from state_machine.time_budget import candidate_s, final_measurement_s, out_of_time, profile_s
from tests.state_machine.records import candidate

XL_CALIBRATION = Path(__file__).resolve().parents[1] / "fixtures" / "h200_xl_calibration.json"


def with_history(state: RunState, accepted: int, rejected: int, calibration: Path = XL_CALIBRATION,
                 **updates) -> RunState:
    history = [Evaluated(candidate=candidate(i + 1, patch={"data_workers": 2}), incumbent_id=None,
                         verdict=Verdict(accepted=i < accepted, stage="measure", reason="r", ratio=0.5))
               for i in range(accepted + rejected)]
    base = Baseline(numerics_file="n", step_ms=314.5, noise_floor=0.01, calibration_file=str(calibration))
    updates.setdefault("plan", state.plan.model_copy(update={"final_pairs": 1}))  # as the runs replayed here measured
    return state.model_copy(update={"history": history, "baseline": base, **updates})


def test_the_final_measurement_is_sized_on_the_baselines_a_a_runs(state):
    """xl on the H200: two 40-block A/A runs of the 314.5 ms baseline took 110.1 and 108.9 s; their fixed cost
    (workers started, built, warmed up) and 20 block pairs make 65.5 s. At the A/A's own 40 blocks the estimate
    gives back the A/A's wall time."""
    runs = json.loads(XL_CALIBRATION.read_text())["runs"]
    xl = with_history(state, accepted=1, rejected=0)
    assert final_measurement_s(xl) == pytest.approx(65.47, abs=0.01)
    as_long = xl.model_copy(update={"plan": xl.plan.model_copy(update={"final_blocks": 40})})
    assert final_measurement_s(as_long) == pytest.approx(statistics.median(r["wall_s"] for r in runs), abs=0.6)
    # spread over three fresh pairs (the default plan): three fixed costs, and 8 blocks a pair (24 in all)
    three = xl.model_copy(update={"plan": state.plan})
    assert state.plan.final_pairs == 3 and final_measurement_s(three) == pytest.approx(117.17, abs=0.01)


def test_nothing_to_measure_reserves_nothing(state, tmp_path):
    assert final_measurement_s(with_history(state, accepted=0, rejected=3)) == 0.0
    assert final_measurement_s(with_history(state, accepted=1, rejected=0, calibration=tmp_path / "gone.json")) == 0.0


# The 2026-12-03 x12.37 `large-cached` run on an H200: its nodes' seconds when it stopped after #9 (9 candidates,
# 7 profiles, two calibrations after #2 and #6 of 46.5 + 50.4 and 56.2 + 55.2 s of A/A runs), 1,025.7 s used of
# 19 minutes.
S27_NODE_S = {"setup": 0.0, "baseline": 190.3, "diagnose": 332.1, "propose": 0.015, "check": 0.002,
              "validate": 229.6, "measure": 273.6, "decide": 0.004}
S27_CALIBRATION = XL_CALIBRATION.parent / "h200_large_cached_s27_calibration.json"


def s27_after_9(state: RunState, tmp_path: Path) -> RunState:
    from state_machine.state import Incumbent, Recalibration
    recalibrations = []
    for after, walls, step_ms in ((2, (46.5, 50.4), 42.17), (6, (56.2, 55.2), 17.28)):
        path = tmp_path / f"calibration_{after}.json"
        path.write_text(json.dumps({"runs": [{"wall_s": w} for w in walls]}))
        recalibrations.append(Recalibration(after_candidate=after, step_ms=step_ms, noise_floor=0.03,
                                            calibration_file=str(path)))
    return with_history(state, accepted=6, rejected=3, calibration=S27_CALIBRATION, elapsed_s=1025.7,
                        node_s=S27_NODE_S, profiles=[f"p{i}" for i in range(7)], recalibrations=recalibrations,
                        incumbent=Incumbent(from_candidate=9, est_speedup=11.7), limits=Limits(max_minutes=19))


def test_a_candidate_costs_its_own_evaluation_and_a_profile_its_own(state, tmp_path):
    """That run: 503 s of validation and timing over 9 candidates is 55.9 s each; 332 s of diagnoses less 208 s
    of calibrations over 7 profiles is 17.7 s each. The old mean (everything after the baseline, 93 s) charged each
    candidate a share of the calibrations and profiles."""
    run = s27_after_9(state, tmp_path)
    assert candidate_s(run) == pytest.approx(503.2 / 9, abs=0.01)
    assert profile_s(run) == pytest.approx((332.1 - 208.3) / 7, abs=0.01)
    assert candidate_s(state) == 0.0 and profile_s(state) == 0.0
    due = run.model_copy(update={"incumbent": run.incumbent.model_copy(update={"est_speedup": 40.0})})
    assert due.recalibration_due  # (this baseline is xl's 314.5 ms) twice as fast as the 17.28 ms of the floor in force
    assert profile_s(due) == pytest.approx(profile_s(run) + 56.2 + 55.2, abs=0.01)


def test_session_27s_run_had_time_for_one_more_candidate(state, tmp_path):
    """It stopped after #9's profile with 114 s of 19 minutes left, reckoning 93 s a candidate and 39 s for the
    final measurement; its candidates took 56 s. With the same numbers the run goes on, and stops when one more
    candidate would not fit. Right after an accepted candidate, the profile that would come first counts too."""
    run = s27_after_9(state, tmp_path)
    assert final_measurement_s(run) == pytest.approx(38.8, abs=0.1)
    assert out_of_time(run) is None and nodes.limit_reason(run) is None
    later = run.model_copy(update={"elapsed_s": 1035.0})
    assert out_of_time(later) is None
    assert out_of_time(later, profile_next=True).startswith(
        "max-minutes: 17.2 minutes used of 19; a profile of the incumbent about 18 s, a candidate takes 56 s")
    assert nodes.limit_reason(later, profile_next=True) is not None and nodes.limit_reason(run, profile_next=True) is None
    assert "a candidate takes 56 s" in out_of_time(run.model_copy(update={"elapsed_s": 1035.0 + 18.0}))


# The 2026-12-04 `large-cached` run on an H200: its seven candidates' own seconds (propose to decide, events.jsonl);
# #3 was extended and confirmed in workers started after it. It stopped at 17.3 of 19 minutes.
S29_CANDIDATE_S = (58.4, 90.1, 133.3, 46.5, 39.2, 42.6, 45.4)


def test_a_candidate_is_expected_to_take_the_median_candidates_time(state, tmp_path):
    """The mean, 65 s, stopped the 2026-12-04 run with 102 s left; the median, 46.5 s, and the final measurement fit
    there. A run whose candidates were not marked one by one (batched lanes, an older checkpoint) keeps the mean."""
    marks = [sum(S29_CANDIDATE_S[:i + 1]) for i in range(len(S29_CANDIDATE_S))]
    run = with_history(state, accepted=5, rejected=2, calibration=S27_CALIBRATION, elapsed_s=1038.0,
                       node_s={"validate": 279.5, "measure": marks[-1] - 279.5}, candidate_marks=marks,
                       limits=Limits(max_minutes=19))
    assert candidate_s(run) == pytest.approx(46.5)
    assert out_of_time(run) is None
    unmarked = run.model_copy(update={"candidate_marks": []})
    assert candidate_s(unmarked) == pytest.approx(sum(S29_CANDIDATE_S) / 7)
    assert "a candidate takes 65 s here" in out_of_time(unmarked)
    # four more turned away at the check (0.01 s each, as the oracle's samples over the HBM budget now are) do not
    # pull the estimate down: the next candidate may go through
    turned_away = [Evaluated(candidate=candidate(8 + i, patch={"pin_memory": True}), incumbent_id=None,
                             verdict=Verdict(accepted=False, stage="check", reason="over the budget"))
                   for i in range(4)]
    more = run.model_copy(update={"history": run.history + turned_away,
                                  "candidate_marks": marks + [marks[-1] + 0.01 * (i + 1) for i in range(4)]})
    assert candidate_s(more) == pytest.approx(46.5)


def test_deciding_a_candidate_marks_its_own_seconds(state):
    """``decide`` marks what candidates' own nodes have taken so far, so each candidate's time is the difference."""
    run = with_history(state, accepted=0, rejected=1, node_s={"propose": 0.5, "validate": 30.0, "measure": 12.0,
                                                               "diagnose": 20.0}, candidate_marks=[10.0])
    run = run.model_copy(update={"current": InFlight(
        candidate=candidate(2, patch={"pin_memory": True}),
        verdict=Verdict(accepted=False, stage="measure", reason="r", ratio=0.97))})
    updates = nodes.decide(run, ctx=type("Ctx", (), {"event": staticmethod(lambda *a, **k: None)})())
    assert updates["candidate_marks"] == [10.0, 42.5]
    assert candidate_s(run.model_copy(update=updates)) == pytest.approx((10.0 + 32.5) / 2)


def test_no_candidate_starts_that_the_final_measurement_would_push_past_the_limit(state):
    """At 17 of 20 minutes, 70 s a candidate and the 65 s final still fit; at 18 they do not, and the run
    stops there (the xl run went on proposing until 20 minutes and ended past them)."""
    node_s = {"baseline": 296.9, "validate": 338.3, "measure": 576.9}
    fits = with_history(state, accepted=4, rejected=9, elapsed_s=17 * 60, node_s=node_s,
                        limits=Limits(max_minutes=20))
    assert candidate_s(fits) + final_measurement_s(fits) + fits.elapsed_s < 20 * 60
    assert out_of_time(fits) is None and nodes.limit_reason(fits) is None
    late = fits.model_copy(update={"elapsed_s": 18 * 60})
    reason = nodes.limit_reason(late)
    assert reason.startswith("max-minutes: 18.0 minutes used of 20; a candidate takes")
    assert "final measurement about 65 s" in reason
    assert out_of_time(late.model_copy(update={"elapsed_s": 20 * 60})) == "max-minutes: 20.0 minutes used of 20"


# --pause-after: a node starts only while it fits in what is left of this invocation

def test_a_node_is_expected_to_take_its_longest_call_plus_what_it_will_do_this_time(state):
    """large-cached on an H200 (2026-12-02): after #2 the incumbent was estimated 3.4x faster than the step the
    floor was set on, so the next diagnose calibrates again: the A/A runs in force (here xl's, 110.1 + 108.9 s)
    come on top of its longest profile. The report carries the final measurement (65.5 s here)."""
    from state_machine.state import Incumbent
    from state_machine.time_budget import expected_node_s
    runs = json.loads(XL_CALIBRATION.read_text())["runs"]
    xl = with_history(state, accepted=1, rejected=0, node_max_s={"diagnose": 15.0, "validate": 52.0})
    assert expected_node_s(xl, "validate") == 52.0 and expected_node_s(xl, "baseline") == 0.0
    assert expected_node_s(xl, "diagnose") == 15.0  # the incumbent is not yet twice as fast
    faster = xl.model_copy(update={"incumbent": Incumbent(from_candidate=1, est_speedup=3.4)})
    assert faster.recalibration_due
    assert expected_node_s(faster, "diagnose") == pytest.approx(15.0 + sum(r["wall_s"] for r in runs))
    assert expected_node_s(xl, "report") == pytest.approx(final_measurement_s(xl))


def test_a_node_that_would_not_fit_pauses_the_run_before_it_starts(state, ctx):
    """The node wrapper checks before the node runs: nothing of it is done, the state is as the last checkpoint
    left it, and the pause says why. A node that ran records its longest call. The first node of an invocation
    starts whatever is left, so a node longer than the whole allowance cannot pause a run for ever."""
    import time

    from state_machine.graph import _timed
    from state_machine.time_budget import Paused, pause_reason
    calls = []

    def validate(s, c):
        calls.append(1)
        return {}
    timed = _timed(validate, ctx)
    ctx.pause_at = time.monotonic() + 60
    ran = state.model_copy(update={"node_max_s": {"validate": 90.0}})
    updates = timed(ran)  # the invocation's first node: it starts though 90 s > 60 s
    assert calls == [1] and updates["node_max_s"]["validate"] == 90.0
    with pytest.raises(Paused) as paused:
        timed(ran)
    assert calls == [1] and paused.value.node == "validate" and paused.value.run_dir == state.run_dir
    assert "expected to take 90 s" in str(paused.value)
    assert pause_reason(ran, "validate", 90.0) is None and pause_reason(ran, "validate", 89.0) is not None
    assert pause_reason(state, "validate", -1.0) is not None  # past the limit, even an unknown node waits
    ctx.pause_at = None
    timed(ran)  # no --pause-after: nothing pauses
    assert calls == [1, 1]
