"""The offline proposer (the rule catalog and its sweep) on states built by hand, and replayed on the real
profiles and histories of H200 runs (tests/fixtures/h200_*.json)."""

from __future__ import annotations

import pytest

from profilers.findings import findings as profile_findings
from state_machine.proposers.offline import propose_offline
from state_machine.state import Evaluated, Verdict
from tests.profilers.test_findings import coarse
from targets.haste_rec.knobs import KNOB_SPACE
from targets.haste_rec.model import tail_kernel_config
from tests.state_machine.records import candidate, checked, finding
from tests.state_machine.replays import LARGE_CACHED_BASE, S22_LARGE_CACHED_HISTORY, S24_LARGE_HISTORY, replayed


def test_offline_ranks_by_expected_gain_and_respects_the_device(state, ctx):
    findings = [finding("data-wait", 0.3, 1.2), finding("optimizer", 0.6, 2.3)]
    first = propose_offline(state.model_copy(update={"findings": findings}), ctx, limit=3)
    assert first[0].patch == {"embedding_grad_mode": "fused"}  # largest gain x plausibility
    assert all("prefetch_to_device" not in p.patch for p in first)  # a CUDA-only rule on a CPU run
    every = propose_offline(state.model_copy(update={"findings": findings}), ctx, limit=200)
    assert all(p.patch.get("tail_backend") not in ("triton", "triton-fused-loss") for p in every)  # nor its sweep
    cuda = propose_offline(state.model_copy(update={"findings": findings, "device": "cuda"}), ctx, limit=20)
    assert all(p.proposer != "offline:pinned-prefetch" for p in cuda)  # the rule needs data_workers > 0 first
    assert any(p.patch.get("optimizer_impl") == "fused" for p in cuda)


def test_offline_does_not_retry_what_was_rejected(state, ctx):
    findings = [finding("optimizer", 0.6, 2.3)]
    rejected = Evaluated(candidate=candidate(1, patch={"embedding_grad_mode": "fused"}), incumbent_id=None,
                         config={"embedding_grad_mode": "fused"},
                         verdict=Verdict(accepted=False, stage="validate", reason="numerics"))
    proposals = propose_offline(state.model_copy(update={"findings": findings, "history": [rejected]}), ctx, 50)
    assert proposals and all(p.patch.get("embedding_grad_mode") != "fused" for p in proposals)


def test_offline_never_proposes_model_changes_unless_allowed(state, ctx):
    space = ctx.target.knob_space
    plain = propose_offline(state, ctx, limit=100)
    assert plain and all(space[k].numerics != "model" for p in plain for k in p.patch)
    allowed = propose_offline(state.model_copy(update={"allow_model_changes": True}), ctx, limit=200)
    assert any(space[k].numerics == "model" for p in allowed for k in p.patch)


def test_offline_sweeps_only_knobs_that_have_an_effect(state, ctx):
    findings = [finding("tail-gather-bound", 0.3, 1.5)]
    torch_tail = propose_offline(state.model_copy(update={"findings": findings}), ctx, limit=200)
    assert not any(k.startswith("tail_block") or k.startswith("tail_num") for p in torch_tail for k in p.patch)
    triton_tail = state.model_copy(update={"findings": findings, "device": "cuda",
                                           "incumbent": state.incumbent.model_copy(
                                               update={"config": {"tail_backend": "triton"}})})
    assert any("tail_block_b" in p.patch for p in propose_offline(triton_tail, ctx, limit=200))


def test_a_fused_triton_tail_leaves_the_data_rules_first(state, ctx):
    """The H200 large run's profile after triton-fused-loss and data_workers=2: the tail's Triton kernel has
    little headroom left beyond how it multiplies fp32, so 3xTF32, TF32 and pinned prefetch rank above the
    tail sweep, and no rule steps back to the autograd or slots tail."""
    config = {"tail_backend": "triton-fused-loss", "data_workers": 2, "embedding_grad_mode": "fused"}
    profile = coarse({"data": 0.22, "embed": 0.12, "tail": 0.48, "loss": 0.033, "backward": 0.21,
                      "optimizer": 0.052})
    bf16 = Evaluated(candidate=candidate(6, patch={"precision": "bf16-autocast"}), incumbent_id=None,
                     config={**config, "precision": "bf16-autocast"},
                     verdict=Verdict(accepted=False, stage="validate", reason="numerics"))  # as in that run; else first
    fused = state.model_copy(update={
        "device": "cuda", "history": [bf16], "incumbent": state.incumbent.model_copy(update={"config": config}),
        "findings": profile_findings(profile, None, {}, ctx.target.knob_space.resolve(config))})
    proposals = propose_offline(fused, ctx, limit=6)
    proposers = [p.proposer for p in proposals]
    assert proposers[:4] == ["offline:tf32x3-tail", "offline:tf32-tail", "offline:tf32-matmuls",
                             "offline:pinned-prefetch"]  # no sweep
    assert proposals[3].patch == {"pin_memory": True, "prefetch_to_device": True}
    assert proposers[4] == "offline:packed-batches"
    assert not {p.proposer for p in proposals} & {"offline:tail-slots", "offline:triton-tail",
                                                   "offline:triton-fused-loss"}


def test_tail_rules_never_go_back_past_the_incumbent_backend(state, ctx):
    tail = [finding("tail-gather-bound", 0.5, 1.5), finding("loss", 0.1, 1.1)]
    rules = {}
    for backend in ("torch", "slots", "triton", "triton-fused-loss"):
        at = state.model_copy(update={"findings": tail, "device": "cuda", "incumbent": state.incumbent.model_copy(
            update={"config": {"tail_backend": backend}})})
        rules[backend] = {p.patch["tail_backend"] for p in propose_offline(at, ctx, limit=200)
                          if "tail_backend" in p.patch and p.proposer != "offline:sweep"}
    assert rules == {"torch": {"slots", "triton", "triton-fused-loss"}, "slots": {"triton", "triton-fused-loss"},
                     "triton": {"triton-fused-loss"}, "triton-fused-loss": set()}


def test_the_sweep_leaves_out_what_the_incumbent_went_past(state, ctx):
    """The H200 large run of 2026-11-30 swept tail_backend torch, slots and triton after it had taken the fused
    Triton tail (x4.2, x1.6, x1.2 slower): torch was what the accepted change moved away from, and the rules
    propose slots and the unfused Triton tail only from behind them."""
    fused = Evaluated(candidate=candidate(1, patch={"tail_backend": "triton-fused-loss"}), incumbent_id=None,
                      config={"tail_backend": "triton-fused-loss"},
                      verdict=Verdict(accepted=True, stage="measure", reason="faster twice", ratio=0.33))
    at = state.model_copy(update={"device": "cuda", "history": [fused], "findings": [
        finding("tail-gather-bound", 0.5, 1.5)], "incumbent": state.incumbent.model_copy(update={
            "config": {"tail_backend": "triton-fused-loss"}, "from_candidate": 1})})
    proposals = propose_offline(at, ctx, limit=200)
    assert any("tail_block_b" in p.patch for p in proposals)  # the fused kernel's own knobs are swept
    assert not any("tail_backend" in p.patch for p in proposals)
    before = at.model_copy(update={"history": [], "incumbent": state.incumbent.model_copy(
        update={"config": {"tail_backend": "slots"}})})  # from slots, triton is a step forward, torch a sweep
    swept = {p.patch["tail_backend"] for p in propose_offline(before, ctx, limit=200) if "tail_backend" in p.patch}
    assert swept == {"torch", "triton", "triton-fused-loss"}


def test_a_rejected_change_still_allows_a_larger_one_that_holds_it(state, ctx):
    """The H200 large-cached run of 2026-11-30: the fused update on host tables measured slower, and that
    blocked the device-cache rule (cached placement + fused update), SparseGear's path for tables over budget."""
    host = {"embedding_placement": "host", "embedding_grad_mode": "sparse", "tail_backend": "triton"}
    rejected = Evaluated(candidate=candidate(3, patch={"embedding_grad_mode": "fused"}), incumbent_id=None,
                         config={**host, "embedding_grad_mode": "fused"},
                         verdict=Verdict(accepted=False, stage="measure", reason="slower", ratio=1.11))
    at = state.model_copy(update={"device": "cuda", "history": [rejected], "findings": [
        finding("optimizer", 0.36, 1.5)], "incumbent": state.incumbent.model_copy(update={"config": host})})
    proposals = propose_offline(at, ctx, limit=200)
    assert proposals[0].proposer == "offline:device-cache"
    assert all(p.patch != {"embedding_grad_mode": "fused"} for p in proposals)  # the rejected change itself: no


def test_the_h200_large_run_after_its_last_win_goes_to_3xtf32_and_packed_batches(state, ctx):
    """Replayed on the real profile of the 2026-11-30 `large` run after its last accepted change (#10), with
    that run's history up to #12: the proposer now offers 3xTF32, TF32 for the tail alone, the dense CUDA graphs
    and packed batches before any sweep, and sweeps no tail backend (that run's #13-15 were torch, slots and
    triton: x4.2, x1.6, x1.2 slower). The graphs come third: half the host's work there is in the phases they
    replay (the optimizer's and embed's are not), and they later measured 0.959 at `large` (no difference)."""
    at = replayed(state, ctx, "h200_large_after_10.json", "large", {}, [
        (1, {"embedding_grad_mode": "fused"}, True), (2, {"tail_backend": "triton-fused-loss"}, True),
        (3, {"data_workers": 2}, True), (4, {"compile_encoder": True}, False),
        (5, {"pin_memory": True, "prefetch_to_device": True}, True), (6, {"precision": "bf16-autocast"}, False),
        (7, {"matmul_precision": "high"}, False), (8, {"embedding_backend": "triton"}, False),
        (9, {"data_workers": 4}, False), (10, {"embedding_grad_mode": "sparse"}, True),
        (11, {"optimizer_impl": "fused"}, False), (12, {"optimizer_impl": "foreach"}, False)])
    proposals = propose_offline(at, ctx, limit=200)
    assert [p.proposer for p in proposals[:4]] == ["offline:tf32x3-tail", "offline:tf32-tail",
                                                   "offline:dense-cuda-graph", "offline:packed-batches"]
    assert not any("tail_backend" in p.patch for p in proposals)


def test_the_h200_large_cached_run_reaches_the_device_cache(state, ctx):
    """Replayed on the real profile of the first 2026-11-30 `large-cached` run after its one win (#2, the
    Triton tail) with its history to #3 (the fused update on host tables, 1.11: rejected): the device cache
    with the fused update, which that run never tried, is among the next three proposals."""
    at = replayed(state, ctx, "h200_large_cached_after_2.json", "large-cached", LARGE_CACHED_BASE, [
        (1, {"tail_backend": "triton-fused-loss"}, False), (2, {"tail_backend": "triton"}, True),
        (3, {"embedding_grad_mode": "fused"}, False)])
    proposals = propose_offline(at, ctx, limit=3)
    assert {"embedding_placement": "cached", "embedding_grad_mode": "fused"} in [p.patch for p in proposals]
    assert all(p.patch != {"embedding_grad_mode": "fused"} for p in propose_offline(at, ctx, limit=200))


def test_the_second_h200_large_cached_run_tries_loader_workers_before_blind_sweeps(state, ctx):
    """Replayed on the real profile of the second 2026-11-30 `large-cached` run after its one win (#1, the
    fused Triton tail) with its history to #8: that run swept the tail's tile sizes next (#9-#11) for its big
    optimizer finding, and never reached the loader workers its data phase (8% of the step) asked for. Now a
    sweep's plausibility is shared among its values. First come pinned row traffic (the optimizer phase waited
    26.8 ms of its 52 on the device, where row gradients come down), then TF32 for the tail alone, host pooling
    and the loader rules; the dense CUDA graphs and the Triton embeddings last: two thirds of the host's work is
    the host tables' update in the optimizer phase, which the graphs do not replay, and `embed` is on the device
    38% of its time, all that faster kernels could shorten."""
    at = replayed(state, ctx, "h200_large_cached_s8_after_1.json", "large-cached", LARGE_CACHED_BASE, [
        (1, {"tail_backend": "triton-fused-loss"}, True),
        (2, {"embedding_placement": "cached", "embedding_grad_mode": "fused"}, False),
        (3, {"optimizer_impl": "fused"}, False), (4, {"compile_encoder": True}, False),
        (5, {"optimizer_impl": "foreach"}, False), (6, {"tail_fp32_dot": "tf32x3"}, False),
        (7, {"precision": "bf16-autocast"}, False), (8, {"matmul_precision": "high"}, False)])
    proposals = propose_offline(at, ctx, limit=200)
    assert [p.proposer for p in proposals[:6]] == ["offline:pinned-row-traffic", "offline:tf32-tail",
                                                   "offline:host-pooling", "offline:loader-workers",
                                                   "offline:packed-batches", "offline:loader-ring"]
    first_sweep = next(i for i, p in enumerate(proposals) if p.proposer == "offline:sweep")
    assert first_sweep == 10  # the ten rules the findings still trigger go first
    assert [p.proposer for p in proposals[6:9]] == ["offline:loader-workers-4", "offline:dense-cuda-graph",
                                                    "offline:triton-embeddings"]


@pytest.mark.parametrize("incumbent", [{"tail_backend": "torch"}, {"tail_backend": "triton", "precision": "bf16"},
                                       {"tail_backend": "triton", "matmul_precision": "high"}])
def test_no_patch_sets_a_knob_that_does_nothing_under_it(state, ctx, incumbent):
    """tail_fp32_dot is in effect only where the Triton tail multiplies fp32 (Knob.active_when): a patch sets it
    only together with such a tail, or over one, whatever the findings say; under bf16 never."""
    at = state.model_copy(update={"device": "cuda", "incumbent": state.incumbent.model_copy(update={
        "config": incumbent}), "findings": [finding(c, 0.4, 2.0) for c in ("fp32-products", "tail-gather-bound",
                                                                           "backward", "compute-bound kernel")]})
    proposals = propose_offline(at, ctx, limit=500)
    knob = KNOB_SPACE["tail_fp32_dot"]
    setting = [p.patch for p in proposals if "tail_fp32_dot" in p.patch]
    assert proposals and all(knob.is_active(KNOB_SPACE.resolve({**incumbent, **patch})) for patch in setting)
    assert bool(setting) == (incumbent.get("precision") != "bf16")
    triton_fp32 = at.model_copy(update={"incumbent": state.incumbent.model_copy(update={
        "config": {"tail_backend": "triton"}})})
    assert {"tail_fp32_dot": "tf32x3"} in [p.patch for p in propose_offline(triton_fp32, ctx, limit=500)]


def test_the_fused_tail_is_proposed_with_3xtf32_products_beside_tf32_matmuls(state, ctx):
    """At `xl` the fused tail's own TF32 pass broke the precision band after TF32 matmuls were accepted: the
    rules also propose it with 3xTF32 products, which a set tail_fp32_dot keeps under TF32 matmuls."""
    at = state.model_copy(update={"device": "cuda", "incumbent": state.incumbent.model_copy(update={
        "config": {"tail_backend": "slots", "matmul_precision": "high"}}),
        "findings": [finding("tail-gather-bound", 0.4, 2.0)]})
    patches = [p.patch for p in propose_offline(at, ctx, limit=500)]
    fused, with_3x = {"tail_backend": "triton-fused-loss"}, {"tail_backend": "triton-fused-loss",
                                                             "tail_fp32_dot": "tf32x3"}
    assert fused in patches and with_3x in patches and patches.index(fused) < patches.index(with_3x)
    assert "tf32x3" == tail_kernel_config(KNOB_SPACE.resolve({"matmul_precision": "high", **with_3x}))["fp32_precision"]


def test_user_settings_are_never_tuned(state, ctx):
    verdict = checked(state, ctx, candidate(patch={"embedding_hbm_budget_gb": 100.0}))["current_verdict"]
    assert not verdict.accepted and verdict.stage == "check" and "user's own setting" in verdict.reason
    every = [finding(c, 0.3, 1.5) for c in ("optimizer", "embedding-bound", "data-wait", "cache-misses", "backward")]
    proposals = propose_offline(state.model_copy(update={"findings": every}), ctx, limit=500)
    assert proposals and all("embedding_hbm_budget_gb" not in p.patch for p in proposals)


def test_host_tables_get_the_device_cache_rule_early(state, ctx):
    host = state.model_copy(update={"findings": [finding("embedding-bound", 0.5, 1.5)], "incumbent":
                                    state.incumbent.model_copy(update={"config": {
                                        "embedding_placement": "host", "embedding_grad_mode": "sparse"}})})
    first = {p.proposer: p.patch for p in propose_offline(host, ctx, limit=2)}
    assert first["offline:device-cache"] == {"embedding_placement": "cached", "embedding_grad_mode": "fused"}
    every = propose_offline(host.model_copy(update={"findings": [finding("optimizer", 0.3, 1.5)]}), ctx, limit=200)
    assert "offline:fused-embedding-update" not in {p.proposer for p in every}  # on host tables: the cache rule's
    device = state.model_copy(update={"findings": [finding("embedding-bound", 0.5, 1.5)]})
    assert all(p.proposer != "offline:device-cache" for p in propose_offline(device, ctx, limit=50))


S9_LARGE_HISTORY = [  # the 2026-11-30 session-9 `large` run (docs/results/2026-11-30-h200x2-large-drained/)
    (1, {"embedding_grad_mode": "fused"}, True), (2, {"tail_backend": "triton-fused-loss"}, True),
    (3, {"data_workers": 2}, True), (4, {"tail_fp32_dot": "tf32x3"}, True), (5, {"compile_encoder": True}, False),
    (6, {"pin_memory": True, "prefetch_to_device": True}, False), (7, {"pack_batches": True}, True),
    (8, {"tail_fp32_dot": "tf32"}, False), (9, {"precision": "bf16-autocast"}, False),
    (10, {"matmul_precision": "high"}, False), (11, {"embedding_backend": "triton"}, False)]


def test_the_host_bound_h200_large_step_goes_to_the_dense_cuda_graphs(state, ctx):
    """Replayed on the real profile of the session-9 `large` run after its last win (#7: 11.4 ms of host work
    in a 13.1 ms step, 38% of it launch gaps) with its history to #11: the CUDA graphs of the dense part come
    first, and the rejected TF32 tail is not offered again in that run."""
    at = replayed(state, ctx, "h200_large_s9_after_7.json", "large", {}, S9_LARGE_HISTORY)
    proposals = propose_offline(at, ctx, limit=200)
    assert proposals[0].patch == {"dense_cuda_graph": True}
    assert all(p.patch != {"tail_fp32_dot": "tf32"} for p in proposals)
    # not from a tail the graphs cannot capture: with the autograd tail the knob would do nothing
    unfused = at.model_copy(update={"incumbent": at.incumbent.model_copy(update={"config": {
        **at.incumbent.config, "tail_backend": "triton"}})})
    assert all("dense_cuda_graph" not in p.patch for p in propose_offline(unfused, ctx, limit=200))


S10_LARGE_HISTORY = [  # the session-10 `large` run (docs/results/2026-11-30-h200x2-large-graphs/), with its ratios
    (1, {"embedding_grad_mode": "fused"}, True, 0.693), (2, {"tail_backend": "triton-fused-loss"}, True, 0.312),
    (3, {"data_workers": 2}, True, 0.774), (4, {"tail_fp32_dot": "tf32x3"}, True, 0.749),
    (5, {"dense_cuda_graph": True}, False, 0.959), (6, {"compile_encoder": True}, False, 0.970),
    (7, {"pin_memory": True, "prefetch_to_device": True}, False, 0.919), (8, {"pack_batches": True}, True, 0.696)]


def test_a_change_that_leaned_faster_is_tried_once_more_after_the_incumbent_got_much_faster(state, ctx):
    """Replayed on the real profile of the session-10 `large` run after its last win (#8, packed batches: the
    incumbent x1.44 faster than when #5-7 were timed): the dense CUDA graphs, no-difference at 0.959 against the
    14 ms incumbent, come first again, and say why; once tried again, they are not offered a third time."""
    at = replayed(state, ctx, "h200_large_s10_after_8.json", "large", {}, S10_LARGE_HISTORY)
    proposals = propose_offline(at, ctx, limit=200)
    assert proposals[0].patch == {"dense_cuda_graph": True}
    assert proposals[0].rationale.startswith("tried again: candidate #5 measured 0.959") and "x1.44 faster" in \
        proposals[0].rationale
    again = [p.patch for p in proposals if p.rationale.startswith("tried again")]
    assert {"compile_encoder": True} in again and {"pin_memory": True, "prefetch_to_device": True} in again
    # not before the incumbent got RETRY_AFTER faster: without #8, none of #5-7 comes back
    before = replayed(state, ctx, "h200_large_s10_after_8.json", "large", {}, S10_LARGE_HISTORY[:7]
                      + [(8, {"pack_batches": True}, False, 0.99)])
    before = before.model_copy(update={"incumbent": at.incumbent.model_copy(update={"est_speedup": 7.98})})
    assert not [p for p in propose_offline(before, ctx, limit=200) if p.rationale.startswith("tried again")]
    # tried twice: never again
    twice = at.model_copy(update={"history": at.history + [Evaluated(
        candidate=candidate(9, patch={"dense_cuda_graph": True}), incumbent_id=8,
        config={**at.incumbent.config, "dense_cuda_graph": True},
        verdict=Verdict(accepted=False, stage="measure", reason="no-difference", ratio=0.97))]})
    assert all(p.patch != {"dense_cuda_graph": True} for p in propose_offline(twice, ctx, limit=200))
    # nor one that measured slower
    slower = [(cid, patch, ok, 1.02 if cid == 5 else r) for cid, patch, ok, r in S10_LARGE_HISTORY]
    assert all(p.patch != {"dense_cuda_graph": True}
               for p in propose_offline(replayed(state, ctx, "h200_large_s10_after_8.json", "large", {}, slower),
                                        ctx, limit=200))


S13_LARGE_HISTORY = [  # the session-13 `large` run (docs/results/2026-11-30-h200x2-large-pairs/), all 15 candidates
    (1, {"embedding_grad_mode": "fused"}, True, 0.618), (2, {"tail_backend": "triton-fused-loss"}, True, 0.201),
    (3, {"tail_fp32_dot": "tf32x3"}, False, 0.947), (4, {"data_workers": 2}, False, 0.917),
    (5, {"tail_fp32_dot": "tf32"}, False, 1.005), (6, {"pack_batches": True}, True, 0.816),
    (7, {"data_workers": 4}, False, 0.954), (8, {"precision": "bf16-autocast"}, False),
    (9, {"matmul_precision": "high"}, False), (10, {"data_workers": 2, "tail_fp32_dot": "tf32x3"}, True, 0.772),
    (11, {"dense_cuda_graph": True}, False, 1.159), (12, {"compile_encoder": True}, False, 1.079),
    (13, {"data_workers": 4, "tail_fp32_dot": "tf32x3"}, False, 0.903),
    (14, {"embedding_backend": "triton"}, False, 1.184),
    (15, {"embedding_grad_mode": "sparse"}, False, 1.104)]


def test_the_session_13_large_run_stopped_one_candidate_short_of_pinned_prefetch(state, ctx):
    """Replayed on the real profile of the session-13 `large` run after its last win (#10, the host-and-device
    pair) with all 15 of its candidates: its 16 minutes ended where the pinned prefetch came next (accepted at
    0.810 in session 8's x13.36 run), then the fused and foreach optimizers. Cheaper candidates reach them. Since
    session 30 the fused optimizer answers the step's launch/host-bound finding too (its optimizer launches), and
    comes just before the pinned prefetch (it was part of session 26's winning bundle at `large`)."""
    at = replayed(state, ctx, "h200_large_s13_after_10.json", "large", {}, S13_LARGE_HISTORY)
    proposals = propose_offline(at, ctx, limit=200)
    assert [p.proposer for p in proposals[:3]] == ["offline:fused-optimizer-launches", "offline:pinned-prefetch",
                                                   "offline:foreach-optimizer"]
    assert proposals[1].patch == {"pin_memory": True, "prefetch_to_device": True}


XL_HISTORY = [  # the first xl run on an H200 (2026-11-30, session 14), its 13 decided candidates
    (1, {"tail_backend": "triton-fused-loss"}, False, "reorder"), (2, {"tail_backend": "triton"}, False, "reorder"),
    (3, {"precision": "bf16-autocast"}, False, "precision"), (4, {"matmul_precision": "high"}, True, 0.9827),
    (5, {"tail_backend": "slots"}, True, 0.3992), (6, {"embedding_grad_mode": "fused"}, True, 0.6645),
    (7, {"data_workers": 2}, False, 1.022), (8, {"pack_batches": True}, True, 0.9604),
    (9, {"data_workers": 4}, False, 1.002), (10, {"embedding_grad_mode": "sparse"}, False, 1.136),
    (11, {"embedding_backend": "triton"}, False, 1.143), (12, {"precision": "bf16"}, False, "precision"),
    (13, {"optimizer_impl": "for-loop"}, False, 0.989)]


def test_the_xl_run_tries_the_fused_triton_tail_again_under_the_bands_it_is_now_held_to(state, ctx):
    """Replayed on the real profile of the first `xl` run after its last win (#8) with its 13 candidates: the fused
    Triton tail broke the reorder band as #1 (2.9e-5 against 1.7e-5); since #4 took TF32 matmuls every candidate
    is held to the precision bands (#5, #6 and #8 were), so it comes back, first, with the unfused Triton tail.
    The bf16 candidates broke the precision bands themselves and stay out."""
    at = replayed(state, ctx, "h200_xl_after_8.json", "xl", {}, XL_HISTORY)
    proposals = propose_offline(at, ctx, limit=200)
    patches = [p.patch for p in proposals]
    assert patches[0] == {"tail_backend": "triton-fused-loss"}
    assert proposals[0].rationale.startswith("tried again: candidate #1 was held to the reorder bands")
    assert {"tail_backend": "triton"} in patches
    assert {"precision": "bf16-autocast"} not in patches and {"precision": "bf16"} not in patches
    before_tf32 = replayed(state, ctx, "h200_xl_after_8.json", "xl", {}, XL_HISTORY[:3])
    assert {"tail_backend": "triton-fused-loss"} not in [p.patch for p in propose_offline(before_tf32, ctx, 200)]


XL15_HISTORY = [  # the second xl run (2026-11-30, session 15) up to its retries: both Triton tails broke the precision
    # bands under TF32 matmuls (loss 0.021 and 0.033 against 0.02), their tl.dot in TF32 too
    *XL_HISTORY[:4], (5, {"tail_backend": "triton-fused-loss"}, False, "precision"),
    (6, {"tail_backend": "triton"}, False, "precision")]


def test_after_the_fused_tail_broke_the_precision_band_under_tf32_it_comes_with_3xtf32_products(state, ctx):
    at = replayed(state, ctx, "h200_xl_after_8.json", "xl", {}, XL15_HISTORY)
    patches = [p.patch for p in propose_offline(at, ctx, limit=200)]
    assert patches[0] == {"tail_backend": "triton-fused-loss", "tail_fp32_dot": "tf32x3"}
    assert {"tail_backend": "triton-fused-loss"} not in patches  # tried under both classes now


def test_the_s20_large_cached_run_after_the_device_index_overlaps_the_cache_next(state, ctx):
    """Replayed on the real profile of session 20's `large-cached` run after #3 (the caches' index on the device),
    whose embed phase waited 3.4 ms for the previous step and then spent its host time while the device idled:
    that run went on to pinned memory, loader workers, CUDA graphs and Triton embeddings, and ran out of time
    before TF32x3. The cache overlap comes first now, TF32x3 within five (the Triton embeddings, 1.376 slower
    there, could only shorten embed's 1.61 ms on the device); host pooling, which cached tables ignore, never."""
    at = replayed(state, ctx, "h200_large_cached_s20_after_3.json", "large-cached", LARGE_CACHED_BASE, [
        (1, {"tail_backend": "triton-fused-loss"}, True, 0.656),
        (2, {"embedding_placement": "cached", "embedding_grad_mode": "fused"}, True, 0.475),
        (3, {"embedding_cache_index": "device"}, True, 0.676)])
    proposals = propose_offline(at, ctx, limit=200)
    assert proposals[0].patch == {"embedding_cache_overlap": True}
    assert proposals[1].patch == {"embedding_cache_prefetch": True}  # session 30's rule: embed's host work too
    assert {"tail_fp32_dot": "tf32x3"} in [p.patch for p in proposals[:6]]
    assert all("embedding_pool_on_host" not in p.patch for p in proposals)


def test_halving_the_host_threads_is_proposed_on_a_gpu_where_embed_works_the_host(state, ctx):
    """On the same replay, the trainer's CPU threads are halved once, after the cache overlap (whose evidence is
    that step's own wait) and never on a CPU, where the threads do the math; an incumbent that already set them
    gets no such proposal."""
    history = [(1, {"tail_backend": "triton-fused-loss"}, True, 0.656),
               (2, {"embedding_placement": "cached", "embedding_grad_mode": "fused"}, True, 0.475),
               (3, {"embedding_cache_index": "device"}, True, 0.676)]
    at = replayed(state, ctx, "h200_large_cached_s20_after_3.json", "large-cached", LARGE_CACHED_BASE, history)
    patches = [p.patch for p in propose_offline(at, ctx, limit=200)]
    assert patches.index({"host_threads": "half"}) > patches.index({"embedding_cache_overlap": True})
    assert [p for p in patches if "host_threads" in p and p != {"host_threads": "half"}] == [{"host_threads": "quarter"}]
    on_cpu = at.model_copy(update={"device": "cpu"})
    assert {"host_threads": "half"} not in [p.patch for p in propose_offline(on_cpu, ctx, limit=200)
                                            if p.proposer == "offline:fewer-host-threads"]
    halved = at.model_copy(update={"incumbent": at.incumbent.model_copy(
        update={"config": {**at.incumbent.config, "host_threads": "half"}})})
    assert not any(p.proposer == "offline:fewer-host-threads" for p in propose_offline(halved, ctx, limit=200))


def test_after_pinned_memory_the_loader_workers_that_measured_no_difference_before_it_come_again(state, ctx):
    """Replayed on the real profile of session 22's `large-cached` run after its last win (#12, pinned memory),
    with its history: two loader workers had measured 1.014 (interval 0.970-1.027) before pinning, and packed
    batches 0.954; session 20 accepted the workers after pinning (0.837). Both come back first, for the data phase
    that profile blamed; the overlap (an embedding knob, untouched since) and 3xTF32 come back later, as changes to
    the other side of the step than pinning's, not to the same part of it."""
    at = replayed(state, ctx, "h200_large_cached_s22_after_12.json", "large-cached", LARGE_CACHED_BASE,
                  S22_LARGE_CACHED_HISTORY)
    workers = at.history[5]
    at.history[5] = workers.model_copy(update={"verdict": workers.verdict.model_copy(
        update={"ci_low": 0.970, "ci_high": 1.027})})
    proposals = propose_offline(at, ctx, limit=200)
    assert [p.patch for p in proposals[:2]] == [{"data_workers": 2}, {"pack_batches": True}]
    assert proposals[0].rationale.startswith("tried again: candidate #6 measured 1.014 (rejected: as in that run) "
                                             "before #12 (pin_memory=True) changed the same part of the step")
    patches = [p.patch for p in proposals]
    for patch in ({"embedding_cache_overlap": True}, {"tail_fp32_dot": "tf32x3"}):
        again = proposals[patches.index(patch)]
        assert patches.index(patch) > 4 and "shortened the other side of the step" in again.rationale
    at.history[5] = workers  # shown slower (no interval: the ratio, 1.014) it stays out
    assert {"data_workers": 2} not in [p.patch for p in propose_offline(at, ctx, limit=200)]


def test_a_device_change_hidden_by_the_host_comes_again_after_each_host_side_win(state, ctx):
    """Session 24's `large` run: TF32 tail products (#4: 1.027, interval 0.945-1.059) and 3xTF32 ones (#3) measured
    no difference while the step waited on its data; two loader workers (#7) and the device prefetch (#8) were then
    accepted, and the run never tried the products again. On top of its best, with the host bundle TPE found, TF32
    products measured 0.505. Replayed on that run's profiles: after #7 both come again first, naming #7; once more
    after #8 if the try after #7 showed no difference again; not a fourth time; not on a CPU, where the host is the
    device; and not one that measured slower."""
    after_7 = replayed(state, ctx, "h200_large_s24_after_7.json", "large", {}, S24_LARGE_HISTORY[:7])
    proposals = propose_offline(after_7, ctx, limit=200)
    assert [p.patch for p in proposals[:2]] == [{"tail_fp32_dot": "tf32x3"}, {"tail_fp32_dot": "tf32"}]
    assert proposals[0].rationale.startswith(
        "tried again: candidate #3 measured 1.037 (rejected: as in that run) before #7 (data_workers=2) shortened "
        "the other side of the step")
    hidden_again = (8, {"tail_fp32_dot": "tf32x3"}, False, (0.99, 0.95, 1.03))
    after_8 = replayed(state, ctx, "h200_large_s24_after_8.json", "large", {},
                       S24_LARGE_HISTORY[:7] + [hidden_again, (9, S24_LARGE_HISTORY[7][1], True, 0.820)])
    again = {p.patch["tail_fp32_dot"]: p for p in propose_offline(after_8, ctx, limit=200)
             if p.rationale.startswith("tried again") and set(p.patch) == {"tail_fp32_dot"}}
    assert set(again) == {"tf32x3", "tf32"}
    assert "candidate #8 measured 0.990" in again["tf32x3"].rationale and "before #9" in again["tf32x3"].rationale

    def then(at, cid, patch, accepted, ratio, low):
        config = {**at.incumbent.config, **patch}
        incumbent = at.incumbent.model_copy(update={"config": config}) if accepted else at.incumbent
        return at.model_copy(update={"incumbent": incumbent, "history": at.history + [Evaluated(
            candidate=candidate(cid, patch=patch), incumbent_id=9, config=config,
            verdict=Verdict(accepted=accepted, stage="measure", reason="as in that run", ratio=ratio, ci_low=low))]})
    third = then(then(after_8, 10, {"tail_fp32_dot": "tf32x3"}, False, 0.98, 0.95), 11, {"data_workers": 4}, True, 0.9,
                 0.85)
    assert {"tail_fp32_dot": "tf32x3"} not in [p.patch for p in propose_offline(third, ctx, limit=200)]
    assert not any("shortened the other side" in p.rationale
                   for p in propose_offline(after_7.model_copy(update={"device": "cpu"}), ctx, limit=200))
    slower = replayed(state, ctx, "h200_large_s24_after_7.json", "large", {},
                      [*S24_LARGE_HISTORY[:3], (4, {"tail_fp32_dot": "tf32"}, False, (1.08, 1.04, 1.12)),
                       *S24_LARGE_HISTORY[4:7]])
    assert {"tail_fp32_dot": "tf32"} not in [p.patch for p in propose_offline(slower, ctx, limit=200)]


def test_on_several_ranks_no_proposal_sets_a_value_the_ranked_run_has_no_path_for(state, ctx):
    """The same findings on one process propose the fused tail loss and the packed batches; a torch.distributed
    run refuses both (``Knob.single_process``), so on two ranks neither a rule nor the sweep proposes them, and the
    check node turns one away before any worker starts. The cache prefetch runs on both."""
    findings = [finding(c, 0.3, 1.5) for c in ("backward", "loss", "data-wait", "embedding-bound", "launch/host-bound")]
    cached = state.model_copy(update={"findings": findings, "device": "cuda", "incumbent": state.incumbent.model_copy(
        update={"config": {"embedding_placement": "cached", "embedding_grad_mode": "fused", "data_workers": 2}})})
    single = {(k, v) for p in propose_offline(cached, ctx, limit=400) for k, v in p.patch.items()}
    refused = {("tail_backend", "triton-fused-loss"), ("pack_batches", True)}
    assert refused <= single and ("embedding_cache_prefetch", True) in single
    ranked = cached.model_copy(update={"ranks": 2})
    on_ranks = {(k, v) for p in propose_offline(ranked, ctx, limit=400) for k, v in p.patch.items()}
    assert not refused & on_ranks and ("embedding_cache_prefetch", True) in on_ranks
    verdict = checked(ranked, ctx, candidate(patch={"pack_batches": True}))["current_verdict"]
    assert verdict.stage == "check" and "runs on one process only" in verdict.reason
