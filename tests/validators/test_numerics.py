"""The numerics gate accepts what each class promises and rejects the rest, naming the quantity."""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from targets.worker_client import run_worker
from targets.worker_protocol import NumericsData, WorkerRequest
from validators.numerics import (PRECISION_DRIFT_RTOL, PRECISION_LOSS_RTOL, QUALITY_MARGIN, REORDER_MAX_SCALE,
                                 REORDER_POINT_MAX, REORDER_RTOL, REORDER_SAFETY, NumericsVerdict,
                                 calibrate_reorder, compare, reorder_band)

STEPS = 12
GROUPS = ("encoder", "tail")


def make(losses=None, norms=None, probe=None, sha="abc123", param_norms=None) -> NumericsData:
    """A baseline-like record: decreasing losses, per-group norms (none at step 0, as the trainer), probe."""
    rng = np.random.default_rng(0)
    losses = losses if losses is not None else [100.0 * 0.8 ** i + 1.0 for i in range(STEPS)]
    norms = norms if norms is not None else [{}] + [{g: 1.0 + 0.1 * i + j for j, g in enumerate(GROUPS)}
                                                    for i in range(1, len(losses))]
    probe = probe if probe is not None else {"logits": rng.normal(-3.0, 2.0, 64).tolist(),
                                             "row_max": rng.normal(1.0, 0.5, 8).tolist()}
    return NumericsData(losses=losses, grad_norms=norms, probe=probe,
                        digest={"sha256": sha, "norms": param_norms or {g: 5.0 + j for j, g in enumerate(GROUPS)}})


def scaled(data: NumericsData, loss=None, norms=None, probe=None, params=None, sha=None) -> NumericsData:
    """A copy with multiplicative perturbations: each argument maps (index/key) -> relative change."""
    out = data.model_copy(deep=True)
    out.losses = [x * (1 + (loss(i) if loss else 0.0)) for i, x in enumerate(out.losses)]
    out.grad_norms = [{k: v * (1 + (norms(i) if norms else 0.0)) for k, v in n.items()}
                      for i, n in enumerate(out.grad_norms)]
    out.probe = {k: [x * (1 + (probe(j) if probe else 0.0)) for j, x in enumerate(v)] for k, v in out.probe.items()}
    out.digest["norms"] = {k: v * (1 + (params if params else 0.0)) for k, v in out.digest["norms"].items()}
    if sha is not None:
        out.digest["sha256"] = sha
    return out


def at(step: int, size: float):
    return lambda i: size if i == step else 0.0


# -- exact -------------------------------------------------------------------------------------------

def test_exact_accepts_bitwise_equal_records():
    verdict = compare(make(), make(), "exact")
    assert verdict.ok and verdict.failed_quantity is None and verdict.max_errors["loss"] == 0.0


@pytest.mark.parametrize("quantity,perturb", [
    ("loss", dict(loss=at(3, 1e-15))),
    ("grad_norms", dict(norms=at(2, 1e-15))),
    ("probe", dict(probe=at(5, 1e-15))),
    ("digest", dict(sha="def456")),
])
def test_exact_rejects_a_one_ulp_change_naming_the_quantity(quantity, perturb):
    verdict = compare(make(), scaled(make(), **perturb), "exact")
    assert not verdict.ok and verdict.failed_quantity == quantity
    assert "band" in verdict.detail


def test_exact_cannot_pass_without_a_parameter_digest():
    verdict = compare(make(sha=""), make(sha=""), "exact")
    assert not verdict.ok and verdict.failed_quantity == "digest"


# -- reorder -----------------------------------------------------------------------------------------

def test_reorder_accepts_fp32_association_noise_and_a_changed_digest():
    noise = scaled(make(), loss=lambda i: 2e-7 * (-1) ** i, norms=lambda i: 3e-7, probe=lambda j: 1e-7 * (j % 3),
                   params=1e-7, sha="other")
    verdict = compare(make(), noise, "reorder")
    assert verdict.ok, verdict.detail
    assert 0 < verdict.max_errors["loss"] < REORDER_RTOL


def test_reorder_band_grows_mildly_with_the_step():
    late = 1.5 * REORDER_RTOL  # inside the band at step 9 (1.9e-5), outside it at step 0 (1e-5)
    assert compare(make(), scaled(make(), loss=at(9, late)), "reorder").ok
    early = compare(make(), scaled(make(), loss=at(0, late)), "reorder")
    assert not early.ok and early.failed_quantity == "loss"
    assert reorder_band(10) == pytest.approx(2 * REORDER_RTOL) and reorder_band(100) < 2e-4


@pytest.mark.parametrize("quantity,perturb", [
    ("loss", dict(loss=at(7, 3.2e-3))),
    ("grad_norms", dict(norms=at(4, 1e-3))),
    ("probe", dict(probe=lambda j: 1e-3)),
    ("param_norms", dict(params=1e-3)),
])
def test_reorder_rejects_a_real_change_of_the_math(quantity, perturb):
    verdict = compare(make(), scaled(make(), **perturb), "reorder")
    assert not verdict.ok and verdict.failed_quantity == quantity
    assert verdict.max_errors[quantity] == pytest.approx(1e-3 if quantity != "loss" else 3.2e-3, rel=1e-6)


def test_reorder_detail_says_where_and_by_how_much():
    verdict = compare(make(), scaled(make(), loss=at(7, 3.2e-3)), "reorder")
    assert verdict.detail == "loss at step 7 differs by 0.0032 relative, band 1.7e-05"


def test_a_reproducible_baseline_keeps_the_fixed_reorder_bands():
    calibration = calibrate_reorder(make(), make())
    assert calibration.scale == 1.0 and calibration.worst == 0.0
    small = calibrate_reorder(make(), scaled(make(), loss=at(5, 0.1 * reorder_band(5))))
    assert small.scale == 1.0 and small.worst == pytest.approx(0.1, rel=1e-6) and small.quantity == "loss at step 5"


def test_self_drift_widens_the_reorder_bands_to_three_times_it():
    # The baseline against itself, reassociated: its loss at step 5 moves by 1.6x the fixed band.
    calibration = calibrate_reorder(make(), scaled(make(), loss=at(5, 1.6 * reorder_band(5))))
    assert calibration.scale == pytest.approx(REORDER_SAFETY * 1.6, rel=1e-6)
    assert "loss at step 5" in calibration.detail
    kernel = scaled(make(), loss=at(5, 2.0 * reorder_band(5)))  # another order, a bit further off
    assert not compare(make(), kernel, "reorder").ok
    assert compare(make(), kernel, "reorder", reorder=calibration).ok


def test_calibrated_bands_are_capped_and_still_reject_a_change_of_the_math():
    wild = calibrate_reorder(make(), scaled(make(), probe=lambda j: 1e-2))
    assert wild.scale == REORDER_MAX_SCALE and wild.quantity.startswith("probe")
    for quantity, perturb in (("loss", dict(loss=at(7, 3.2e-3))), ("param_norms", dict(params=1e-3)),
                              ("probe", dict(probe=lambda j: 2 * REORDER_POINT_MAX))):  # past the widest point band
        verdict = compare(make(), scaled(make(), **perturb), "reorder", reorder=wild)
        assert not verdict.ok and verdict.failed_quantity == quantity


def test_one_sensitive_step_widens_that_step_only():
    # As haste-rec @ large on the H200: the baseline's grad norms move by 5.2e-4 at step 5 between two runs of
    # itself (35x the fixed band there) and by ~2e-6 elsewhere.
    drift = scaled(make(), norms=lambda i: 5.2e-4 if i == 5 else 2e-6)
    calibration = calibrate_reorder(make(), drift)
    assert calibration.scale == REORDER_MAX_SCALE and calibration.quantity == "grad norm of encoder at step 5"
    assert calibration.step_drift[5] == pytest.approx(5.2e-4, rel=1e-6)
    assert "step 5" in calibration.detail and "get 3x their own drift" in calibration.detail
    kernel = scaled(make(), norms=at(5, 5.1e-4))  # another order: the same size of difference at the same step
    assert not compare(make(), kernel, "reorder").ok
    verdict = compare(make(), kernel, "reorder", reorder=calibration)
    assert verdict.ok, verdict.detail
    elsewhere = compare(make(), scaled(make(), norms=at(7, 5.1e-4)), "reorder", reorder=calibration)
    assert not elsewhere.ok and "at step 7" in elsewhere.detail  # the other steps keep x10 the fixed band
    wrong = compare(make(), scaled(make(), norms=at(5, 5.1e-4), loss=at(0, 1e-3)), "reorder", reorder=calibration)
    assert not wrong.ok and wrong.failed_quantity == "loss"


def test_a_point_band_never_exceeds_its_cap():
    calibration = calibrate_reorder(make(), scaled(make(), loss=at(5, 1e-2)))
    assert compare(make(), scaled(make(), loss=at(5, 0.9 * REORDER_POINT_MAX)), "reorder", reorder=calibration).ok
    verdict = compare(make(), scaled(make(), loss=at(5, 1.2 * REORDER_POINT_MAX)), "reorder", reorder=calibration)
    assert not verdict.ok and verdict.detail.endswith(f"band {REORDER_POINT_MAX:.2g}")


# -- precision ---------------------------------------------------------------------------------------

def bf16_like(data: NumericsData, rng_seed: int = 1) -> NumericsData:
    rng = np.random.default_rng(rng_seed)
    return scaled(data, loss=lambda i: rng.normal(0, 0.004), norms=lambda i: rng.normal(0, 0.02),
                  probe=lambda j: rng.normal(0, 0.01), params=0.003, sha="bf16")


def test_precision_accepts_bf16_sized_noise():
    verdict = compare(make(), bf16_like(make()), "precision")
    assert verdict.ok, verdict.detail


def test_precision_rejects_a_loss_step_outside_the_band():
    verdict = compare(make(), scaled(make(), loss=at(5, 1.5 * PRECISION_LOSS_RTOL)), "precision")
    assert not verdict.ok and verdict.failed_quantity == "loss" and "step 5" in verdict.detail


def test_precision_rejects_divergence_that_stays_inside_the_per_step_band():
    creeping = scaled(make(), loss=lambda i: 0.015 if i >= STEPS - STEPS // 4 else 0.0)
    assert 0.015 < PRECISION_LOSS_RTOL and 0.015 > PRECISION_DRIFT_RTOL
    verdict = compare(make(), creeping, "precision")
    assert not verdict.ok and verdict.failed_quantity == "loss_drift"
    assert compare(make(), scaled(make(), loss=lambda i: -0.015), "precision").ok  # a lower loss is no divergence


def test_precision_rejects_probe_outputs_that_lost_their_ranking():
    base = make(probe={"scores": (100.0 + np.random.default_rng(2).normal(0, 1, 64)).tolist()})
    shuffled = base.model_copy(deep=True)
    shuffled.probe["scores"] = list(np.random.default_rng(3).permutation(base.probe["scores"]))
    verdict = compare(base, shuffled, "precision")
    assert verdict.max_errors["probe"] < 5e-2  # close in L2 (a large common offset) ...
    assert not verdict.ok and verdict.failed_quantity == "probe_correlation"  # ... but uncorrelated


@pytest.mark.parametrize("quantity,perturb", [
    ("grad_norms", dict(norms=at(3, 0.2))),
    ("probe", dict(probe=lambda j: 0.1)),
])
def test_precision_rejects_large_grad_and_probe_errors(quantity, perturb):
    verdict = compare(make(), scaled(make(), **perturb), "precision")
    assert not verdict.ok and verdict.failed_quantity == quantity


# -- model -------------------------------------------------------------------------------------------

def test_model_class_judges_quality_not_trajectories():
    different = scaled(make(), loss=lambda i: 0.3, probe=lambda j: 0.5, sha="model")
    ok = compare(make(), different, "model", quality_baseline={"P@1": 0.40}, quality_candidate={"P@1": 0.395})
    assert ok.ok and ok.max_errors["quality"] == pytest.approx(0.005)
    worse = compare(make(), make(), "model", quality_baseline={"P@1": 0.40},
                    quality_candidate={"P@1": 0.40 - 2 * QUALITY_MARGIN})
    assert not worse.ok and worse.failed_quantity == "quality" and "0.0200" in worse.detail


@pytest.mark.parametrize("baseline,candidate", [(None, {"P@1": 0.4}), ({"P@1": 0.4}, None),
                                                ({"P@1": 0.4}, {"P@5": 0.3})])
def test_model_class_fails_without_its_quality_metric(baseline, candidate):
    verdict = compare(make(), make(), "model", quality_baseline=baseline, quality_candidate=candidate)
    assert not verdict.ok and verdict.failed_quantity == "quality" and "missing" in verdict.detail
    assert NumericsVerdict.model_validate_json(verdict.model_dump_json()) == verdict


def test_model_class_takes_another_metric_and_margin():
    kwargs = dict(quality_baseline={"PSP@5": 0.30}, quality_candidate={"PSP@5": 0.27}, quality_metric="PSP@5")
    assert not compare(make(), make(), "model", **kwargs).ok
    assert compare(make(), make(), "model", quality_margin=0.05, **kwargs).ok


# -- what fails whatever the class -----------------------------------------------------------------

CLASSES = ("exact", "reorder", "precision", "model")
QUALITY = dict(quality_baseline={"P@1": 0.4}, quality_candidate={"P@1": 0.4})


def poisoned(where: str, value: float) -> NumericsData:
    data = make()
    if where == "loss":
        data.losses[4] = value
    elif where == "grad_norms":
        data.grad_norms[2]["tail"] = value
    elif where == "probe":
        data.probe["logits"][7] = value
    else:
        data.digest["norms"]["encoder"] = value
    return data


@pytest.mark.parametrize("numerics_class", CLASSES)
@pytest.mark.parametrize("where", ["loss", "grad_norms", "probe", "digest"])
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_non_finite_values_always_fail(numerics_class, where, value):
    verdict = compare(make(), poisoned(where, value), numerics_class, **QUALITY)
    assert not verdict.ok and verdict.failed_quantity == where and str(value) in verdict.detail
    flipped = compare(poisoned(where, value), make(), numerics_class, **QUALITY)
    assert not flipped.ok and "baseline" in flipped.detail


@pytest.mark.parametrize("numerics_class", CLASSES)
def test_non_finite_quality_fails(numerics_class):
    verdict = compare(make(), make(), numerics_class, quality_baseline={"P@1": 0.4},
                      quality_candidate={"P@1": math.nan})
    assert not verdict.ok and verdict.failed_quantity == "quality"


@pytest.mark.parametrize("numerics_class", CLASSES)
def test_different_lengths_fail(numerics_class):
    base = make()
    short = make(losses=base.losses[:-1], norms=base.grad_norms[:-1])
    verdict = compare(base, short, numerics_class, **QUALITY)
    assert not verdict.ok and verdict.failed_quantity == "loss" and "12 steps" in verdict.detail


@pytest.mark.parametrize("numerics_class", ["exact", "reorder", "precision"])
def test_mismatched_groups_or_probe_shapes_fail(numerics_class):
    fewer_groups = make(norms=[{}] + [{"encoder": 1.0}] * (STEPS - 1))
    assert compare(make(), fewer_groups, numerics_class).failed_quantity == "grad_norms"
    shorter_probe = make()
    shorter_probe.probe["row_max"] = shorter_probe.probe["row_max"][:-1]
    assert compare(make(), shorter_probe, numerics_class).failed_quantity == "probe"


def test_unknown_class_is_a_programming_error():
    with pytest.raises(ValueError, match="unknown numerics class"):
        compare(make(), make(), "roughly")


# -- real runs of the reference trainer -------------------------------------------------------------

@pytest.fixture(scope="module")
def trainer_runs() -> dict[str, NumericsData]:
    configs = {"baseline": {}, "fused": {"embedding_grad_mode": "fused"}, "bf16": {"precision": "bf16-autocast"},
               "nudged": {}}

    def run(name: str) -> NumericsData:
        req = WorkerRequest(target="haste-rec", size="tiny", mode="numerics", steps=6, threads=1,
                            config=configs[name], reassociate=name == "nudged")
        result = run_worker(req, timeout_s=300)
        assert result.ok, result.failure
        return result.numerics

    with ThreadPoolExecutor(max_workers=2) as pool:
        return dict(zip(configs, pool.map(run, configs)))


def test_a_nudged_baseline_moves_by_rounding_and_calibrates_the_bands(trainer_runs):
    base, nudged = trainer_runs["baseline"], trainer_runs["nudged"]
    assert nudged.losses != base.losses  # one fp32 rounding of every dense parameter shows
    assert compare(base, nudged, "reorder").ok  # ...and stays a rounding-sized difference
    calibration = calibrate_reorder(base, nudged)
    assert 0 < calibration.worst < 1 and calibration.scale == 1.0


def test_fused_embedding_gradients_are_a_reorder_not_exact(trainer_runs):
    base, fused = trainer_runs["baseline"], trainer_runs["fused"]
    reorder = compare(base, fused, "reorder")
    assert reorder.ok, reorder.detail
    exact = compare(base, fused, "exact")
    assert not exact.ok and exact.failed_quantity in ("grad_norms", "probe", "digest")


def test_bf16_autocast_is_a_precision_change_not_a_reorder(trainer_runs):
    base, bf16 = trainer_runs["baseline"], trainer_runs["bf16"]
    precision = compare(base, bf16, "precision")
    assert precision.ok, precision.detail
    reorder = compare(base, bf16, "reorder")
    assert not reorder.ok and reorder.failed_quantity in ("loss", "grad_norms", "probe")
