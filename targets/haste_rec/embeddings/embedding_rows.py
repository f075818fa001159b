"""Where the embedding rows and their Adagrad state live: on the device, on the host, or in a
device cache over host tables with parameters and optimizer state cached independently.

The backend (EmbeddingConfig.backend) picks what runs on the device: torch's ops (``row_ops``) or
the Triton kernels (``triton_embedding``). With triton, every pooling of device-resident rows runs
the Triton kernel (device tables, the cache's slots, host rows gathered to the device), and grad
mode fused updates device tables and cached rows with the Triton fused update, both launched with
the meta-parameters of EmbeddingConfig's triton_* fields (``_kernel_config``); the host's parts
(pooling on the host, host-side Adagrad, cache bookkeeping) and sparse mode's row gradients stay
torch. Grad mode dense stays torch throughout: its table gradient is torch autograd's.
"""

from __future__ import annotations

import functools
import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator, Sequence

import torch
from torch import nn

from targets.haste_rec.cache.cache_prefetch import PrefetchThread
from targets.haste_rec.cache.row_cache import gather_to_device, should_pin, to_device, to_host
from targets.haste_rec.cache.shared_slot_rows import SharedSlotRows
from targets.haste_rec.cache.table_caches import TableCaches, replay_until_full
from targets.haste_rec.embeddings.embedding_config import CPU, EmbeddingConfig
from targets.haste_rec.embeddings.row_ops import (Lookup, TableLayout, apply_rowwise_adagrad_, coalesce_rows,
                                                  make_lookup, pool, row_gradients)

# -- where the rows and their Adagrad state live ----------------------------------------------------
COUNTERS = tuple(f"{cache}_{what}" for cache in ("param", "state") for what in ("hits", "misses", "bytes_h2d",
                 "bytes_d2h")) + ("lookup_bytes_h2d", "lookup_bytes_d2h")


@dataclass
class _Bags:
    """A lookup as the Triton fused update needs it: the batch itself (the kernel sorts the ids)."""

    ids: torch.Tensor
    offsets: torch.Tensor
    weights: torch.Tensor | None


def _kernel_config(cfg: EmbeddingConfig):
    """The Triton kernels' meta-parameters (``triton_embedding.EmbeddingKernelConfig``) from cfg's triton_* fields.

    triton_embedding is imported only when asked for: triton reads TRITON_INTERPRET at import."""
    from targets.haste_rec.embeddings.triton_embedding import EmbeddingKernelConfig
    return EmbeddingKernelConfig(**cfg.triton_kernel_options)


def _pooling(cfg: EmbeddingConfig) -> Callable:
    """pool(ids, rows, offsets, weights) on the device: row_ops.pool or the Triton kernel."""
    if not cfg.triton_pooling:
        return pool
    from targets.haste_rec.embeddings.triton_embedding import embedding_pool_forward
    config = _kernel_config(cfg)
    return lambda ids, rows, offsets, weights: embedding_pool_forward(ids, offsets, weights, rows, config=config)


def _fused_kernel(cfg: EmbeddingConfig) -> Callable | None:
    """The Triton in-place fused update (backend triton, grad mode fused, rows updated on the device), else None."""
    if cfg.backend != "triton" or cfg.grad_mode != "fused" or cfg.placement == "host":
        return None
    from targets.haste_rec.embeddings.triton_embedding import embedding_fused_update_
    return functools.partial(embedding_fused_update_, config=_kernel_config(cfg))


class Rows(ABC):
    """All tables' rows: lookup without autograd, row-wise update, snapshot, traffic counters."""

    index_device: torch.device  # where lookups want the batch's ids

    def __init__(self, device: torch.device, cfg: EmbeddingConfig):
        self.device, self.cfg = device, cfg
        self.pinned = should_pin(cfg.pin_memory, device)
        self.pool = _pooling(cfg)
        self.fused_kernel = _fused_kernel(cfg)
        self.bytes_h2d = 0  # host-table lookup traffic (pooled vectors, rows, gradients), counted as
        self.bytes_d2h = 0  # what crosses to an accelerator, also when the compute device is the CPU

    @abstractmethod
    def lookup(self, ids: torch.Tensor, offsets: torch.Tensor, weights: torch.Tensor | None,
               record: bool, key=None) -> tuple[torch.Tensor, Lookup | _Bags]:
        """(pooled [T*B, dim], the lookup backward needs); `key` names the batch (``CachedRows``' prefetch)."""

    @abstractmethod
    def update(self, rows: torch.Tensor | None, grads: torch.Tensor) -> None: ...

    @abstractmethod
    def snapshot(self) -> tuple[torch.Tensor, torch.Tensor]:
        """CPU copies of (weights [rows, dim], Adagrad state [rows, 1])."""

    def current_weights(self) -> torch.Tensor:
        """The current weights [rows, dim] without a copy where they live whole (to read, never to write)."""
        return self.snapshot()[0]

    def row_grads(self, lookup: Lookup, grad_pooled: torch.Tensor) -> torch.Tensor:
        return row_gradients(grad_pooled.to(lookup.inverse.device), lookup)

    def fused_update(self, lookup: Lookup, grad_pooled: torch.Tensor) -> torch.Tensor:
        """Backward's gradient applied at once (grad mode fused); returns its squared norm (a 0-dim tensor)."""
        grads = self.row_grads(lookup, grad_pooled)
        sq = grads.pow(2).sum()
        self.update(lookup.rows, grads)
        return sq

    def counters(self) -> dict[str, float]:
        return dict.fromkeys(COUNTERS, 0.0) | {"lookup_bytes_h2d": self.bytes_h2d, "lookup_bytes_d2h": self.bytes_d2h}


def _host_buffers(init: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Host weights and state. Pageable even under pin_memory: every transfer of their rows goes through a
    pinned staging buffer (``row_cache.gather_to_device``, ``to_host``), so page-locking whole tables (13.3 GB
    at size large-cached, copied at every build) would buy nothing."""
    return init, torch.zeros(init.shape[0], 1)


class DeviceRows(Rows):
    """Weights and state on the compute device; an autograd leaf for the dense and sparse modes."""

    def __init__(self, init: torch.Tensor, device: torch.device, cfg: EmbeddingConfig):
        super().__init__(device, cfg)
        self.index_device = device
        self.weight = nn.Parameter(init.to(device), requires_grad=cfg.autograd_tables)
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

    def lookup(self, ids, offsets, weights, record, key=None):
        if self.fused_kernel is not None:  # it sorts the ids itself: no unique here
            return self.pool(ids, self.weight, offsets, weights), _Bags(ids, offsets, weights)
        lookup = make_lookup(ids, offsets, weights, self.device)
        return self.pool(ids, self.weight, lookup.offsets, lookup.weights), lookup

    @torch.no_grad()
    def update(self, rows, grads):
        apply_rowwise_adagrad_(self.weight, rows, self.state, rows, grads, self.cfg.lr, self.cfg.eps)

    def fused_update(self, lookup, grad_pooled):
        if self.fused_kernel is None:
            return super().fused_update(lookup, grad_pooled)
        return self.fused_kernel(lookup.ids, lookup.offsets, lookup.weights, grad_pooled, self.weight.detach(),
                                 self.state, self.cfg.lr, self.cfg.eps).sum()

    def snapshot(self):
        return self.weight.detach().cpu().clone(), self.state.cpu().clone()

    def current_weights(self):
        return self.weight.detach()


class HostRows(Rows):
    """Weights and state in host memory; lookups and updates on the host."""

    index_device = CPU

    def __init__(self, init: torch.Tensor, device: torch.device, cfg: EmbeddingConfig):
        super().__init__(device, cfg)
        self.weight, self.state = _host_buffers(init)

    def lookup(self, ids, offsets, weights, record, key=None):
        if self.cfg.pool_on_host:  # only [bags, dim] crosses; backward brings d(pooled) back to the host
            pooled = pool(ids, self.weight, offsets, weights)
            self.bytes_h2d += pooled.numel() * pooled.element_size()
            return to_device(pooled, self.device, self.pinned), make_lookup(ids, offsets, weights, CPU)
        lookup = make_lookup(ids, offsets, weights, self.device)
        gathered = gather_to_device(self.weight, lookup.rows, self.device, self.pinned)  # each distinct row once
        self.bytes_h2d += gathered.numel() * gathered.element_size()
        return self.pool(lookup.inverse, gathered, lookup.offsets, lookup.weights), lookup

    def row_grads(self, lookup, grad_pooled):
        if self.cfg.pool_on_host:  # the pooled vectors' gradient goes down; rows are summed on the host
            self.bytes_d2h += grad_pooled.numel() * grad_pooled.element_size()
        return super().row_grads(lookup, grad_pooled)

    def update(self, rows, grads):
        if not self.cfg.pool_on_host:  # row gradients were formed on the device: they come down
            self.bytes_d2h += grads.numel() * grads.element_size()
        apply_rowwise_adagrad_(self.weight, rows, self.state, rows, to_host(grads, self.pinned), self.cfg.lr,
                               self.cfg.eps)

    def snapshot(self):
        return self.weight.clone(), self.state.clone()

    def current_weights(self):
        return self.weight


class CachedRows(Rows):
    """Host weights and state, each behind its own per-table device caches with their own budgets; the caches'
    id -> slot maps on the host, or on the device (cache_index), where the batch's ids then go (with
    cache_overlap, the caches copy them there on their own stream)."""

    def __init__(self, init: torch.Tensor, device: torch.device, cfg: EmbeddingConfig, layout: TableLayout,
                 capacities: Sequence[int], state_capacities: Sequence[int]):
        super().__init__(device, cfg)
        self.index_device = device if cfg.ids_on_device else CPU
        metadata = device if cfg.cache_index == "device" else CPU
        weight, state = _host_buffers(init)
        self.params = TableCaches(weight, layout.table_rows, capacities, cfg.eviction, device, cfg.pin_memory,
                                  "row cache", metadata, cfg.cache_overlap)
        # Equal capacities make equal decisions: the state then rides in the weights' slots, one set of
        # bookkeeping a step instead of two (SharedSlotRows).
        self.states = (SharedSlotRows(self.params, state) if list(capacities) == list(state_capacities) else
                       TableCaches(state, layout.table_rows, state_capacities, cfg.eviction, device, cfg.pin_memory,
                                   "state cache", metadata, cfg.cache_overlap))
        self.chunk = [min(a, b) for a, b in zip(capacities, state_capacities)]
        # prefetch (``cache_prefetch``): the next training batch's lookup prepared on a thread of its own, holding the
        # rows of the last training lookup (`_last`); `_protected` is the lookup the job running or done holds.
        self.prefetcher = PrefetchThread(device) if cfg.cache_prefetch else None
        self._last: Lookup | None = None
        self._protected: Lookup | None = None
        if self.fused_kernel is not None and not isinstance(self.states, SharedSlotRows):  # the Triton update's map:
            self.state_slot_of = torch.zeros(sum(capacities), dtype=torch.int64, device=device)

    def warm(self, batches_rows: Iterable[torch.Tensor],
             remembered: Callable[[Callable[[], dict]], dict] | None = None) -> int:
        """Both caches as training leaves them once they are full, before the first step; returns the batches
        replayed. Each batch's sorted distinct rows go through the slot decisions of a step (a lookup, then the
        state's update), until every table's caches are full or the batches run out (``replay_until_full``);
        then the resident rows load at once. Values are the host's either way: only which rows sit on the
        device, and in what eviction order, is fast-forwarded. `remembered(replay)` may give the decisions an
        earlier replay saved (the build cache) instead of calling it."""
        def replay() -> dict:
            replayed = replay_until_full((self.params, self.states), batches_rows)
            return {"params": self.params.decisions(), "states": self.states.decisions(),
                    "replayed": torch.tensor(replayed)}

        decided = replay() if remembered is None else remembered(replay)
        self.params.adopt(decided["params"])
        self.states.adopt(decided["states"])
        self.params.load_resident()
        self.states.load_resident()
        return int(decided["replayed"])

    def settle(self) -> None:
        """The caches' metadata to this thread: the prefetch job, if any, finished (its lookup kept for the step that
        takes it, which prepares it again if a prepare since has moved its rows)."""
        if self.prefetcher is not None:
            self.prefetcher.wait()

    def prefetch(self, key, ids, offsets, weights) -> None:
        """Start preparing the lookup of the next training batch (`key` names it) on the prefetch thread, holding
        the rows of the last training lookup, whose update is still to come."""
        self._protected = held = self._last
        self.prefetcher.submit(key, self._prepared, ids, offsets, weights, True, None if held is None else held.slots)

    def _prepared(self, ids, offsets, weights, record, held=None) -> Lookup:
        """The batch's lookup with its rows resident and their slots (``lookup`` without the pooling)."""
        stream = self.params.stream
        with stream.deciding():  # overlap: the ids cross and are sorted on the caches' stream
            if stream.enabled:
                ids, offsets, weights = (None if t is None else to_device(t, self.device, pinned=True)
                                         for t in (ids, offsets, weights))
            lookup = make_lookup(ids, offsets, weights, self.device)
        lookup.slots = self.params.prepare(lookup.rows, record, held)
        stream.hand_over(lookup.rows, lookup.inverse, lookup.counts, lookup.offsets, lookup.bag_of, lookup.weights)
        lookup.slots_epoch = self.params.epoch
        return lookup

    def lookup(self, ids, offsets, weights, record, key=None):
        """`key`, given, names the batch: its lookup is taken from the prefetch thread if it prepared it."""
        lookup = self.prefetcher.take(key) if self.prefetcher is not None and key is not None and record else None
        if lookup is None:
            self.settle()
            self._protected = None  # a prepare that holds nothing: no earlier lookup's slots are kept
            lookup = self._prepared(ids, offsets, weights, record)
        elif lookup.slots_epoch != self.params.epoch:  # a lookup between (an evaluation) may have evicted its rows
            self._protected = None
            lookup.slots = self.params.prepare(lookup.rows, record=False)
            lookup.slots_epoch = self.params.epoch
        if record:
            self._last = lookup
        return self.pool(lookup.slots[lookup.inverse], self.params.device_rows, lookup.offsets, lookup.weights), lookup

    def fused_update(self, lookup, grad_pooled):
        """Backward's update straight into the cache slots when one round fits both caches: always with the state
        riding in the weights' slots (equal capacities hold what the lookup held), else when the rows' bounds say
        so (they do whenever the caches are planned with the batch's distinct rows as their floor, as the trainer
        plans them). The Triton update, or torch's row-wise one; the lookup's slots are reused when no row has
        been evicted since (no second prepare), else prepared again (record=False: the lookup counted them)."""
        riding = isinstance(self.states, SharedSlotRows)
        if not riding and (self.fused_kernel is None or self._round_count(self.params.bounds(lookup.rows)) > 1):
            return super().fused_update(lookup, grad_pooled)
        param_slots = lookup.slots  # valid while a prefetch holds its rows, else until a prepare moves them (epoch)
        if lookup is not self._protected:
            self.settle()
            if lookup.slots_epoch != self.params.epoch:
                param_slots = self.params.prepare(lookup.rows, record=False)
        if self.fused_kernel is None:  # riding: a row's state sits in its weights' slot
            grads = self.row_grads(lookup, grad_pooled)
            sq = grads.pow(2).sum()
            apply_rowwise_adagrad_(self.params.device_rows, param_slots, self.states.device_rows, param_slots,
                                   grads.to(self.device), self.cfg.lr, self.cfg.eps)
            return sq
        state_index = None  # riding: the Triton update's state slot is the row's own
        if not riding:
            self.state_slot_of[param_slots] = self.states.prepare(lookup.rows, record=True)
            state_index = self.state_slot_of
        return self.fused_kernel(param_slots[lookup.inverse], lookup.offsets, lookup.weights, grad_pooled,
                                 self.params.device_rows, self.states.device_rows, self.cfg.lr, self.cfg.eps,
                                 state_index=state_index).sum()

    def update(self, rows, grads):
        self.settle()
        rows, grads = rows.to(self.index_device), grads.to(self.device)
        for part in self._rounds(rows):
            param_slots = self.params.prepare(rows[part], record=False)  # resident since the lookup
            state_slots = self.states.prepare(rows[part], record=True)
            apply_rowwise_adagrad_(self.params.device_rows, param_slots, self.states.device_rows, state_slots,
                                   grads[part.to(self.device)], self.cfg.lr, self.cfg.eps)

    def _rounds(self, rows: torch.Tensor) -> Iterator[torch.Tensor]:
        """Positions of `rows` in rounds that fit every table's caches: one round unless several
        backwards were accumulated; rows are distinct, so splitting changes no arithmetic."""
        bounds = self.params.bounds(rows)
        for r in range(self._round_count(bounds)):
            yield torch.cat([torch.arange(min(hi, lo + r * chunk), min(hi, lo + (r + 1) * chunk), device=rows.device)
                             for (lo, hi), chunk in zip(bounds, self.chunk)])

    def _round_count(self, bounds: list[tuple[int, int]]) -> int:
        """Rounds needed for rows whose per-table ranges are `bounds` (``TableCaches.bounds``)."""
        return max(math.ceil((hi - lo) / chunk) for (lo, hi), chunk in zip(bounds, self.chunk))

    def snapshot(self):
        self.settle()
        self.params.flush()
        self.states.flush()
        return self.params.host_rows.clone(), self.states.host_rows.clone()

    def current_weights(self):
        """The host weights once every cached row is written back: no copy (13.3 GB at large-cached, which the
        parameter digest of every numerics run made, beside the workers started ahead)."""
        self.settle()
        self.params.flush()
        return self.params.host_rows

    def counters(self):
        self.settle()
        return super().counters() | {f"{name}_{key}": value for name, caches in (("param", self.params),
                                     ("state", self.states)) for key, value in caches.counters().items()}
