"""Synthetic extreme-retrieval data whose labels really depend on its features.

The reference trainer has to run at production shape (26 tables of 1M rows, 670K labels) without
shipping a data set, and the tuner must be able to tell a model that learns from one that does
not. So samples come from latent clusters: each cluster owns a set of labels and a "hot region" of
rows in every sparse table, and its dense features sit near the cluster's unit-norm centroid. Ids
and labels are Zipf-skewed as in real click logs. Every batch is a pure function of (seed, index),
so batches can be produced in any order, by any worker, and compared bit for bit.

The module also holds what every data source of the trainer shares: the `RetrievalData` protocol,
stream seeding, and the accumulations behind `id_access_counts` and `label_feature_means`.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import Callable, Iterable, Protocol, Sequence

import torch

from targets.haste_rec.data.batch import Batch
from targets.protocol import ConfigError

DENSE_NOISE_STD = 0.5        # std of the Gaussian noise around a cluster centroid
EXTRA_LABEL_PROB = 0.05      # probability that a sample also gets one label drawn from all labels
MAX_POSITIVES_FACTOR = 4     # draws of cluster labels are capped at this times labels_per_sample
SPARSE_BUCKETS = 4096        # hashed buckets per table behind the sparse part of label features
SPARSE_PROJECTION_DIM = 32   # width of the fixed random projection of a sample's hashed sparse ids


class RetrievalData(Protocol):
    """What the trainer reads from a data source (synthetic or a real extreme-classification file)."""

    num_labels: int
    num_dense: int
    table_rows: tuple[int, ...]

    def train_batch(self, index: int) -> Batch: ...
    def heldout(self) -> Batch: ...
    def label_frequencies(self) -> torch.Tensor: ...
    def id_access_counts(self, num_batches: int, start: int = 0) -> list[torch.Tensor]: ...
    def label_feature_means(self, num_batches: int) -> torch.Tensor: ...  # [L, d], d per source


def seeded_generator(seed: int, stream: str, index: int = 0) -> torch.Generator:
    """A CPU generator that depends only on (seed, stream, index): distinct streams never collide."""
    digest = hashlib.blake2b(f"{seed}/{stream}/{index}".encode(), digest_size=8).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest, "little") >> 1)


def count_id_accesses(batches: Iterable[Batch], table_rows: Sequence[int]) -> list[torch.Tensor]:
    """int64 [rows] per table: how often each row is looked up over `batches`."""
    counts = [torch.zeros(rows, dtype=torch.int64) for rows in table_rows]
    for batch in batches:
        for total, ids in zip(counts, batch.ids):
            total += torch.bincount(ids, minlength=total.numel())
    return counts


def mean_vector_per_label(batches: Iterable[Batch], num_labels: int,
                          sample_vectors: Callable[[Batch], torch.Tensor]) -> torch.Tensor:
    """float32 [L, dim]: per label, the mean of `sample_vectors(batch)` over its positive samples.

    Labels that never occur get a zero row.
    """
    sums: torch.Tensor | None = None
    counts = torch.zeros(num_labels, dtype=torch.float64)
    for batch in batches:
        vectors = sample_vectors(batch).to(torch.float64)
        if sums is None:
            sums = torch.zeros(num_labels, vectors.shape[1], dtype=torch.float64)
        owner = torch.repeat_interleave(torch.arange(batch.batch_size), batch.label_offsets.diff())
        sums.index_add_(0, batch.labels, vectors[owner])
        counts += torch.bincount(batch.labels, minlength=num_labels)
    if sums is None:
        raise ValueError("label means need at least one batch")
    return (sums / counts.clamp(min=1).unsqueeze(1)).to(torch.float32)


def zipf_weights(n: int, exponent: float) -> torch.Tensor:
    """float64 [n]: the Zipf law p(rank) ∝ (rank + 1)^-exponent, normalised to sum to one."""
    weights = torch.arange(1, n + 1, dtype=torch.float64).pow(-exponent)
    return weights / weights.sum()


def zipf_ranks(u: torch.Tensor, n: torch.Tensor, exponent: torch.Tensor) -> torch.Tensor:
    """int64 ranks in [0, n) from uniforms `u`, elementwise (all float64 tensors of one shape).

    Inverse CDF of the continuous power law x^-exponent on [1, n + 1), floored: rank k has
    probability ∝ ∫_{k+1}^{k+2} x^-exponent dx, a Zipf law without any per-row table.
    """
    slope = 1.0 - exponent
    log_top = torch.log(n + 1.0)
    power_law = torch.log1p(u * torch.expm1(slope * log_top)) / slope
    log_x = torch.where(slope.abs() > 1e-9, power_law, u * log_top)
    ranks = torch.exp(log_x).floor().to(torch.int64) - 1
    return torch.minimum(ranks.clamp(min=0), n.to(torch.int64) - 1)


def unique_rows(candidates: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """CSR (values, offsets [R + 1]) of the distinct non-negative entries of each row, ascending."""
    ordered = candidates.sort(dim=1).values
    keep = ordered >= 0
    keep[:, 1:] &= ordered[:, 1:] != ordered[:, :-1]
    offsets = torch.zeros(candidates.shape[0] + 1, dtype=torch.int64)
    offsets[1:] = keep.sum(dim=1).cumsum(0)
    return ordered[keep], offsets


def _random_coprime(n: int, gen: torch.Generator) -> int:
    """A random multiplier in [1, n) coprime with n, so that x -> a*x + b mod n is a permutation."""
    if n <= 2:
        return 1
    while True:
        candidate = int(torch.randint(1, n, (1,), generator=gen))
        if math.gcd(candidate, n) == 1:
            return candidate


@dataclass(frozen=True)
class SyntheticSpec:
    """Shape and statistics of a synthetic data set (see the module docstring for the model)."""

    num_labels: int                 # L
    num_clusters: int               # latent semantic clusters
    table_rows: tuple[int, ...]     # rows of each sparse feature table
    table_zipf: tuple[float, ...]   # Zipf exponent of each table's id distribution
    pooling: tuple[int, ...]        # mean ids per sample per table; each bag varies +-50%, min 1
    num_dense: int
    batch_size: int
    label_zipf: float = 1.1         # Zipf exponent of label frequencies
    labels_per_sample: int = 3      # mean number of label draws per sample (>= 1), see SyntheticData
    feature_signal: float = 0.7     # prob. that an id comes from the sample's cluster region
    heldout_size: int = 2048
    seed: int = 0

    def __post_init__(self) -> None:
        tables = len(self.table_rows)
        if tables == 0 or len(self.table_zipf) != tables or len(self.pooling) != tables:
            raise ConfigError("table_rows, table_zipf and pooling must be non-empty and of one length.")
        if min(self.table_rows) < 1 or min(self.pooling) < 1 or min(self.table_zipf) < 0:
            raise ConfigError("table_rows and pooling must be positive and table_zipf non-negative.")
        if not 1 <= self.num_clusters <= self.num_labels:
            raise ConfigError(f"num_clusters must lie in [1, num_labels={self.num_labels}], "
                              f"got {self.num_clusters}.")
        if min(self.num_dense, self.batch_size, self.labels_per_sample, self.heldout_size) < 1:
            raise ConfigError("num_dense, batch_size, labels_per_sample and heldout_size must be positive.")
        if not 0.0 <= self.feature_signal <= 1.0 or self.label_zipf < 0:
            raise ConfigError("feature_signal must lie in [0, 1] and label_zipf must be non-negative.")


@dataclass(frozen=True)
class _LabelModel:
    """Which labels a cluster emits, and how often."""

    probs: torch.Tensor          # float64 [L]: Zipf weight of each label (sums to one)
    cluster_of: torch.Tensor     # int64 [L]
    cluster_probs: torch.Tensor  # float64 [C]: total weight of each cluster's labels
    by_cluster: torch.Tensor     # int64 [L]: label ids grouped by cluster
    cluster_ends: torch.Tensor   # int64 [C]: end of each cluster's group in by_cluster
    cluster_keys: torch.Tensor   # float64 [L]: c + within-cluster CDF, aligned with by_cluster
    cluster_cdf: torch.Tensor    # float64 [C]
    label_cdf: torch.Tensor      # float64 [L]
    max_draws: int
    mean_draws: float

    @classmethod
    def build(cls, spec: SyntheticSpec, gen: torch.Generator) -> "_LabelModel":
        num_labels, num_clusters = spec.num_labels, spec.num_clusters
        probs = torch.empty(num_labels, dtype=torch.float64)
        probs[torch.randperm(num_labels, generator=gen)] = zipf_weights(num_labels, spec.label_zipf)
        # Balanced random clusters: every cluster is non-empty and holds labels of all frequencies.
        cluster_of = torch.empty(num_labels, dtype=torch.int64)
        cluster_of[torch.randperm(num_labels, generator=gen)] = torch.arange(num_labels) % num_clusters
        by_cluster = torch.argsort(cluster_of, stable=True)
        sorted_cluster = cluster_of[by_cluster]
        cluster_probs = torch.bincount(cluster_of, weights=probs, minlength=num_clusters)
        cluster_ends = torch.bincount(cluster_of, minlength=num_clusters).cumsum(0)
        running = probs[by_cluster].cumsum(0)
        before = torch.cat([running.new_zeros(1), running[cluster_ends[:-1] - 1]])
        within = (running - before[sorted_cluster]) / cluster_probs[sorted_cluster]
        within[cluster_ends - 1] = 1.0
        return cls(probs, cluster_of, cluster_probs, by_cluster, cluster_ends,
                   sorted_cluster.to(torch.float64) + within, cluster_probs.cumsum(0), probs.cumsum(0),
                   max_draws=MAX_POSITIVES_FACTOR * spec.labels_per_sample,
                   mean_draws=float(spec.labels_per_sample))

    def sample(self, batch_size: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(clusters [B], positive labels, label_offsets [B + 1]) of `batch_size` new samples."""
        clusters = self._search(self.cluster_cdf, torch.rand(batch_size, dtype=torch.float64, generator=gen))
        rates = torch.full((batch_size,), self.mean_draws - 1.0)
        draws = (1 + torch.poisson(rates, generator=gen).to(torch.int64)).clamp(max=self.max_draws)
        u = torch.rand(batch_size, self.max_draws, dtype=torch.float64, generator=gen)
        slot = torch.searchsorted(self.cluster_keys, clusters.unsqueeze(1) + u, right=True)
        slot = torch.minimum(slot, self.cluster_ends[clusters].unsqueeze(1) - 1)
        candidates = self.by_cluster[slot].masked_fill(torch.arange(self.max_draws) >= draws.unsqueeze(1), -1)
        extra = self._search(self.label_cdf, torch.rand(batch_size, dtype=torch.float64, generator=gen))
        extra = extra.masked_fill(torch.rand(batch_size, generator=gen) >= EXTRA_LABEL_PROB, -1)
        labels, offsets = unique_rows(torch.cat([candidates, extra.unsqueeze(1)], dim=1))
        return clusters, labels, offsets

    @staticmethod
    def _search(cdf: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        return torch.searchsorted(cdf, u, right=True).clamp_(max=cdf.numel() - 1)

    def _draw_count_pmf(self) -> torch.Tensor:
        """float64 [max_draws]: P(draws = k + 1) for draws = min(1 + Poisson(mean - 1), max_draws)."""
        rate = self.mean_draws - 1.0
        k = torch.arange(self.max_draws, dtype=torch.float64)
        pmf = torch.exp(k * math.log(rate) - rate - torch.lgamma(k + 1)) if rate > 0 else (k == 0).double()
        pmf[-1] = 1.0 - pmf[:-1].sum()
        return pmf

    def positive_probabilities(self) -> torch.Tensor:
        """float64 [L]: the exact probability that a fresh sample has each label as a positive."""
        share = self.probs / self.cluster_probs[self.cluster_of]
        draws = torch.arange(1, self.max_draws + 1, dtype=torch.float64)
        missed = (1.0 - share).unsqueeze(1).pow(draws)                      # [L, max_draws]
        from_cluster = 1.0 - missed @ self._draw_count_pmf()
        extra = EXTRA_LABEL_PROB * self.probs
        own = self.cluster_probs[self.cluster_of]
        return own * (1.0 - (1.0 - from_cluster) * (1.0 - extra)) + (1.0 - own) * extra


@dataclass(frozen=True)
class _SparseModel:
    """Which rows a cluster looks up in each table: its hot region, or the table's global Zipf law."""

    rows: torch.Tensor           # int64 [T]
    exponent: torch.Tensor       # float64 [T]
    bag_low: torch.Tensor        # int64 [T]: smallest bag size
    bag_span: torch.Tensor       # int64 [T]: number of possible bag sizes
    region: torch.Tensor         # int64 [T]: rows in one cluster's hot region
    global_mult: torch.Tensor    # int64 [T]: x -> mult * x + shift mod rows maps ranks to rows
    global_shift: torch.Tensor
    hot_mult: torch.Tensor       # the same for region positions, independent of the global map
    hot_shift: torch.Tensor
    num_clusters: int
    signal: float

    @classmethod
    def build(cls, spec: SyntheticSpec, gen: torch.Generator) -> "_SparseModel":
        rows = torch.tensor(spec.table_rows, dtype=torch.int64)
        pooling = torch.tensor(spec.pooling, dtype=torch.int64)

        def affine() -> tuple[torch.Tensor, torch.Tensor]:
            mult = [_random_coprime(n, gen) for n in spec.table_rows]
            shift = [int(torch.randint(0, n, (1,), generator=gen)) for n in spec.table_rows]
            return torch.tensor(mult), torch.tensor(shift)

        global_mult, global_shift = affine()
        hot_mult, hot_shift = affine()
        bag_low = (pooling - pooling // 2).clamp(min=1)
        return cls(rows, torch.tensor(spec.table_zipf, dtype=torch.float64), bag_low,
                   pooling + pooling // 2 - bag_low + 1, (rows // spec.num_clusters).clamp(min=1),
                   global_mult, global_shift, hot_mult, hot_shift, spec.num_clusters, spec.feature_signal)

    def sample(self, clusters: torch.Tensor, gen: torch.Generator) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Per table, (ids, bag offsets) for samples of the given clusters."""
        num_tables, batch_size = self.rows.numel(), clusters.numel()
        uniform = torch.rand(num_tables, batch_size, generator=gen)
        sizes = self.bag_low.unsqueeze(1) + (uniform * self.bag_span.unsqueeze(1)).to(torch.int64)
        sizes = torch.minimum(sizes, (self.bag_low + self.bag_span - 1).unsqueeze(1))
        bag = torch.repeat_interleave(torch.arange(num_tables * batch_size), sizes.flatten())
        table, cluster = bag // batch_size, clusters[bag % batch_size]
        rows = self.rows[table]
        hot = torch.rand(bag.numel(), generator=gen) < self.signal
        span = torch.where(hot, self.region[table], rows)
        ranks = zipf_ranks(torch.rand(bag.numel(), dtype=torch.float64, generator=gen),
                           span.to(torch.float64), self.exponent[table])
        position = torch.where(hot, (cluster * rows // self.num_clusters + ranks) % rows, ranks)
        mult = torch.where(hot, self.hot_mult[table], self.global_mult[table])
        shift = torch.where(hot, self.hot_shift[table], self.global_shift[table])
        ids = torch.split((mult * position + shift) % rows, sizes.sum(dim=1).tolist())
        offsets = (sizes.cumsum(dim=1) - sizes).unbind(0)
        return list(ids), list(offsets)


class SyntheticData:
    """Deterministic synthetic batches drawn from a latent-cluster model.

    A sample picks a cluster c with probability equal to the total Zipf weight of c's labels. It
    draws 1 + Poisson(labels_per_sample - 1) labels (capped) from c's labels by their Zipf weights,
    with replacement, and keeps the distinct ones, so every label's frequency follows the global
    Zipf law; with probability EXTRA_LABEL_PROB it adds one label drawn from all labels. Because
    duplicates collapse, samples of head-dominated clusters have fewer distinct positives than
    labels_per_sample. Each sparse id comes with probability feature_signal from c's hot region of
    the table (about rows / num_clusters rows, Zipf within), else from the table's global Zipf law;
    ranks map to rows through fixed random permutations. Dense features are c's unit-norm centroid
    plus Gaussian noise of std DENSE_NOISE_STD.
    """

    def __init__(self, spec: SyntheticSpec):
        self.spec = spec
        self.num_labels = spec.num_labels
        self.num_dense = spec.num_dense
        self.table_rows = tuple(spec.table_rows)
        gen = seeded_generator(spec.seed, "structure")
        self._labels = _LabelModel.build(spec, gen)
        self._sparse = _SparseModel.build(spec, gen)
        centroids = torch.randn(spec.num_clusters, spec.num_dense, generator=gen)
        self._centroids = centroids / centroids.norm(dim=1, keepdim=True)
        self._heldout: Batch | None = None

    def train_batch(self, index: int) -> Batch:
        """Training batch `index`: a pure function of (seed, index)."""
        return self._draw(self.spec.batch_size, seeded_generator(self.spec.seed, "train", index))

    def heldout(self) -> Batch:
        """The held-out split: heldout_size samples from a stream no training batch uses."""
        if self._heldout is None:
            self._heldout = self._draw(self.spec.heldout_size, seeded_generator(self.spec.seed, "heldout"))
        return self._heldout

    def label_frequencies(self) -> torch.Tensor:
        """float64 [L]: the generative probability that a sample has each label as a positive."""
        return self._labels.positive_probabilities()

    def id_access_counts(self, num_batches: int, start: int = 0) -> list[torch.Tensor]:
        """int64 [rows] per table: measured lookups over train batches [start, start + num_batches)."""
        batches = (self.train_batch(i) for i in range(start, start + num_batches))
        return count_id_accesses(batches, self.table_rows)

    def label_feature_means(self, num_batches: int) -> torch.Tensor:
        """float32 [L, num_dense + 32]: per label, the mean features of its positives in the first batches.

        A sample's features are its dense vector and a fixed random projection of its hashed sparse
        ids (the hashing trick keeps the projection small whatever the table sizes), so labels whose
        positives look up the same rows end up close, as HASTE's label embeddings from features do.
        """
        tables = len(self.table_rows)
        projection = torch.randn(tables * SPARSE_BUCKETS, SPARSE_PROJECTION_DIM,
                                 generator=seeded_generator(self.spec.seed, "sparse-projection"))
        projection /= math.sqrt(SPARSE_PROJECTION_DIM * tables)

        def features(batch: Batch) -> torch.Tensor:
            sparse = 0
            for table, (ids, offsets) in enumerate(zip(batch.ids, batch.offsets)):
                buckets = (ids * 2_654_435_761) % SPARSE_BUCKETS + table * SPARSE_BUCKETS
                sparse = sparse + torch.nn.functional.embedding_bag(buckets, projection, offsets, mode="mean")
            return torch.cat([batch.dense, sparse], dim=1)

        batches = (self.train_batch(i) for i in range(num_batches))
        return mean_vector_per_label(batches, self.num_labels, features)

    def _draw(self, batch_size: int, gen: torch.Generator) -> Batch:
        clusters, labels, label_offsets = self._labels.sample(batch_size, gen)
        ids, offsets = self._sparse.sample(clusters, gen)
        noise = torch.randn(batch_size, self.num_dense, generator=gen) * DENSE_NOISE_STD
        return Batch(ids=ids, offsets=offsets, weights=[None] * len(ids),
                     dense=self._centroids[clusters] + noise, labels=labels, label_offsets=label_offsets)
