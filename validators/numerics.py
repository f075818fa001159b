"""Numerics gate: does a candidate config compute what the baseline computes, to its knob's promise?

Every knob declares a numerics class (``targets.protocol.NumericsClass``); this module turns that
promise into a check of two ``NumericsData`` records taken at the same seed and step count (loss and
grad norms per step, probe outputs, parameter digest) and returns a verdict naming the first quantity
that broke its band and by how much. The bands are module constants so that a verdict can always be
traced to a stated number and its reason:

* ``exact``: bitwise. Every loss, grad norm and probe output has the same bits and the sha256 of all
  trainable state is equal. A change that only moves data (loader workers, cache sizes) must not
  alter one bit.
* ``reorder``: same math, other float association (fused kernels, sparse gradients, foreach
  optimizers). fp32 rounds each operation to u = 2**-24 ~ 6e-8 relative. Reassociating a reduction of
  n terms changes its result by about log2(n) u for the blocked/pairwise sums torch runs (for the
  largest reduction of a step, the loss over B x L ~ 2e8 logits, that is ~28 u ~ 1.7e-6); the losses
  summed are positive, so the condition number is ~1. ``REORDER_RTOL`` = 1e-5 (~160 u) leaves a
  factor ~6 over that. Training feeds each step's rounding into the next, so the band grows linearly
  by ``REORDER_GROWTH_PER_STEP`` = 10% of itself per step (2e-5 at step 10, 1.1e-4 at step 100):
  enough for accumulated rounding on the short numerics runs, still 10x below the >= 1e-3 a real
  change of the math (a dropped term, a wrong scale, a stale row) produces. The reference trainer
  measured 1.8e-6 (loss), 3.9e-6 (grad norms), 2e-6 (probe) for fused vs dense gradients at size
  small over 30 steps.
  Some workloads amplify rounding faster than that (a high learning rate early in training); the
  agent measures it at baseline time by running the baseline twice, once deterministic and once free
  to reassociate with its dense parameters nudged by one fp32 rounding before every step (a reordering
  kernel differs by a rounding at every step; nudged once, `xl`'s baseline drifted 12 times less than
  its correct Triton tails), and ``calibrate_reorder`` widens the
  bands to ``REORDER_SAFETY`` = 3 times that self-drift, at most ``REORDER_MAX_SCALE`` = 10 times the
  fixed bands. Where the self-drift at one point (a step's loss and grad norms, one probe output, one
  parameter norm) is larger still, that point's band follows it: 3 times the drift there, at most
  ``REORDER_POINT_MAX`` = 5e-3 (a quarter of the precision class's loss band). haste-rec @ large on
  the H200 needs it: its grad norms at step 5 move by 5.2e-4 between two runs of the baseline itself
  (steps 4 and 6: 2.5e-6 and 1.7e-6), 35 times the fixed band, and the Triton tails move them by the same
  5.1e-4 there; every other step keeps its tight band, where a change of the math still shows.
* ``precision``: bf16 keeps 8 mantissa bits, u = 2**-8 ~ 3.9e-3. A loss computed in fp32 from bf16
  activations moves by a few u per step, so ``PRECISION_LOSS_RTOL`` = 2% (~5 u) per step; grad norms
  carry the rounding of every backward layer, hence 10%; probe outputs must stay within relative L2
  5e-2 (~13 u, the forward's accumulated rounding plus the drift of the trained weights) and keep a
  Pearson correlation >= 0.99 with the baseline's, so the ranking the metrics read survives. Rounding
  noise has no sign; divergence does: the mean signed excess of the candidate's loss over the last
  quarter of the steps must stay below ``PRECISION_DRIFT_RTOL`` = 1% (half the per-step band, since
  averaging removes most of the noise). Measured on the reference trainer (tiny, 40 steps):
  bf16-autocast loss <= 8e-4, grad norms <= 1.2e-2, probe rel-L2 <= 3.7e-3; pure bf16 at size
  small diverges (loss +16%, probe correlation < 0) and fails, as it should.
* ``model``: the knob changes the model, so trajectories are not compared; every quality metric the
  target declares must stay within its band of the baseline's (``validators.quality``; without a
  declaration, ``QUALITY_METRIC`` = P@1 may fall at most ``QUALITY_MARGIN`` = 0.01 absolute). A
  missing metric is a failure, never a pass.

Whatever the class, a NaN or infinity anywhere, or trajectories of different lengths, fail.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping, Sequence

import numpy as np
from pydantic import BaseModel, Field

from targets.protocol import NUMERICS_CLASSES
from targets.tuning import QualityMetric
from validators.quality import quality_sentences
from targets.worker_protocol import NumericsData

REORDER_RTOL = 1e-5
REORDER_GROWTH_PER_STEP = 0.1
REORDER_SAFETY = 3.0      # calibrated bands: this many times the baseline's own reassociation drift
REORDER_MAX_SCALE = 10.0  # ...and never wider than this many times the fixed bands
REORDER_POINT_MAX = 5e-3  # the widest band one point gets from its own self-drift
PRECISION_LOSS_RTOL = 0.02
PRECISION_DRIFT_RTOL = 0.01
PRECISION_GRAD_NORM_RTOL = 0.10
PRECISION_PROBE_REL_L2 = 5e-2
PRECISION_PROBE_MIN_CORRELATION = 0.99
QUALITY_METRIC = "P@1"
QUALITY_MARGIN = 0.01
TINY = 1e-30  # the denominator floor of a relative error, so zero against zero is a zero error


class NumericsVerdict(BaseModel):
    ok: bool
    numerics_class: str
    failed_quantity: str | None = Field(None, description="loss, loss_drift, grad_norms, probe, "
                                        "probe_correlation, param_norms, digest or quality; None when ok")
    detail: str = Field(description="one sentence: which quantity failed and by how much, or what passed")
    max_errors: dict[str, float] = Field(default_factory=dict, description=(
        "worst error per quantity: relative for loss, grad_norms, param_norms; signed relative for "
        "loss_drift; relative L2 for probe (elementwise relative under exact); 1 - correlation for "
        "probe_correlation; 1 if the sha256 differs for digest; absolute drop for quality"))


@dataclass(frozen=True)
class Measure:
    """The worst error of one quantity against its band, and the sentence that reports it."""

    quantity: str
    error: float
    failed: bool
    sentence: str


class _Broken(Exception):
    """A structural fault (non-finite value, length or key mismatch) that fails whatever the class."""

    def __init__(self, quantity: str, sentence: str):
        super().__init__(sentence)
        self.quantity, self.sentence = quantity, sentence


def reorder_band(step: int, scale: float = 1.0) -> float:
    """The reorder class's relative band at a 0-based step (or after ``step`` steps, for end state),
    times the workload's calibrated ``scale`` (see ``calibrate_reorder``)."""
    return scale * REORDER_RTOL * (1.0 + REORDER_GROWTH_PER_STEP * step)


def _rel(base: float, cand: float) -> float:
    return abs(cand - base) / max(abs(base), TINY)


def _bits(x: float) -> bytes:
    return struct.pack("<d", x)


def _worst(quantity: str, errors: Iterator[tuple[float, float, str]], unit: str) -> Measure:
    """Fold (error, band, where) triples: the largest error, and the first band breach if any (the
    earliest step where the candidate left its band is where to look)."""
    worst, band_at_worst, breach = 0.0, 0.0, ""
    for error, band, where in errors:
        if error > band and not breach:
            breach = f"{quantity} {where} differs by {error:.2g} {unit}, band {band:.2g}"
        if error >= worst:
            worst, band_at_worst = error, band
    return Measure(quantity, worst, bool(breach), breach or f"{quantity} {worst:.2g} {unit} (band {band_at_worst:.2g})")


# -- structure: what fails whatever the class ------------------------------------------------------

def _numbers(value: Any, path: str) -> Iterator[tuple[str, float]]:
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return
    if isinstance(value, (int, float)):
        yield path, float(value)
    elif isinstance(value, Mapping):
        for key, item in value.items():
            yield from _numbers(item, f"{path}[{key}]")
    elif isinstance(value, Sequence):
        for i, item in enumerate(value):
            yield from _numbers(item, f"{path}[{i}]")


def _check_finite(data: NumericsData, quality: Mapping[str, float] | None, side: str) -> None:
    where = {"loss": [(f"at step {i}", x) for i, x in enumerate(data.losses)],
             "grad_norms": [(f"of group {k} at step {i}", x) for i, norms in enumerate(data.grad_norms)
                            for k, x in norms.items()],
             "probe": [(f"output {p}", x) for p, x in _numbers(data.probe, "")],
             "digest": [(f"entry {p}", x) for p, x in _numbers(data.digest, "")],
             "quality": [(f"metric {p}", x) for p, x in _numbers(quality or {}, "")]}
    for quantity, values in where.items():
        for label, x in values:
            if not math.isfinite(x):
                raise _Broken(quantity, f"{side} {quantity} {label} is {x}, and non-finite values always fail")


def _check_lengths(base: NumericsData, cand: NumericsData, with_probe: bool) -> None:
    for quantity, b, c in (("loss", base.losses, cand.losses), ("grad_norms", base.grad_norms, cand.grad_norms)):
        if len(b) != len(c):
            raise _Broken(quantity, f"{quantity} trajectories differ in length: {len(b)} steps in the baseline, "
                                    f"{len(c)} in the candidate")
    if not with_probe:
        return
    for i, (b, c) in enumerate(zip(base.grad_norms, cand.grad_norms)):
        if set(b) != set(c):
            raise _Broken("grad_norms", f"grad_norms at step {i} cover groups {sorted(b)} in the baseline but "
                                        f"{sorted(c)} in the candidate")
    if set(base.probe) != set(cand.probe):
        raise _Broken("probe", f"probe outputs are {sorted(base.probe)} in the baseline but {sorted(cand.probe)} "
                               f"in the candidate")
    for key in base.probe:
        if len(base.probe[key]) != len(cand.probe[key]):
            raise _Broken("probe", f"probe output {key} has {len(base.probe[key])} values in the baseline, "
                                   f"{len(cand.probe[key])} in the candidate")


# -- the classes -----------------------------------------------------------------------------------

def _exact(base: NumericsData, cand: NumericsData) -> list[Measure]:
    def bitwise(quantity: str, pairs: Iterator[tuple[str, float, float]]) -> Measure:
        # any differing bit is a breach of band 0, even one that is no difference in value (-0.0 vs 0.0)
        errors = ((max(_rel(b, c), TINY) if _bits(b) != _bits(c) else 0.0, 0.0, f"{where} ({b!r} vs {c!r})")
                  for where, b, c in pairs)
        return _worst(quantity, errors, "relative")

    b_sha, c_sha = base.digest.get("sha256") or "", cand.digest.get("sha256") or ""
    if not b_sha or not c_sha:
        digest = Measure("digest", 1.0, True, "digest has no sha256 of the parameters to compare, so bitwise "
                                              "equality cannot be shown")
    else:
        digest = Measure("digest", float(b_sha != c_sha), b_sha != c_sha,
                         f"parameter digest sha256 {b_sha[:12]} vs {c_sha[:12]}, band: equal")
    return [bitwise("loss", ((f"at step {i}", b, c) for i, (b, c) in enumerate(zip(base.losses, cand.losses)))),
            bitwise("grad_norms", ((f"of group {k} at step {i}", b[k], c[k])
                                   for i, (b, c) in enumerate(zip(base.grad_norms, cand.grad_norms)) for k in b)),
            bitwise("probe", ((f"output {key}[{j}]", x, y) for key in base.probe
                              for j, (x, y) in enumerate(zip(base.probe[key], cand.probe[key])))),
            digest]


def _probe_error(base: NumericsData, cand: NumericsData, key: str) -> float:
    """Relative L2 distance of one probe output."""
    b, c = np.asarray(base.probe[key], float), np.asarray(cand.probe[key], float)
    return float(np.linalg.norm(c - b) / max(float(np.linalg.norm(b)), TINY))


def _probe_rel_l2(base: NumericsData, cand: NumericsData, band: Callable[[str], float]) -> Measure:
    errors = ((_probe_error(base, cand, key), band(key), f"output {key}") for key in base.probe)
    return _worst("probe", errors, "relative L2")


def _param_norms(base: NumericsData, cand: NumericsData, band: Callable[[str], float]) -> list[Measure]:
    b, c = base.digest.get("norms"), cand.digest.get("norms")
    if not isinstance(b, Mapping) or not isinstance(c, Mapping):
        return []
    if set(b) != set(c):
        return [Measure("param_norms", 1.0, True, f"param_norms cover groups {sorted(b)} in the baseline but "
                                                  f"{sorted(c)} in the candidate")]
    return [_worst("param_norms", ((_rel(b[k], c[k]), band(k), f"of group {k}") for k in b), "relative")]


def _trajectories(base: NumericsData, cand: NumericsData, loss_band: Callable[[int], float],
                  norm_band: Callable[[int], float]) -> tuple[Measure, Measure]:
    """Relative errors of the loss and of every group's grad norm, step by step, against per-step bands."""
    losses = ((_rel(b, c), loss_band(i), f"at step {i}") for i, (b, c) in enumerate(zip(base.losses, cand.losses)))
    norms = ((_rel(b[k], c[k]), norm_band(i), f"of group {k} at step {i}")
             for i, (b, c) in enumerate(zip(base.grad_norms, cand.grad_norms)) for k in b)
    return _worst("loss", losses, "relative"), _worst("grad_norms", norms, "relative")


class ReorderCalibration(BaseModel):
    """How far the baseline drifts from itself when only its float association changes, and the reorder
    bands that follow: every point gets the fixed band times ``scale``, or SAFETY times the baseline's own
    drift at that point where that is wider (at most REORDER_POINT_MAX)."""

    scale: float = Field(1.0, description="multiplier of the reorder bands: max(1, SAFETY x worst), at most MAX_SCALE")
    worst: float = Field(0.0, description="the largest error / unscaled band of the self-comparison")
    quantity: str | None = Field(None, description="the quantity and place of that largest ratio")
    step_drift: list[float] = Field(default_factory=list, description=(
        "per step, the largest relative self-drift of the loss and the grad norms: a step's band is at least "
        "SAFETY times it (at most REORDER_POINT_MAX)"))
    end_drift: dict[str, float] = Field(default_factory=dict, description=(
        "'probe <key>' and 'param norm of <group>': their relative self-drift, widening their bands alike"))
    detail: str = ""

    def step_band(self, step: int) -> float:
        """The band of a step's loss and grad norms."""
        drift = self.step_drift[step] if step < len(self.step_drift) else 0.0
        return _widened(reorder_band(step, self.scale), drift)

    def end_band(self, point: str, steps: int) -> float:
        """The band of an end-of-run point (``_probe_point``, ``_norm_point``) after ``steps`` steps."""
        return _widened(reorder_band(steps, self.scale), self.end_drift.get(point, 0.0))


def _widened(fixed: float, drift: float) -> float:
    """A point's band: the (scaled) fixed band, or SAFETY times its self-drift where wider, at most POINT_MAX."""
    return max(fixed, min(REORDER_POINT_MAX, REORDER_SAFETY * drift))


def _probe_point(key: str) -> str:
    """The name of a probe output in ``ReorderCalibration.end_drift``."""
    return f"probe {key}"


def _norm_point(group: str) -> str:
    """The name of a parameter group's norm in ``ReorderCalibration.end_drift``."""
    return f"param norm of {group}"


def _reorder(base: NumericsData, cand: NumericsData, calibration: ReorderCalibration | None = None) -> list[Measure]:
    """Every point against its calibrated band (``ReorderCalibration``; None: the fixed bands)."""
    cal, steps = calibration or ReorderCalibration(), len(base.losses)
    return [*_trajectories(base, cand, cal.step_band, cal.step_band),
            _probe_rel_l2(base, cand, lambda key: cal.end_band(_probe_point(key), steps)),
            *_param_norms(base, cand, lambda k: cal.end_band(_norm_point(k), steps))]


def _step_drift(a: NumericsData, b: NumericsData) -> Iterator[tuple[float, str]]:
    """Per step, the largest relative difference of the loss and the grad norms, and where it is."""
    for i, (x, y, gx, gy) in enumerate(zip(a.losses, b.losses, a.grad_norms, b.grad_norms)):
        yield max([(_rel(x, y), f"loss at step {i}")]
                  + [(_rel(gx[k], gy[k]), f"grad norm of {k} at step {i}") for k in gx])


def calibrate_reorder(deterministic: NumericsData, reordered: NumericsData) -> ReorderCalibration:
    """The reorder bands for this workload, from two runs of the SAME config: one deterministic,
    one free to reassociate (nondeterministic CUDA atomics, all CPU threads) with its parameters nudged by
    one fp32 rounding before every step (where the target offers ``Session.perturb``; ``targets.worker.
    run_numerics``), so that the run shows how far this workload's training carries rounding-sized
    differences made at every step, as a reordering kernel makes them.

    The fixed bands assume rounding grows by 10% a step. A workload that amplifies rounding faster
    (a high learning rate early in training) shows it on itself: its own reassociation already moves
    the loss by more than the band, and then a correct kernel that merely sums in another order
    would be rejected. Like the A/A noise floor for speed, the bands are then widened to
    ``REORDER_SAFETY`` times the self-drift measured here, and never more than ``REORDER_MAX_SCALE``
    times the fixed band (at most 1e-4 at step 0, still 10x below the >= 1e-3 a change of the math
    produces). A point whose own drift is larger still (one sensitive step) gets SAFETY times that
    drift, at most ``REORDER_POINT_MAX``, and only there. A workload that reproduces itself to within
    the band keeps scale 1 and no widened point.
    """
    step_worst = list(_step_drift(deterministic, reordered))
    step_drift = [drift for drift, _ in step_worst]
    end_drift = {_probe_point(key): _probe_error(deterministic, reordered, key) for key in deterministic.probe}
    norms_a, norms_b = deterministic.digest.get("norms") or {}, reordered.digest.get("norms") or {}
    end_drift.update({_norm_point(k): _rel(norms_a[k], norms_b[k]) for k in norms_a if k in norms_b})
    end = reorder_band(len(deterministic.losses))
    ratios = [(d / reorder_band(i), where) for i, (d, where) in enumerate(step_worst)]
    ratios += [(d / end, where) for where, d in end_drift.items()]
    ratio, where = max(ratios, default=(0.0, "nowhere"))
    scale = min(REORDER_MAX_SCALE, max(1.0, REORDER_SAFETY * ratio))
    calibration = ReorderCalibration(scale=scale, worst=ratio, quantity=where, step_drift=step_drift,
                                     end_drift=end_drift)
    steps = len(step_drift)
    points = [f"step {i}" for i in range(steps) if calibration.step_band(i) > reorder_band(i, scale)]
    points += [w for w in end_drift if calibration.end_band(w, steps) > reorder_band(steps, scale)]
    detail = (f"the baseline against itself with float association free drifts by at most {ratio:.2g} of the "
              f"reorder band ({where}), so its bands are x{scale:.2f}")
    if points:
        named = ", ".join(points[:4])
        detail += (f"; {len(points)} point(s) drift further ({named}{', ...' if len(points) > 4 else ''}) and get "
                   f"{REORDER_SAFETY:g}x their own drift, at most {REORDER_POINT_MAX:g}")
    return calibration.model_copy(update={"detail": detail})


def _correlation(base: NumericsData, cand: NumericsData) -> Measure:
    def deficits() -> Iterator[tuple[float, float, str]]:
        for key in base.probe:
            b, c = np.asarray(base.probe[key], float), np.asarray(cand.probe[key], float)
            if b.size < 2 or b.std() == 0 or c.std() == 0:  # correlation undefined: equal counts as correlated
                corr = 1.0 if np.array_equal(b, c) else 0.0
            else:
                corr = float(np.corrcoef(b, c)[0, 1])
            yield 1.0 - corr, 1.0 - PRECISION_PROBE_MIN_CORRELATION, f"output {key} (correlation {corr:.4f})"
    return _worst("probe_correlation", deficits(), "below 1")


def _drift(base: NumericsData, cand: NumericsData) -> Measure:
    quarter = max(1, len(base.losses) // 4)
    tail = list(zip(base.losses[-quarter:], cand.losses[-quarter:]))
    excess = sum((c - b) / max(abs(b), TINY) for b, c in tail) / max(len(tail), 1)
    failed = excess > PRECISION_DRIFT_RTOL
    if failed:
        return Measure("loss_drift", excess, True,
                       f"loss_drift: the candidate's loss over the last {len(tail)} steps exceeds the baseline's "
                       f"by {excess:.2g} relative on average, band {PRECISION_DRIFT_RTOL:.2g}")
    return Measure("loss_drift", excess, False, f"loss_drift {excess:+.2g} relative over the last {len(tail)} steps "
                                                f"(band {PRECISION_DRIFT_RTOL:.2g})")


def _precision(base: NumericsData, cand: NumericsData) -> list[Measure]:
    loss, norms = _trajectories(base, cand, lambda _: PRECISION_LOSS_RTOL, lambda _: PRECISION_GRAD_NORM_RTOL)
    return [loss, _drift(base, cand), norms, _probe_rel_l2(base, cand, lambda _: PRECISION_PROBE_REL_L2),
            _correlation(base, cand), *_param_norms(base, cand, lambda _: PRECISION_LOSS_RTOL)]


def _quality(baseline: Mapping[str, float] | None, candidate: Mapping[str, float] | None,
             metrics: Sequence[QualityMetric]) -> list[Measure]:
    """One measure over every declared metric (``validators.quality``): the worst, failed where any is out of band."""
    judged = quality_sentences(metrics, baseline, candidate)
    failed = [sentence for _, _, bad, sentence in judged if bad]
    return [Measure("quality", max(worse for _, worse, _, _ in judged), bool(failed),
                    "; ".join(failed or [sentence for _, _, _, sentence in judged]))]


_CLASSES: dict[str, Callable[..., list[Measure]]] = {"exact": _exact, "reorder": _reorder, "precision": _precision}


def compare(baseline: NumericsData, candidate: NumericsData, numerics_class: str, *,
            quality_baseline: Mapping[str, float] | None = None, quality_candidate: Mapping[str, float] | None = None,
            quality_metric: str = QUALITY_METRIC, quality_margin: float = QUALITY_MARGIN,
            quality_metrics: Sequence[QualityMetric] | None = None,
            reorder: ReorderCalibration | None = None) -> NumericsVerdict:
    """Judge a candidate's numerics against the baseline's under a knob's numerics class; the reorder
    bands follow the workload's ``reorder`` calibration (``calibrate_reorder``; None keeps the fixed bands). A model
    change is judged by the target's declared ``quality_metrics``, else by ``quality_metric`` (higher is better)
    within ``quality_margin``."""
    if numerics_class not in NUMERICS_CLASSES:
        raise ValueError(f"unknown numerics class {numerics_class!r}; one of {', '.join(NUMERICS_CLASSES)}")
    try:
        _check_finite(baseline, quality_baseline, "baseline")
        _check_finite(candidate, quality_candidate, "candidate")
        _check_lengths(baseline, candidate, with_probe=numerics_class != "model")
    except _Broken as broken:
        return NumericsVerdict(ok=False, numerics_class=numerics_class, failed_quantity=broken.quantity,
                               detail=broken.sentence)
    if numerics_class == "model":
        declared = quality_metrics if quality_metrics is not None else (
            QualityMetric(quality_metric, "higher", quality_margin),)
        measures = _quality(quality_baseline, quality_candidate, declared)
    elif numerics_class == "reorder":
        measures = _reorder(baseline, candidate, reorder)
    else:
        measures = _CLASSES[numerics_class](baseline, candidate)
    errors = {m.quantity: m.error for m in measures if math.isfinite(m.error)}  # JSON has no inf
    failed = next((m for m in measures if m.failed), None)
    if failed is not None:
        return NumericsVerdict(ok=False, numerics_class=numerics_class, failed_quantity=failed.quantity,
                               detail=failed.sentence, max_errors=errors)
    return NumericsVerdict(ok=True, numerics_class=numerics_class, max_errors=errors,
                           detail=f"{numerics_class} numerics hold: " + ", ".join(m.sentence for m in measures) + ".")
