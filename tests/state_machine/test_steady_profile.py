"""The incumbent's profile held against the run's own measurements: a disturbed one (its steps far slower, even
without the profiler, than measured side by side) is profiled once more and the steadier kept, and one that stays
disturbed says so. The profiles are real: `xl` on an H200 (2026-12-03), after candidates 10 and 14."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from profilers.records import DISTURBED_SLOWDOWN, ProfileResult
from state_machine import nodes
from state_machine.state import Baseline, Incumbent, Recalibration
from state_machine.steady_profile import PROFILE_TRIES_WHEN_DISTURBED, expected_step_ms, steadiest_profile
from targets.worker_protocol import Failure

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
# After #14 the run's measurements put the incumbent at 17.62 ms (the baseline's 313.02 ms A/A step times the
# accepted ratios 0.9823, 0.2067, 0.3282, 0.8921, 0.9470); the final side-by-side measured it at 17.99 ms.
XL_AFTER_14_MS = 313.02417 * 0.9823452206615608 * 0.20668103710166413 * 0.32815987506247624 * 0.8920744561419274 \
    * 0.9470443426860812


def xl_profile(after: int) -> ProfileResult:
    return ProfileResult.model_validate_json((FIXTURES / f"h200_xl_s23_after_{after}.json").read_text())


def profiles(*results: ProfileResult):
    """A stand-in for one worker per call, handing out ``results`` in order; ``calls`` counts them."""
    queue = list(results)

    def profile() -> ProfileResult:
        profile.calls += 1
        return queue.pop(0)
    profile.calls = 0
    return profile


def test_the_disturbed_xl_profile_is_taken_again_and_the_steady_one_kept():
    disturbed, steady = xl_profile(14), xl_profile(10)
    assert disturbed.coarse.profiler_overhead < 1.5  # the profiler itself did not slow it: only the expectation can tell
    heard = []
    profile = profiles(disturbed, steady)
    kept = steadiest_profile(profile, XL_AFTER_14_MS, heard.append)
    assert profile.calls == 2 and heard == [pytest.approx(31.54 / 17.62, rel=1e-3)]
    assert kept.coarse.unprofiled_step_s == steady.coarse.unprofiled_step_s
    assert kept.coarse.expected_step_s == pytest.approx(XL_AFTER_14_MS / 1e3)
    assert kept.coarse.slowdowns_tried == [pytest.approx(1.790, abs=1e-3), pytest.approx(1.254, abs=1e-3)]
    assert kept.coarse.distortion_note() is None and kept.findings == steady.findings


def test_a_profile_that_stays_disturbed_says_so_and_the_least_disturbed_is_kept():
    worse = xl_profile(14)
    worse = worse.model_copy(update={"coarse": worse.coarse.model_copy(update={"unprofiled_step_s": 0.040})})
    profile = profiles(worse, xl_profile(14))
    kept = steadiest_profile(profile, XL_AFTER_14_MS)
    assert profile.calls == PROFILE_TRIES_WHEN_DISTURBED == 2
    assert kept.coarse.unprofiled_step_s == pytest.approx(0.03153790989999834)
    note = kept.coarse.distortion_note()
    assert note == ("its steps took 31.54 ms even without the profiler, x1.79 the 17.62 ms the side-by-side "
                    "measurements put this configuration at; the steadier of 2 profiles: other work slowed the "
                    "machine while it ran, so its phase times overstate the step's")


def test_a_steady_profile_is_taken_once_and_keeps_its_expectation():
    profile = profiles(xl_profile(10))
    kept = steadiest_profile(profile, 18.6)
    assert profile.calls == 1 and kept.coarse.slowdowns_tried == [pytest.approx(22.09 / 18.6, abs=1e-3)]
    assert kept.coarse.slowdown < DISTURBED_SLOWDOWN and kept.coarse.distortion_note() is None


def test_without_an_expectation_or_a_profile_nothing_is_compared():
    profile = profiles(xl_profile(14))
    assert steadiest_profile(profile, None).coarse.expected_step_s is None and profile.calls == 1
    failed = ProfileResult(ok=False, target="haste-rec", size="xl", failure=Failure(kind="crash", message="x"))
    profile = profiles(failed)
    assert steadiest_profile(profile, 17.6) is failed and profile.calls == 1


def test_a_failed_second_profile_keeps_the_first():
    failed = ProfileResult(ok=False, target="haste-rec", size="xl", failure=Failure(kind="oom", message="x"))
    profile = profiles(xl_profile(14), failed)
    kept = steadiest_profile(profile, XL_AFTER_14_MS)
    assert profile.calls == 2 and kept.ok and len(kept.coarse.slowdowns_tried) == 1
    assert "other work slowed the machine" in kept.coarse.distortion_note()


def test_both_causes_are_named_in_one_sentence():
    coarse = xl_profile(14).coarse
    coarse = coarse.model_copy(update={"expected_step_s": 0.01762, "step_s": 0.0500,
                                       "profiler_overhead": 0.0500 / coarse.unprofiled_step_s})
    note = coarse.distortion_note()
    assert note.startswith("the profiler made its steps x1.59 slower (50.00 against 31.54 ms without it) and its "
                           "steps took 31.54 ms even without the profiler, x1.79 the 17.62 ms")
    assert note.endswith(", so its phase times overstate the step's")


def test_the_expected_step_is_the_newest_measurement_of_the_incumbent(state):
    base = state.model_copy(update={"baseline": Baseline(numerics_file="n.json", step_ms=313.0, noise_floor=0.01,
                                                         calibration_file="c.json")})
    assert expected_step_ms(state, []) is None
    assert expected_step_ms(base, []) == 313.0
    after = base.model_copy(update={"incumbent": Incumbent(from_candidate=8, est_speedup=15.0)})
    assert expected_step_ms(after, []) == pytest.approx(313.0 / 15.0)
    recal = [Recalibration(after_candidate=7, step_ms=63.6, noise_floor=0.01, calibration_file="a"),
             Recalibration(after_candidate=8, step_ms=20.73, noise_floor=0.014, calibration_file="b")]
    assert expected_step_ms(after, recal) == 20.73
    assert expected_step_ms(after, recal[:1]) == pytest.approx(313.0 / 15.0)  # an older incumbent's A/A


def test_diagnose_profiles_a_disturbed_incumbent_again_and_logs_it(state, ctx, monkeypatch):
    handed = [xl_profile(14), xl_profile(10)]
    monkeypatch.setattr(nodes, "run_profile", lambda req, timeout_s: handed.pop(0))
    accepted = state.model_copy(update={
        "baseline": Baseline(numerics_file="n.json", step_ms=313.02417, noise_floor=0.01, calibration_file="c.json"),
        "incumbent": Incumbent(from_candidate=14, est_speedup=313.02417 / XL_AFTER_14_MS),
        "plan": state.plan.model_copy(update={"recalibrate_after": 0.0})})
    out = nodes.diagnose(accepted, ctx)
    assert not handed
    saved = json.loads(Path(out["profiles"][-1]).read_text())
    assert saved["coarse"]["slowdowns_tried"] == [pytest.approx(1.790, abs=1e-3), pytest.approx(1.254, abs=1e-3)]
    events = [json.loads(line) for line in Path(state.run_dir, "events.jsonl").read_text().splitlines()]
    (disturbed,) = [e for e in events if e["event"] == "profile-disturbed"]
    assert disturbed["slowdown"] == pytest.approx(1.790, abs=1e-3) and "profiled again" in disturbed["reason"]
    assert [e["distorted"] for e in events if e["event"] == "diagnose"] == [None]


def test_without_a_calibration_the_incumbent_is_expected_at_its_own_blocks_in_the_measurement_that_accepted_it(
        state):
    """The 2026-12-04 `large-cached` run, after #3: the product of the ratios said 29.0 ms; #3's own blocks in its
    accepting (pooled) confirmation ran at a median of 63.5 ms, and its profile's unprofiled 76.0 ms is then no
    disturbance (x1.20, where against the product it was x2.62 and profiled again)."""
    from state_machine.state import Evaluated, Verdict
    from tests.state_machine.records import candidate
    from validators.ab_result import ABResult, SideSummary
    last = json.loads((FIXTURES / "h200_large_cached_s29_ab_3.json").read_text())["runs"][-1]
    accepting = ABResult.model_construct(**{side: SideSummary.model_construct(**last[side]) for side in "ab"})
    accepted = Evaluated(candidate=candidate(3, patch={"embedding_cache_index": "device"}), incumbent_id=2,
                         verdict=Verdict(accepted=True, stage="measure", reason="r", ratio=0.6873,
                                         step_ms=accepting.step_ms("b")))  # as the measure node records it
    run = state.model_copy(update={
        "baseline": Baseline(numerics_file="n.json", step_ms=152.58, noise_floor=0.03, calibration_file="c.json"),
        "incumbent": Incumbent(from_candidate=3, est_speedup=152.58 / 29.04), "history": [accepted]})
    assert expected_step_ms(run, []) == pytest.approx(63.49, abs=0.01)
    assert 76.04 / expected_step_ms(run, []) < DISTURBED_SLOWDOWN
    assert expected_step_ms(run, [Recalibration(after_candidate=3, step_ms=60.0, noise_floor=0.05,
                                                calibration_file="a")]) == 60.0  # an A/A on it comes first
    unrecorded = accepted.model_copy(update={"verdict": accepted.verdict.model_copy(update={"step_ms": None})})
    assert expected_step_ms(run.model_copy(update={"history": [unrecorded]}), []) == pytest.approx(29.04)
