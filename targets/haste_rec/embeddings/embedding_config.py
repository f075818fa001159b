"""How the embedding tables are stored and updated: the SparseGear knobs as one validated record."""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass

import torch

from targets.haste_rec.cache.cache_plan import PLANS
from targets.haste_rec.cache.row_cache import EVICTIONS
from targets.protocol import ConfigError

PLACEMENTS = ("device", "host", "cached")
GRAD_MODES = ("dense", "sparse", "fused")
BACKENDS = ("torch", "triton")
CACHE_INDEXES = ("host", "device")  # where a cache's id -> slot maps and eviction stamps live
CPU = torch.device("cpu")


@dataclass(frozen=True)
class EmbeddingConfig:
    """How the tables are stored and updated; the defaults are the baseline a team writes first."""

    placement: str = "device"
    grad_mode: str = "dense"
    cache_fraction: float = 0.2            # device cache rows / all rows (placement cached)
    cache_plan: str = "uniform"
    eviction: str = "lru"
    cache_index: str = "host"              # placement cached: the caches' bookkeeping on the host or the device
    cache_overlap: bool = False            # placement cached: decisions on a side stream, write-backs behind
    cache_prefetch: bool = False           # placement cached: the next batch's lookup prepared on a thread ahead
    opt_state_cache_fraction: float = 0.2  # Adagrad-state cache rows / all rows (placement cached)
    pool_on_host: bool = False             # placement host: only pooled vectors cross to the device
    pin_memory: bool = False               # pinned host tables and staging buffers (CUDA only)
    backend: str = "torch"                 # triton: Triton pooling and fused update where the rows are on the device
    # backend triton: the kernels' meta-parameters, int or "auto" (triton_embedding.EmbeddingKernelConfig)
    triton_tile_elements: int | str = "auto"
    triton_num_warps: int | str = "auto"
    triton_num_stages: int | str = "auto"
    hbm_budget_bytes: float | None = None  # device memory the tables, their state and caches may use (None: any)
    lr: float = 0.01
    eps: float = 1e-8
    init_std: float = 0.01

    def __post_init__(self) -> None:
        for name, choices in (("placement", PLACEMENTS), ("grad_mode", GRAD_MODES), ("cache_plan", PLANS),
                              ("eviction", EVICTIONS), ("backend", BACKENDS), ("cache_index", CACHE_INDEXES)):
            if getattr(self, name) not in choices:
                raise ConfigError(f"{name} must be one of {', '.join(choices)}, not {getattr(self, name)!r}")
        if self.grad_mode == "dense" and self.placement != "device":
            raise ConfigError(f"grad_mode dense needs placement device: {self.placement} tables are updated "
                              f"row-wise (use sparse or fused)")
        fractions = (self.cache_fraction, self.opt_state_cache_fraction)
        if not all(0 < f <= 1 for f in fractions) or self.lr <= 0 or self.eps <= 0 or self.init_std < 0:
            raise ConfigError(f"cache fractions must lie in (0, 1], lr and eps be positive and init_std non-negative,"
                              f" not {fractions}, {self.lr}, {self.eps}, {self.init_std}")

    @property
    def ids_on_device(self) -> bool:
        """Whether lookups want the batch's ids on the compute device: the tables are there, or the caches'
        bookkeeping is (cache_index device) and does not overlap the step (cache_overlap: the caches copy the ids
        on their own stream, so that the copy does not queue behind the previous step); else on the host. The
        loader moves them there ahead."""
        return self.placement == "device" or (self.placement == "cached" and self.cache_index == "device"
                                              and not self.cache_overlap)

    @property
    def prefetches(self) -> bool:
        """Whether each next training batch's lookup is prepared ahead: cache_prefetch, which only the device
        caches have (placement cached)."""
        return self.placement == "cached" and self.cache_prefetch

    @property
    def autograd_tables(self) -> bool:
        """Whether torch autograd forms the table gradient: dense, and sparse on the device with the torch
        backend (embedding_bag's sparse gradient); every other mode forms row gradients itself."""
        return self.grad_mode == "dense" or (self.grad_mode == "sparse" and self.placement == "device"
                                              and self.backend == "torch")

    @property
    def triton_kernel_options(self) -> dict[str, int | str]:
        """The keywords of ``triton_embedding.EmbeddingKernelConfig`` (backend triton)."""
        return {"tile_elements": self.triton_tile_elements, "num_warps": self.triton_num_warps,
                "num_stages": self.triton_num_stages}

    @property
    def triton_pooling(self) -> bool:
        """Whether device-side pooling runs the Triton kernel. Not under grad mode dense, whose table
        gradient is torch autograd's through embedding_bag (evaluation pools the same way, for consistency)."""
        return self.backend == "triton" and self.grad_mode != "dense"


def check_backend(backend: str, device: torch.device) -> None:
    """ConfigError unless the backend can run on `device`: Triton needs CUDA or its CPU interpreter."""
    if backend != "triton":
        return
    interpreted = os.environ.get("TRITON_INTERPRET", "") not in ("", "0")
    if device.type != "cuda" and not interpreted:
        raise ConfigError("embedding_backend triton needs a CUDA device (or TRITON_INTERPRET=1 on the CPU)")
    if importlib.util.find_spec("triton") is None:
        raise ConfigError("embedding_backend triton needs the triton package, which is not installed")
