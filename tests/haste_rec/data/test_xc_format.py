"""The XC reader round-trips files, names the faulty line of bad ones, and serves proper batches."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from targets.haste_rec.data.xc_format import PROJECTION_DIM, XCData, XCDataset, XCFormatError, read_xc

Sample = tuple[list[int], list[tuple[int, float]]]


def _write(path: Path, header: str, samples: list[Sample]) -> Path:
    lines = [header] + [",".join(map(str, labels)) + "".join(f" {i}:{v!r}" for i, v in features)
                        for labels, features in samples]
    path.write_text("\n".join(lines) + "\n")
    return path


def _rows(offsets: torch.Tensor, values: torch.Tensor) -> list[list]:
    return [values[offsets[i]:offsets[i + 1]].tolist() for i in range(offsets.numel() - 1)]


def test_round_trip_of_random_file(tmp_path: Path) -> None:
    gen = torch.Generator().manual_seed(0)
    num_features, num_labels = 50, 12
    samples: list[Sample] = []
    for _ in range(40):
        labels = torch.randperm(num_labels, generator=gen)[: int(torch.randint(0, 4, (1,), generator=gen))]
        indices = torch.randint(0, num_features, (int(torch.randint(0, 6, (1,), generator=gen)),), generator=gen)
        values = torch.rand(indices.numel(), generator=gen)
        samples.append((labels.tolist(), list(zip(indices.tolist(), values.tolist()))))
    data = read_xc(_write(tmp_path / "random.txt", f"40 {num_features} {num_labels}", samples))
    assert (data.num_samples, data.num_features, data.num_labels) == (40, num_features, num_labels)
    assert data.feature_values.dtype == torch.float32 and data.labels.dtype == torch.int64
    assert _rows(data.label_offsets, data.labels) == [labels for labels, _ in samples]
    assert _rows(data.feature_offsets, data.feature_indices) == [[i for i, _ in f] for _, f in samples]
    expected_values = torch.tensor([v for _, features in samples for _, v in features], dtype=torch.float32)
    assert torch.equal(data.feature_values, expected_values)


def test_reads_empty_label_lists_and_empty_lines(tmp_path: Path) -> None:
    path = tmp_path / "edge.txt"
    path.write_text("4 6 5\n 0:1.5 3:2\n4\n\n1,3 5:0.25\n\n")
    data = read_xc(path)
    assert _rows(data.label_offsets, data.labels) == [[], [4], [], [1, 3]]
    assert _rows(data.feature_offsets, data.feature_indices) == [[0, 3], [], [], [5]]
    assert data.feature_values.tolist() == [1.5, 2.0, 0.25]


@pytest.mark.parametrize("text, line, problem", [
    ("2 4\n1 0:1\n2 1:1\n", 1, "header"),
    ("2 4 3\n1 0:1\n", 3, "1 sample lines but its header declares 2"),
    ("1 4 3\n1 0:1\n2 1:1\n", 3, "2 sample lines but its header declares 1"),
    ("2 4 3\n1 0:1\n3 1:1\n", 3, "label 3 is outside [0, 3)"),
    ("2 4 3\n1 0:1\n1,x 1:1\n", 3, "'1,x' is not comma-separated integers"),
    ("2 4 3\n1,1 0:1\n2 1:1\n", 2, "repeats a label"),
    ("2 4 3\n1 0:1\n2 1\n", 3, "feature token '1' is not index:value"),
    ("2 4 3\n1 0:abc\n2 1:1\n", 2, "feature token '0:abc'"),
    ("2 4 3\n1 0:1\n2 4:1\n", 3, "feature index 4 is outside [0, 4)"),
    ("2 4 3\n1 -1:1\n2 1:1\n", 2, "feature index -1 is outside"),
])
def test_malformed_files_name_the_line(tmp_path: Path, text: str, line: int, problem: str) -> None:
    path = tmp_path / "bad.txt"
    path.write_text(text)
    with pytest.raises(XCFormatError) as caught:
        read_xc(path)
    message = str(caught.value)
    assert message.startswith(f"{path}, line {line}: ") and problem in message
    assert message.endswith(".") and "\n" not in message


def _numbered(num_samples: int, num_labels: int) -> XCData:
    """Sample i has the single feature i with value i + 1 and the label i % num_labels."""
    offsets = torch.arange(num_samples + 1)
    return XCData(num_samples, num_samples, num_labels, torch.arange(num_samples),
                  torch.arange(1, num_samples + 1, dtype=torch.float32), offsets,
                  torch.arange(num_samples) % num_labels, offsets.clone())


def test_dataset_batches_walk_shuffled_epochs() -> None:
    dataset = XCDataset(_numbered(25, 3), batch_size=4, heldout_fraction=0.2, seed=3)
    heldout = dataset.heldout()
    held_rows = set(heldout.ids[0].tolist())
    assert heldout.batch_size == 5 and dataset.table_rows == (25,)
    stream = torch.cat([dataset.train_batch(i).ids[0] for i in range(10)])   # two epochs of 20 samples
    first, second = stream[:20].tolist(), stream[20:].tolist()
    assert sorted(first) == sorted(second) == sorted(set(range(25)) - held_rows)
    assert first != second
    again = XCDataset(_numbered(25, 3), batch_size=4, heldout_fraction=0.2, seed=3).train_batch(7)
    assert torch.equal(again.ids[0], dataset.train_batch(7).ids[0])
    batch = dataset.train_batch(2)
    assert torch.equal(batch.weights[0], batch.ids[0].float() + 1)
    assert torch.equal(batch.labels, batch.ids[0] % 3) and torch.equal(batch.dense, torch.ones(4, 1))
    counts = dataset.id_access_counts(num_batches=5)[0]
    assert counts.tolist() == [0 if row in held_rows else 1 for row in range(25)]


def test_dataset_label_frequencies_are_train_fractions() -> None:
    dataset = XCDataset(_numbered(25, 3), batch_size=4, heldout_fraction=0.2, seed=3)
    train = torch.tensor(sorted(set(range(25)) - set(dataset.heldout().ids[0].tolist())))
    expected = torch.bincount(train % 3, minlength=3).double() / train.numel()
    assert torch.equal(dataset.label_frequencies(), expected)


def test_label_feature_means_average_a_linear_projection() -> None:
    # Features: sample 0 = x, sample 1 = 2x, sample 2 = y. Label 0: {x}; 1: {2x}; 2: {x, 2x}; 3: {y}; 4: none.
    data = XCData(3, 8, 5, torch.tensor([1, 5, 1, 5, 6]), torch.tensor([1.0, 0.5, 2.0, 1.0, 3.0]),
                  torch.tensor([0, 2, 4, 5]), torch.tensor([0, 2, 1, 2, 3]), torch.tensor([0, 2, 4, 5]))
    means = XCDataset(data, batch_size=3, heldout_fraction=0.0).label_feature_means(num_batches=1)
    assert means.shape == (5, PROJECTION_DIM)
    assert means[0].norm() > 0 and torch.allclose(means[1], 2 * means[0], atol=1e-6)
    assert torch.allclose(means[2], 1.5 * means[0], atol=1e-6)
    assert torch.nn.functional.cosine_similarity(means[0], means[3], dim=0).abs() < 0.9
    assert torch.equal(means[4], torch.zeros(PROJECTION_DIM))


def test_dataset_rejects_an_empty_train_split() -> None:
    with pytest.raises(ValueError):
        XCDataset(_numbered(1, 1), batch_size=1, heldout_fraction=0.9)
