"""The offline proposer (the rule catalog and its sweep) on states built by hand; test_offline_replays.py replays it
on the real profiles and histories of H200 runs."""

from __future__ import annotations

import pytest

from profilers.findings import findings as profile_findings
from state_machine.proposers.offline import propose_offline
from state_machine.state import Evaluated, Verdict
from tests.profilers.test_findings import coarse
from targets.haste_rec.knobs import KNOB_SPACE
from targets.haste_rec.model import tail_kernel_config
from tests.state_machine.records import candidate, checked, finding


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
    little headroom left beyond how it multiplies fp32, so 3xTF32, TF32, TF32 matmuls, pinned prefetch and packed
    batches are among the first six, before any sweep, and no rule steps back to the autograd or slots tail."""
    config = {"tail_backend": "triton-fused-loss", "data_workers": 2, "embedding_grad_mode": "fused"}
    profile = coarse({"data": 0.22, "embed": 0.12, "tail": 0.48, "loss": 0.033, "backward": 0.21,
                      "optimizer": 0.052})
    bf16 = Evaluated(candidate=candidate(6, patch={"precision": "bf16-autocast"}), incumbent_id=None,
                     config={**config, "precision": "bf16-autocast"},
                     verdict=Verdict(accepted=False, stage="validate", reason="numerics"))  # as in that run; else first
    fused = state.model_copy(update={
        "device": "cuda", "history": [bf16], "incumbent": state.incumbent.model_copy(update={"config": config}),
        "findings": profile_findings(profile, None, {}, ctx.target.knob_space.resolve(config), ctx.target)})
    proposals = propose_offline(fused, ctx, limit=6)
    proposers = [p.proposer for p in proposals]
    rules = ("offline:tf32x3-tail", "offline:tf32-tail", "offline:tf32-matmuls", "offline:pinned-prefetch",
             "offline:packed-batches")
    assert set(rules) <= set(proposers)
    first_sweep = proposers.index("offline:sweep") if "offline:sweep" in proposers else len(proposers)
    assert max(proposers.index(rule) for rule in rules) < first_sweep
    assert {"pin_memory": True, "prefetch_to_device": True} in [p.patch for p in proposals]
    assert not set(proposers) & {"offline:tail-slots", "offline:triton-tail", "offline:triton-fused-loss"}


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
    assert "offline:device-cache" in [p.proposer for p in proposals[:2]]
    assert all(p.patch != {"embedding_grad_mode": "fused"} for p in proposals)  # the rejected change itself: no


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
    verdict = checked(state, ctx, candidate(patch={"embedding_hbm_budget_gb": 100.0}))["current"].verdict
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
    verdict = checked(ranked, ctx, candidate(patch={"pack_batches": True}))["current"].verdict
    assert verdict.stage == "check" and "runs on one process only" in verdict.reason
