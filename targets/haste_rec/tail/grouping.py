"""How HASTE's tail labels are packed into groups of G that share one fan-in set.

A group's labels read the same F input dims, so which labels share a group decides how well the
tail can fit them. Three packings: random (the ablation baseline), by frequency (labels of similar
popularity together) and semantic (labels with similar feature vectors together). Also the split
of the label space into the dense head and the sparse tail. Every packing returns [K, G] label
ids with K = ceil(n / G) and -1 padding only at the end of the last group.

Semantic packing is spherical k-means into about K clusters of exactly G labels. A flat k-means
with K ~ 21K clusters over 670K labels costs n*K*d per iteration (minutes on one core), so it is
done as a tree: a node of m groups' worth of labels is split by a spherical k-means of
min(m, ``BRANCH``) centroids (fitted on a sample of the node) into children that hold whole
groups, in proportion to the clusters' natural sizes, until every child is one group. Each level
of the tree runs batched: its nodes are padded into one [nodes, rows, d] tensor per batch and
clustered by batched matmuls. Children's capacities are met greedily: each cluster keeps the
labels most similar to its centroid, and the leftovers of over-full clusters go to the nearest
cluster of the same node that still has room. Only the root's n mod G leftover labels end up in
a short group, which is placed last.
"""

from __future__ import annotations

import math

import torch

from targets.protocol import ConfigError

BRANCH = 32               # most centroids one node's k-means has
SAMPLE_PER_CENTROID = 64   # most labels a node's k-means is fitted on, per centroid
BATCH_ROWS = 1 << 16       # padded rows of the nodes clustered together (a larger node goes alone)


# ----------------------------------------------------------------------------- shared helpers

def _check_group_size(G: int) -> None:
    if G < 1:
        raise ConfigError(f"HASTE group size must be at least 1, not {G}")


def _to_groups(ordered: torch.Tensor, G: int) -> torch.Tensor:
    """Consecutive runs of G labels as [ceil(n/G), G], the last run padded with -1."""
    groups = math.ceil(ordered.numel() / G)
    packed = torch.full((groups * G,), -1, dtype=torch.int64, device=ordered.device)
    packed[:ordered.numel()] = ordered
    return packed.reshape(groups, G)


def _randperm(n: int, generator: torch.Generator) -> torch.Tensor:
    """A random permutation of 0..n-1 drawn on the generator's device, returned on the CPU."""
    return torch.randperm(n, generator=generator, device=generator.device).cpu()


def _frequency_order(labels: torch.Tensor, frequencies: torch.Tensor) -> torch.Tensor:
    """Labels sorted by decreasing frequency; ties keep their given order."""
    order = torch.sort(frequencies.to(labels.device)[labels], descending=True, stable=True).indices
    return labels[order]


# ----------------------------------------------------------------------------- simple packings

def split_head_tail(frequencies: torch.Tensor, head_fraction: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(head_labels, tail_labels), each sorted by id: the head is the top head_fraction most frequent.

    A positive fraction gives at least one head label; ties in frequency go to the lower id.
    """
    if not 0.0 <= head_fraction <= 1.0:
        raise ConfigError(f"HASTE head fraction must lie in [0, 1], not {head_fraction}")
    num_labels = frequencies.numel()
    n_head = round(head_fraction * num_labels)
    if head_fraction > 0:
        n_head = min(max(1, n_head), num_labels)
    order = torch.sort(frequencies, descending=True, stable=True).indices
    return order[:n_head].sort().values, order[n_head:].sort().values


def group_random(tail_labels: torch.Tensor, G: int, generator: torch.Generator) -> torch.Tensor:
    """Tail labels in a random order (from ``generator``), packed into [K, G]."""
    _check_group_size(G)
    permutation = _randperm(tail_labels.numel(), generator).to(tail_labels.device)
    return _to_groups(tail_labels[permutation], G)


def group_by_frequency(tail_labels: torch.Tensor, frequencies: torch.Tensor, G: int) -> torch.Tensor:
    """Tail labels in decreasing frequency, consecutive runs of G as groups: [K, G]."""
    _check_group_size(G)
    return _to_groups(_frequency_order(tail_labels, frequencies), G)


# ----------------------------------------------------------------------------- semantic packing

def group_semantic(tail_labels: torch.Tensor, label_features: torch.Tensor, G: int,
                   generator: torch.Generator, iters: int = 10,
                   frequencies: torch.Tensor | None = None) -> torch.Tensor:
    """Tail labels packed into [K, G] so that a group's labels have similar (cosine) feature vectors.

    ``label_features`` is [L, d], indexed by label id. Labels whose features are all zero (never
    seen) cannot be placed by similarity: they fill the last groups, in decreasing ``frequencies``
    when given, else in the order of ``tail_labels``. Runs on the CPU.
    """
    _check_group_size(G)
    labels = tail_labels.cpu()
    features = label_features.cpu()[labels].float()
    norms = features.norm(dim=1)
    seen = norms > 0
    groups = _pack(features[seen] / norms[seen, None], labels[seen], G, generator, iters)
    unseen = labels[~seen]
    if frequencies is not None:
        unseen = _frequency_order(unseen, frequencies.cpu())
    full = [group for group in groups if group.numel() == G]
    ragged = [group for group in groups if group.numel() < G]  # at most one
    return _to_groups(torch.cat(full + ragged + [unseen]), G).to(tail_labels.device)


def _pack(x: torch.Tensor, ids: torch.Tensor, G: int, generator: torch.Generator,
          iters: int) -> list[torch.Tensor]:
    """Groups (label-id tensors) of exactly G ids, except at most one smaller; x holds unit rows."""
    groups: list[torch.Tensor] = []
    nodes = [(x, ids)] if ids.numel() else []
    while nodes:  # one level of the tree per pass
        children = [child for batch in _batches(nodes) for child in _split(batch, G, generator, iters)]
        groups += [part for _, part in children if part.numel() <= G]
        nodes = [child for child in children if child[1].numel() > G]
    return groups


def _batches(nodes: list[tuple[torch.Tensor, torch.Tensor]]) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """Nodes in order of size, cut into batches of at most BATCH_ROWS padded rows."""
    batches: list[list[tuple[torch.Tensor, torch.Tensor]]] = []
    current: list[tuple[torch.Tensor, torch.Tensor]] = []
    for node in sorted(nodes, key=lambda node: node[1].numel()):
        if current and (len(current) + 1) * node[1].numel() > BATCH_ROWS:
            batches.append(current)
            current = []
        current.append(node)
    return batches + [current] if current else batches


def _split(nodes: list[tuple[torch.Tensor, torch.Tensor]], G: int, generator: torch.Generator,
           iters: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Every node's children (features, ids), each holding whole groups but for the root's short one."""
    x = torch.nn.utils.rnn.pad_sequence([xs for xs, _ in nodes], batch_first=True)
    ids = torch.nn.utils.rnn.pad_sequence([part for _, part in nodes], batch_first=True, padding_value=-1)
    valid = ids >= 0
    sizes = valid.sum(dim=1)
    k = ((sizes + G - 1) // G).clamp(max=BRANCH)
    centroids, penalty = _spherical_kmeans(_kmeans_rows(nodes, k, generator), k, iters, generator)
    sims = torch.baddbmm(penalty[:, None, :], x, centroids.transpose(1, 2))
    natural = _cluster_sizes(sims.argmax(dim=2), valid, penalty.shape[1])
    assign = _capacity_assign(sims, valid, _capacity(natural, sizes, k, G))
    key = (torch.arange(len(nodes))[:, None] * penalty.shape[1] + assign)[valid]
    order = torch.argsort(key, stable=True)
    counts = torch.bincount(key, minlength=penalty.numel()).tolist()
    children = zip(x[valid][order].split(counts), ids[valid][order].split(counts))
    return [(xs, part) for xs, part in children if part.numel()]


def _kmeans_rows(nodes: list[tuple[torch.Tensor, torch.Tensor]], k: torch.Tensor,
                 generator: torch.Generator) -> torch.Tensor:
    """[N, rows, d]: each node's rows, or a random SAMPLE_PER_CENTROID * k of them, zero-padded."""
    rows = []
    for (xs, _), centroids in zip(nodes, k.tolist()):
        limit = SAMPLE_PER_CENTROID * centroids
        rows.append(xs if xs.shape[0] <= limit else xs[_randperm(xs.shape[0], generator)[:limit]])
    return torch.nn.utils.rnn.pad_sequence(rows, batch_first=True)


def _spherical_kmeans(x: torch.Tensor, k: torch.Tensor, iters: int,
                      generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Per node of a batch, k[i] unit centroids fitted to the rows of x [N, n, d] (zero rows: padding).

    Returns (centroids [N, k_max, d], penalty [N, k_max]): 0 for a node's real centroids, -inf past
    k[i], to add to similarities. Starts from distinct random rows; empty clusters keep their centroid.
    """
    nodes, rows, _ = x.shape
    k_max = int(k.max())
    penalty = torch.zeros(nodes, k_max).masked_fill_(torch.arange(k_max) >= k[:, None], -math.inf)
    scores = torch.rand(nodes, rows, generator=generator, device=generator.device).cpu()
    scores[x.abs().sum(dim=2) == 0] = 2.0  # padding rows last
    start = scores.topk(k_max, dim=1, largest=False).indices
    centroids = x.gather(1, start[:, :, None].expand(-1, -1, x.shape[2]))
    offsets = torch.arange(nodes)[:, None] * k_max
    for _ in range(iters):
        best = torch.baddbmm(penalty[:, None, :], x, centroids.transpose(1, 2)).argmax(dim=2)
        sums = torch.zeros(nodes * k_max, x.shape[2]).index_add_(0, (best + offsets).flatten(), x.flatten(0, 1))
        sums = sums.reshape(nodes, k_max, -1)
        norms = sums.norm(dim=2, keepdim=True)
        centroids = torch.where(norms > 0, sums / norms.clamp_min(1e-30), centroids)
    return centroids, penalty


def _cluster_sizes(best: torch.Tensor, valid: torch.Tensor, k_max: int) -> torch.Tensor:
    """[N, k_max] count of each node's valid rows per cluster."""
    flat = (best + torch.arange(best.shape[0])[:, None] * k_max)[valid]
    return torch.bincount(flat, minlength=best.shape[0] * k_max).reshape(-1, k_max)


def _capacity(natural: torch.Tensor, sizes: torch.Tensor, k: torch.Tensor, G: int) -> torch.Tensor:
    """[N, k_max] labels each child of each node receives: whole groups, plus the node's n mod G to one.

    Whole groups go in proportion to the clusters' natural sizes (largest remainder); where that
    would hand one child the whole node (no progress), they are shared out evenly instead.
    """
    real = torch.arange(natural.shape[1]) < k[:, None]
    whole = sizes // G
    proportional = _largest_remainder(natural.double() * (whole / sizes)[:, None], whole, real)
    capacity = _with_remainder(proportional * G, natural, sizes, G, real)
    stuck = (capacity == sizes[:, None]).any(dim=1)
    if stuck.any():
        even = _largest_remainder(real.double() * (whole / k)[:, None], whole, real)
        capacity[stuck] = _with_remainder(even * G, -even, sizes, G, real)[stuck]
    return capacity


def _largest_remainder(exact: torch.Tensor, total: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
    """Integer shares [N, k] of each row's ``total``: floors of ``exact``, plus one to the largest remainders."""
    share = exact.floor().long()
    remainder = (exact - share).masked_fill(~real, -1.0)
    rank = remainder.argsort(dim=1, descending=True, stable=True).argsort(dim=1)
    return share + (rank < (total - share.sum(dim=1))[:, None]).long()


def _with_remainder(capacity: torch.Tensor, preference: torch.Tensor, sizes: torch.Tensor, G: int,
                    real: torch.Tensor) -> torch.Tensor:
    """capacity plus each node's n mod G labels, given to its real child of highest preference - capacity."""
    target = (preference - capacity).masked_fill(~real, torch.iinfo(torch.int64).min).argmax(dim=1)
    capacity = capacity.clone()
    capacity[torch.arange(sizes.numel()), target] += sizes % G
    return capacity


def _capacity_assign(sims: torch.Tensor, valid: torch.Tensor, capacity: torch.Tensor) -> torch.Tensor:
    """Cluster [N, n] of each valid row (-1 for padding), ``capacity[i, c]`` rows to each cluster.

    ``sims`` [N, n, k] holds row-centroid similarities (-inf for clusters a node lacks); each node's
    capacities sum to its valid rows. Every row picks its most similar cluster with room left; each
    cluster keeps the most similar of the rows picking it; the rest pick again, until all are placed.
    """
    if not torch.equal(capacity.sum(dim=1), valid.sum(dim=1)):  # else rows would wait for room forever
        raise ValueError("each node's capacities must sum to its number of rows")
    nodes, rows, k = sims.shape
    flat = sims.reshape(nodes * rows, k)
    pending = torch.nonzero(valid.flatten()).flatten()
    node = pending // rows
    free = capacity.flatten().clone()
    assign = torch.full((nodes * rows,), -1, dtype=torch.int64)
    while pending.numel():
        room = (free > 0).reshape(nodes, k)
        sim, cluster = flat[pending].masked_fill_(~room[node], -math.inf).max(dim=1)
        choice = node * k + cluster
        accept = _within_room(choice, sim, free)
        assign[pending[accept]] = cluster[accept]
        free -= torch.bincount(choice[accept], minlength=free.numel())
        pending, node = pending[~accept], node[~accept]
    return assign.reshape(nodes, rows)


def _within_room(choice: torch.Tensor, sim: torch.Tensor, free: torch.Tensor) -> torch.Tensor:
    """Whether each row ranks, by similarity among the rows choosing its cluster, within the room left."""
    order = torch.argsort(choice.double() + (1.0 - sim.double()) / 4.0, stable=True)  # cluster, then sim desc
    counts = torch.bincount(choice, minlength=free.numel())
    starts = torch.cumsum(counts, 0) - counts
    rank = torch.empty_like(choice)
    rank[order] = torch.arange(choice.numel()) - starts[choice[order]]
    return rank < free[choice]
