"""Ranking quality of an extreme classifier: precision and propensity-scored precision at k.

P@k rewards getting frequent labels right; PSP@k (Jain, Prabhu and Varma, KDD 2016) weights each
hit by the inverse propensity of its label, so it exposes a model that only predicts head labels.
A change the tuner makes must keep both, hence one vectorised implementation that every component
reports with.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch


def propensity_scores(label_counts: torch.Tensor, num_samples: int, A: float = 0.55, B: float = 1.5) -> torch.Tensor:
    """float64 [L]: p_l = 1 / (1 + C (N_l + B)^-A) with C = (log N - 1)(B + 1)^A (Jain et al. 2016)."""
    C = (math.log(num_samples) - 1.0) * (B + 1.0) ** A
    return 1.0 / (1.0 + C * (label_counts.to(torch.float64) + B).pow(-A))


def _owner(offsets: torch.Tensor) -> torch.Tensor:
    """For CSR offsets [N + 1], the row of every element."""
    return torch.repeat_interleave(torch.arange(offsets.numel() - 1), offsets.diff())


def _hits(topk: torch.Tensor, labels: torch.Tensor, label_offsets: torch.Tensor, num_labels: int) -> torch.Tensor:
    """bool [N, K]: whether each predicted label is a positive of its sample (negative ids never are)."""
    if labels.numel() == 0:
        return torch.zeros_like(topk, dtype=torch.bool)
    keys = (_owner(label_offsets) * num_labels + labels).sort().values
    queries = torch.arange(topk.shape[0]).unsqueeze(1) * num_labels + topk.clamp(min=0)
    found = torch.searchsorted(keys, queries).clamp(max=keys.numel() - 1)
    return (keys[found] == queries) & (topk >= 0)


def _best_gain(labels: torch.Tensor, label_offsets: torch.Tensor, gain: torch.Tensor, k: int) -> torch.Tensor:
    """float64 [N]: per sample, the sum of its k largest positive-label gains (the ideal ranking)."""
    owner = _owner(label_offsets)
    values = gain[labels]
    by_value = torch.argsort(values, descending=True, stable=True)
    order = by_value[torch.argsort(owner[by_value], stable=True)]   # by sample, then gain descending
    rank = torch.arange(order.numel()) - label_offsets[owner[order]]
    best = torch.zeros(label_offsets.numel() - 1, dtype=torch.float64)
    keep = rank < k
    return best.index_add_(0, owner[order][keep], values[order][keep])


def topk_metrics(topk: torch.Tensor, labels: torch.Tensor, label_offsets: torch.Tensor,
                 propensity: torch.Tensor, ks: Sequence[int] = (1, 3, 5)) -> dict[str, float]:
    """P@k and PSP@k of ranked predictions.

    topk: int64 [N, K] predicted label ids, best first, distinct per row; negative ids pad rows with
    fewer predictions. labels / label_offsets: the true positives in CSR form ([N + 1] offsets).
    propensity: [L] as from `propensity_scores`. P@k averages hits/k over all N samples. PSP@k is
    sum over samples of the propensity-weighted hits in the top k, divided by the same sum for the
    best ranking of each sample's true positives (the normalisation of the XC repository), so it is
    1 for a perfect ranker; it is NaN when no sample has a positive.
    """
    if topk.dim() != 2 or topk.shape[0] != label_offsets.numel() - 1:
        raise ValueError(f"topk must be [N, K] with N = {label_offsets.numel() - 1}, got {list(topk.shape)}")
    if max(ks) > topk.shape[1]:
        raise ValueError(f"ks {tuple(ks)} need at least {max(ks)} predictions per sample, got {topk.shape[1]}")
    hits = _hits(topk, labels, label_offsets, propensity.numel()).to(torch.float64)
    inverse = 1.0 / propensity.to(torch.float64)
    weighted = hits * inverse[topk.clamp(min=0)]
    results: dict[str, float] = {}
    for k in ks:
        results[f"P@{k}"] = float(hits[:, :k].sum(dim=1).mean()) / k
    for k in ks:
        ideal = float(_best_gain(labels, label_offsets, inverse, k).sum())
        results[f"PSP@{k}"] = float(weighted[:, :k].sum()) / ideal if ideal > 0 else math.nan
    return results
