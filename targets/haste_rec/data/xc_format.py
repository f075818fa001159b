"""Reader for the Extreme Classification Repository's text format, served like the synthetic data.

Public XC benchmarks (Amazon-670K, Wiki10-31K, ...) ship as a header line `N D L` followed by one
line per sample, `l1,l2,... f:v f:v ...` (labels may be empty). The reference trainer can train on
them instead of synthetic data: `XCDataset` exposes the `RetrievalData` interface with one sparse
table of D rows whose per-id weights are the feature values. A malformed file raises
`XCFormatError` whose one-sentence message names the file, the 1-based line and what is wrong.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from functools import lru_cache

import torch

from targets.haste_rec.data.batch import Batch
from targets.haste_rec.data.data import count_id_accesses, mean_vector_per_label, seeded_generator

PROJECTION_DIM = 32   # width of the fixed random projection behind XCDataset.label_feature_means


class XCFormatError(ValueError):
    """A file is not in the extreme-classification text format; the message is one sentence."""


@dataclass
class XCData:
    """A whole XC file in CSR form: sample i owns elements [offsets[i], offsets[i + 1])."""

    num_samples: int
    num_features: int
    num_labels: int
    feature_indices: torch.Tensor   # int64 [nnz_features]
    feature_values: torch.Tensor    # float32 [nnz_features]
    feature_offsets: torch.Tensor   # int64 [N + 1]
    labels: torch.Tensor            # int64 [nnz_labels]
    label_offsets: torch.Tensor     # int64 [N + 1]


class _LineParser:
    """Parses sample lines of one file against its header, raising XCFormatError on the first fault."""

    def __init__(self, path: str, num_features: int, num_labels: int):
        self.path, self.num_features, self.num_labels = path, num_features, num_labels

    def error(self, line_number: int, problem: str) -> XCFormatError:
        return XCFormatError(f"{self.path}, line {line_number}: {problem}.")

    def parse(self, line_number: int, line: str) -> tuple[list[int], list[int], list[float]]:
        """(labels, feature indices, feature values) of one sample line."""
        tokens = line.split()
        has_labels = bool(tokens) and ":" not in tokens[0]
        labels = self._labels(line_number, tokens[0]) if has_labels else []
        indices, values = [], []
        for token in tokens[1:] if has_labels else tokens:
            index, value = self._feature(line_number, token)
            indices.append(index)
            values.append(value)
        return labels, indices, values

    def _labels(self, line_number: int, token: str) -> list[int]:
        try:
            labels = [int(text) for text in token.split(",")]
        except ValueError:
            raise self.error(line_number, f"label list {token!r} is not comma-separated integers") from None
        for label in labels:
            if not 0 <= label < self.num_labels:
                raise self.error(line_number, f"label {label} is outside [0, {self.num_labels})")
        if len(set(labels)) != len(labels):
            raise self.error(line_number, f"label list {token!r} repeats a label")
        return labels

    def _feature(self, line_number: int, token: str) -> tuple[int, float]:
        index_text, colon, value_text = token.partition(":")
        try:
            index, value = int(index_text), float(value_text)
        except ValueError:
            index, value = -1, math.nan
        if not colon or not math.isfinite(value):
            raise self.error(line_number, f"feature token {token!r} is not index:value with a finite value")
        if not 0 <= index < self.num_features:
            raise self.error(line_number, f"feature index {index} is outside [0, {self.num_features})")
        return index, value


def _read_header(path: str, line: str | None) -> tuple[int, int, int]:
    fields = (line or "").split()
    try:
        sizes = tuple(int(field) for field in fields)
    except ValueError:
        sizes = ()
    if len(sizes) != 3 or min(sizes) < 0:
        raise XCFormatError(f"{path}, line 1: header {line!r} is not three non-negative integers N D L.")
    return sizes


def _csr_offsets(lengths: list[int]) -> torch.Tensor:
    offsets = torch.zeros(len(lengths) + 1, dtype=torch.int64)
    offsets[1:] = torch.tensor(lengths, dtype=torch.int64).cumsum(0)
    return offsets


def read_xc(path: str | os.PathLike) -> XCData:
    """Read an XC text file, validating every line against the header."""
    path = os.fspath(path)
    with open(path, encoding="utf-8") as handle:
        lines = handle.read().splitlines()
    num_samples, num_features, num_labels = _read_header(path, lines[0] if lines else None)
    body = lines[1:]
    while len(body) > num_samples and not body[-1].strip():
        body.pop()                                          # trailing blank lines are not samples
    if len(body) != num_samples:
        where = min(len(body), num_samples) + 2
        raise XCFormatError(f"{path}, line {where}: the file has {len(body)} sample lines but its "
                            f"header declares {num_samples}.")
    parser = _LineParser(path, num_features, num_labels)
    labels, indices, values, label_lengths, feature_lengths = [], [], [], [], []
    for line_number, line in enumerate(body, start=2):
        sample_labels, sample_indices, sample_values = parser.parse(line_number, line)
        labels += sample_labels
        indices += sample_indices
        values += sample_values
        label_lengths.append(len(sample_labels))
        feature_lengths.append(len(sample_indices))
    return XCData(num_samples, num_features, num_labels,
                  torch.tensor(indices, dtype=torch.int64), torch.tensor(values, dtype=torch.float32),
                  _csr_offsets(feature_lengths), torch.tensor(labels, dtype=torch.int64),
                  _csr_offsets(label_lengths))


def gather_csr(offsets: torch.Tensor, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(element positions, new offsets [len(rows) + 1]) of the CSR rows `rows`, in that order."""
    lengths = offsets[rows + 1] - offsets[rows]
    new_offsets = torch.zeros(rows.numel() + 1, dtype=torch.int64)
    new_offsets[1:] = lengths.cumsum(0)
    shift = torch.repeat_interleave(offsets[rows] - new_offsets[:-1], lengths)
    return torch.arange(int(new_offsets[-1])) + shift, new_offsets


class XCDataset:
    """An XC data set split into train / held-out samples, served as `Batch`es.

    Features become one sparse table of num_features rows with the feature values as per-id
    weights; dense features are num_dense constant columns of ones (the format has none). Train
    batches walk a fresh seeded shuffle of the train split each epoch and wrap across epochs, so
    every batch is full and batch `index` depends only on (seed, index).
    """

    def __init__(self, data: XCData, batch_size: int, heldout_fraction: float = 0.1,
                 seed: int = 0, num_dense: int = 1):
        if batch_size < 1 or num_dense < 1 or not 0.0 <= heldout_fraction < 1.0:
            raise ValueError("batch_size and num_dense must be positive and heldout_fraction in [0, 1).")
        num_heldout = round(data.num_samples * heldout_fraction)
        if num_heldout == data.num_samples:
            raise ValueError(f"{data.num_samples} samples leave none for training at "
                             f"heldout_fraction={heldout_fraction}")
        self.data, self.batch_size, self.seed = data, batch_size, seed
        self.num_labels = data.num_labels
        self.num_dense = num_dense
        self.table_rows = (data.num_features,)
        order = torch.randperm(data.num_samples, generator=seeded_generator(seed, "xc-split"))
        self._heldout_rows, self._train_rows = order[:num_heldout].sort().values, order[num_heldout:]
        self._epoch_order = lru_cache(maxsize=2)(self._shuffle)
        self._heldout: Batch | None = None

    def train_batch(self, index: int) -> Batch:
        """Training batch `index`: positions [index * B, (index + 1) * B) of the epoch-shuffled stream."""
        positions = torch.arange(index * self.batch_size, (index + 1) * self.batch_size)
        num_train = self._train_rows.numel()
        epochs = positions // num_train
        rows = torch.empty_like(positions)
        for epoch in epochs.unique().tolist():
            here = epochs == epoch
            rows[here] = self._epoch_order(epoch)[positions[here] % num_train]
        return self._batch(rows)

    def heldout(self) -> Batch:
        """All held-out samples as one batch (cached)."""
        if self._heldout is None:
            self._heldout = self._batch(self._heldout_rows)
        return self._heldout

    def label_frequencies(self) -> torch.Tensor:
        """float64 [L]: the fraction of train samples that have each label as a positive."""
        positions, _ = gather_csr(self.data.label_offsets, self._train_rows)
        counts = torch.bincount(self.data.labels[positions], minlength=self.num_labels)
        return counts.to(torch.float64) / self._train_rows.numel()

    def id_access_counts(self, num_batches: int, start: int = 0) -> list[torch.Tensor]:
        """int64 [num_features]: feature lookups over train batches [start, start + num_batches)."""
        batches = (self.train_batch(i) for i in range(start, start + num_batches))
        return count_id_accesses(batches, self.table_rows)

    def label_feature_means(self, num_batches: int) -> torch.Tensor:
        """float32 [L, PROJECTION_DIM]: per label, the mean projected sparse features of its positives.

        Each sample's raw sparse feature vector (values as given, no TF-IDF) is multiplied by a
        fixed Gaussian matrix [num_features, PROJECTION_DIM] seeded from `seed`, since the constant
        dense columns carry no information; the first `num_batches` train batches are used.
        """
        projection = torch.randn(self.data.num_features, PROJECTION_DIM,
                                 generator=seeded_generator(self.seed, "xc-projection"))
        projection /= math.sqrt(PROJECTION_DIM)

        def project(batch: Batch) -> torch.Tensor:
            return torch.nn.functional.embedding_bag(batch.ids[0], projection, batch.offsets[0], mode="sum",
                                                     per_sample_weights=batch.weights[0])

        batches = (self.train_batch(i) for i in range(num_batches))
        return mean_vector_per_label(batches, self.num_labels, project)

    def _shuffle(self, epoch: int) -> torch.Tensor:
        generator = seeded_generator(self.seed, "xc-epoch", epoch)
        return self._train_rows[torch.randperm(self._train_rows.numel(), generator=generator)]

    def _batch(self, rows: torch.Tensor) -> Batch:
        features, feature_offsets = gather_csr(self.data.feature_offsets, rows)
        positives, label_offsets = gather_csr(self.data.label_offsets, rows)
        return Batch(ids=[self.data.feature_indices[features]], offsets=[feature_offsets[:-1]],
                     weights=[self.data.feature_values[features]],
                     dense=torch.ones(rows.numel(), self.num_dense),
                     labels=self.data.labels[positives], label_offsets=label_offsets)
