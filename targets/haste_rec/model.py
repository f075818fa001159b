"""The reference model: pooled sparse embeddings + dense features -> MLP encoder -> HASTE output.

Building it means deciding the label layout first (head/tail split, grouping of tail labels), which
needs statistics of the training data; `build_model` does that from the data source alone.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch
from torch import nn

from targets.haste_rec.cache import build_cache
from targets.haste_rec.data import data as data_module
from targets.haste_rec.data.data import SyntheticData, SyntheticSpec
from targets.haste_rec.embeddings.embeddings import EmbeddingConfig, EmbeddingStore, check_budget, least_device_bytes
from targets.haste_rec.knobs import PRESET, tail_dot_precision
from targets.haste_rec.sizes import HasteRecSize, get_size
from targets.haste_rec.tail import grouping as grouping_module
from targets.haste_rec.tail.grouping import group_by_frequency, group_random, group_semantic, split_head_tail
from targets.haste_rec.tail.haste import HasteOutput
from targets.protocol import BuildClock

PLAN_BATCHES = 64        # training batches whose id counts plan the embedding cache


def grouping_batches(num_labels: int, batch_size: int) -> int:
    """Training batches whose features place labels for semantic grouping: enough to see a label
    about 16 times on average (rare labels stay noisy), bounded so set-up stays in seconds."""
    return max(128, min(1024, -(-16 * num_labels // batch_size)))


class Encoder(nn.Module):
    """A two-layer MLP from [pooled embeddings | dense features] to the H-dim representation."""

    def __init__(self, in_dim: int, inner: int, hidden: int):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(in_dim, inner), nn.ReLU(), nn.Linear(inner, hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


@dataclass(frozen=True)
class ModelShape:
    """The model-class knobs resolved against the size preset."""

    group_size: int
    fan_in: int
    head_fraction: float

    @staticmethod
    def resolve(config: Mapping[str, Any], size: HasteRecSize) -> "ModelShape":
        pick = lambda key, preset: preset if config[key] == PRESET else int(config[key])  # noqa: E731
        head = size.head_fraction if config["head_fraction"] < 0 else float(config["head_fraction"])
        return ModelShape(pick("group_size", size.group_size), pick("fan_in", size.fan_in), head)


def synthetic_data(size: HasteRecSize, seed: int) -> SyntheticData:
    return SyntheticData(SyntheticSpec(
        num_labels=size.num_labels, num_clusters=size.num_clusters, table_rows=size.table_rows,
        table_zipf=size.table_zipf, pooling=size.pooling, num_dense=size.num_dense, batch_size=size.batch_size,
        heldout_size=size.heldout_size, seed=seed))


def _build_key(data, *parts) -> tuple | None:
    """The build cache's key for a product of synthetic `data` (None for a file: not cached)."""
    if not isinstance(data, SyntheticData):
        return None
    return (data.spec, *parts, build_cache.source_digest((data_module, grouping_module, sys.modules[__name__])))


def _maybe_cached(kind: str, key: tuple | None, compute):
    return compute() if key is None else build_cache.cached(kind, key, compute)


def label_layout(data, grouping: str, shape: ModelShape, seed: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(head label ids, tail groups [K, G]) from the data's label statistics and the grouping knob;
    read from the build cache when another worker computed it already."""
    key = _build_key(data, grouping, shape, seed, batch_size)
    head, groups = _maybe_cached("layout", key, lambda: _compute_layout(data, grouping, shape, seed, batch_size))
    return head, groups


def _compute_layout(data, grouping: str, shape: ModelShape, seed: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    freq = data.label_frequencies()
    head, tail = split_head_tail(freq, shape.head_fraction)
    gen = torch.Generator().manual_seed(seed + 17)
    if grouping == "random":
        groups = group_random(tail, shape.group_size, gen)
    elif grouping == "frequency":
        groups = group_by_frequency(tail, freq, shape.group_size)
    else:
        features = data.label_feature_means(grouping_batches(data.num_labels, batch_size))
        groups = group_semantic(tail, features, shape.group_size, gen,
                                frequencies=freq)
    return head, groups


# Most batches replayed into device caches before training (EmbeddingStore.warm_caches): the batches before the
# first, drawn until every cache is full. At large-cached its 26 tables' caches of 200K rows each fill after 290
# batches (the slowest table, Zipf 1.3, sees its 200,000th distinct id then; benchmarks/cache_steady.py). Measured cold on an H200
# (2026-12-01), the best configuration's first two blocks took 29 and 25 ms a step, the later ones 42-68: with
# its caches filling, the run's final ratio (0.378) and a fresh `bench --vs` (0.355) were 6% apart.
CACHE_WARM_BATCHES = 500


def hbm_budget_bytes(config: Mapping[str, Any], size: HasteRecSize) -> float | None:
    """The embedding HBM budget in bytes: the knob's when set (>= 0), else the size preset's (None: unlimited)."""
    gb = config["embedding_hbm_budget_gb"] if config["embedding_hbm_budget_gb"] >= 0 else size.hbm_budget_gb
    return None if gb is None else gb * 1e9


def embedding_config(config: Mapping[str, Any], size: HasteRecSize) -> EmbeddingConfig:
    return EmbeddingConfig(hbm_budget_bytes=hbm_budget_bytes(config, size),
        placement=config["embedding_placement"], grad_mode=config["embedding_grad_mode"],
        cache_fraction=config["embedding_cache_fraction"], cache_plan=config["embedding_cache_plan"],
        eviction=config["embedding_eviction"], cache_index=config["embedding_cache_index"],
        cache_overlap=config["embedding_cache_overlap"], cache_prefetch=config["embedding_cache_prefetch"],
        opt_state_cache_fraction=config["embedding_opt_state_cache_fraction"],
        pool_on_host=config["embedding_pool_on_host"], pin_memory=config["pin_memory"],
        backend=config["embedding_backend"], triton_tile_elements=config["embedding_tile_elements"],
        triton_num_warps=config["embedding_num_warps"], triton_num_stages=config["embedding_num_stages"])


def check_config(config: Mapping[str, Any], size_name: str) -> None:
    """The checks of a resolved config that need no build (``Target.check_config``): its embedding placement's
    least device memory against the HBM budget. In the TPE oracle at `large-cached` (H200, 2026-12-04), 12
    of its first 25 samples were over it, each rejected by a numerics run's build 2.4-27.7 s after it was proposed."""
    size = get_size(size_name)
    cfg = embedding_config(config, size)
    check_budget(cfg, least_device_bytes(cfg, size.table_rows, size.embedding_dim), at_least=True)


def cache_plan_inputs(data, size: HasteRecSize, emb_cfg: EmbeddingConfig) -> tuple[list[torch.Tensor] | None, list[int]]:
    """What the embedding cache plan reads: measured access counts (placement cached only; from the build
    cache when another worker measured them) and the most distinct ids one batch can hold per table
    (bags are pool +- 50%), which is each table's cache floor."""
    counts = None
    if emb_cfg.placement == "cached":
        counts = _maybe_cached("access-counts", _build_key(data, PLAN_BATCHES),
                               lambda: data.id_access_counts(PLAN_BATCHES))
    max_unique = [min(rows, (pool + pool // 2) * size.batch_size) for rows, pool in zip(size.table_rows, size.pooling)]
    return counts, max_unique


def tail_kernel_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """The Triton tail's tile config from the tail_* kernel knobs and matmul_precision (used by the Triton
    backends only): its fp32 products as ``knobs.tail_dot_precision`` says."""
    return {"block_b": config["tail_block_b"], "num_warps": config["tail_num_warps"],
            "num_stages": config["tail_num_stages"], "fp32_precision": tail_dot_precision(config)}


class HasteRecModel(nn.Module):
    """Embeddings, encoder and output layer; the session drives them phase by phase (and has checked the tail
    backend against the device before building anything)."""

    def __init__(self, data, size: HasteRecSize, config: Mapping[str, Any], kernels: Mapping[str, Callable],
                 device: torch.device, seed: int, clock: BuildClock):
        super().__init__()
        shape = ModelShape.resolve(config, size)
        emb_cfg = embedding_config(config, size)
        counts, max_unique = cache_plan_inputs(data, size, emb_cfg)
        clock.mark("cache plan inputs")
        self.embeddings = EmbeddingStore(size.table_rows, size.embedding_dim, emb_cfg, device, seed,
                                         access_counts=counts, max_unique_per_batch=max_unique)
        clock.mark("embedding tables")
        self.embeddings.warm_caches((data.train_batch(-1 - i) for i in range(CACHE_WARM_BATCHES)),
                                    lambda key, replay: _maybe_cached("cache-warm", _build_key(
                                        data, CACHE_WARM_BATCHES, *key), replay))
        clock.mark("cache warm-up")
        torch.manual_seed(seed)
        in_dim = size.num_tables * size.embedding_dim + size.num_dense
        self.encoder = Encoder(in_dim, size.encoder_hidden, size.hidden).to(device)
        head, groups = label_layout(data, config["grouping"], shape, seed, size.batch_size)
        self.output = HasteOutput(size.hidden, size.hidden, head, groups, shape.fan_in,
                                  backend=config["tail_backend"], kernels=kernels, seed=seed,
                                  kernel_config=tail_kernel_config(config)).to(device)
        clock.mark("output layer")
        self.shape = shape
