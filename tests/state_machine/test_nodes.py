"""The agent's nodes and proposers as plain functions of the state, without LangGraph or workers."""

from __future__ import annotations

from pathlib import Path

import pytest

from profilers.findings import findings as profile_findings
from profilers.records import Finding, ProfileResult
from state_machine import nodes
from state_machine.context import ProposerPolicy, RunContext
from state_machine.proposers.llm import REPLY_SCHEMA, build_prompt, to_proposals
from state_machine.proposers.offline import propose_offline
from state_machine.state import Candidate, Evaluated, Limits, RunState, Verdict, loosest
from targets.registry import resolve_target
from tests.profilers.test_findings import coarse


@pytest.fixture
def ctx():
    return RunContext(target=resolve_target("haste-rec"), policy=ProposerPolicy(kinds=("knob", "kernel")))


@pytest.fixture
def state(tmp_path):
    return RunState(run_id="t", run_dir=str(tmp_path), target="haste-rec", size="tiny")


def finding(category: str, share: float, gain: float) -> Finding:
    return Finding(category=category, phase=None, evidence=f"{category} evidence", share=share, headroom=10.0,
                   headroom_basis="test", amdahl_gain=gain)


def candidate(cid=1, **kw) -> Candidate:
    kw.setdefault("kind", "knob")
    return Candidate(id=cid, rationale="test", proposer="test", **kw)


def checked(state, ctx, cand):
    return nodes.check(state.model_copy(update={"current": cand}), ctx)


def test_loosest_numerics_class():
    assert loosest([]) == "exact"
    assert loosest(["exact", "precision", "reorder"]) == "precision"
    assert loosest(["model", "exact"]) == "model"


@pytest.mark.parametrize("patch,words", [
    ({"no_such_knob": 1}, "unknown knob"),
    ({"precision": "fp8"}, "must be one of"),
    ({"embedding_placement": "host"}, "needs embedding_placement device"),  # constraint: dense grads
    ({"group_size": 64}, "--allow-model-changes"),
    ({}, "changes nothing"),
])
def test_check_rejects_bad_patches_with_a_reason(state, ctx, patch, words):
    verdict = checked(state, ctx, candidate(patch=patch))["current_verdict"]
    assert not verdict.accepted and verdict.stage == "check"
    assert words in verdict.reason


def test_check_parses_string_values_and_sets_the_numerics_class(state, ctx):
    out = checked(state, ctx, candidate(patch={"data_workers": "2", "embedding_grad_mode": "fused"}))
    assert "current_verdict" not in out
    assert out["current"].patch == {"data_workers": 2, "embedding_grad_mode": "fused"}
    assert out["current_numerics_class"] == "reorder"  # exact + reorder


@pytest.mark.parametrize("dot,numerics", [("tf32x3", "reorder"), ("tf32", "precision")])
def test_a_knob_value_may_promise_another_numerics_class_than_its_knob(state, ctx, dot, numerics):
    """tail_fp32_dot is a reorder knob, but its one-pass TF32 value rounds the inputs: held to the precision band."""
    triton = state.model_copy(update={"incumbent": state.incumbent.model_copy(update={"config": {
        "tail_backend": "triton"}})})
    out = checked(triton, ctx, candidate(patch={"tail_fp32_dot": dot}))
    assert out["current_numerics_class"] == numerics


def test_check_rejects_disallowed_kinds_and_unsafe_kernel_sources(state, ctx, tmp_path):
    offline = RunContext(target=ctx.target, policy=ProposerPolicy(kinds=("knob",)))
    source = tmp_path / "tail_forward.py"
    source.write_text("import os\ndef tail_forward(h, idx, w, bias):\n    return os.system('true')\n")
    kernel = candidate(kind="kernel", kernels={"tail_forward": str(source)}, patch={"tail_backend": "slots"})
    assert "does not allow kernel" in checked(state, offline, kernel)["current_verdict"].reason
    verdict = checked(state, ctx, kernel)["current_verdict"]
    assert verdict.stage == "check" and "os" in verdict.reason


def test_check_rejects_a_duplicate_of_an_evaluated_candidate(state, ctx):
    first = checked(state, ctx, candidate(1, patch={"data_workers": 2}))
    done = Evaluated(candidate=first["current"], verdict=Verdict(accepted=False, stage="measure", reason="slower"),
                     incumbent_id=None, config={"data_workers": 2}, digest=first["current_digest"])
    again = checked(state.model_copy(update={"history": [done]}), ctx, candidate(2, patch={"data_workers": 2}))
    assert "duplicate of candidate #1" in again["current_verdict"].reason


def test_decide_makes_an_accepted_candidate_the_incumbent(state, ctx):
    cand = candidate(3, patch={"embedding_grad_mode": "fused"})
    verdict = Verdict(accepted=True, stage="measure", reason="faster twice", ratio=0.5)
    out = nodes.decide(state.model_copy(update={"current": cand, "current_verdict": verdict}), ctx)
    assert out["incumbent"].config == {"embedding_grad_mode": "fused"}
    assert out["incumbent"].from_candidate == 3 and out["incumbent"].est_speedup == pytest.approx(2.0)
    assert out["history"][-1].verdict.accepted and out["current"] is None
    assert (state.run_dir and open(f"{state.run_dir}/events.jsonl").read().count('"decide"') == 1)


def test_limits_stop_the_run(state):
    history = [Evaluated(candidate=candidate(i, patch={"data_workers": 2}), incumbent_id=None,
                         verdict=Verdict(accepted=False, stage="check", reason="x")) for i in range(3)]
    assert nodes.limit_reason(state) is None
    assert nodes.limit_reason(state.model_copy(update={"history": history, "limits": Limits(max_iters=3)})
                              ).startswith("max-iters")
    assert nodes.limit_reason(state.model_copy(update={"elapsed_s": 120.0, "limits": Limits(max_minutes=1)})
                              ).startswith("max-minutes")


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


def test_llm_prompt_carries_findings_knobs_history_and_slot_sources(state, ctx):
    rejected = Evaluated(candidate=candidate(1, patch={"data_workers": 4}), incumbent_id=None,
                         verdict=Verdict(accepted=False, stage="measure", reason="slower", ratio=1.3))
    prompt = build_prompt(state.model_copy(update={"findings": [finding("optimizer", 0.6, 2.3)],
                                                   "history": [rejected]}), ctx)
    for words in ("optimizer evidence", "embedding_grad_mode = 'dense'", "numerics reorder", "#1 data_workers=4",
                  "rejected at measure", "slot tail_forward(", "def tail_forward"):
        assert words in prompt
    assert REPLY_SCHEMA["required"] == ["candidates"]


def test_llm_reply_becomes_proposals_with_parsed_values(state, ctx):
    reply = {"candidates": [
        {"rationale": "r1", "knob_changes": [{"knob": "data_workers", "value": "2"}], "kernel_slot": "",
         "kernel_source": ""},
        {"rationale": "r2", "knob_changes": [{"knob": "precision", "value": "fp8"}],
         "kernel_slot": "tail_forward", "kernel_source": "def tail_forward(h, idx, w, bias): ..."},
    ]}
    first, second = to_proposals(reply, state, RunContext(target=ctx.target, policy=ProposerPolicy(
        tier="ultra", candidates_per_iteration=4, kinds=("knob", "kernel"))))
    assert first.patch == {"data_workers": 2} and first.kind == "knob" and first.proposer == "llm:ultra"
    assert second.kind == "kernel" and second.patch == {"precision": "fp8"}  # left for check to reject
    assert list(second.kernel_sources) == ["tail_forward"]


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


FIXTURES = Path(__file__).parents[1] / "fixtures"
LARGE_CACHED_BASE = {"embedding_placement": "host", "embedding_grad_mode": "sparse"}  # haste_rec_large_cached.toml


def replayed(state: RunState, ctx: RunContext, profile: str, size: str, base: dict, steps: list) -> RunState:
    """The state of a real H200 run: its history from `steps` (id, patch, accepted[, measured ratio]), each
    candidate measured against the incumbent of its time, and the findings of `profile` (that run's profile
    of its incumbent)."""
    result = ProfileResult.model_validate_json((FIXTURES / profile).read_text())
    history, config, incumbent, est = [], dict(base), None, 1.0
    for cid, patch, accepted, *ratio in steps:
        ratio = ratio[0] if ratio else None
        history.append(Evaluated(candidate=candidate(cid, patch=patch), incumbent_id=incumbent,
                                 config={**config, **patch},
                                 verdict=Verdict(accepted=accepted, stage="measure", reason="as in that run",
                                                 ratio=ratio)))
        if accepted:
            config, incumbent, est = {**config, **patch}, cid, est / (ratio or 1.0)
    resolved = ctx.target.knob_space.resolve(config)
    assert {k: resolved[k] for k in config} == {k: result.config[k] for k in config}  # the profile's own config
    return state.model_copy(update={
        "device": "cuda", "size": size, "baseline_config": base, "history": history,
        "incumbent": state.incumbent.model_copy(update={"config": config, "from_candidate": incumbent,
                                                        "est_speedup": est}),
        "findings": profile_findings(result.coarse, None, result.counters, resolved)})


def test_the_h200_large_run_after_its_last_win_goes_to_3xtf32_and_packed_batches(state, ctx):
    """Replayed on the real profile of the 2026-11-30 `large` run after its last accepted change (#10), with
    that run's history up to #12: the proposer now offers the dense CUDA graphs, 3xTF32, TF32 for the tail
    alone and packed batches before any sweep, and sweeps no tail backend (that run's #13-15 were torch, slots and triton: x4.2, x1.6,
    x1.2 slower)."""
    at = replayed(state, ctx, "h200_large_after_10.json", "large", {}, [
        (1, {"embedding_grad_mode": "fused"}, True), (2, {"tail_backend": "triton-fused-loss"}, True),
        (3, {"data_workers": 2}, True), (4, {"compile_encoder": True}, False),
        (5, {"pin_memory": True, "prefetch_to_device": True}, True), (6, {"precision": "bf16-autocast"}, False),
        (7, {"matmul_precision": "high"}, False), (8, {"embedding_backend": "triton"}, False),
        (9, {"data_workers": 4}, False), (10, {"embedding_grad_mode": "sparse"}, True),
        (11, {"optimizer_impl": "fused"}, False), (12, {"optimizer_impl": "foreach"}, False)])
    proposals = propose_offline(at, ctx, limit=200)
    # first the CUDA graphs of the dense part (session 9: the step is host-bound, 38% of it launch gaps)
    assert [p.proposer for p in proposals[:4]] == ["offline:dense-cuda-graph", "offline:tf32x3-tail",
                                                   "offline:tf32-tail", "offline:packed-batches"]
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
    26.8 ms of its 52 on the device, where row gradients come down), then the dense CUDA graphs, TF32 for the tail alone, the
    embedding rules and the loader workers."""
    at = replayed(state, ctx, "h200_large_cached_s8_after_1.json", "large-cached", LARGE_CACHED_BASE, [
        (1, {"tail_backend": "triton-fused-loss"}, True),
        (2, {"embedding_placement": "cached", "embedding_grad_mode": "fused"}, False),
        (3, {"optimizer_impl": "fused"}, False), (4, {"compile_encoder": True}, False),
        (5, {"optimizer_impl": "foreach"}, False), (6, {"tail_fp32_dot": "tf32x3"}, False),
        (7, {"precision": "bf16-autocast"}, False), (8, {"matmul_precision": "high"}, False)])
    proposals = propose_offline(at, ctx, limit=200)
    assert [p.proposer for p in proposals[:6]] == ["offline:pinned-row-traffic", "offline:dense-cuda-graph",
                                                   "offline:tf32-tail", "offline:triton-embeddings",
                                                   "offline:host-pooling", "offline:loader-workers"]
    first_sweep = next(i for i, p in enumerate(proposals) if p.proposer == "offline:sweep")
    assert first_sweep == 8  # the eight rules the findings still trigger go first


@pytest.mark.parametrize("incumbent", [{"tail_backend": "torch"}, {"tail_backend": "triton", "precision": "bf16"},
                                       {"tail_backend": "triton", "matmul_precision": "high"}])
def test_no_patch_sets_a_knob_that_does_nothing_under_it(state, ctx, incumbent):
    """tail_fp32_dot is in effect only when the Triton tail multiplies fp32 at matmul_precision highest
    (Knob.active_when): elsewhere neither its rules nor a sweep propose it, whatever the findings say."""
    at = state.model_copy(update={"device": "cuda", "incumbent": state.incumbent.model_copy(update={
        "config": incumbent}), "findings": [finding(c, 0.4, 2.0) for c in ("fp32-products", "tail-gather-bound",
                                                                           "backward", "compute-bound kernel")]})
    proposals = propose_offline(at, ctx, limit=500)
    assert proposals and not any("tail_fp32_dot" in p.patch for p in proposals)
    triton_fp32 = at.model_copy(update={"incumbent": state.incumbent.model_copy(update={
        "config": {"tail_backend": "triton"}})})
    assert {"tail_fp32_dot": "tf32x3"} in [p.patch for p in propose_offline(triton_fp32, ctx, limit=500)]


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


def _final_ab(baseline_ms, best_ms, ratio):
    from targets.worker_protocol import WorkerRequest
    from validators.speedup import ABResult, SideSummary, block_order
    spec = WorkerRequest(target="haste-rec", size="tiny", mode="bench")
    sides = [SideSummary(label=label, digest=label, spec=spec, block_medians=[ms / 1e3 for ms in medians])
             for label, medians in (("baseline", baseline_ms), ("best", best_ms))]
    return ABResult(a=sides[0], b=sides[1], ratio_definition="best_time / baseline_time", ratio=ratio,
                    ci_low=ratio - 0.01, ci_high=ratio + 0.01, floor=0.011, verdict="faster",
                    order=block_order(len(baseline_ms)), blocks=len(baseline_ms), steps_per_block=3)


@pytest.mark.parametrize("disturbed_first", [True, False])
def test_a_disturbed_final_measurement_is_repeated_and_the_steadier_one_quoted(state, ctx, monkeypatch,
                                                                              disturbed_first):
    from state_machine.state import Baseline
    # the final A/B of the --gpus 2 run on two H200s: three baseline blocks stalled
    stalled = _final_ab([117, 117, 117, 220, 190, 334], [29.2, 29.9, 30.1, 29.5, 28.9, 29.2], 0.201)
    steady = _final_ab([117, 116.8, 116.9, 117.2, 117.0, 116.9], [29.2, 29.9, 30.1, 29.5, 28.9, 29.2], 0.252)
    queue, blocks = [stalled, steady] if disturbed_first else [steady, stalled], []

    def measure_ab(a, b, n_blocks, *args, **kwargs):
        blocks.append(n_blocks)
        assert kwargs["block_seconds"] == state.plan.block_seconds == 0.3  # blocks as long as at the baseline
        return queue.pop(0)
    monkeypatch.setattr(nodes, "measure_ab", measure_ab)
    accepted = Evaluated(candidate=candidate(1, patch={"embedding_grad_mode": "fused"}), incumbent_id=None,
                         verdict=Verdict(accepted=True, stage="measure", reason="faster twice", ratio=0.25))
    run = state.model_copy(update={"history": [accepted], "baseline": Baseline(
        numerics_file="n.json", step_ms=117.0, noise_floor=0.011, calibration_file="c.json")})
    final = nodes.report(run, ctx)["final"]
    assert final.ratio == 0.252
    assert set(blocks) == {20}  # as many blocks as the fresh `bench --vs` re-measurement, not a candidate's 6
    if disturbed_first:
        assert not queue and "disturbed (block spread 185%" in final.note and "the repeat, is quoted" in final.note
        assert (state.run_dir and open(f"{state.run_dir}/final_ab_disturbed.json").read().count('"ratio": 0.201'))
        assert open(f"{state.run_dir}/final_ab_repeat.json").read().count('"ratio": 0.252')
    else:
        assert queue == [stalled] and final.note is None  # a steady first measurement is not repeated


def test_a_disturbed_final_measurement_whose_repeat_is_worse_keeps_both(state, ctx, monkeypatch):
    """Session 10 at `large`: the repeat was more disturbed than the first, so the first was quoted, and the
    repeat was nowhere on disk. Both are kept now, and the note says which one is quoted."""
    from state_machine.state import Baseline
    first = _final_ab([110.3, 110.5, 110.4, 109.1, 109.6, 109.8], [10.2, 10.4, 12.1, 10.3, 16.0, 9.4], 0.0941)
    worse = _final_ab([110.1, 110.2, 110.0, 109.9, 110.4, 110.1], [9.6, 17.9, 10.1, 10.0, 18.2, 10.3], 0.0920)
    queue = [first, worse]
    monkeypatch.setattr(nodes, "measure_ab", lambda *args, **kwargs: queue.pop(0))
    accepted = Evaluated(candidate=candidate(1, patch={"embedding_grad_mode": "fused"}), incumbent_id=None,
                         verdict=Verdict(accepted=True, stage="measure", reason="faster twice", ratio=0.1))
    run = state.model_copy(update={"history": [accepted], "baseline": Baseline(
        numerics_file="n.json", step_ms=110.0, noise_floor=0.010, calibration_file="c.json")})
    final = nodes.report(run, ctx)["final"]
    assert final.ratio == 0.0941 and "the first, is quoted" in final.note
    assert open(f"{state.run_dir}/final_ab_repeat.json").read().count('"ratio": 0.092')


def test_a_candidate_is_timed_in_blocks_of_the_plans_length(state, ctx, monkeypatch):
    from state_machine.state import Baseline
    from validators.speedup import Confirmation
    seen = {}

    def confirm_win(incumbent, cand, floor, blocks, steps_per_block, timeout_s, **kwargs):
        seen.update(kwargs, blocks=blocks, steps_per_block=steps_per_block, config=cand.config)
        run = _final_ab([9.2, 9.1], [8.0, 8.1], 0.88)
        return Confirmation(accepted=True, reason="faster twice", runs=[run, run])
    monkeypatch.setattr(nodes, "confirm_win", confirm_win)
    run = state.model_copy(update={
        "current": candidate(1, patch={"embedding_grad_mode": "fused"}),
        "plan": state.plan.model_copy(update={"block_steps": 3}),
        "baseline": Baseline(numerics_file="n.json", step_ms=115.0, noise_floor=0.011, calibration_file="c.json")})
    verdict = nodes.measure(run, ctx)["current_verdict"]
    assert verdict.accepted and verdict.ratio == 0.88
    # block_steps was sized on a 115 ms baseline; a 9 ms incumbent's blocks must still last 0.3 s
    assert seen["steps_per_block"] == 3 and seen["block_seconds"] == 0.3
    assert seen["config"]["embedding_grad_mode"] == "fused"


def test_the_noise_floor_is_calibrated_again_on_a_much_faster_incumbent(state, ctx, monkeypatch):
    """The session-10 `large` run: a 1.0% floor from the 110 ms baseline, incumbents of 24 ms after #2 and 9.7 ms
    after #8. diagnose calibrates the floor again on each incumbent at least twice as fast as the step of the
    floor in force, and measure judges candidates against the newest one."""
    from state_machine.state import Baseline, Incumbent
    from targets.worker_protocol import Failure
    from validators.speedup import Confirmation, NoiseFloor
    calibrated, profiled = [], []

    def noise_floor(st, spec, blocks, block_steps, timeout_s):
        calibrated.append(dict(spec.config))
        run = _final_ab([24.1, 24.6, 23.8, 24.9], [24.4, 23.9, 25.0, 24.2], 1.0)
        return NoiseFloor(floor=0.031, runs=[run, run]), {}
    monkeypatch.setattr(nodes, "noise_floor", noise_floor)
    monkeypatch.setattr(nodes, "run_profile", lambda req, timeout_s: profiled.append(req) or ProfileResult(
        ok=False, target="haste-rec", size="tiny", failure=Failure(kind="crash", message="not in this test")))
    base = state.model_copy(update={"baseline": Baseline(numerics_file="n.json", step_ms=110.0, noise_floor=0.010,
                                                         calibration_file="c.json")})

    def after(cid: int, est: float, run=base):
        return run.model_copy(update={"incumbent": Incumbent(config={"embedding_grad_mode": "fused"},
                                                             from_candidate=cid, est_speedup=est)})
    assert "recalibrations" not in nodes.diagnose(after(1, 1.44), ctx)  # 76 ms: not yet twice as fast
    assert not calibrated and len(profiled) == 1
    out = nodes.diagnose(after(2, 4.6), ctx)  # 24 ms
    (first,) = out["recalibrations"]
    assert (first.after_candidate, first.noise_floor, calibrated) == (2, 0.031, [{"embedding_grad_mode": "fused"}])
    assert first.step_ms == pytest.approx(24.3) and Path(first.calibration_file).name == "calibration.json"
    recalibrated = after(3, 6.0, base.model_copy(update=out))  # 18 ms: not twice as fast as 24.3 ms
    assert "recalibrations" not in nodes.diagnose(recalibrated, ctx) and recalibrated.noise_floor == 0.031
    assert len(nodes.diagnose(after(8, 11.4, recalibrated), ctx)["recalibrations"]) == 2  # 9.6 ms
    never = recalibrated.model_copy(update={"plan": state.plan.model_copy(update={"recalibrate_after": 0.0})})
    assert "recalibrations" not in nodes.diagnose(after(8, 11.4, never), ctx)  # --recalibrate-after 0
    seen = {}

    def confirm_win(incumbent, cand, floor, *args, **kwargs):
        seen["floor"] = floor
        run = _final_ab([24.1, 24.0], [20.0, 20.1], 0.83)
        return Confirmation(accepted=True, reason="faster twice", runs=[run, run])
    monkeypatch.setattr(nodes, "confirm_win", confirm_win)
    nodes.measure(recalibrated.model_copy(update={"current": candidate(4, patch={"data_workers": 2}),
                                                  "plan": state.plan.model_copy(update={"block_steps": 3})}), ctx)
    assert seen["floor"] == 0.031
    events = Path(state.run_dir, "events.jsonl").read_text()
    assert events.count('"recalibrate"') == 2 and '"was": 0.01' in events


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
