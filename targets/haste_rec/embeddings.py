"""Sum-pooled embedding tables trained with row-wise Adagrad, with every SparseGear choice a knob.

Where the rows live (`placement`: device, host, or a device cache over host tables with the
optimizer state cached independently) and how the gradient is formed (`grad_mode`: a dense
table-sized autograd gradient, per-row sparse gradients applied in `optimizer_step`, or a fused
backward that applies the update in place) are the knobs a sparse-model team tunes first. The
optimizer math is one function, `rowwise_adagrad`, used by every mode, so modes differ only in data
movement and summation order, never in the update rule, and their trajectories can be compared
bit for bit or to a tight tolerance.

All tables share one row space (table t's rows follow table t-1's), as in FBGEMM's table-batched
embeddings: a step pools, forms row gradients and updates with one operation each, whatever the
number of tables, instead of paying kernel-launch overhead per table.

Row-wise Adagrad (FBGEMM/DLRM): state[r] += mean(g_r ** 2); w_r -= lr * g_r / (sqrt(state[r]) + eps).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from targets.haste_rec.batch import Batch
from targets.haste_rec.cache_plan import PLANS, plan_capacities
from targets.haste_rec.row_cache import EVICTIONS, TableCaches, gather_to_device, should_pin, to_device
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


# -- the math every mode shares -------------------------------------------------------------------
def rowwise_adagrad(weights: torch.Tensor, state: torch.Tensor, grads: torch.Tensor, lr: float,
                    eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """New (weights [n, dim], state [n, 1]) after one row-wise Adagrad step with `grads` [n, dim]."""
    state = state + grads.pow(2).mean(dim=1, keepdim=True)
    return weights - lr * grads / (state.sqrt() + eps), state


def apply_rowwise_adagrad_(weight: torch.Tensor, w_index: torch.Tensor | None, state: torch.Tensor,
                           s_index: torch.Tensor | None, grads: torch.Tensor, lr: float, eps: float) -> None:
    """Row-wise Adagrad in place on weight[w_index] and state[s_index] (both None: every row)."""
    if w_index is None or s_index is None:
        weight[...], state[...] = rowwise_adagrad(weight, state, grads, lr, eps)
        return
    new_w, new_s = rowwise_adagrad(weight.index_select(0, w_index), state.index_select(0, s_index), grads, lr, eps)
    weight.index_copy_(0, w_index, new_w)
    state.index_copy_(0, s_index, new_s)


def segment_sum(values: torch.Tensor, segment: torch.Tensor, num_segments: int) -> torch.Tensor:
    """out[s] = sum of values[i] with segment[i] == s, added once each in the order of i.

    A stable sort groups each segment's contributions, then one sequential reduction per segment
    sums them: deterministic on every device (no atomics). Every segment must be non-empty.
    """
    order = torch.argsort(segment, stable=True)
    counts = torch.bincount(segment, minlength=num_segments)
    return torch.segment_reduce(values.index_select(0, order), "sum", lengths=counts, axis=0)


def unique_ids(ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted distinct ids, position -> index into them)."""
    return torch.unique(ids, sorted=True, return_inverse=True)


def coalesce_rows(rows: torch.Tensor, grads: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(distinct rows, summed gradient of each) from per-occurrence rows and gradients."""
    unique, inverse = unique_ids(rows)
    return unique, segment_sum(grads, inverse.to(grads.device), unique.numel())


@dataclass
class Lookup:
    """One batch's lookup as backward needs it; all but `rows` sit where pooling and row gradients happen."""

    rows: torch.Tensor            # distinct rows of the batch, sorted
    inverse: torch.Tensor         # position -> index into rows
    offsets: torch.Tensor         # bag starts
    bag_of: torch.Tensor          # position -> bag
    weights: torch.Tensor | None  # per-sample weights, or None


def make_lookup(ids: torch.Tensor, offsets: torch.Tensor, weights: torch.Tensor | None, device: torch.device) -> Lookup:
    rows, inverse = unique_ids(ids)
    inverse, offsets = inverse.to(device), offsets.to(device)
    lengths = torch.diff(offsets, append=offsets.new_tensor([inverse.numel()]))
    bag_of = torch.repeat_interleave(torch.arange(offsets.numel(), device=device), lengths,
                                     output_size=inverse.numel())
    return Lookup(rows, inverse, offsets, bag_of, None if weights is None else weights.to(device))


def row_gradients(grad_pooled: torch.Tensor, lookup: Lookup) -> torch.Tensor:
    """[len(rows), dim]: each row's gradient, its contributions segment-summed once."""
    contrib = grad_pooled.index_select(0, lookup.bag_of)
    if lookup.weights is not None:
        contrib = contrib * lookup.weights.unsqueeze(1)
    return segment_sum(contrib, lookup.inverse, lookup.rows.numel())


def pool(ids: torch.Tensor, rows: torch.Tensor, offsets: torch.Tensor, weights: torch.Tensor | None,
         sparse: bool = False) -> torch.Tensor:
    return F.embedding_bag(ids, rows, offsets, mode="sum", per_sample_weights=weights, sparse=sparse)


# -- one row space for all tables ------------------------------------------------------------------
@dataclass(frozen=True)
class TableLayout:
    """Table t holds rows [starts[t], starts[t] + table_rows[t]) of the shared row space."""

    table_rows: tuple[int, ...]

    @property
    def starts(self) -> list[int]:
        return [sum(self.table_rows[:t]) for t in range(len(self.table_rows))]

    def initial_rows(self, dim: int, std: float, seed: int) -> torch.Tensor:
        """N(0, std) rows; table t drawn on the CPU from (seed, t), so every placement starts identical."""
        out = torch.empty(sum(self.table_rows), dim)
        for t, table in enumerate(self.split(out)):
            torch.randn(table.shape, generator=torch.Generator().manual_seed((seed * 1_000_003 + t) % 2**63),
                        out=table)
        return out.mul_(std)

    def split(self, rows: torch.Tensor) -> list[torch.Tensor]:
        return list(torch.split(rows, self.table_rows))

    def flatten(self, batch: Batch, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(shared-space ids, offsets of all T*B bags table-major, weights or None) on `device`."""
        nnz = [ids.numel() for ids in batch.ids]
        ids = torch.cat([ids.to(device) + start for ids, start in zip(batch.ids, self.starts)])
        offsets = torch.cat([off.to(device) + sum(nnz[:t]) for t, off in enumerate(batch.offsets)])
        if all(w is None for w in batch.weights):
            return ids, offsets, None
        weights = torch.cat([torch.ones(i.numel(), device=device) if w is None else w.to(device)
                             for i, w in zip(batch.ids, batch.weights)])  # x * 1.0 is exact
        return ids, offsets, weights


# -- where the rows and their Adagrad state live ----------------------------------------------------
COUNTERS = tuple(f"{cache}_{what}" for cache in ("param", "state") for what in ("hits", "misses", "bytes_h2d",
                 "bytes_d2h")) + ("lookup_bytes_h2d", "lookup_bytes_d2h")


class _Rows(ABC):
    """All tables' rows: lookup without autograd, row-wise update, snapshot, traffic counters."""

    index_device: torch.device  # where lookups want the batch's ids

    def __init__(self, device: torch.device, cfg: EmbeddingConfig):
        self.device, self.cfg = device, cfg
        self.pinned = should_pin(cfg.pin_memory, device)
        self.bytes_h2d = 0  # host-table lookup traffic (pooled vectors, rows, gradients), counted as
        self.bytes_d2h = 0  # what crosses to an accelerator, also when the compute device is the CPU

    @abstractmethod
    def lookup(self, ids: torch.Tensor, offsets: torch.Tensor, weights: torch.Tensor | None,
               record: bool) -> tuple[torch.Tensor, Lookup]: ...

    @abstractmethod
    def update(self, rows: torch.Tensor | None, grads: torch.Tensor) -> None: ...

    @abstractmethod
    def snapshot(self) -> tuple[torch.Tensor, torch.Tensor]:
        """CPU copies of (weights [rows, dim], Adagrad state [rows, 1])."""

    def row_grads(self, lookup: Lookup, grad_pooled: torch.Tensor) -> torch.Tensor:
        return row_gradients(grad_pooled.to(lookup.inverse.device), lookup)

    def counters(self) -> dict[str, float]:
        return dict.fromkeys(COUNTERS, 0.0) | {"lookup_bytes_h2d": self.bytes_h2d, "lookup_bytes_d2h": self.bytes_d2h}


def _host_buffers(init: torch.Tensor, pinned: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return (init.pin_memory() if pinned else init), torch.zeros(init.shape[0], 1, pin_memory=pinned)


class _DeviceRows(_Rows):
    """Weights and state on the compute device; an autograd leaf for the dense and sparse modes."""

    def __init__(self, init: torch.Tensor, device: torch.device, cfg: EmbeddingConfig):
        super().__init__(device, cfg)
        self.index_device = device
        self.weight = nn.Parameter(init.to(device), requires_grad=cfg.grad_mode != "fused")
        self.state = torch.zeros(init.shape[0], 1, device=device)

    def autograd_pool(self, ids: torch.Tensor, offsets: torch.Tensor, weights: torch.Tensor | None) -> torch.Tensor:
        return pool(ids, self.weight, offsets, weights, sparse=self.cfg.grad_mode == "sparse")

    def autograd_grads(self) -> tuple[torch.Tensor | None, torch.Tensor] | None:
        """(rows or None for all, per-row gradient) from the leaf's dense or sparse .grad."""
        g = self.weight.grad
        if g is None or not g.is_sparse:
            return None if g is None else (None, g)
        # _indices/_values read the uncoalesced gradient: coalesce_rows sums it in position order
        return coalesce_rows(g._indices()[0], g._values())

    def lookup(self, ids, offsets, weights, record):
        lookup = make_lookup(ids, offsets, weights, self.device)
        return pool(ids, self.weight, lookup.offsets, lookup.weights), lookup

    @torch.no_grad()
    def update(self, rows, grads):
        apply_rowwise_adagrad_(self.weight, rows, self.state, rows, grads, self.cfg.lr, self.cfg.eps)

    def snapshot(self):
        return self.weight.detach().cpu().clone(), self.state.cpu().clone()


class _HostRows(_Rows):
    """Weights and state in host memory; lookups and updates on the host."""

    index_device = CPU

    def __init__(self, init: torch.Tensor, device: torch.device, cfg: EmbeddingConfig):
        super().__init__(device, cfg)
        self.weight, self.state = _host_buffers(init, self.pinned)

    def lookup(self, ids, offsets, weights, record):
        if self.cfg.pool_on_host:  # only [bags, dim] crosses; backward brings d(pooled) back to the host
            pooled = pool(ids, self.weight, offsets, weights)
            self.bytes_h2d += pooled.numel() * pooled.element_size()
            return to_device(pooled, self.device, self.pinned), make_lookup(ids, offsets, weights, CPU)
        lookup = make_lookup(ids, offsets, weights, self.device)
        gathered = gather_to_device(self.weight, lookup.rows, self.device, self.pinned)  # each distinct row once
        self.bytes_h2d += gathered.numel() * gathered.element_size()
        return pool(lookup.inverse, gathered, lookup.offsets, lookup.weights), lookup

    def row_grads(self, lookup, grad_pooled):
        if self.cfg.pool_on_host:  # the pooled vectors' gradient goes down; rows are summed on the host
            self.bytes_d2h += grad_pooled.numel() * grad_pooled.element_size()
        return super().row_grads(lookup, grad_pooled)

    def update(self, rows, grads):
        if not self.cfg.pool_on_host:  # row gradients were formed on the device: they come down
            self.bytes_d2h += grads.numel() * grads.element_size()
        apply_rowwise_adagrad_(self.weight, rows, self.state, rows, grads.cpu(), self.cfg.lr, self.cfg.eps)

    def snapshot(self):
        return self.weight.clone(), self.state.clone()


class _CachedRows(_Rows):
    """Host weights and state, each behind its own per-table device caches with their own budgets."""

    index_device = CPU  # the id -> slot maps live on the host

    def __init__(self, init: torch.Tensor, device: torch.device, cfg: EmbeddingConfig, layout: TableLayout,
                 capacities: Sequence[int], state_capacities: Sequence[int]):
        super().__init__(device, cfg)
        weight, state = _host_buffers(init, self.pinned)
        self.params, self.states = (TableCaches(host, layout.table_rows, caps, cfg.eviction, device, cfg.pin_memory,
                                                name) for host, caps, name in
                                    ((weight, capacities, "row cache"), (state, state_capacities, "state cache")))
        self.chunk = [min(a, b) for a, b in zip(capacities, state_capacities)]

    def lookup(self, ids, offsets, weights, record):
        lookup = make_lookup(ids, offsets, weights, self.device)
        slots = self.params.prepare(lookup.rows, record)
        return pool(slots[lookup.inverse], self.params.device_rows, lookup.offsets, lookup.weights), lookup

    def update(self, rows, grads):
        rows, grads = rows.cpu(), grads.to(self.device)
        for part in self._rounds(rows):
            param_slots = self.params.prepare(rows[part], record=False)  # resident since the lookup
            state_slots = self.states.prepare(rows[part], record=True)
            apply_rowwise_adagrad_(self.params.device_rows, param_slots, self.states.device_rows, state_slots,
                                   grads[part.to(self.device)], self.cfg.lr, self.cfg.eps)

    def _rounds(self, rows: torch.Tensor) -> Iterator[torch.Tensor]:
        """Positions of `rows` in rounds that fit every table's caches: one round unless several
        backwards were accumulated; rows are distinct, so splitting changes no arithmetic."""
        bounds = self.params.bounds(rows)
        rounds = max(math.ceil((hi - lo) / chunk) for (lo, hi), chunk in zip(bounds, self.chunk))
        for r in range(rounds):
            yield torch.cat([torch.arange(min(hi, lo + r * chunk), min(hi, lo + (r + 1) * chunk))
                             for (lo, hi), chunk in zip(bounds, self.chunk)])

    def snapshot(self):
        self.params.flush()
        self.states.flush()
        return self.params.host_rows.clone(), self.states.host_rows.clone()

    def counters(self):
        return super().counters() | {f"{name}_{key}": value for name, caches in (("param", self.params),
                                     ("state", self.states)) for key, value in caches.counters().items()}


class _RowGradLookup(torch.autograd.Function):
    """Pooled lookup whose backward forms per-unique-row gradients and hands them to a sink.

    The rows are not an autograd input (they may sit on the host or in a cache); `anchor`, an
    empty tensor that requires grad, puts the lookup into the graph so that backward runs.
    """

    @staticmethod
    def forward(ctx, anchor, rows: _Rows, ids, offsets, weights, sink: Callable) -> torch.Tensor:
        pooled, ctx.lookup = rows.lookup(ids, offsets, weights, record=True)
        ctx.rows, ctx.sink = rows, sink
        return pooled

    @staticmethod
    def backward(ctx, grad_pooled):
        ctx.sink(ctx.lookup.rows, ctx.rows.row_grads(ctx.lookup, grad_pooled))
        return None, None, None, None, None, None


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
        self.cache_rows, self.state_cache_rows = self._plan(access_counts, max_unique_per_batch)
        self._rows = self._build(self.layout.initial_rows(dim, cfg.init_std, seed))
        self._anchor = torch.zeros(0, device=self.device, requires_grad=True)
        self._pending: tuple[torch.Tensor, torch.Tensor] | None = None
        self._fused_sq: list[torch.Tensor] = []

    def _plan(self, access_counts: list[torch.Tensor] | None,
              max_unique_per_batch: Sequence[int] | None) -> tuple[list[int], list[int]]:
        """Rows per table of the parameter and the optimizer-state caches (none unless placement is cached)."""
        cfg, table_rows = self.cfg, self.layout.table_rows
        if cfg.placement != "cached":
            return [0] * len(table_rows), [0] * len(table_rows)
        floors = list(max_unique_per_batch) if max_unique_per_batch is not None else [1] * len(table_rows)
        params, states = (plan_capacities(cfg.cache_plan, table_rows, fraction, floors, access_counts)
                          for fraction in (cfg.cache_fraction, cfg.opt_state_cache_fraction))
        return params, states

    def _build(self, init: torch.Tensor) -> _Rows:
        if self.cfg.placement == "device":
            return _DeviceRows(init, self.device, self.cfg)
        if self.cfg.placement == "host":
            return _HostRows(init, self.device, self.cfg)
        return _CachedRows(init, self.device, self.cfg, self.layout, self.cache_rows, self.state_cache_rows)

    @property
    def _autograd_tables(self) -> bool:
        """dense, and sparse on the device: torch autograd forms the table gradient."""
        return self.cfg.grad_mode == "dense" or (self.cfg.grad_mode == "sparse" and self.cfg.placement == "device")

    # -- forward / backward ---------------------------------------------------------------------
    def forward(self, batch: Batch) -> torch.Tensor:
        ids, offsets, weights = self.layout.flatten(batch, self._rows.index_device)
        if self._autograd_tables:
            pooled = self._rows.autograd_pool(ids, offsets, weights)
        elif not torch.is_grad_enabled():  # evaluation and probes: no gradient, not counted as cache traffic
            pooled = self._rows.lookup(ids, offsets, weights, record=False)[0]
        else:
            pooled = _RowGradLookup.apply(self._anchor, self._rows, ids, offsets, weights, self._on_row_grads)
        tables, bags = len(self.layout.table_rows), batch.offsets[0].numel()
        return pooled.view(tables, bags, self.dim).transpose(0, 1).reshape(bags, tables * self.dim)

    def _on_row_grads(self, rows: torch.Tensor, grads: torch.Tensor) -> None:
        """Backward's per-row gradients: applied at once (fused) or kept for optimizer_step (sparse)."""
        if self.cfg.grad_mode == "fused":
            self._fused_sq.append(grads.pow(2).sum())
            self._rows.update(rows, grads)
        elif self._pending is None:
            self._pending = (rows, grads)
        else:  # several backwards before one step: merge, each row's gradients added once
            old_rows, old_grads = self._pending
            self._pending = coalesce_rows(torch.cat([old_rows, rows]), torch.cat([old_grads, grads]))

    def _gradient(self) -> tuple[torch.Tensor | None, torch.Tensor] | None:
        """(rows, or None for every row; their gradient) since zero_grad, or None if there is none."""
        return self._rows.autograd_grads() if self._autograd_tables else self._pending

    # -- optimizer ------------------------------------------------------------------------------
    def optimizer_step(self) -> None:
        """Row-wise Adagrad with the pending gradient (dense, sparse); fused has applied it in backward."""
        gradient = self._gradient()
        if gradient is not None:
            self._rows.update(*gradient)

    def zero_grad(self) -> None:
        if isinstance(self._rows, _DeviceRows):
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
        out.update({"cache_rows": float(sum(self.cache_rows)), "state_cache_rows": float(sum(self.state_cache_rows))})
        out.update({f"cache_rows_t{t}": float(rows) for t, rows in enumerate(self.cache_rows)})
        return out

    def full_tables(self) -> list[torch.Tensor]:
        """CPU copies of every table's current weights (caches flushed first)."""
        return self.layout.split(self._rows.snapshot()[0])

    def full_optimizer_states(self) -> list[torch.Tensor]:
        """CPU copies of every table's row-wise Adagrad state [rows, 1] (caches flushed first)."""
        return self.layout.split(self._rows.snapshot()[1])
