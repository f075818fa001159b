"""Real H200 runs replayed into a RunState (their profiles in tests/fixtures/h200_*.json, their histories here or
beside the tests that use them), for the proposer tests."""

from __future__ import annotations

from pathlib import Path

from profilers.findings import findings as profile_findings
from profilers.records import ProfileResult
from state_machine.context import RunContext
from state_machine.state import Evaluated, RunState, Verdict
from tests.state_machine.records import candidate

FIXTURES = Path(__file__).parents[1] / "fixtures"


LARGE_CACHED_BASE = {"embedding_placement": "host", "embedding_grad_mode": "sparse"}  # haste_rec_large_cached.toml


def replayed(state: RunState, ctx: RunContext, profile: str, size: str, base: dict, steps: list) -> RunState:
    """The state of a real H200 run: its history from `steps` (id, patch, accepted[, measured ratio, or (ratio,
    interval low, interval high), or the numerics class whose bands it broke at validation]), each
    candidate measured against the incumbent of its time, and the findings of `profile` (that run's profile
    of its incumbent)."""
    result = ProfileResult.model_validate_json((FIXTURES / profile).read_text())
    history, config, incumbent, est = [], dict(base), None, 1.0
    for cid, patch, accepted, *ratio in steps:
        ratio = ratio[0] if ratio else None
        broke = ratio if isinstance(ratio, str) else None  # a numerics class: rejected at validation under it
        ratio, low, high = ratio if isinstance(ratio, tuple) else (ratio, None, None)  # (ratio, its 95% interval)
        verdict = Verdict(accepted=accepted, stage="validate" if broke else "measure", reason="as in that run",
                          ratio=None if broke else ratio, ci_low=low, ci_high=high, numerics_class=broke)
        history.append(Evaluated(candidate=candidate(cid, patch=patch), incumbent_id=incumbent,
                                 config={**config, **patch}, verdict=verdict))
        if accepted:
            config, incumbent, est = {**config, **patch}, cid, est / (ratio or 1.0)
    resolved = ctx.target.knob_space.resolve(config)
    assert {k: resolved[k] for k in config} == {k: result.config[k] for k in config}  # the profile's own config
    return state.model_copy(update={
        "device": "cuda", "size": size, "baseline_config": base, "history": history,
        "incumbent": state.incumbent.model_copy(update={"config": config, "from_candidate": incumbent,
                                                        "est_speedup": est}),
        "findings": profile_findings(result.coarse, None, result.counters, resolved, ctx.target)})


S22_LARGE_CACHED_HISTORY = [  # the 2026-12-03 x7.29 `large-cached` run (docs/results/2026-12-03-h200-large-cached-s22/)
    (1, {"tail_backend": "triton-fused-loss"}, True, 0.611),
    (2, {"embedding_placement": "cached", "embedding_grad_mode": "fused"}, True, 0.471),
    (3, {"embedding_cache_index": "device"}, True, 0.627), (4, {"tail_fp32_dot": "tf32x3"}, False, 0.995),
    (5, {"embedding_cache_overlap": True}, False, 0.926), (6, {"data_workers": 2}, False, 1.014),
    (7, {"tail_fp32_dot": "tf32"}, False, 0.956), (8, {"precision": "bf16-autocast"}, False, "precision"),
    (9, {"matmul_precision": "high"}, False, "precision"), (10, {"pack_batches": True}, False, 0.954),
    (11, {"pack_batches": True, "embedding_cache_overlap": True}, False, 0.962),
    (12, {"pin_memory": True}, True, 0.894)]


S27_LARGE_CACHED_HISTORY = [  # the 2026-12-03 x12.37 `large-cached` run (docs/results/2026-12-03-h200-large-cached-s27/)
    (1, {"tail_backend": "triton-fused-loss"}, True, 0.674),
    (2, {"embedding_placement": "cached", "embedding_grad_mode": "fused"}, True, 0.398),
    (3, {"embedding_cache_index": "device"}, True, 0.605), (4, {"embedding_cache_overlap": True}, False, 0.930),
    (5, {"data_workers": 2}, False, 0.900), (6, {"data_workers": 2, "embedding_cache_overlap": True}, True, 0.711),
    (7, {"tail_fp32_dot": "tf32x3"}, True, 0.828), (8, {"pin_memory": True}, False, 0.918),
    (9, {"pack_batches": True}, True, 0.896)]


S24_LARGE_HISTORY = [  # the 2026-12-03 x9.72 `large` run (docs/results/2026-12-03-h200-large-s24/) to its last win
    (1, {"embedding_grad_mode": "fused"}, True, 0.613), (2, {"tail_backend": "triton-fused-loss"}, True, 0.219),
    (3, {"tail_fp32_dot": "tf32x3"}, False, (1.037, 0.987, 1.077)),
    (4, {"tail_fp32_dot": "tf32"}, False, (1.027, 0.945, 1.059)),
    (5, {"precision": "bf16-autocast"}, False, "precision"), (6, {"matmul_precision": "high"}, False, "precision"),
    (7, {"data_workers": 2}, True, 0.865), (8, {"pin_memory": True, "prefetch_to_device": True}, True, 0.820)]
