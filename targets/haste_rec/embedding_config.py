"""How the embedding tables are stored and updated: the SparseGear knobs as one validated record."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from targets.haste_rec.cache_plan import PLANS
from targets.haste_rec.row_cache import EVICTIONS
from targets.protocol import ConfigError

PLACEMENTS = ("device", "host", "cached")
GRAD_MODES = ("dense", "sparse", "fused")
CPU = torch.device("cpu")


@dataclass(frozen=True)
class EmbeddingConfig:
    """How the tables are stored and updated; the defaults are the baseline a team writes first."""

    placement: str = "device"
    grad_mode: str = "dense"
    cache_fraction: float = 0.2            # device cache rows / all rows (placement cached)
    cache_plan: str = "uniform"
    eviction: str = "lru"
    opt_state_cache_fraction: float = 0.2  # Adagrad-state cache rows / all rows (placement cached)
    pool_on_host: bool = False             # placement host: only pooled vectors cross to the device
    pin_memory: bool = False               # pinned host tables and staging buffers (CUDA only)
    lr: float = 0.01
    eps: float = 1e-8
    init_std: float = 0.01

    def __post_init__(self) -> None:
        for name, choices in (("placement", PLACEMENTS), ("grad_mode", GRAD_MODES), ("cache_plan", PLANS),
                              ("eviction", EVICTIONS)):
            if getattr(self, name) not in choices:
                raise ConfigError(f"{name} must be one of {', '.join(choices)}, not {getattr(self, name)!r}")
        if self.grad_mode == "dense" and self.placement != "device":
            raise ConfigError(f"grad_mode dense needs placement device: {self.placement} tables are updated "
                              f"row-wise (use sparse or fused)")
        fractions = (self.cache_fraction, self.opt_state_cache_fraction)
        if not all(0 < f <= 1 for f in fractions) or self.lr <= 0 or self.eps <= 0 or self.init_std < 0:
            raise ConfigError(f"cache fractions must lie in (0, 1], lr and eps be positive and init_std non-negative,"
                              f" not {fractions}, {self.lr}, {self.eps}, {self.init_std}")
