"""The offline rules' joined proposals (state_machine/proposers/joined.py), replayed on the real profiles and
histories of H200 runs: a leaning host change with a leaning device change, and every leaning change at once."""

from __future__ import annotations

import pytest

from state_machine.proposers.offline import propose_offline
from state_machine.state import Evaluated, Verdict
from tests.state_machine.records import candidate
from tests.state_machine.replays import (LARGE_CACHED_BASE, S22_LARGE_CACHED_HISTORY,
                                        S27_LARGE_CACHED_HISTORY, replayed)

S12_LARGE_HISTORY = [  # the x8.19 `large` run (docs/results/2026-11-30-h200x2-large-aa40/) to its last win
    (1, {"embedding_grad_mode": "fused"}, True, 0.614), (2, {"tail_backend": "triton-fused-loss"}, True, 0.205),
    (3, {"tail_fp32_dot": "tf32x3"}, False, 0.933), (4, {"tail_fp32_dot": "tf32"}, False, 0.955),
    (5, {"precision": "bf16-autocast"}, False), (6, {"matmul_precision": "high"}, False),
    (7, {"data_workers": 2}, False, 0.968), (8, {"pack_batches": True}, True, 0.895)]


def test_a_leaning_host_change_and_a_leaning_device_change_are_tried_together(state, ctx):
    """Replayed on the real profile of the x8.19 `large` run after its last win (#8, packed batches: 7.4 ms of host data
    work and 8.7 ms of tail on the device in a 15.3 ms step): 3xTF32 (0.933) and two loader workers (0.968) each leaned
    faster alone, and come back as one candidate, right after the data rules; the x13.36, x12.42 and x10.63 `large` runs
    earlier that day accepted both, one by one, when the step was still device-bound. The two workers come first, alone:
    they measured no difference before packed batches (#8) changed the data path under them; before them, the TF32 tail
    products alone, which measured no difference before packed batches shortened the other side of the step."""
    at = replayed(state, ctx, "h200_large_s12_after_8.json", "large", {}, S12_LARGE_HISTORY)
    proposals = propose_offline(at, ctx, limit=200)
    assert [p.proposer for p in proposals[:6]] == ["offline:tf32x3-tail", "offline:tf32-tail",
                                                   "offline:loader-workers", "offline:loader-workers-4",
                                                   "offline:host-and-device", "offline:host-and-device"]
    assert proposals[0].rationale.startswith("tried again: candidate #3 measured 0.933 (rejected: as in that run) "
                                             "before #8 (pack_batches=True) shortened the other side of the step")
    assert proposals[2].rationale.startswith("tried again: candidate #7 measured 0.968 (rejected: as in that run) "
                                             "before #8 (pack_batches=True) changed the same part of the step")
    pair = proposals[4]
    assert pair.patch == {"data_workers": 2, "tail_fp32_dot": "tf32x3"}
    assert pair.expected_gain == pytest.approx(1 / (0.933 * 0.968))
    assert pair.rationale.startswith("#7 (data_workers=2, host side) leaned 0.968 and #3 (tail_fp32_dot=tf32x3, "
                                     "device side) 0.933")
    assert proposals[5].patch == {"data_workers": 2, "tail_fp32_dot": "tf32"}
    # rejected together: not again, but the next pair still comes, and the pair kept its parts' retries
    tried = at.model_copy(update={"history": at.history + [Evaluated(
        candidate=candidate(9, patch=pair.patch, proposer="offline:host-and-device"), incumbent_id=8,
        config={**at.incumbent.config, **pair.patch},
        verdict=Verdict(accepted=False, stage="measure", reason="no-difference", ratio=0.95))]})
    after = propose_offline(tried, ctx, limit=200)
    assert pair.patch not in [p.patch for p in after]
    assert {"data_workers": 2, "tail_fp32_dot": "tf32"} in [p.patch for p in after]
    faster = tried.model_copy(update={"incumbent": tried.incumbent.model_copy(update={"est_speedup": 20.0})})
    assert {"tail_fp32_dot": "tf32x3"} in [p.patch for p in propose_offline(faster, ctx, limit=200)
                                           if p.rationale.startswith("tried again")]
    # a leaning change that slowed down once more is no longer leaning; on a CPU host and device are one
    slower = replayed(state, ctx, "h200_large_s12_after_8.json", "large", {}, S12_LARGE_HISTORY + [
        (9, {"data_workers": 2}, False, 1.02)])
    assert all(p.proposer != "offline:host-and-device" or "data_workers" not in p.patch
               for p in propose_offline(slower, ctx, limit=200))
    assert all(p.proposer != "offline:host-and-device"
               for p in propose_offline(at.model_copy(update={"device": "cpu"}), ctx, limit=200))


def test_the_changes_that_leaned_faster_come_together_as_one(state, ctx):
    """On the 2026-12-03 x7.29 `large-cached` run after #12: the overlap (0.926), packed batches (0.954) and TF32 tail
    products (0.956) each leaned faster under a 4.7% floor; 3xTF32 (0.995) sets the same knob as TF32 and leaned
    less, and the host-and-device pair (#11) is not a change of its own. They come as one candidate, expected
    x1.18, whose rejection rules none of them out; with two leaning changes no bundle of three (two join only when
    their product clears the floor in force, which this replay does not hold: see the 2026-12-04 test below)."""
    at = replayed(state, ctx, "h200_large_cached_s22_after_12.json", "large-cached", LARGE_CACHED_BASE,
                  S22_LARGE_CACHED_HISTORY)
    proposals = propose_offline(at, ctx, limit=200)
    (bundle,) = [p for p in proposals if p.proposer == "offline:leaning-bundle"]
    assert bundle.patch == {"embedding_cache_overlap": True, "pack_batches": True, "tail_fp32_dot": "tf32"}
    assert bundle.expected_gain == pytest.approx(1 / (0.926 * 0.954 * 0.956))
    assert bundle.rationale.startswith("#5 (embedding_cache_overlap=True) 0.926, #10 (pack_batches=True) 0.954, "
                                       "#7 (tail_fp32_dot=tf32) 0.956: each leaned faster")
    assert proposals.index(bundle) < 4
    rejected = Evaluated(candidate=candidate(13, patch=bundle.patch, proposer="offline:leaning-bundle"),
                         incumbent_id=12, config={**at.incumbent.config, **bundle.patch},
                         verdict=Verdict(accepted=False, stage="measure", reason="no-difference", ratio=0.97))
    after = at.model_copy(update={"history": at.history + [rejected]})
    patches = [p.patch for p in propose_offline(after, ctx, limit=200)]
    assert bundle.patch not in patches and {"pack_batches": True} in patches  # its parts stay open
    two = at.model_copy(update={"history": [e for e in at.history if e.candidate.id not in (7, 10)]})
    assert not any(p.proposer == "offline:leaning-bundle" for p in propose_offline(two, ctx, limit=200))


def test_a_leaning_change_the_incumbent_took_since_stays_out_of_the_bundle(state, ctx):
    """Packed batches, accepted on a later try, are the incumbent's: the bundle of the rest has two changes, too few
    for a bundle of three (and this replay holds no noise floor to join two under)."""
    at = replayed(state, ctx, "h200_large_cached_s22_after_12.json", "large-cached", LARGE_CACHED_BASE,
                  S22_LARGE_CACHED_HISTORY)
    taken = at.model_copy(update={"incumbent": at.incumbent.model_copy(
        update={"config": {**at.incumbent.config, "pack_batches": True}})})
    assert not any(p.proposer == "offline:leaning-bundle" for p in propose_offline(taken, ctx, limit=200))


def test_a_pair_is_not_proposed_with_a_part_the_incumbent_already_holds(state, ctx):
    """The 2026-12-03 x12.37 `large-cached` run after #9: the overlap (#4, 0.930) came into the incumbent with two
    loader workers (#6, their host-and-device pair), and pinned memory (#8, 0.918) leaned faster after that. Joining the
    pinning to the overlap again would be the pinning alone: it comes first, as a retry after packed batches (#9)
    changed the data path, and no pair names the overlap. (The cache prefetch, a rule since 2026-12-04, comes before it:
    the caches' prepare held most of the step's host work in embed.)"""
    at = replayed(state, ctx, "h200_large_cached_s27_after_9.json", "large-cached", LARGE_CACHED_BASE,
                  S27_LARGE_CACHED_HISTORY)
    proposals = propose_offline(at, ctx, limit=200)
    assert proposals.pop(0).patch == {"embedding_cache_prefetch": True}
    assert proposals[0].patch == {"pin_memory": True} and proposals[0].rationale.startswith(
        "tried again: candidate #8 measured 0.918 (rejected: as in that run) before #9 (pack_batches=True)")
    assert all(p.proposer != "offline:host-and-device" for p in proposals)


S29_LARGE_CACHED_HISTORY = [  # the 2026-12-04 `large-cached` run (docs/results/2026-12-04-h200-large-cached-1812/)
    (1, {"tail_backend": "triton-fused-loss"}, True, 0.662),
    (2, {"embedding_placement": "cached", "embedding_grad_mode": "fused"}, True, 0.418),
    (3, {"embedding_cache_index": "device"}, True, 0.687), (4, {"data_workers": 2}, True, 0.410)]


def test_two_leaning_changes_on_one_side_come_together_when_their_product_clears_the_floor(state, ctx):
    """The 2026-12-04 run after #7: the overlap (#5) accepted, then pinned memory (0.876) and packed batches (0.925),
    both on the host side, leaned faster under the 7.7% floor calibrated after #4. No host-and-device pair joins
    them; together, 0.810, they would clear it: they come as one candidate, first. Under a floor their product
    does not clear, or one of them alone, no bundle."""
    from state_machine.state import Baseline, Recalibration
    at = replayed(state, ctx, "h200_large_cached_s29_after_4.json", "large-cached", LARGE_CACHED_BASE,
                  S29_LARGE_CACHED_HISTORY)
    later = [(5, {"embedding_cache_overlap": True}, True, 0.821), (6, {"pin_memory": True}, False, 0.876),
             (7, {"pack_batches": True}, False, 0.925)]
    history = list(at.history)
    config = dict(at.incumbent.config)
    for cid, patch, accepted, ratio in later:
        history.append(Evaluated(candidate=candidate(cid, patch=patch), incumbent_id=4 if cid == 5 else 5,
                                 config={**config, **patch}, verdict=Verdict(
                                     accepted=accepted, stage="measure", reason="as in that run", ratio=ratio)))
        if accepted:
            config = {**config, **patch}
    floor = Recalibration(after_candidate=4, step_ms=32.94, noise_floor=0.0772, calibration_file="c")
    s29 = at.model_copy(update={
        "history": history, "incumbent": at.incumbent.model_copy(update={"config": config, "from_candidate": 5}),
        "baseline": Baseline(numerics_file="n", step_ms=152.58, noise_floor=0.0301, calibration_file="c"),
        "recalibrations": [floor]})
    proposals = propose_offline(s29, ctx, limit=200)
    assert proposals.pop(0).patch == {"embedding_cache_prefetch": True}  # the 2026-12-04 rule, on embed's host work
    assert proposals[0].proposer == "offline:leaning-bundle"
    assert proposals[0].patch == {"pin_memory": True, "pack_batches": True}
    assert proposals[0].expected_gain == pytest.approx(1 / (0.876 * 0.925))
    looser = s29.model_copy(update={"recalibrations": [floor.model_copy(update={"noise_floor": 0.2})]})
    assert not any(p.proposer == "offline:leaning-bundle" for p in propose_offline(looser, ctx, limit=200))
    one = s29.model_copy(update={"history": history[:-1]})
    assert not any(p.proposer == "offline:leaning-bundle" for p in propose_offline(one, ctx, limit=200))
