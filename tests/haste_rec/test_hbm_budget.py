"""The embedding HBM budget: a user setting that a placement must fit, checked before any table is built."""

import pytest
import torch

from targets.haste_rec.embeddings.embeddings import EmbeddingConfig, EmbeddingStore
from targets.haste_rec.knobs import KNOB_SPACE
from targets.haste_rec.model import hbm_budget_bytes
from targets.haste_rec.sizes import get_size
from targets.haste_rec.target import build
from targets.protocol import ConfigError

ROWS, DIM = (1000, 3000), 8  # 4000 rows x (8 x 4 bytes + 4 bytes of Adagrad state) = 144 KB on the device


def test_large_cached_is_large_with_a_quarter_of_its_tables_as_budget():
    large, cached = get_size("large"), get_size("large-cached")
    assert cached.table_rows == large.table_rows and cached.num_labels == large.num_labels
    assert large.hbm_budget_gb is None
    assert cached.hbm_budget_gb * 1e9 == pytest.approx(large.table_bytes / 4)
    config = KNOB_SPACE.resolve({})
    assert hbm_budget_bytes(config, cached) == pytest.approx(large.table_bytes / 4)
    assert hbm_budget_bytes({**config, "embedding_hbm_budget_gb": 2.0}, cached) == 2e9  # the user's own wins
    assert hbm_budget_bytes(config, large) is None


def store(placement, budget, **kw):
    cfg = EmbeddingConfig(placement=placement, grad_mode="dense" if placement == "device" else "fused",
                          hbm_budget_bytes=budget, **kw)
    return EmbeddingStore(ROWS, DIM, cfg, torch.device("cpu"), seed=0, max_unique_per_batch=[10, 10])


def test_a_placement_over_the_budget_fails_in_one_sentence():
    assert store("device", 144_000).device_bytes() == 144_000
    with pytest.raises(ConfigError, match=r"embedding placement device needs 0.000144 GB .* over the 0.0001 GB"):
        store("device", 100_000)
    cached = store("cached", 100_000, cache_fraction=0.5, opt_state_cache_fraction=0.5)
    assert cached.device_bytes() == 2000 * DIM * 4 + 2000 * 4
    with pytest.raises(ConfigError, match="smaller embedding_cache_fraction"):
        store("cached", 50_000, cache_fraction=0.5, opt_state_cache_fraction=0.5)
    assert store("host", 0.0).device_bytes() == 0


def test_the_knob_reaches_the_trainer():
    with pytest.raises(ConfigError, match="embedding HBM budget"):
        build(KNOB_SPACE.resolve({"embedding_hbm_budget_gb": 0.001}), "tiny", {}, "cpu")
    assert KNOB_SPACE["embedding_hbm_budget_gb"].user_setting


@pytest.mark.parametrize("plan", ["uniform", "planned"])
@pytest.mark.parametrize("fraction,floor", [(0.5, 10), (0.01, 200), (0.001, 1), (1.0, 10)])
def test_the_least_device_memory_known_before_the_build_never_exceeds_what_the_build_needs(plan, fraction, floor):
    """The static bound takes every table's uniform share with a floor of one row; the build's floors (a batch's
    distinct ids) and the planned split only raise or move rows, never lower their total."""
    from targets.haste_rec.embeddings.embeddings import least_device_bytes
    counts = [torch.arange(rows, 0, -1) for rows in ROWS]  # skewed access counts for the planned split
    cfg = EmbeddingConfig(placement="cached", grad_mode="fused", cache_fraction=fraction,
                          opt_state_cache_fraction=fraction / 2 if fraction > 0.001 else fraction, cache_plan=plan)
    built = EmbeddingStore(ROWS, DIM, cfg, torch.device("cpu"), seed=0, access_counts=counts,
                           max_unique_per_batch=[floor, floor])
    assert least_device_bytes(cfg, ROWS, DIM) <= built.device_bytes()
    for placement in ("device", "host"):
        other = EmbeddingConfig(placement=placement, grad_mode="dense" if placement == "device" else "fused")
        assert least_device_bytes(other, ROWS, DIM) == store(placement, None).device_bytes()


def test_the_agent_rejects_a_config_over_the_budget_before_any_worker_starts():
    """The TPE oracle at `large-cached` (2026-12-04): all 12 of its first 25 samples that a numerics run's build
    rejected on the budget (device placement, or caches of 5.78-12.8 GB), each 2.4-27.7 s after it was proposed, fail
    the static check; a cached placement inside the budget passes."""
    from targets.haste_rec.model import check_config
    over = [{"embedding_placement": "device", "embedding_grad_mode": "dense"},
            {"embedding_placement": "cached", "embedding_grad_mode": "fused", "embedding_cache_fraction": 0.25}]
    for patch in over:
        with pytest.raises(ConfigError, match="needs at least .* over the 3.33 GB embedding HBM budget"):
            check_config(KNOB_SPACE.resolve(patch), "large-cached")
    check_config(KNOB_SPACE.resolve({"embedding_placement": "cached", "embedding_grad_mode": "fused",
                                     "embedding_cache_fraction": 0.24}), "large-cached")
    check_config(KNOB_SPACE.resolve({"embedding_placement": "device", "embedding_grad_mode": "dense"}), "large")
