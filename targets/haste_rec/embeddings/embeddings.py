"""Sum-pooled embedding tables trained with row-wise Adagrad, with every SparseGear choice a knob.

Where the rows live (`placement`: device, host, or a device cache over host tables with the
optimizer state cached independently) and how the gradient is formed (`grad_mode`: a dense
table-sized autograd gradient, per-row sparse gradients applied in `optimizer_step`, or a fused
backward that applies the update in place) are the knobs a sparse-model team tunes first. The
optimizer math is one function, `row_ops.rowwise_adagrad`, used by every mode, so modes differ only in data
movement and summation order, never in the update rule, and their trajectories can be compared
bit for bit or to a tight tolerance.

All tables share one row space (`row_ops.TableLayout`), so a step pools, forms row gradients and
updates with one operation each, whatever the number of tables. Placements live in
`embedding_rows` (which also says where `backend` triton runs Triton kernels); this module holds
the autograd seam and the store the trainer uses.
"""

from __future__ import annotations

import functools
from typing import Callable, Iterable, Sequence

import torch
from torch import nn

from targets.haste_rec.cache import build_cache, table_caches
from targets.haste_rec.cache.cache_plan import plan_capacities, plan_uniform
from targets.haste_rec.data.batch import Batch, PackedBatch
from targets.haste_rec.embeddings import embedding_rows, row_ops
from targets.haste_rec.embeddings.embedding_config import CPU, EmbeddingConfig, check_backend
from targets.haste_rec.embeddings.embedding_rows import CachedRows, DeviceRows, HostRows, Rows
from targets.haste_rec.embeddings.row_ops import TableLayout, coalesce_rows, unique_ids
from targets.protocol import ConfigError


class _RowGradLookup(torch.autograd.Function):
    """Pooled lookup whose backward hands the lookup record and d(pooled) to a sink, which forms the
    per-row gradients (or, fused, applies them at once).

    The rows are not an autograd input (they may sit on the host or in a cache); `anchor`, an
    empty tensor that requires grad, puts the lookup into the graph so that backward runs.
    """

    @staticmethod
    def forward(ctx, anchor, rows: Rows, ids, offsets, weights, sink: Callable, key) -> torch.Tensor:
        pooled, ctx.lookup = rows.lookup(ids, offsets, weights, record=True, key=key)
        ctx.rows, ctx.sink = rows, sink
        return pooled

    @staticmethod
    def backward(ctx, grad_pooled):
        ctx.sink(ctx.lookup, grad_pooled)
        return None, None, None, None, None, None, None


# -- the HBM budget ------------------------------------------------------------------------------
def placement_bytes(placement: str, dim: int, table_rows: Sequence[int], cache_rows: Sequence[int],
                    state_cache_rows: Sequence[int]) -> int:
    """Device memory a placement needs for rows and Adagrad state (fp32; state one value per row)."""
    if placement == "device":
        return sum(table_rows) * (4 * dim + 4)
    if placement == "cached":
        return sum(cache_rows) * 4 * dim + sum(state_cache_rows) * 4
    return 0


def least_device_bytes(cfg: EmbeddingConfig, table_rows: Sequence[int], dim: int) -> int:
    """The least device memory `cfg`'s placement can need over tables of `table_rows`, before the data is read:
    every cache plan gives each table at least its uniform share (a floor of one row, where the build's floor is a
    batch's distinct ids, only raises it; ``cache_plan``), so a config over the budget here is over it built."""
    if cfg.placement != "cached":
        return placement_bytes(cfg.placement, dim, table_rows, (), ())
    ones = [1] * len(table_rows)
    return placement_bytes("cached", dim, table_rows, plan_uniform(table_rows, cfg.cache_fraction, ones),
                           plan_uniform(table_rows, cfg.opt_state_cache_fraction, ones))


def check_budget(cfg: EmbeddingConfig, needed: int, at_least: bool = False) -> None:
    """ConfigError when `needed` bytes of device memory (`at_least`: at the least) are over the HBM budget."""
    budget = cfg.hbm_budget_bytes
    if budget is not None and needed > budget:
        raise ConfigError(f"embedding placement {cfg.placement} needs {'at least ' if at_least else ''}"
                          f"{needed / 1e9:.3g} GB of device memory, over the {budget / 1e9:.3g} GB embedding HBM "
                          f"budget: use placement host, or cached with a smaller embedding_cache_fraction")


# -- the store ----------------------------------------------------------------------------------
class EmbeddingStore(nn.Module):
    """T sum-pooled tables of one width, stored and updated as `cfg` says; forward gives [B, T*dim].

    The store owns its tables and their row-wise Adagrad update: nothing is registered as a module
    parameter, so a trainer's optimizer over `model.parameters()` never sees a table. Gradients
    persist from backward to `zero_grad` (the fused mode has applied them already), so
    `grad_sq_norm` can be read before or after `optimizer_step`.
    """

    def __init__(self, table_rows: Sequence[int], dim: int, cfg: EmbeddingConfig, device: torch.device, seed: int,
                 access_counts: list[torch.Tensor] | None = None,
                 max_unique_per_batch: Sequence[int] | None = None):
        super().__init__()
        self.layout = TableLayout(tuple(int(r) for r in table_rows))
        self.dim, self.cfg, self.device = dim, cfg, torch.device(device)
        check_backend(cfg.backend, self.device)
        self.cache_rows, self.state_cache_rows = self._plan(access_counts, max_unique_per_batch)
        self._check_budget()
        store = self.device if cfg.placement == "device" else CPU
        self._rows = self._build(self.layout.initial_rows(dim, cfg.init_std, seed, self.device, store))
        self._anchor = torch.zeros(0, device=self.device, requires_grad=True)
        self._pending: tuple[torch.Tensor, torch.Tensor] | None = None
        self._fused_sq: list[torch.Tensor] = []
        self._upcoming: Batch | PackedBatch | None = None  # the next training batch, to prefetch (cache_prefetch)
        self.warm_batches = 0  # batches replayed into the caches before training (warm_caches)

    def _plan(self, access_counts: list[torch.Tensor] | None,
              max_unique_per_batch: Sequence[int] | None) -> tuple[list[int], list[int]]:
        """Rows per table of the parameter and the optimizer-state caches (none unless placement is cached)."""
        cfg, table_rows = self.cfg, self.layout.table_rows
        if cfg.placement != "cached":
            return [0] * len(table_rows), [0] * len(table_rows)
        floors = list(max_unique_per_batch) if max_unique_per_batch is not None else [1] * len(table_rows)
        if cfg.cache_prefetch:  # a prefetch holds the batch before beside its own: two batches' rows at most
            floors = [min(2 * floor, rows) for floor, rows in zip(floors, table_rows)]
        params, states = (plan_capacities(cfg.cache_plan, table_rows, fraction, floors, access_counts)
                          for fraction in (cfg.cache_fraction, cfg.opt_state_cache_fraction))
        return params, states

    def device_bytes(self) -> int:
        """Device memory the placement needs for rows and Adagrad state (fp32; state one value per row)."""
        return placement_bytes(self.cfg.placement, self.dim, self.layout.table_rows, self.cache_rows,
                               self.state_cache_rows)

    def _check_budget(self) -> None:
        """ConfigError, before any table is built, when the placement does not fit the HBM budget."""
        check_budget(self.cfg, self.device_bytes())

    def _build(self, init: torch.Tensor) -> Rows:
        if self.cfg.placement == "device":
            return DeviceRows(init, self.device, self.cfg)
        if self.cfg.placement == "host":
            return HostRows(init, self.device, self.cfg)
        return CachedRows(init, self.device, self.cfg, self.layout, self.cache_rows, self.state_cache_rows)

    # -- forward / backward ---------------------------------------------------------------------
    def forward(self, batch: Batch | PackedBatch) -> torch.Tensor:
        ids, offsets, weights = self.layout.flatten(batch, self._rows.index_device)
        if self.cfg.autograd_tables:
            pooled = self._rows.autograd_pool(ids, offsets, weights)
        elif not torch.is_grad_enabled():  # evaluation and probes: no gradient, not counted as cache traffic
            pooled = self._rows.lookup(ids, offsets, weights, record=False)[0]
        else:
            pooled = _RowGradLookup.apply(self._anchor, self._rows, ids, offsets, weights, self._on_row_grads, batch)
            self._prefetch_upcoming()
        tables, bags = len(self.layout.table_rows), batch.batch_size
        return pooled.view(tables, bags, self.dim).transpose(0, 1).reshape(bags, tables * self.dim)

    @property
    def prefetches(self) -> bool:
        """Whether the store wants each next training batch ahead (``prefetch_next``)."""
        return self.cfg.prefetches

    def prefetch_next(self, batch: Batch | PackedBatch) -> None:
        """The batch the next training step takes: its lookup is prepared on the prefetch thread
        (``cache_prefetch``) as soon as the current step's lookup is done."""
        self._upcoming = batch

    def _prefetch_upcoming(self) -> None:
        if self._upcoming is not None and self.prefetches:
            batch, self._upcoming = self._upcoming, None
            self._rows.prefetch(batch, *self.layout.flatten(batch, self._rows.index_device))

    def _on_row_grads(self, lookup, grad_pooled: torch.Tensor) -> None:
        """Backward's gradient: applied at once (fused) or kept as per-row gradients for optimizer_step (sparse)."""
        if self.cfg.grad_mode == "fused":
            self._fused_sq.append(self._rows.fused_update(lookup, grad_pooled))
            return
        rows, grads = lookup.rows, self._rows.row_grads(lookup, grad_pooled)
        if self._pending is None:
            self._pending = (rows, grads)
        else:  # several backwards before one step: merge, each row's gradients added once
            old_rows, old_grads = self._pending
            self._pending = coalesce_rows(torch.cat([old_rows, rows]), torch.cat([old_grads, grads]))

    def _gradient(self) -> tuple[torch.Tensor | None, torch.Tensor] | None:
        """(rows, or None for every row; their gradient) since zero_grad, or None if there is none."""
        return self._rows.autograd_grads() if self.cfg.autograd_tables else self._pending

    # -- optimizer ------------------------------------------------------------------------------
    def optimizer_step(self) -> None:
        """Row-wise Adagrad with the pending gradient (dense, sparse); fused has applied it in backward."""
        gradient = self._gradient()
        if gradient is not None:
            self._rows.update(*gradient)

    def zero_grad(self) -> None:
        if isinstance(self._rows, DeviceRows):
            self._rows.weight.grad = None
        self._pending = None
        self._fused_sq = []

    def dense_parameters(self) -> list[nn.Parameter]:
        """The tables (one shared-row-space parameter) when grad_mode is dense; the store updates them."""
        return [self._rows.weight] if self.cfg.grad_mode == "dense" else []

    def grad_sq_norm(self) -> float:
        """Squared norm of the embedding gradient since the last zero_grad."""
        if self.cfg.grad_mode == "fused":
            return sum(float(sq) for sq in self._fused_sq)
        gradient = self._gradient()
        return 0.0 if gradient is None else float(gradient[1].pow(2).sum())

    def warm_caches(self, batches: Iterable[Batch],
                    remembered: Callable[[tuple, Callable[[], dict]], dict] | None = None) -> None:
        """Placement cached: fast-forward the device caches to the state training keeps them in, full, by
        replaying the rows of `batches` (``CachedRows.warm``; lazily drawn, as many as filling takes). A step
        on filling caches loads rows but writes none back: timed then, the cache looks cheaper than it is in
        training (see model.CACHE_WARM_BATCHES). `remembered(key, replay)`, given, may answer with what an
        earlier replay of the same batches decided for caches of the same shape (``key`` says which)."""
        if not isinstance(self._rows, CachedRows):
            return
        rows = (unique_ids(self.layout.flatten(batch, CPU)[0])[0] for batch in batches)
        key = (tuple(self.cache_rows), tuple(self.state_cache_rows), self.cfg.eviction,
               build_cache.source_digest((table_caches, embedding_rows, row_ops)))
        self.warm_batches = self._rows.warm(rows, None if remembered is None else functools.partial(remembered, key))

    # -- inspection -----------------------------------------------------------------------------
    def counters(self) -> dict[str, float]:
        """hits, misses, miss_rate (parameter cache), bytes_h2d/d2h (all traffic), the same per cache
        with a param_/state_ prefix, host lookup traffic (lookup_), and cache rows in total and per table."""
        out = {key: float(value) for key, value in self._rows.counters().items()}
        for cache in ("param", "state"):
            lookups = out[f"{cache}_hits"] + out[f"{cache}_misses"]
            out[f"{cache}_miss_rate"] = out[f"{cache}_misses"] / lookups if lookups else 0.0
        out.update({key: out[f"param_{key}"] for key in ("hits", "misses", "miss_rate")})
        out.update({f"bytes_{way}": sum(out[f"{src}_bytes_{way}"] for src in ("param", "state", "lookup"))
                    for way in ("h2d", "d2h")})
        if self.prefetches:
            out["cache_prefetched"] = float(self._rows.prefetcher.taken)
        out.update({"cache_rows": float(sum(self.cache_rows)), "state_cache_rows": float(sum(self.state_cache_rows)),
                    "cache_warm_batches": float(self.warm_batches)})
        out.update({f"cache_rows_t{t}": float(rows) for t, rows in enumerate(self.cache_rows)})
        return out

    def full_tables(self) -> list[torch.Tensor]:
        """CPU copies of every table's current weights (caches flushed first)."""
        return self.layout.split(self._rows.snapshot()[0])

    def current_tables(self) -> list[torch.Tensor]:
        """Every table's current weights, wherever they live, without copying whole tables (for digests)."""
        return self.layout.split(self._rows.current_weights())

    def full_optimizer_states(self) -> list[torch.Tensor]:
        """CPU copies of every table's row-wise Adagrad state [rows, 1] (caches flushed first)."""
        return self.layout.split(self._rows.snapshot()[1])
