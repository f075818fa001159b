"""A device cache of table rows over a host tensor: one level of SparseGear's multi-level store.

Embedding tables (and their row-wise optimizer state) can be far larger than device memory, but
a Zipf-skewed workload touches a small hot set most of the time. `RowCache` keeps `capacity` rows
on the device, maps host row ids to cache slots with metadata kept on the HOST (as SparseGear
does: the id->slot map is a CPU tensor, so lookups need no device round trip), evicts by LRU or
LFU among the slots the current batch does not use, writes victims back (they may be dirty) and
loads missing rows in one batched host->device copy. Deciding (``plan``: host metadata only) is kept
apart from moving (``move_rows``), so that several caches' rows can move at once: one device->host
read-back for all tables' write-backs, not one per table. The caller reads and updates `device_rows`
in place through the slots that `prepare` returns.

``table_caches.TableCaches`` keeps every embedding table's cache at once, with exactly RowCache's
decisions per table. The small transfer helpers used by every host-resident store live here too, so pinned-memory and
non-blocking rules are written down once: a copy is non-blocking only from pinned memory, and
device->host copies are blocking because the host reads the result at once (into pinned memory when
the store is pinned).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import torch

from targets.protocol import ConfigError

if TYPE_CHECKING:
    from targets.haste_rec.cache.cache_overlap import WriteBehind

EVICTIONS = ("lru", "lfu")
NEVER = torch.iinfo(torch.int64).max  # eviction key of a slot the current batch uses
CLOCK_BITS = 40  # LFU key = use count << 40 | use stamp: exact below 2**40 stamps and 2**23 uses of a slot


def should_pin(requested: bool, device: torch.device) -> bool:
    """Pin host buffers only when asked and when there is a CUDA device to copy to."""
    return requested and device.type == "cuda" and torch.cuda.is_available()


def to_device(t: torch.Tensor, device: torch.device, pinned: bool) -> torch.Tensor:
    """Copy `t` to `device`; asynchronously only from pinned memory (a fresh pinned copy if needed)."""
    if t.device == device:
        return t
    if pinned and t.device.type == "cpu":
        staged = t if t.is_pinned() else t.pin_memory()
        return staged.to(device, non_blocking=True)
    return t.to(device)


def to_host(t: torch.Tensor, pinned: bool) -> torch.Tensor:
    """`t` on the host, blocking (the host reads it at once). With `pinned`, into a page-locked buffer: the
    copy is one DMA transfer at bus speed, where a copy into pageable memory is staged by the driver at a
    fraction of it (43.5 MB of row gradients a step at size large-cached with host tables: the store's
    lookup_bytes_d2h counter in an H200 profile, 2026-11-30)."""
    if t.device.type == "cpu":
        return t
    if not pinned:
        return t.cpu()
    out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    return out.copy_(t)


def flat_rows(t: torch.Tensor) -> torch.Tensor:
    """Rows one value wide (the Adagrad state) as a flat view: torch's CPU index_select and index_copy_ take a
    faster path in one dimension (30K of 26M rows on the 2-core VM: 0.51 against 0.76 ms), where an H200 step
    gathered them in 1.2 ms (profile of large-cached, 2026-12-02)."""
    return t.view(-1) if t.dim() == 2 and t.shape[1] == 1 else t


def gather_to_device(host: torch.Tensor, index: torch.Tensor, device: torch.device, pinned: bool) -> torch.Tensor:
    """host[index] on `device`; with `pinned`, gathered straight into a pinned staging buffer.

    The staging buffer comes from torch's caching host allocator, which does not hand a block out
    again before the asynchronous copy reading it has finished, so reusing it is safe.
    """
    return gather_together([host], index, device, pinned)[0]


def gather_together(hosts: Sequence[torch.Tensor], index: torch.Tensor, device: torch.device,
                    pinned: bool) -> list[torch.Tensor]:
    """host[index] on `device` for every host array of one dtype, gathered into one staging buffer (pinned
    with `pinned`) that crosses in one copy; views of it on the device."""
    shapes = [(index.numel(), *host.shape[1:]) for host in hosts]
    staged = torch.empty(sum(math.prod(shape) for shape in shapes), dtype=hosts[0].dtype, pin_memory=pinned)
    for host, part in zip(hosts, _views(staged, shapes)):
        torch.index_select(flat_rows(host), 0, index, out=flat_rows(part))
    return _views(staged.to(device, non_blocking=pinned), shapes)


@dataclass
class RowMoves:
    """The rows one prepare moves, as host rows and device slots (CPU int64): victims written back from
    their slots to their host rows, then missing host rows loaded into those slots."""

    back_rows: torch.Tensor
    back_slots: torch.Tensor
    load_rows: torch.Tensor
    load_slots: torch.Tensor

    def rows_on_host(self) -> "RowMoves":
        """These moves with the host rows' ids on the host, where they index the host array: one read-back for
        both when the cache's metadata lives on the device (``TableCaches``' index_device)."""
        if self.back_rows.device.type == "cpu":  # both ids come from the same metadata, so they live together
            return self
        both = torch.cat([self.back_rows, self.load_rows]).cpu()
        back = self.back_rows.numel()
        return RowMoves(both[:back], self.back_slots, both[back:], self.load_slots)


def move_rows(host_rows: torch.Tensor, device_rows: torch.Tensor, moves: RowMoves, device: torch.device,
              pinned: bool, behind: WriteBehind | None = None) -> None:
    """Carry out `moves` on one array's rows (``move_rows_together``)."""
    move_rows_together([(host_rows, device_rows)], moves, device, pinned, behind)


def move_rows_together(arrays: Sequence[tuple[torch.Tensor, torch.Tensor]], moves: RowMoves, device: torch.device,
                       pinned: bool, behind: WriteBehind | None = None) -> None:
    """Carry out `moves` on every (host rows, device rows) array of `arrays` (the weights and the Adagrad state
    that rides in their slots): every write-back first (one read-back from the device, the only wait), then
    every load (one gather into a pinned buffer and one copy). A victim's slot is read before it is overwritten;
    written-back and loaded host rows are disjoint (a row is either cached or missing).

    Arrays of one dtype cross the bus together, packed into one buffer (``_packed``): one slot copy, one
    staging buffer and one transfer each way, not one per array. The prefetch thread moved the weights' rows in
    1.95 ms and the state's, a 128th of the bytes, in 0.84 ms a step, most of it per-call work (H200,
    ``benchmarks/embed_host.py``, 2026-12-04).

    With `behind` (``cache_overlap.WriteBehind``) nothing waits for the device: the victims' values go to a
    page-locked buffer without blocking and the worker writes them into the host rows once they have arrived;
    the gather first waits for each array's earlier write-backs, whose rows it may load again."""
    if len({host.dtype for host, _ in arrays}) > 1:
        for array in arrays:  # arrays of several dtypes do not pack: one at a time
            move_rows_together([array], moves, device, pinned, behind)
        return
    moves = moves.rows_on_host()
    if behind is not None:
        for host_rows, _ in arrays:
            behind.wait(host_rows)
        pinned = should_pin(True, device)  # copies that must not wait go through page-locked buffers
    hosts, devices = [host for host, _ in arrays], [rows for _, rows in arrays]
    if moves.back_slots.numel():
        slots = to_device(moves.back_slots, device, pinned)
        values = [rows.index_select(0, slots) for rows in devices]
        packed, shapes = _packed(values), [value.shape for value in values]
        if behind is None:
            for host_rows, value in zip(hosts, _views(to_host(packed, pinned), shapes)):
                flat_rows(host_rows).index_copy_(0, moves.back_rows, flat_rows(value))
        else:
            staged = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=pinned)
            staged.copy_(packed, non_blocking=True)
            copied = None
            if packed.is_cuda:
                copied = torch.cuda.Event()
                copied.record()
            for host_rows, value in zip(hosts, _views(staged, shapes)):
                behind.submit(host_rows, moves.back_rows, value, copied)
    if moves.load_rows.numel():
        loaded = gather_together(hosts, moves.load_rows, device, pinned)
        slots = to_device(moves.load_slots, device, pinned)
        for rows, values in zip(devices, loaded):
            rows.index_copy_(0, slots, values)


def _packed(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """Contiguous row arrays of one dtype as one flat buffer (a flat view of the one array, when only one)."""
    return tensors[0].reshape(-1) if len(tensors) == 1 else torch.cat([t.reshape(-1) for t in tensors])


def _views(flat: torch.Tensor, shapes: Sequence[Sequence[int]]) -> list[torch.Tensor]:
    """Consecutive views of the flat buffer `flat` in these shapes (``_packed``'s parts, or a copy of them)."""
    views, start = [], 0
    for shape in shapes:
        size = math.prod(shape)
        views.append(flat[start:start + size].view(shape))
        start += size
    return views


_NO_ROWS = torch.zeros(0, dtype=torch.int64)


class RowCache:
    """`capacity` rows of `host_rows [rows, width]` held on `device`, with host-side metadata."""

    def __init__(self, host_rows: torch.Tensor, capacity: int, eviction: str, device: torch.device,
                 pin_memory: bool = False, name: str = "cache", device_rows: torch.Tensor | None = None):
        """`device_rows`, if given, is the [capacity, width] device storage to use (e.g. a slice of a
        buffer that several caches share, so that their rows can be read in one operation)."""
        if eviction not in EVICTIONS:
            raise ConfigError(f"eviction must be one of {', '.join(EVICTIONS)}, not {eviction!r}")
        if not 1 <= capacity <= host_rows.shape[0]:
            raise ConfigError(f"{name} capacity must lie in [1, {host_rows.shape[0]}] rows, not {capacity}")
        self.host_rows = host_rows
        self.capacity = capacity
        self.eviction = eviction
        self.device = device
        self.name = name
        self.pinned = should_pin(pin_memory, device)
        shape = (capacity, host_rows.shape[1])
        if device_rows is None:
            device_rows = torch.zeros(shape, dtype=host_rows.dtype, device=device)
        elif tuple(device_rows.shape) != shape:
            raise ValueError(f"{name}: device_rows must have shape {shape}, not {tuple(device_rows.shape)}")
        self.device_rows = device_rows
        self.slot_of_row = torch.full((host_rows.shape[0],), -1, dtype=torch.int64)
        self.row_of_slot = torch.full((capacity,), -1, dtype=torch.int64)
        self.last_use = torch.zeros(capacity, dtype=torch.int64)  # stamp of the slot's last use
        self.use_count = torch.zeros(capacity, dtype=torch.int64)  # uses since its row was loaded
        self.clock = 0   # use stamps advance once per row touched, so no two slots share one
        self.filled = 0  # slots [0, filled) hold rows (slots are only ever reused, never emptied)
        self.step = 0
        self.hits = 0
        self.misses = 0
        self.bytes_h2d = 0
        self.bytes_d2h = 0

    @property
    def row_bytes(self) -> int:
        return self.host_rows.shape[1] * self.host_rows.element_size()

    @property
    def miss_rate(self) -> float:
        lookups = self.hits + self.misses
        return self.misses / lookups if lookups else 0.0

    def prepare(self, unique_rows: torch.Tensor, record: bool = True) -> torch.Tensor:
        """Make every row of `unique_rows` (CPU int64, distinct) resident; return their device slots.

        `record` counts hits and misses and refreshes recency/frequency (the lookup path); the
        update path passes False so that touching the same rows again is not counted twice.
        """
        return to_device(self.prepare_host(unique_rows, record), self.device, self.pinned)

    def prepare_host(self, unique_rows: torch.Tensor, record: bool = True) -> torch.Tensor:
        """`prepare`, returning the slots on the host (for callers that batch several caches' slots)."""
        slots, moves = self.plan(unique_rows, record)
        move_rows(self.host_rows, self.device_rows, moves, self.device, self.pinned)
        return slots

    def plan(self, unique_rows: torch.Tensor, record: bool = True) -> tuple[torch.Tensor, RowMoves]:
        """The slots of `unique_rows` and the moves that make them resident, with the metadata and the
        traffic counters already updated: the caller must carry the moves out (``move_rows``) before the
        slots are read."""
        if unique_rows.numel() > self.capacity:
            raise ConfigError(f"{self.name} holds {self.capacity} rows but one batch needs {unique_rows.numel()} "
                              f"distinct rows; raise the cache fraction or lower the batch size")
        slots = self.slot_of_row.index_select(0, unique_rows)
        missing = slots < 0
        n_missing = int(missing.sum())
        if record:
            self.step += 1
            self.hits += unique_rows.numel() - n_missing
            self.misses += n_missing
        moves = RowMoves(_NO_ROWS, _NO_ROWS, _NO_ROWS, _NO_ROWS)
        if n_missing:
            moves = self._assign(unique_rows[missing], in_use=slots[~missing])
            slots[missing] = moves.load_slots
        if record:
            self._stamp(slots)
            self.use_count[slots] += 1
        return slots, moves

    def flush(self) -> None:
        """Write every cached row back to the host (for digests and checkpoints; not counted as traffic)."""
        occupied = (self.row_of_slot >= 0).nonzero().squeeze(1)
        move_rows(self.host_rows, self.device_rows, RowMoves(self.row_of_slot[occupied], occupied, _NO_ROWS, _NO_ROWS),
                  self.device, self.pinned)

    def counters(self) -> dict[str, float]:
        return {"hits": float(self.hits), "misses": float(self.misses), "miss_rate": self.miss_rate,
                "bytes_h2d": float(self.bytes_h2d), "bytes_d2h": float(self.bytes_d2h)}

    def _assign(self, rows: torch.Tensor, in_use: torch.Tensor) -> RowMoves:
        """Pick len(rows) victims outside `in_use` for `rows` and update the metadata; return the moves."""
        victims = self._pick_victims(rows.numel(), in_use)
        evicted = self.row_of_slot[victims]
        held = evicted >= 0
        self.slot_of_row[evicted[held]] = -1
        self.bytes_d2h += int(held.sum()) * self.row_bytes
        self.bytes_h2d += rows.numel() * self.row_bytes
        self.slot_of_row[rows] = victims
        self.row_of_slot[victims] = rows
        self._stamp(victims)
        self.use_count[victims] = 0
        return RowMoves(evicted[held], victims[held], rows, victims)

    def _stamp(self, slots: torch.Tensor) -> None:
        """Mark `slots` used now, in their order (a batch's rows are sorted, so this is deterministic)."""
        self.last_use[slots] = torch.arange(self.clock, self.clock + slots.numel())
        self.clock += slots.numel()

    def _pick_victims(self, k: int, in_use: torch.Tensor) -> torch.Tensor:
        """k slots not in `in_use`: empty ones first, then the least recently used (LRU) or the least
        frequently used, the least recently used of those first (LFU). Keys are unique: no ties."""
        occupied = self.filled
        fresh = torch.arange(occupied, min(occupied + k, self.capacity))
        self.filled += fresh.numel()
        if fresh.numel() == k:
            return fresh
        recency = self.last_use[:occupied]
        keys = recency.clone() if self.eviction == "lru" else (self.use_count[:occupied] << CLOCK_BITS) | recency
        keys[in_use] = NEVER
        lowest = torch.topk(keys, k - fresh.numel(), largest=False, sorted=True).indices
        return torch.cat([fresh, lowest])
