"""Every embedding table's device cache at once: SparseGear's device level over a shared host row space.

Each table t has its own cache of capacities[t] rows and evicts among its own slots, exactly as one
``RowCache`` per table would (``tests/haste_rec/cache/test_cache.py`` replays both and compares every slot,
eviction and counter). But the metadata of all tables sits in shared host arrays, so a batch is prepared
with one set of whole-array operations, not one set per table (26 at size large), and the victims of every
table come from one ``topk`` over a [tables, capacity] view of the eviction keys, not one per table. All
tables' slots are slices of one device buffer, so a batch of every table is read and updated through
shared slot numbers in one operation; rows move with one read-back and one load per prepare (``move_rows``).

Two more things serve the steady state of training, in which the caches are full and every miss evicts:
``replay`` fast-forwards the caches there before the first step (only the decisions; the resident rows then
load at once), and ``shared_slot_rows.SharedSlotRows`` keeps a second array's rows (the optimizer state) in the
same slots when its cache would decide the same, so one set of decisions serves both.

Where the metadata lives is ``index_device``'s choice (knob embedding_cache_index). On the host (SparseGear's
way) a lookup needs no device round trip, but in the steady state the bookkeeping is host work on every step
that grows with the batch's distinct rows: at large-cached, 41-51 ms of a step's prepares on the 2-core VM
(``benchmarks/cache_steady.py``, 2026-12-01), where an H200 profile of the cached step found it host-bound
(44.1 ms of host work in a 45.0 ms step, 2026-12-01). On the device the same operations run as kernels, with a
few read-backs for sizes; only the moved rows' ids come back to the host, to gather and write back host rows.
The decisions are the same either way.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterable, Sequence

import torch

from targets.haste_rec.cache.cache_overlap import CacheStream, WriteBehind
from targets.haste_rec.cache.row_cache import (CLOCK_BITS, EVICTIONS, NEVER, RowMoves, move_rows, move_rows_together,
                                               should_pin, to_device)
from targets.protocol import ConfigError

if TYPE_CHECKING:
    from targets.haste_rec.cache.shared_slot_rows import SharedSlotRows


LOAD_CHUNK_ROWS = 1 << 16  # rows per copy when warmed caches load their resident rows


def _starts(sizes: Sequence[int]) -> list[int]:
    return [sum(sizes[:i]) for i in range(len(sizes))]


def _ranges(starts: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """cat(arange(s, s + c) for s, c in zip(starts, counts)) without a Python loop."""
    total = int(counts.sum())
    group_start = torch.repeat_interleave(torch.cumsum(counts, 0) - counts, counts, output_size=total)
    return (torch.repeat_interleave(starts, counts, output_size=total) + torch.arange(total, device=counts.device)
            - group_start)


class TableCaches:
    """Per-table device caches of `capacities` rows over `host_rows` [sum(table_rows), width], whose table t
    holds rows [starts[t], starts[t] + table_rows[t]) (table t's rows follow table t-1's); their metadata on
    `index_device` (the host unless given)."""

    def __init__(self, host_rows: torch.Tensor, table_rows: Sequence[int], capacities: Sequence[int], eviction: str,
                 device: torch.device, pin_memory: bool = False, name: str = "cache",
                 index_device: torch.device = torch.device("cpu"), overlap: bool = False):
        if eviction not in EVICTIONS:
            raise ConfigError(f"eviction must be one of {', '.join(EVICTIONS)}, not {eviction!r}")
        for t, (rows, cap) in enumerate(zip(table_rows, capacities)):
            if not 1 <= cap <= rows:
                raise ConfigError(f"table {t} {name} capacity must lie in [1, {rows}] rows, not {cap}")
        self.host_rows, self.device, self.eviction, self.name = host_rows, device, eviction, name
        self.capacities, self.row_starts = list(capacities), _starts(table_rows)
        self.pinned = should_pin(pin_memory, device)
        self.device_rows = torch.zeros(sum(capacities), host_rows.shape[1], dtype=host_rows.dtype, device=device)
        tables = len(table_rows)
        self.index_device = index = index_device
        self.caps = torch.tensor(self.capacities, device=index)
        self.slot_start = torch.tensor(_starts(capacities), device=index)
        self.row_edges = torch.tensor(self.row_starts[1:], device=index)  # bucketize(row, edges, right=True): table
        slots = sum(capacities)
        self.slot_of_row = torch.full((host_rows.shape[0],), -1, dtype=torch.int64, device=index)
        self.row_of_slot = torch.full((slots,), -1, dtype=torch.int64, device=index)
        # One clock for all tables; one spare stamp past the slots, where the steady path's index fills send
        # the positions that name no slot (a miss has none), so that it needs no read-back to leave them out.
        self._stamps = torch.zeros(slots + 1, dtype=torch.int64, device=index)
        self.last_use = self._stamps[:slots]
        self.use_count = torch.zeros(slots, dtype=torch.int64, device=index)
        self.clock = 0
        self.filled = torch.zeros(tables, dtype=torch.int64, device=index)  # table t's slots [0, filled[t]) hold rows
        self.width = max(capacities)  # the eviction keys as [tables, width]; narrower tables padded with NEVER
        self.table_ids = torch.arange(tables, device=index)
        table_of_slot = torch.repeat_interleave(self.table_ids, self.caps)
        local = torch.arange(slots, device=index) - self.slot_start[table_of_slot]
        self.uniform = len(set(self.capacities)) == 1
        self.padded_position = table_of_slot * self.width + local
        self.local_of_slot = local
        self.hits = self.misses = self.bytes_h2d = self.bytes_d2h = 0
        self.row_bytes = host_rows.shape[1] * host_rows.element_size()
        self._all_full = False  # known on the host once every table is full: they stay so (slots are never emptied)
        self.riders: list[SharedSlotRows] = []  # other rows kept in these slots (SharedSlotRows), moved with them
        # Bumped whenever a slot's row changes (a prepare that evicts, a replay, an adoption): slots read in one
        # epoch hold their rows for all of it (a load into an empty slot changes no other slot).
        self.epoch = 0
        # overlap (``cache_overlap``): the metadata on a side stream of its own (made last: it starts after the
        # metadata's initialisation queued above), write-backs behind the host's back
        self.stream = CacheStream(device, overlap and index.type == "cuda")
        self.behind = WriteBehind() if overlap else None

    def bounds(self, sorted_rows: torch.Tensor) -> list[tuple[int, int]]:
        """[lo, hi) of each table's rows within sorted shared-space rows."""
        edges = torch.tensor(self.row_starts + [self.host_rows.shape[0]], device=sorted_rows.device)
        edges = torch.searchsorted(sorted_rows, edges).tolist()
        return list(zip(edges[:-1], edges[1:]))

    def prepare(self, unique_rows: torch.Tensor, record: bool = True, held: torch.Tensor | None = None) -> torch.Tensor:
        """Shared-buffer slots (on the device) of sorted, distinct shared-space rows, made resident.

        `record` counts hits and misses and refreshes recency/frequency (the lookup path); the update path
        passes False so that touching the same rows again is not counted twice. `held` (slots, anywhere) are kept
        as if this batch used them too: no row of theirs is evicted (``cache_prefetch``: the batch before, whose
        update is still to come).
        """
        with self.stream.deciding():
            slots, moves = self._assign(unique_rows, record, None if held is None else held.to(self.index_device))
            if moves is not None:
                moves = moves.rows_on_host()  # one read-back of the moved rows' ids, for every array moved
        self.stream.hand_over(slots, *([] if moves is None else [moves.back_slots, moves.load_slots]))
        if moves is not None:
            self.epoch += bool(moves.back_slots.numel())
            for rider in self.riders:
                rider.count(moves)
            move_rows_together([(self.host_rows, self.device_rows)] + [(r.host_rows, r.device_rows)
                                                                       for r in self.riders],
                               moves, self.device, self.pinned, self.behind)
        return to_device(slots, self.device, self.pinned)

    def settle(self) -> None:
        """Metadata and host rows as every earlier prepare left them (``cache_overlap``): before the step's stream
        reads them (flushes, snapshots, loading the resident rows)."""
        self.stream.hand_over()
        if self.behind is not None:
            self.behind.wait()

    @property
    def full(self) -> bool:
        """Every table's slots hold rows: from here on each miss evicts (the steady state of training)."""
        with self.stream.deciding():
            return bool(torch.equal(self.filled, self.caps))

    def replay(self, unique_rows: torch.Tensor) -> None:
        """The slot decisions of ``prepare(unique_rows)`` without moving a row: only before training, while
        every host row is current, so an evicted row needs no write-back (``load_resident`` then loads them)."""
        with self.stream.deciding():
            self._assign(unique_rows, record=True)
        self.epoch += 1  # slots were reassigned

    def decisions(self) -> dict[str, torch.Tensor]:
        """Where every row sits and how recently and often each slot was used: what ``replay`` arrives at, to be
        saved and given to ``adopt`` (the build cache keeps it for the next worker)."""
        with self.stream.deciding():
            return {"row_of_slot": self.row_of_slot.cpu().clone(), "last_use": self.last_use.cpu().clone(),
                    "use_count": self.use_count.cpu().clone(), "filled": self.filled.cpu().clone(),
                    "clock": torch.tensor(self.clock)}

    def adopt(self, decisions: dict[str, torch.Tensor]) -> None:
        """The state ``decisions()`` saved, before training (``load_resident`` then loads the rows)."""
        if decisions["row_of_slot"].shape != self.row_of_slot.shape:
            raise ValueError("saved cache decisions are for other capacities")
        with self.stream.deciding():
            self.row_of_slot.copy_(decisions["row_of_slot"])
            self.last_use.copy_(decisions["last_use"])
            self.use_count.copy_(decisions["use_count"])
            self.filled.copy_(decisions["filled"])
            self.slot_of_row.fill_(-1)
            occupied = (self.row_of_slot >= 0).nonzero().squeeze(1)
            self.slot_of_row.index_copy_(0, self.row_of_slot.index_select(0, occupied), occupied)
        self.clock = int(decisions["clock"])
        self._all_full = False
        self.epoch += 1

    def load_resident(self) -> None:
        """After ``replay``: every occupied slot's row from the host, LOAD_CHUNK_ROWS at a time (a staging buffer
        of 32 MB at width 128, where all at once would be 2.7 GB of page-locked memory at large-cached); counters
        zeroed, so that they count training's traffic only."""
        self.settle()
        load_occupied(self, self.row_of_slot)
        self.hits = self.misses = self.bytes_h2d = self.bytes_d2h = 0

    def _assign(self, unique_rows: torch.Tensor, record: bool,
                held: torch.Tensor | None = None) -> tuple[torch.Tensor, RowMoves | None]:
        """(slots of `unique_rows` where the metadata lives, the rows to move for them or None): ``prepare``'s
        decisions, evicting none of the `held` slots."""
        unique_rows = unique_rows.to(self.index_device)
        if self.eviction == "lru" and self.uniform and (self._all_full or self._became_full()):
            return self._assign_steady(unique_rows, record, held)
        table = torch.bucketize(unique_rows, self.row_edges, right=True)
        needed = torch.bincount(table, minlength=len(self.capacities))
        if held is not None:
            needed += torch.bincount(self._table_of_slots(held), minlength=len(self.capacities))
        self._check_fits(needed.tolist(), held is not None)
        slots = self.slot_of_row.index_select(0, unique_rows)
        missing = (slots < 0).nonzero().squeeze(1)
        n_missing = missing.numel()
        if record:
            self.hits += unique_rows.numel() - n_missing
            self.misses += n_missing
        moves = None
        if n_missing:
            rows = unique_rows.index_select(0, missing)
            in_use = slots[slots >= 0]
            victims = self._victims(table.index_select(0, missing),
                                    in_use=in_use if held is None else torch.cat([in_use, held]))
            evicted = self.row_of_slot.index_select(0, victims)
            had_row = (evicted >= 0).nonzero().squeeze(1)  # victims whose row goes back to the host
            moves = self._place(slots, missing, rows, victims, evicted.index_select(0, had_row),
                                victims.index_select(0, had_row))
        self._touch(slots, record)
        return slots, moves

    def _place(self, slots: torch.Tensor, missing: torch.Tensor, rows: torch.Tensor, victims: torch.Tensor,
               back_rows: torch.Tensor, back_slots: torch.Tensor) -> RowMoves:
        """The missing `rows` (at positions `missing` of `slots`) into their `victims`, whose rows `back_rows` (in
        `back_slots`) leave: the maps, stamps, traffic counters and `slots` updated; the moves returned."""
        self.slot_of_row.index_fill_(0, back_rows, -1)
        self.bytes_d2h += back_rows.numel() * self.row_bytes
        self.bytes_h2d += rows.numel() * self.row_bytes
        self.slot_of_row.index_copy_(0, rows, victims)
        self.row_of_slot.index_copy_(0, victims, rows)
        self._stamp(victims)
        self.use_count.index_fill_(0, victims, 0)
        slots.index_copy_(0, missing, victims)
        return RowMoves(back_rows, back_slots, rows, victims)

    def _touch(self, slots: torch.Tensor, record: bool) -> None:
        """On the lookup path (`record`), the batch's slots used now: stamped in order, their use counts raised."""
        if record:
            self._stamp(slots)
            self.use_count[slots] += 1

    def _became_full(self) -> bool:
        """Whether every table is full now, remembered once true (one read-back a prepare until then)."""
        self._all_full = self.full
        return self._all_full

    def _table_of_slots(self, slots: torch.Tensor) -> torch.Tensor:
        """The table each of `slots` belongs to."""
        return torch.bucketize(slots, self.slot_start[1:], right=True)

    def _assign_steady(self, unique_rows: torch.Tensor, record: bool,
                       held: torch.Tensor | None = None) -> tuple[torch.Tensor, RowMoves | None]:
        """``_assign`` once every table is full, under LRU over equal capacities: training's steady state. The same
        decisions with one read-back of sizes (each table's distinct and missing rows), where the general path reads
        sizes back over a dozen times: on a GPU each waits for the caches' stream, which shares the device with the
        step's kernels. In H200 profiles of large-cached's best step of 2026-12-02, `embed` synchronised 22 times a
        step before (9 scalar reads, 7 nonzero, 6 copies) and 6 times with this path.

        Every miss evicts. Missing rows come sorted, so grouped by table: the j-th missing row of table t takes the
        j-th oldest slot of t among those the batch does not use (``_oldest_unused``'s order), found by position
        arithmetic instead of boolean-mask selections, whose sizes would be read back. `held` slots count as used:
        their tables must hold them beside the batch's rows."""
        tables, n = len(self.capacities), unique_rows.numel()
        table = torch.bucketize(unique_rows, self.row_edges, right=True)
        slots = self.slot_of_row.index_select(0, unique_rows)
        miss = slots < 0
        sizes = torch.zeros(3 * tables, dtype=torch.int64, device=slots.device)
        sizes.index_add_(0, table, torch.ones_like(table))
        sizes.index_add_(0, table + tables, miss.long())
        if held is not None:
            sizes.index_add_(0, self._table_of_slots(held) + 2 * tables, torch.ones_like(held))
        counts = sizes.tolist()  # the one read-back: distinct rows, misses and held slots per table
        needed, wanted = counts[:tables], counts[tables:2 * tables]
        self._check_fits([a + b for a, b in zip(needed, counts[2 * tables:])], held is not None)
        n_missing = sum(wanted)
        if record:
            self.hits += n - n_missing
            self.misses += n_missing
        moves = None
        if n_missing:
            missing = _positions(miss, n_missing)
            rows = unique_rows.index_select(0, missing)
            in_use = slots.masked_fill(miss, self.row_of_slot.numel())  # a miss names the stamps' spare element
            if held is not None:
                in_use = torch.cat([in_use, held])
            lowest = self._oldest_unused(max(wanted), in_use)  # [tables, k] local slots, oldest first
            t = table.index_select(0, missing)
            per_table = sizes[tables:2 * tables]
            first = torch.cumsum(per_table, 0) - per_table  # each table's first position among the missing rows
            j = torch.arange(n_missing, device=slots.device) - first.index_select(0, t)
            victims = lowest[t, j] + self.slot_start.index_select(0, t)
            evicted = self.row_of_slot.index_select(0, victims)  # full: every victim holds a row
            moves = self._place(slots, missing, rows, victims, evicted, victims)
        self._touch(slots, record)
        return slots, moves

    def _check_fits(self, needed: Sequence[int], with_held: bool = False) -> None:
        """ConfigError when a batch needs more distinct rows of a table than its cache holds (`with_held`: beside
        the slots held for the batch before)."""
        for t, (need, cap) in enumerate(zip(needed, self.capacities)):
            if need > cap:
                what = "two batches need" if with_held else "one batch needs"
                raise ConfigError(f"table {t} {self.name} holds {cap} rows but {what} {need} distinct rows; "
                                  f"raise the cache fraction or lower the batch size"
                                  + (" or turn embedding_cache_prefetch off" if with_held else ""))

    def _victims(self, table_of_missing: torch.Tensor, in_use: torch.Tensor) -> torch.Tensor:
        """A slot for each missing row (grouped by table, in row order): per table its empty slots first, then
        the occupied slots outside `in_use` with the lowest eviction keys, lowest first (RowCache's order)."""
        wanted = torch.bincount(table_of_missing, minlength=len(self.capacities))
        fresh_n = torch.minimum(wanted, self.caps - self.filled)
        evict_n = wanted - fresh_n
        fresh = _ranges(self.slot_start + self.filled, fresh_n)
        occupied = self.filled.clone()
        self.filled += fresh_n
        parts, tables = [fresh], [torch.repeat_interleave(self.table_ids, fresh_n)]
        if int(evict_n.sum()):
            evicting = evict_n.nonzero().squeeze(1)
            lowest = self._lowest_keys(evicting, int(evict_n.max()), occupied, in_use)
            take = torch.arange(lowest.shape[1], device=lowest.device) < evict_n[evicting].unsqueeze(1)
            parts.append((lowest + self.slot_start[evicting].unsqueeze(1))[take])
            tables.append(evicting.unsqueeze(1).expand_as(lowest)[take])
        victims, table = torch.cat(parts), torch.cat(tables)
        fresh_first = torch.cat([torch.zeros(fresh.numel(), dtype=torch.int64, device=victims.device),
                                 torch.ones(victims.numel() - fresh.numel(), dtype=torch.int64, device=victims.device)])
        return victims[torch.argsort(table * 2 + fresh_first, stable=True)]

    def _lowest_keys(self, evicting: torch.Tensor, k: int, occupied: torch.Tensor,
                     in_use: torch.Tensor) -> torch.Tensor:
        """[len(evicting), k]: local slots of each evicting table with the lowest eviction keys, lowest first,
        among its slots that held a row before this prepare and are not `in_use` (whole-array index fills on
        a fresh key array: boolean-mask indexing over every slot costs several times more)."""
        if self.eviction == "lru" and self.uniform and bool((occupied[evicting] == self.caps[evicting]).all()):
            return self._oldest_unused(k, in_use, evicting)
        keys = self.last_use.clone() if self.eviction == "lru" else (self.use_count << CLOCK_BITS) | self.last_use
        keys.index_fill_(0, in_use, NEVER)
        if bool((occupied[evicting] < self.caps[evicting]).any()):  # a table filling up: empty slots are no victims
            keys.masked_fill_(self.local_of_slot >= torch.repeat_interleave(occupied, self.caps), NEVER)
        if self.uniform:
            keys2d = keys.view(-1, self.width)
        else:
            keys2d = torch.full((len(self.capacities) * self.width,), NEVER, dtype=torch.int64, device=keys.device)
            keys2d = keys2d.index_copy_(0, self.padded_position, keys).view(-1, self.width)
        if evicting.numel() < keys2d.shape[0]:  # after the warm-up every table evicts: no copy then
            keys2d = keys2d.index_select(0, evicting)
        return torch.topk(keys2d, k, dim=1, largest=False, sorted=True).indices

    def _oldest_unused(self, k: int, in_use: torch.Tensor, evicting: torch.Tensor | None = None) -> torch.Tensor:
        """``_lowest_keys`` for LRU over full tables of equal capacity, the steady state of training: topk straight
        over the stamps, with the in-use slots' stamps set past every other for it and put back after. No key
        array is made, and k is the misses alone: the in-use slots sort last, and a table's in-use slots and
        misses fit in it (``_check_fits``), so its k oldest that it needs are never in use. Before, topk took k
        plus the hits: at large-cached one batch missed at most 1,876 rows of a table and hit 2,287
        (``benchmarks/cache_steady.py``). On the 2-core VM (``--threads 2 --batches 10``, two runs of each version,
        alternated) a step's two prepares with the state in its own cache went from 86.0 and 83.7 ms to 76.9 and
        69.1; with the state riding (one topk), 44.2 and 43.8 against 50.6 and 42.9, within the VM's noise.

        [len(evicting), k] local slots (every table's when `evicting` is None); `in_use` may name the spare stamp
        past the slots, which no table holds (the steady path sends the misses there)."""
        saved = self._stamps.index_select(0, in_use)
        self._stamps.index_fill_(0, in_use, NEVER)
        stamps = self.last_use.view(-1, self.width)
        if evicting is not None and evicting.numel() < stamps.shape[0]:
            stamps = stamps.index_select(0, evicting)
        oldest = torch.topk(stamps, k, dim=1, largest=False, sorted=True).indices
        self._stamps.index_copy_(0, in_use, saved)
        return oldest

    def _stamp(self, slots: torch.Tensor) -> None:
        """Mark `slots` used now, in their order (a batch's rows are sorted, so this is deterministic)."""
        self.last_use[slots] = torch.arange(self.clock, self.clock + slots.numel(), device=slots.device)
        self.clock += slots.numel()

    def flush(self) -> None:
        """Write every cached row back to the host (for digests and checkpoints; not counted as traffic)."""
        self.settle()
        write_back_occupied(self, self.row_of_slot)

    def counters(self) -> dict[str, float]:
        """hits, misses, bytes_h2d, bytes_d2h summed over the tables' caches."""
        return {"hits": float(self.hits), "misses": float(self.misses), "bytes_h2d": float(self.bytes_h2d),
                "bytes_d2h": float(self.bytes_d2h)}


def _positions(mask: torch.Tensor, count: int) -> torch.Tensor:
    """The positions where `mask` holds, ascending, given their `count`: nonzero() without its read-back of the size.
    Positions outside the mask are scattered to one spare element past the end, then cut off."""
    rank = torch.cumsum(mask, 0) - 1
    out = torch.empty(count + 1, dtype=torch.int64, device=mask.device)
    out.scatter_(0, torch.where(mask, rank, count), torch.arange(mask.numel(), device=mask.device))
    return out[:count]


def replay_until_full(caches: Sequence["TableCaches | SharedSlotRows"], batches_rows: Iterable[torch.Tensor]) -> int:
    """Each batch's sorted distinct rows through every cache's ``replay``, in order, until all are full or the
    batches run out (drawn lazily: no batch past the one that filled them); returns the batches replayed."""
    replayed = 0
    for rows in batches_rows:
        if all(cache.full for cache in caches):
            break
        for cache in caches:
            cache.replay(rows)
        replayed += 1
    return replayed


def load_occupied(cache: "TableCaches | SharedSlotRows", row_of_slot: torch.Tensor) -> None:
    """Every occupied slot's row from the cache's host rows, LOAD_CHUNK_ROWS at a time."""
    empty = torch.zeros(0, dtype=torch.int64, device=row_of_slot.device)
    for slots in (row_of_slot >= 0).nonzero().squeeze(1).split(LOAD_CHUNK_ROWS):
        move_rows(cache.host_rows, cache.device_rows, RowMoves(empty, empty, row_of_slot[slots], slots), cache.device,
                  cache.pinned)


def write_back_occupied(cache: "TableCaches | SharedSlotRows", row_of_slot: torch.Tensor) -> None:
    """Every occupied slot's row back to the cache's host rows (not counted as traffic)."""
    occupied = (row_of_slot >= 0).nonzero().squeeze(1)
    empty = torch.zeros(0, dtype=torch.int64, device=row_of_slot.device)
    move_rows(cache.host_rows, cache.device_rows, RowMoves(row_of_slot[occupied], occupied, empty, empty),
              cache.device, cache.pinned)
