"""Packing HASTE tail labels into groups: validity of every packing, semantic purity, head/tail split."""

from __future__ import annotations

import math

import pytest
import torch

from targets.haste_rec.tail import grouping
from targets.haste_rec.tail.grouping import group_by_frequency, group_random, group_semantic, split_head_tail
from targets.protocol import ConfigError


def _assert_packing(groups: torch.Tensor, tail_labels: torch.Tensor, G: int) -> None:
    """[ceil(n/G), G], every tail label exactly once, -1 padding only at the very end."""
    n = tail_labels.numel()
    assert groups.shape == (math.ceil(n / G), G) and groups.dtype == torch.int64
    flat = groups.flatten()
    assert (flat[:n] >= 0).all() and (flat[n:] == -1).all()
    assert torch.equal(flat[:n].sort().values, tail_labels.sort().values)


def _tail(n: int, seed: int = 0) -> torch.Tensor:
    """n distinct label ids out of 3n, in random order."""
    return torch.randperm(3 * n, generator=torch.Generator().manual_seed(seed))[:n]


def _clustered_features(n_labels: int, clusters: int, d: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(features [n, d], cluster of each label): tight clusters around well-separated directions."""
    g = torch.Generator().manual_seed(seed)
    centers = torch.nn.functional.normalize(torch.randn(clusters, d, generator=g), dim=1) * 5.0
    membership = torch.randint(0, clusters, (n_labels,), generator=g)
    return centers[membership] + 0.05 * torch.randn(n_labels, d, generator=g), membership


def _purity(groups: torch.Tensor, membership: torch.Tensor) -> float:
    """Mean over groups of the share of a group's labels in its most common cluster."""
    shares = []
    for group in groups:
        labels = group[group >= 0]
        shares.append(torch.bincount(membership[labels]).max().item() / labels.numel())
    return sum(shares) / len(shares)


# ----------------------------------------------------------------------------- head / tail split

def test_split_head_tail_takes_the_most_frequent() -> None:
    freq = torch.tensor([5, 1, 9, 9, 0, 3, 7, 2, 9, 4])
    head, tail = split_head_tail(freq, 0.3)
    assert head.tolist() == [2, 3, 8] and tail.tolist() == [0, 1, 4, 5, 6, 7, 9]
    head, _ = split_head_tail(freq, 0.2)
    assert head.tolist() == [2, 3], "ties go to the lower id"


@pytest.mark.parametrize("fraction,n_head", [(0.0, 0), (1e-6, 1), (0.05, 5), (1.0, 100)])
def test_split_head_tail_sizes(fraction: float, n_head: int) -> None:
    freq = torch.randint(0, 50, (100,), generator=torch.Generator().manual_seed(0))
    head, tail = split_head_tail(freq, fraction)
    assert head.numel() == n_head
    assert torch.equal(torch.cat([head, tail]).sort().values, torch.arange(100))
    if n_head and tail.numel():
        assert freq[head].min() >= freq[tail].max()


def test_split_head_tail_rejects_bad_fraction() -> None:
    with pytest.raises(ConfigError):
        split_head_tail(torch.ones(5), 1.5)


# ----------------------------------------------------------------------------- random / frequency

@pytest.mark.parametrize("n,G", [(1, 4), (12, 4), (13, 4), (100, 7), (5, 32)])
def test_group_random(n: int, G: int) -> None:
    tail = _tail(n)
    groups = group_random(tail, G, torch.Generator().manual_seed(0))
    _assert_packing(groups, tail, G)
    assert torch.equal(groups, group_random(tail, G, torch.Generator().manual_seed(0)))
    if n > 10:
        assert not torch.equal(groups, group_random(tail, G, torch.Generator().manual_seed(1)))


@pytest.mark.parametrize("n,G", [(12, 4), (13, 4), (101, 8)])
def test_group_by_frequency_is_sorted(n: int, G: int) -> None:
    tail = _tail(n, seed=1)
    freq = torch.randint(0, 20, (3 * n,), generator=torch.Generator().manual_seed(2)).float()
    groups = group_by_frequency(tail, freq, G)
    _assert_packing(groups, tail, G)
    flat = groups.flatten()[:n]
    assert (freq[flat].diff() <= 0).all()


def test_group_size_must_be_positive() -> None:
    with pytest.raises(ConfigError):
        group_random(torch.arange(4), 0, torch.Generator())


# ----------------------------------------------------------------------------- semantic

@pytest.mark.parametrize("n,G", [(3, 4), (4, 4), (37, 4), (128, 4), (129, 4), (1000, 8), (3001, 4)])
def test_group_semantic_is_a_valid_packing(n: int, G: int) -> None:
    features, _ = _clustered_features(3 * n, 7, 5, seed=n)
    tail = _tail(n, seed=n)
    groups = group_semantic(tail, features, G, torch.Generator().manual_seed(0))
    _assert_packing(groups, tail, G)


def test_group_semantic_is_seeded() -> None:
    features, _ = _clustered_features(3000, 7, 5, seed=0)
    tail = _tail(1000)
    first = group_semantic(tail, features, 8, torch.Generator().manual_seed(3))
    assert torch.equal(first, group_semantic(tail, features, 8, torch.Generator().manual_seed(3)))


@pytest.mark.parametrize("n,clusters,G", [(1000, 5, 16), (6000, 12, 8), (700, 3, 32)])
def test_group_semantic_keeps_clusters_together(n: int, clusters: int, G: int) -> None:
    features, membership = _clustered_features(n, clusters, 13, seed=clusters)
    tail = torch.arange(n)
    semantic = _purity(group_semantic(tail, features, G, torch.Generator().manual_seed(0)), membership)
    random = _purity(group_random(tail, G, torch.Generator().manual_seed(0)), membership)
    assert semantic > 0.95, semantic
    assert random < 0.6 and semantic > random + 0.35


def test_group_semantic_tree_keeps_clusters_together(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(grouping, "BRANCH", 4)  # several tree levels on a small input
    features, membership = _clustered_features(2000, 6, 8, seed=5)
    groups = group_semantic(torch.arange(2000), features, 8, torch.Generator().manual_seed(0))
    _assert_packing(groups, torch.arange(2000), 8)
    assert _purity(groups, membership) > 0.9


def test_group_semantic_puts_unseen_labels_last_by_frequency() -> None:
    n, G = 203, 8
    features, _ = _clustered_features(n, 4, 6, seed=1)
    unseen = torch.arange(0, n, 10)
    features[unseen] = 0.0
    freq = torch.randperm(n, generator=torch.Generator().manual_seed(4)).float()
    groups = group_semantic(torch.arange(n), features, G, torch.Generator().manual_seed(0), frequencies=freq)
    _assert_packing(groups, torch.arange(n), G)
    tail_end = groups.flatten()[n - unseen.numel():n]
    assert set(tail_end.tolist()) == set(unseen.tolist())
    assert (freq[tail_end].diff() <= 0).all()
    seen_part = groups.flatten()[:n - unseen.numel()]
    assert not set(seen_part.tolist()) & set(unseen.tolist())


def test_group_semantic_all_unseen_is_frequency_grouping() -> None:
    n, G = 50, 8
    freq = torch.randperm(n, generator=torch.Generator().manual_seed(0)).float()
    groups = group_semantic(torch.arange(n), torch.zeros(n, 5), G, torch.Generator(), frequencies=freq)
    assert torch.equal(groups, group_by_frequency(torch.arange(n), freq, G))


def test_capacity_assign_keeps_the_closest_and_moves_leftovers_to_the_nearest_with_room() -> None:
    # one node, 4 rows, 3 clusters with room for 1, 2 and 1 rows
    sims = torch.tensor([[[0.5, 0.2, 0.4],
                          [0.7, 0.6, 0.1],
                          [0.9, 0.1, 0.3],
                          [0.2, 0.8, 0.0]]])
    valid = torch.ones(1, 4, dtype=torch.bool)
    assign = grouping._capacity_assign(sims, valid, torch.tensor([[1, 2, 1]]))
    # rows 0-2 all want cluster 0, which keeps the closest, row 2; row 0's next choice is cluster 2, row 1's is 1
    assert assign.tolist() == [[2, 1, 0, 1]]
    with pytest.raises(ValueError):
        grouping._capacity_assign(sims, valid, torch.tensor([[1, 1, 1]]))
