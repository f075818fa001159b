"""Size presets of the reference trainer, from CI-sized `tiny` to H200-sized `large` and `xl`.

`large` follows the HASTE Amazon-670K shapes (L=670,080 labels, H=768, F=64, G=32, B=256) with
26 sparse tables of 1M rows x 128 dims; `large-cached` is `large` under an embedding HBM budget of
a quarter of its 13.3 GB of tables (tables on the host or behind a device cache, SparseGear's case); `xl` takes the label space to Amazon-3M's 2.8M labels. Even `tiny` keeps the embedding tables
(140K rows) the largest trainable state, as in production, so its bottleneck is the one the
larger sizes have (the dense table gradient), only smaller.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from targets.protocol import ConfigError


@dataclass(frozen=True)
class HasteRecSize:
    name: str
    num_labels: int
    num_clusters: int
    hidden: int                      # encoder output width H
    encoder_hidden: int              # width of the encoder's inner layer
    fan_in: int                      # F: input dims shared by each tail group
    group_size: int                  # G: labels per tail group
    head_fraction: float             # share of labels (most frequent) in the dense head
    batch_size: int
    table_rows: tuple[int, ...]
    table_zipf: tuple[float, ...]
    pooling: tuple[int, ...]
    embedding_dim: int
    num_dense: int
    heldout_size: int
    quality_steps: int               # training steps before the quality metric is read
    hbm_budget_gb: float | None = None  # device memory the tables may use (None: unlimited)

    @property
    def table_bytes(self) -> int:
        """fp32 bytes of all embedding tables."""
        return sum(self.table_rows) * self.embedding_dim * 4

    @property
    def num_tables(self) -> int:
        return len(self.table_rows)


def _spread(n: int, lo: float, hi: float) -> tuple[float, ...]:
    """n Zipf exponents evenly spread over [lo, hi]: tables differ in skew, as real ones do."""
    if n == 1:
        return (lo,)
    return tuple(round(lo + (hi - lo) * i / (n - 1), 3) for i in range(n))


SIZES: dict[str, HasteRecSize] = {
    s.name: s
    for s in (
        HasteRecSize("tiny", num_labels=512, num_clusters=64, hidden=32, encoder_hidden=64, fan_in=8,
                     group_size=8, head_fraction=0.05, batch_size=32, table_rows=(40_000, 80_000, 20_000),
                     table_zipf=(0.8, 1.1, 1.3), pooling=(4, 3, 2), embedding_dim=16, num_dense=8,
                     heldout_size=256, quality_steps=300),
        HasteRecSize("small", num_labels=8192, num_clusters=256, hidden=128, encoder_hidden=256,
                     fan_in=16, group_size=16, head_fraction=0.05, batch_size=128,
                     table_rows=(20_000, 50_000, 100_000, 30_000, 80_000, 10_000, 60_000, 40_000),
                     table_zipf=_spread(8, 0.7, 1.3), pooling=(8,) * 8, embedding_dim=32, num_dense=13,
                     heldout_size=1024, quality_steps=300),
        HasteRecSize("medium", num_labels=65_536, num_clusters=1024, hidden=384, encoder_hidden=1024,
                     fan_in=32, group_size=32, head_fraction=0.03, batch_size=256,
                     table_rows=(200_000,) * 16, table_zipf=_spread(16, 0.6, 1.3), pooling=(16,) * 16,
                     embedding_dim=64, num_dense=13, heldout_size=2048, quality_steps=500),
        HasteRecSize("large", num_labels=670_080, num_clusters=10_470, hidden=768, encoder_hidden=1024,
                     fan_in=64, group_size=32, head_fraction=0.03, batch_size=256,
                     table_rows=(1_000_000,) * 26, table_zipf=_spread(26, 0.6, 1.3), pooling=(20,) * 26,
                     embedding_dim=128, num_dense=13, heldout_size=4096, quality_steps=1000),
        HasteRecSize("xl", num_labels=2_812_224, num_clusters=43_941, hidden=768, encoder_hidden=1024,
                     fan_in=64, group_size=32, head_fraction=0.02, batch_size=256,
                     table_rows=(1_000_000,) * 26, table_zipf=_spread(26, 0.6, 1.3), pooling=(20,) * 26,
                     embedding_dim=128, num_dense=13, heldout_size=4096, quality_steps=1000),
    )
}


# large with its tables four times over an embedding HBM budget: the multi-level store decides.
SIZES["large-cached"] = dataclasses.replace(SIZES["large"], name="large-cached",
                                            hbm_budget_gb=SIZES["large"].table_bytes / 4 / 1e9)


def get_size(name: str) -> HasteRecSize:
    try:
        return SIZES[name]
    except KeyError:
        raise ConfigError(f"unknown size {name!r}; sizes: {', '.join(SIZES)}") from None
