"""The synthetic data is deterministic, well formed, skewed like real logs, and learnable."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from targets.haste_rec.data.batch import Batch
from targets.haste_rec.data.data import SPARSE_PROJECTION_DIM, SyntheticData, SyntheticSpec, zipf_ranks
from targets.haste_rec.metrics import propensity_scores, topk_metrics
from targets.protocol import ConfigError

SPEC = SyntheticSpec(num_labels=512, num_clusters=16, table_rows=(2000, 2000, 1000),
                     table_zipf=(0.6, 1.3, 1.0), pooling=(4, 1, 8), num_dense=8, batch_size=32,
                     heldout_size=400)


@pytest.fixture(scope="module")
def data() -> SyntheticData:
    return SyntheticData(SPEC)


def _tensors(batch: Batch) -> list[torch.Tensor]:
    return [*batch.ids, *batch.offsets, batch.dense, batch.labels, batch.label_offsets]


def _same(a: Batch, b: Batch) -> bool:
    pairs = zip(_tensors(a), _tensors(b), strict=True)
    return len(a.ids) == len(b.ids) and all(x.shape == y.shape and torch.equal(x, y) for x, y in pairs)


def _sample_of(offsets: torch.Tensor, numel: int) -> torch.Tensor:
    """The sample owning each element of a bag-offsets ([B]) layout."""
    return torch.repeat_interleave(torch.arange(offsets.numel()), torch.diff(offsets, append=torch.tensor([numel])))


def _indicator(batch: Batch, table: int, rows: int) -> torch.Tensor:
    """float [B, rows]: which rows of `table` each sample looks up."""
    ids = batch.ids[table]
    marks = torch.zeros(batch.batch_size, rows)
    marks[_sample_of(batch.offsets[table], ids.numel()), ids] = 1.0
    return marks


def _label_indicator(batch: Batch, num_labels: int) -> torch.Tensor:
    marks = torch.zeros(batch.batch_size, num_labels)
    marks[torch.repeat_interleave(torch.arange(batch.batch_size), batch.label_offsets.diff()), batch.labels] = 1.0
    return marks


def test_train_batch_is_deterministic_and_independent_of_call_order(data: SyntheticData) -> None:
    fresh = SyntheticData(SPEC)
    later_first = [fresh.train_batch(i) for i in (7, 3, 0)]
    assert all(_same(data.train_batch(i), b) for i, b in zip((7, 3, 0), later_first))
    assert not _same(data.train_batch(3), data.train_batch(4))
    assert not _same(data.train_batch(3), SyntheticData(dataclasses.replace(SPEC, seed=1)).train_batch(3))


@pytest.mark.parametrize("which", ["train", "heldout"])
def test_batches_are_well_formed(data: SyntheticData, which: str) -> None:
    batches = [data.train_batch(i) for i in range(5)] if which == "train" else [data.heldout()]
    for batch in batches:
        size = batch.batch_size
        assert batch.dense.shape == (size, SPEC.num_dense) and batch.dense.dtype == torch.float32
        for ids, offsets, weight, rows, pooling in zip(batch.ids, batch.offsets, batch.weights,
                                                       SPEC.table_rows, SPEC.pooling):
            assert ids.dtype == offsets.dtype == torch.int64 and offsets.shape == (size,) and weight is None
            bags = torch.diff(offsets, append=torch.tensor([ids.numel()]))
            assert offsets[0] == 0
            assert bags.min() >= max(1, pooling - pooling // 2) and bags.max() <= pooling + pooling // 2
            assert ids.min() >= 0 and ids.max() < rows
        counts = batch.label_offsets.diff()
        assert batch.label_offsets.shape == (size + 1,) and batch.label_offsets[0] == 0
        assert batch.label_offsets[-1] == batch.labels.numel() and counts.min() >= 1
        assert batch.labels.dtype == torch.int64
        assert batch.labels.min() >= 0 and batch.labels.max() < SPEC.num_labels
        assert all(batch.positives(b).unique().numel() == counts[b] for b in range(size))


def test_heldout_is_cached_and_distinct_from_training(data: SyntheticData) -> None:
    heldout = data.heldout()
    assert heldout is data.heldout() and heldout.batch_size == SPEC.heldout_size
    train_dense = torch.cat([data.train_batch(i).dense for i in range(20)])
    assert not (heldout.dense.unsqueeze(1) == train_dense.unsqueeze(0)).all(dim=2).any()


def test_id_access_counts_show_each_tables_zipf_skew(data: SyntheticData) -> None:
    counts = data.id_access_counts(num_batches=20, start=10)
    batches = [data.train_batch(i) for i in range(10, 30)]
    for table, (count, rows) in enumerate(zip(counts, SPEC.table_rows, strict=True)):
        assert torch.equal(count, torch.bincount(torch.cat([b.ids[table] for b in batches]), minlength=rows))
    top_share = [float(c.sort(descending=True).values[: c.numel() // 100].sum() / c.sum()) for c in counts]
    assert top_share[0] > 0.05                      # uniform ids would give 0.01
    assert top_share[1] > 0.25 and top_share[1] > 2 * top_share[0]   # exponent 1.3 vs 0.6


def test_zipf_ranks_follow_a_power_law() -> None:
    u = torch.rand(100_000, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    for exponent in (0.6, 1.0, 1.3):
        ranks = zipf_ranks(u, torch.full_like(u, 1000.0), torch.full_like(u, exponent))
        counts = torch.bincount(ranks, minlength=1000).double()
        assert ranks.min() >= 0 and ranks.max() < 1000
        slope = torch.log(counts[9] / counts[99]) / torch.log(torch.tensor(100.0 / 10.0, dtype=torch.float64))
        assert abs(float(slope) - exponent) < 0.15


def test_label_frequencies_are_the_sampling_probabilities() -> None:
    data = SyntheticData(dataclasses.replace(SPEC, heldout_size=20_000))
    heldout = data.heldout()
    expected = data.label_frequencies()
    observed = torch.bincount(heldout.labels, minlength=SPEC.num_labels).double() / heldout.batch_size
    tolerance = 5 * torch.sqrt(expected * (1 - expected) / heldout.batch_size) + 1e-3
    assert expected.dtype == torch.float64 and expected.shape == (SPEC.num_labels,)
    assert ((observed - expected).abs() <= tolerance).all()
    mean_positives = heldout.labels.numel() / heldout.batch_size
    assert abs(float(expected.sum()) - mean_positives) < 0.05


def test_samples_sharing_a_label_share_sparse_ids(data: SyntheticData) -> None:
    heldout = data.heldout()
    labels = _label_indicator(heldout, SPEC.num_labels)
    share_label = (labels @ labels.T) > 0
    share_label.fill_diagonal_(False)
    disjoint = (labels @ labels.T) == 0
    for table, rows in enumerate(SPEC.table_rows):
        features = _indicator(heldout, table, rows)
        common = features @ features.T
        assert common[share_label].mean() > 4 * common[disjoint].mean()


def test_label_feature_means_cluster_co_occurring_labels(data: SyntheticData) -> None:
    means = data.label_feature_means(num_batches=50)
    assert means.shape == (SPEC.num_labels, SPEC.num_dense + SPARSE_PROJECTION_DIM) and means.dtype == torch.float32
    seen = torch.bincount(torch.cat([data.train_batch(i).labels for i in range(50)]), minlength=SPEC.num_labels) > 0
    assert torch.equal(means.norm(dim=1) > 0, seen)
    heldout = data.heldout()
    pairs = torch.stack([heldout.labels[heldout.label_offsets[:-1]], heldout.labels[heldout.label_offsets[1:] - 1]], 1)
    pairs = pairs[(pairs[:, 0] != pairs[:, 1]) & seen[pairs].all(dim=1)]
    random_pairs = torch.randint(0, SPEC.num_labels, (500, 2), generator=torch.Generator().manual_seed(0))
    random_pairs = random_pairs[seen[random_pairs].all(dim=1)]
    cosine = torch.nn.functional.cosine_similarity
    assert len(pairs) > 50
    assert cosine(means[pairs[:, 0]], means[pairs[:, 1]]).median() > 0.8
    assert cosine(means[random_pairs[:, 0]], means[random_pairs[:, 1]]).median() < 0.3


def test_sparse_features_predict_labels_far_above_popularity(data: SyntheticData) -> None:
    """A count-based learner on one table beats the popularity ranking by a wide margin."""
    rows, num_labels = SPEC.table_rows[0], SPEC.num_labels
    co_occurrence = torch.zeros(rows, num_labels)
    for i in range(100):
        batch = data.train_batch(i)
        owner = _sample_of(batch.offsets[0], batch.ids[0].numel())
        co_occurrence.index_add_(0, batch.ids[0], _label_indicator(batch, num_labels)[owner])
    heldout = data.heldout()
    votes = co_occurrence[heldout.ids[0]]
    scores = torch.zeros(heldout.batch_size, num_labels).index_add_(
        0, _sample_of(heldout.offsets[0], heldout.ids[0].numel()), votes / (votes.sum(1, keepdim=True) + 1))
    frequencies = data.label_frequencies()
    propensity = propensity_scores(frequencies * 1e5, 100_000)
    learned = topk_metrics(scores.topk(5).indices, heldout.labels, heldout.label_offsets, propensity)
    popular = frequencies.topk(5).indices.expand(heldout.batch_size, 5)
    baseline = topk_metrics(popular, heldout.labels, heldout.label_offsets, propensity)
    assert learned["P@1"] > 2 * baseline["P@1"] and learned["PSP@5"] > 2 * baseline["PSP@5"]


def test_spec_rejects_inconsistent_tables() -> None:
    with pytest.raises(ConfigError):
        dataclasses.replace(SPEC, table_zipf=(1.0,))
    with pytest.raises(ConfigError):
        dataclasses.replace(SPEC, num_clusters=SPEC.num_labels + 1)


@pytest.mark.parametrize("weighted", [(False, False, False), (True, False, True)], ids=["unweighted", "mixed"])
def test_a_packed_batch_holds_the_flattened_batch_in_one_buffer(data: SyntheticData, weighted) -> None:
    """TableLayout.pack gives what flatten gives, every tensor a view of one byte buffer, and moves whole."""
    from targets.haste_rec.embeddings.row_ops import TableLayout
    batch = data.train_batch(3)
    weights = [torch.rand(ids.numel()) if w else None for ids, w in zip(batch.ids, weighted)]
    batch = dataclasses.replace(batch, weights=weights)
    layout = TableLayout(SPEC.table_rows)
    packed = layout.pack(batch)
    want = layout.flatten(batch, torch.device("cpu"))
    got = layout.flatten(packed, torch.device("cpu"))
    assert all((g is None and w is None) or torch.equal(g, w) for g, w in zip(got, want))
    assert torch.equal(packed.ids, want[0]) and torch.equal(packed.offsets, want[1])
    (buffer,) = packed.tensors()
    assert buffer.dtype == torch.uint8 and buffer.numel() == packed.layout.nbytes
    storage = buffer.untyped_storage().data_ptr()
    views = [packed.sparse, packed.dense, packed.label_part] + ([packed.weights] if any(weighted) else [])
    assert all(t.untyped_storage().data_ptr() == storage for t in views)  # one storage crosses to the trainer
    assert packed.weights is None if not any(weighted) else torch.equal(packed.weights, want[2])
    assert packed.batch_size == batch.batch_size and torch.equal(packed.dense, batch.dense)
    assert torch.equal(packed.labels, batch.labels) and torch.equal(packed.label_offsets, batch.label_offsets)
    moved = packed.to("cpu", sparse=False)  # host tables: the sparse bytes stay, the rest moves
    assert moved.apart is not None and moved.buffer.numel() == packed.layout.split
    assert moved.sparse.data_ptr() == packed.sparse.data_ptr() and torch.equal(moved.label_part, packed.label_part)
    assert torch.equal(moved.dense, batch.dense) and torch.equal(moved.to("cpu").ids, packed.ids)
