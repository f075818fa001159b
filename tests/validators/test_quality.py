"""A model change is judged by the quality metrics its target declares: each in its direction, within its band,
and never when one is missing."""

from __future__ import annotations

from targets.haste_rec.target import TARGET as TRAINER
from targets.tuning import QualityMetric
from targets.worker_protocol import NumericsData
from validators.numerics import compare

LOSS = QualityMetric("heldout_loss", "lower", 0.01)
AUC = QualityMetric("auc", "higher", 0.005)
SAME = NumericsData(losses=[1.0], grad_norms=[{}], probe={}, digest={})


def judged(baseline, candidate, metrics=(LOSS, AUC)):
    return compare(SAME, SAME, "model", quality_baseline=baseline, quality_candidate=candidate,
                   quality_metrics=metrics)


def test_each_metric_in_its_direction_within_its_band():
    base = {"heldout_loss": 0.50, "auc": 0.80}
    assert judged(base, {"heldout_loss": 0.505, "auc": 0.797}).ok  # a little worse, inside both bands
    assert judged(base, {"heldout_loss": 0.45, "auc": 0.85}).ok    # better on both
    worse = judged(base, {"heldout_loss": 0.52, "auc": 0.80})
    assert not worse.ok and "heldout_loss is 0.5200 against the baseline's 0.5000" in worse.detail
    assert "band 0.0100" in worse.detail and "lower is better" in worse.detail
    assert not judged(base, {"heldout_loss": 0.50, "auc": 0.79}).ok


def test_a_missing_or_undeclared_metric_fails():
    assert "missing from the candidate" in judged({"heldout_loss": 0.5, "auc": 0.8}, {"heldout_loss": 0.5}).detail
    assert "declares no quality metric" in judged({"a": 1.0}, {"a": 1.0}, metrics=()).detail


def test_the_trainer_declares_p_at_1_and_its_presets_steps():
    assert TRAINER.quality_metrics == (QualityMetric("P@1", "higher", 0.01),)
    assert TRAINER.steps_for_quality("tiny") == 300
