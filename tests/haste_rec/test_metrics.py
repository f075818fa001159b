"""P@k and PSP@k match a hand-computed example and a slow per-sample reference."""

from __future__ import annotations

import math

import pytest
import torch

from targets.haste_rec.metrics import propensity_scores, topk_metrics


def _csr(positives: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    labels = torch.tensor([label for row in positives for label in row], dtype=torch.int64)
    offsets = torch.tensor([0] + [len(row) for row in positives], dtype=torch.int64).cumsum(0)
    return labels, offsets


def _reference(topk: list[list[int]], positives: list[list[int]], inverse: list[float], k: int) -> tuple[float, float]:
    """(P@k, PSP@k) by the textbook definitions, one sample at a time."""
    precision, gained, ideal = 0.0, 0.0, 0.0
    for ranked, true in zip(topk, positives):
        hits = [label for label in ranked[:k] if label in set(true)]
        precision += len(hits) / k
        gained += sum(inverse[label] for label in hits)
        ideal += sum(sorted((inverse[label] for label in true), reverse=True)[:k])
    return precision / len(topk), gained / ideal


def test_hand_computed_example() -> None:
    labels, offsets = _csr([[2, 5], [4, 0]])
    propensity = torch.tensor([0.5, 0.25, 0.5, 1.0, 0.2, 0.1], dtype=torch.float64)   # inverse 2 4 2 1 5 10
    topk = torch.tensor([[1, 2, 3], [4, 0, 5]])
    result = topk_metrics(topk, labels, offsets, propensity, ks=(1, 3))
    assert result["P@1"] == pytest.approx(0.5) and result["P@3"] == pytest.approx(0.5)
    assert result["PSP@1"] == pytest.approx(5 / 15)       # hits: 5 of ideal 10 + 5
    assert result["PSP@3"] == pytest.approx(9 / 19)       # hits: 2 + 5 + 2 of ideal 12 + 7


def test_matches_slow_reference_on_random_input() -> None:
    gen = torch.Generator().manual_seed(0)
    num_samples, num_labels, width = 60, 40, 5
    positives = [torch.randperm(num_labels, generator=gen)[: int(torch.randint(0, 7, (1,), generator=gen))].tolist()
                 for _ in range(num_samples)]
    topk = torch.stack([torch.randperm(num_labels, generator=gen)[:width] for _ in range(num_samples)])
    propensity = torch.rand(num_labels, generator=gen, dtype=torch.float64) * 0.9 + 0.1
    labels, offsets = _csr(positives)
    result = topk_metrics(topk, labels, offsets, propensity)
    inverse = (1.0 / propensity).tolist()
    for k in (1, 3, 5):
        precision, psp = _reference(topk.tolist(), positives, inverse, k)
        assert result[f"P@{k}"] == pytest.approx(precision) and result[f"PSP@{k}"] == pytest.approx(psp)


def test_perfect_ranking_scores_one_and_padding_never_hits() -> None:
    positives = [[3], [1, 4], [0, 2, 5]]
    labels, offsets = _csr(positives)
    propensity = torch.tensor([0.9, 0.3, 0.5, 0.2, 0.7, 0.4], dtype=torch.float64)
    by_inverse = [sorted(row, key=lambda label: float(propensity[label])) for row in positives]
    topk = torch.tensor([row + [-1] * (3 - len(row)) for row in by_inverse])
    result = topk_metrics(topk, labels, offsets, propensity, ks=(1, 3))
    assert result["PSP@1"] == pytest.approx(1.0) and result["PSP@3"] == pytest.approx(1.0)
    assert result["P@1"] == pytest.approx(1.0) and result["P@3"] == pytest.approx(6 / 9)


def test_rejects_too_few_predictions_and_has_no_psp_without_positives() -> None:
    labels, offsets = _csr([[], []])
    propensity = torch.full((4,), 0.5, dtype=torch.float64)
    with pytest.raises(ValueError):
        topk_metrics(torch.zeros(2, 3, dtype=torch.int64), labels, offsets, propensity, ks=(1, 5))
    result = topk_metrics(torch.tensor([[0], [1]]), labels, offsets, propensity, ks=(1,))
    assert result["P@1"] == 0.0 and math.isnan(result["PSP@1"])


def test_propensity_scores_follow_jain_et_al() -> None:
    counts = torch.tensor([0, 10, 1000])
    scores = propensity_scores(counts, num_samples=10_000)
    C = (math.log(10_000) - 1) * 2.5 ** 0.55
    expected = [1 / (1 + C * (n + 1.5) ** -0.55) for n in (0, 10, 1000)]
    assert scores.dtype == torch.float64 and scores.tolist() == pytest.approx(expected)
    assert 0 < scores[0] < scores[1] < scores[2] < 1
