"""RowCache (hits, misses, eviction, write-back, traffic) and the cache budget plans.

Holds the small Zipf batch maker the embedding tests share, so neither test module depends on the
trainer's data module.
"""

from __future__ import annotations

from typing import Sequence

import pytest
import torch

from targets.haste_rec.cache.cache_plan import expected_miss_rate, plan_by_frequency, plan_uniform
from targets.haste_rec.cache.row_cache import RowCache
from targets.haste_rec.cache.table_caches import TableCaches
from targets.haste_rec.data.batch import Batch
from targets.protocol import ConfigError

CPU = torch.device("cpu")


@pytest.fixture(autouse=True, scope="module")
def one_intra_op_thread():
    """These tensors are tiny: on a shared 2-core runner torch's intra-op threads only wait on each other."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# -- a Zipf workload -----------------------------------------------------------------------------
class ZipfBatches:
    """Batches whose ids follow a per-table Zipf law over a fixed random permutation of the rows."""

    def __init__(self, table_rows: Sequence[int], exponents: Sequence[float], batch_size: int, max_bag: int,
                 seed: int, weighted_tables: Sequence[int] = ()):
        gen = torch.Generator().manual_seed(seed)
        self.table_rows, self.batch_size, self.max_bag = list(table_rows), batch_size, max_bag
        self.weighted = set(weighted_tables)
        self.probs = [torch.arange(1, rows + 1, dtype=torch.float64).pow(-s) for rows, s in zip(table_rows, exponents)]
        self.perms = [torch.randperm(rows, generator=gen) for rows in table_rows]
        self.seed = seed

    def batch(self, index: int) -> Batch:
        gen = torch.Generator().manual_seed(self.seed * 10_007 + index + 1)
        ids, offsets, weights = [], [], []
        for t, (probs, perm) in enumerate(zip(self.probs, self.perms)):
            lengths = torch.randint(0, self.max_bag + 1, (self.batch_size,), generator=gen)  # empty bags too
            n = int(lengths.sum())
            ids.append(perm[torch.multinomial(probs, n, replacement=True, generator=gen)])
            offsets.append(torch.cumsum(lengths, 0) - lengths)
            weights.append(torch.rand(n, generator=gen) + 0.5 if t in self.weighted else None)
        b = self.batch_size
        return Batch(ids, offsets, weights, dense=torch.zeros(b, 1), labels=torch.zeros(0, dtype=torch.int64),
                     label_offsets=torch.zeros(b + 1, dtype=torch.int64))

    def batches(self, start: int, count: int) -> list[Batch]:
        return [self.batch(i) for i in range(start, start + count)]


def access_counts(batches: Sequence[Batch], table_rows: Sequence[int]) -> list[torch.Tensor]:
    counts = [torch.zeros(rows, dtype=torch.int64) for rows in table_rows]
    for batch in batches:
        for total, ids in zip(counts, batch.ids):
            total += torch.bincount(ids, minlength=total.numel())
    return counts


def replay_misses(batches: Sequence[Batch], table_rows: Sequence[int], capacities: Sequence[int],
                  eviction: str, warm: int = 0) -> int:
    """Misses of per-table RowCaches of `capacities` rows over `batches` (each batch's distinct ids),
    counted after the first `warm` batches have filled the caches."""
    caches = [RowCache(torch.zeros(rows, 1), cap, eviction, CPU) for rows, cap in zip(table_rows, capacities)]
    cold = 0
    for i, batch in enumerate(batches):
        if i == warm:
            cold = sum(cache.misses for cache in caches)
        for cache, ids in zip(caches, batch.ids):
            cache.prepare(torch.unique(ids))
    return sum(cache.misses for cache in caches) - cold


# -- RowCache --------------------------------------------------------------------------------------
def small_cache(eviction: str, capacity: int = 3) -> RowCache:
    host = torch.arange(20, dtype=torch.float32).view(10, 2)
    return RowCache(host, capacity, eviction, CPU)


def rows(*r: int) -> torch.Tensor:
    return torch.tensor(r, dtype=torch.int64)


def warm_up(cache: RowCache) -> None:
    """Rows 0,1,2 loaded at step 1; then row 0 is used twice, row 1 once, row 2 once (latest).

    Afterwards recency (last use) is 0:3, 1:4, 2:5 and use count 0:3, 1:2, 2:2.
    """
    for batch in ((0, 1, 2), (0,), (0,), (1,), (2,)):
        cache.prepare(rows(*batch))


@pytest.mark.parametrize("eviction,victim", [("lru", 0), ("lfu", 1)])
def test_eviction_picks_the_right_victim(eviction: str, victim: int):
    cache = small_cache(eviction)
    warm_up(cache)
    freed_slot = int(cache.slot_of_row[victim])
    cache.prepare(rows(3))
    # LRU drops row 0 (least recently used); LFU drops row 1 (count 2 ties with row 2, row 1 is older)
    assert int(cache.slot_of_row[victim]) == -1
    assert int(cache.slot_of_row[3]) == freed_slot
    assert sorted(cache.row_of_slot.tolist()) == sorted({0, 1, 2, 3} - {victim})


def test_rows_of_the_current_batch_are_never_evicted():
    cache = small_cache("lru")
    warm_up(cache)
    cache.prepare(rows(0, 3))  # row 0 is the LRU row but the batch uses it: row 1 goes instead
    assert int(cache.slot_of_row[0]) >= 0 and int(cache.slot_of_row[1]) == -1


@pytest.mark.parametrize("eviction", ["lru", "lfu"])
def test_rows_used_in_one_step_leave_in_batch_order(eviction: str):
    cache = small_cache(eviction)
    cache.prepare(rows(4, 7, 9))  # one step, one use each: the first row of the sorted batch is oldest
    cache.prepare(rows(5))
    assert int(cache.slot_of_row[4]) == -1 and cache.row_of_slot.tolist() == [5, 7, 9]


def test_counters_and_loaded_values():
    cache = small_cache("lru")
    lookups = [(0, 1, 2), (1, 2, 3), (4,), (3, 4)]
    for batch in lookups:
        slots = cache.prepare(rows(*batch))
        assert torch.equal(cache.device_rows[slots], cache.host_rows[rows(*batch)])
    assert cache.hits + cache.misses == sum(len(b) for b in lookups)
    # (4,) evicts row 1, not row 3: within step 2 the batch (1, 2, 3) was used in that order
    assert (cache.hits, cache.misses) == (4, 5)
    assert cache.miss_rate == pytest.approx(5 / 9)
    assert cache.bytes_h2d == 5 * 2 * 4            # five rows of two fp32 loaded
    assert cache.bytes_d2h == 2 * 2 * 4            # two evictions, each writing an occupied slot back


def test_dirty_rows_are_written_back_on_eviction_and_flush():
    cache = small_cache("lru", capacity=2)
    slots = cache.prepare(rows(0, 1))
    cache.device_rows[slots] += 100.0
    cache.prepare(rows(2))                          # evicts row 0 (the older stamp of the one step)
    assert cache.host_rows[0].tolist() == [100.0, 101.0]
    assert cache.host_rows[1].tolist() == [2.0, 3.0]  # still cached: the host copy is stale
    cache.flush()
    assert cache.host_rows[1].tolist() == [102.0, 103.0]


def test_table_caches_share_one_device_buffer():
    host = torch.arange(30, dtype=torch.float32).view(15, 2)  # table 0: rows 0..9, table 1: rows 10..14
    caches = TableCaches(host, [10, 5], [3, 2], "lru", CPU)
    batch = rows(1, 4, 9, 11, 14)                             # sorted shared-space rows of both tables
    slots = caches.prepare(batch)
    assert caches.bounds(batch) == [(0, 3), (3, 5)]
    assert slots.tolist() == [0, 1, 2, 3, 4]                 # table 1's slots follow table 0's
    assert torch.equal(caches.device_rows[slots], host[batch])
    caches.device_rows[slots[3]] = -1.0                      # an update through the shared buffer...
    caches.prepare(rows(12, 13))                              # ...written back when table 1 evicts row 11
    assert host[11].tolist() == [-1.0, -1.0]
    assert caches.counters() == {"hits": 0, "misses": 7, "bytes_h2d": 56, "bytes_d2h": 16}


@pytest.mark.parametrize("eviction", ["lru", "lfu"])
@pytest.mark.parametrize("capacities", [[300, 300, 300], [500, 120, 260]], ids=["uniform", "planned"])
def test_table_caches_decide_exactly_as_one_row_cache_per_table(eviction, capacities):
    """TableCaches prepares all tables with whole-array operations; replayed on Zipf batches beside one
    RowCache per table, it picks the same slots, evicts the same rows and moves the same bytes, also when the
    lookup path (record) and the update path (no record) alternate and the cached rows are written to."""
    table_rows = [2000, 600, 1300]
    row_starts, slot_starts = [0, 2000, 2600], [0, capacities[0], capacities[0] + capacities[1]]
    data = ZipfBatches(table_rows, [0.8, 1.2, 1.0], batch_size=40, max_bag=4, seed=11)
    host = torch.randn(sum(table_rows), 3, generator=torch.Generator().manual_seed(0))
    ref_host = host.clone()
    together = TableCaches(host, table_rows, capacities, eviction, CPU)
    alone = [RowCache(part, cap, eviction, CPU) for part, cap in zip(torch.split(ref_host, table_rows), capacities)]
    for i, batch in enumerate(data.batches(0, 40)):
        unique = [torch.unique(ids) for ids in batch.ids]
        for record in (True, False):
            got = together.prepare(torch.cat([u + s for u, s in zip(unique, row_starts)]), record=record)
            local = [c.prepare(u, record=record) for c, u in zip(alone, unique)]
            assert torch.equal(got, torch.cat([slots + s for slots, s in zip(local, slot_starts)])), (i, record)
        together.device_rows[got] += 1.0  # an update: dirty rows must be written back on eviction
        for c, slots in zip(alone, local):
            c.device_rows[slots] += 1.0
    assert together.counters() == {key: sum(c.counters()[key] for c in alone)
                                   for key in ("hits", "misses", "bytes_h2d", "bytes_d2h")}
    assert together.counters()["bytes_d2h"] > 0  # rows were evicted and written back
    together.flush()
    for c in alone:
        c.flush()
    assert torch.equal(host, ref_host)


@pytest.mark.parametrize("eviction", ["lru", "lfu"])
def test_replayed_caches_hold_what_prepared_ones_hold(eviction):
    """Warming a cache before training (``replay`` then ``load_resident``) leaves it exactly as preparing the
    same batches would, with untouched host rows: the same slots, recency and use counts, every resident row's
    host value on the device, and counters that start at zero; later steps then decide alike."""
    table_rows, capacities, row_starts = [2000, 600], [300, 120], [0, 2000]
    data = ZipfBatches(table_rows, [0.8, 1.2], batch_size=40, max_bag=4, seed=5)
    host = torch.randn(sum(table_rows), 3, generator=torch.Generator().manual_seed(1))
    warmed, prepared = (TableCaches(host.clone(), table_rows, capacities, eviction, CPU) for _ in range(2))
    shared = [torch.cat([torch.unique(ids) + s for ids, s in zip(b.ids, row_starts)]) for b in data.batches(0, 60)]
    for rows_of_batch in shared[:40]:
        warmed.replay(rows_of_batch)
        prepared.prepare(rows_of_batch)
    assert warmed.full and prepared.full  # filled, then evicting: the state training keeps
    assert torch.equal(warmed.device_rows, torch.zeros_like(warmed.device_rows))  # nothing moved yet
    warmed.load_resident()
    for name in ("slot_of_row", "row_of_slot", "last_use", "use_count", "filled", "device_rows"):
        assert torch.equal(getattr(warmed, name), getattr(prepared, name)), name
    assert warmed.counters() == {"hits": 0, "misses": 0, "bytes_h2d": 0, "bytes_d2h": 0}
    for rows_of_batch in shared[40:]:
        assert torch.equal(warmed.prepare(rows_of_batch), prepared.prepare(rows_of_batch))
    assert warmed.counters()["bytes_d2h"] > 0


def test_a_cache_is_full_only_when_every_table_is():
    caches = TableCaches(torch.zeros(15, 1), [10, 5], [3, 2], "lru", CPU)
    caches.replay(rows(1, 2, 3, 11))
    assert not caches.full
    caches.replay(rows(12))
    assert caches.full


def test_table_caches_name_the_table_a_batch_overflows():
    caches = TableCaches(torch.zeros(15, 1), [10, 5], [3, 2], "lru", CPU)
    with pytest.raises(ConfigError, match="table 1 cache holds 2 rows but one batch needs 3"):
        caches.prepare(rows(1, 11, 12, 13))


def test_update_path_prepare_is_not_counted():
    cache = small_cache("lru")
    cache.prepare(rows(0, 1))
    cache.prepare(rows(0, 1), record=False)
    assert (cache.hits, cache.misses, cache.step) == (0, 2, 1)


def test_batch_larger_than_capacity_is_a_config_error():
    with pytest.raises(ConfigError, match="holds 3 rows but one batch needs 4"):
        small_cache("lfu").prepare(rows(0, 1, 2, 3))


def test_bigger_cache_misses_less():
    data = ZipfBatches([3000], [1.0], batch_size=64, max_bag=4, seed=3)
    batches = data.batches(0, 30)
    misses = [replay_misses(batches, [3000], [cap], "lru") for cap in (300, 600, 1200)]
    assert misses[0] > misses[1] > misses[2] > 0


# -- plans ---------------------------------------------------------------------------------------
def test_uniform_plan_rounds_and_honours_minimum():
    assert plan_uniform([1000, 200, 50], 0.1, [0, 30, 80]) == [100, 30, 50]
    with pytest.raises(ConfigError):
        plan_uniform([10], 0.0, [0])


def test_frequency_plan_keeps_the_total_and_floors():
    counts = [torch.tensor([100, 90, 80, 70, 1, 1, 1, 1, 1, 1]), torch.tensor([5, 5, 5, 5, 5, 5, 5, 5, 5, 5])]
    # uniform total 2 + 2; the four hottest rows are all in table 0, but every table keeps one row
    assert plan_by_frequency(counts, 0.2, [0, 0]) == [3, 1]   # floor 1 each, then 90 and 80 win
    # a floor of 3 raises the uniform total to 2 + 3; the one row left over goes to table 0's 90
    assert plan_by_frequency(counts, 0.2, [0, 3]) == [2, 3]
    assert plan_by_frequency(counts, 0.2, [0, 3]) == plan_by_frequency(counts, 0.2, [0, 3])


def test_equal_counts_are_spread_over_tables():
    # a short window leaves many rows at the same count: ties must not all go to table 0
    counts = [torch.ones(100, dtype=torch.int64), torch.ones(100, dtype=torch.int64)]
    assert plan_by_frequency(counts, 0.1, [0, 0]) == [10, 10]


def test_expected_miss_rate_of_a_static_cache():
    counts = [torch.tensor([6, 3, 1]), torch.tensor([0, 10])]
    assert expected_miss_rate(counts, [1, 1]) == pytest.approx(4 / 20)
    assert expected_miss_rate(counts, [3, 2]) == 0.0


@pytest.mark.parametrize("eviction", ["lru", "lfu"])
def test_planned_split_beats_uniform_on_skewed_tables(eviction: str):
    # tables of different size and skew, as in the trainer: uniform overspends on the big skewed one
    table_rows, exponents = [8000, 2000, 16000], [0.6, 1.0, 1.4]
    data = ZipfBatches(table_rows, exponents, batch_size=64, max_bag=4, seed=11)
    floor = [64 * 4] * 3                                     # every id of a batch distinct: always fits
    plan_window, heldout = data.batches(0, 40), data.batches(1000, 100)
    uniform = plan_uniform(table_rows, 0.1, floor)
    planned = plan_by_frequency(access_counts(plan_window, table_rows), 0.1, floor)
    assert sum(planned) == sum(uniform) and planned != uniform
    uniform_misses = replay_misses(heldout, table_rows, uniform, eviction, warm=30)
    planned_misses = replay_misses(heldout, table_rows, planned, eviction, warm=30)
    print(f"{eviction}: planned/uniform misses = {planned_misses}/{uniform_misses} "
          f"= {planned_misses / uniform_misses:.3f} (capacities {planned} vs {uniform})")
    assert planned_misses < uniform_misses


def test_riding_rows_move_with_their_leaders_and_refuse_rows_it_does_not_hold():
    from targets.haste_rec.cache.shared_slot_rows import SharedSlotRows
    weights = TableCaches(torch.arange(30, dtype=torch.float32).view(15, 2), [10, 5], [3, 2], "lru", CPU)
    state = SharedSlotRows(weights, torch.arange(15, dtype=torch.float32).view(15, 1) + 100)
    slots = weights.prepare(rows(1, 4, 9, 11, 14))
    assert torch.equal(state.prepare(rows(1, 4, 9, 11, 14)), slots)
    assert state.device_rows[slots].flatten().tolist() == [101.0, 104.0, 109.0, 111.0, 114.0]
    state.device_rows[slots[3]] = -1.0                  # row 11's state, updated in its slot...
    weights.prepare(rows(12, 13))                         # ...written back when the weights evict row 11
    assert state.host_rows[11].tolist() == [-1.0]
    assert state.counters() == {"hits": 0, "misses": 7, "bytes_h2d": 28, "bytes_d2h": 8}
    with pytest.raises(RuntimeError, match="not in the cache"):
        state.prepare(rows(11))


@pytest.mark.parametrize("hold", [False, True], ids=["alone", "holding"])
def test_the_steady_path_decides_as_the_general_one(monkeypatch, hold):
    """Full caches under LRU over equal capacities take ``_assign_steady`` (one read-back of sizes); replayed beside
    caches held to the general path, lookups and updates alternating, every slot, move and counter agree. Holding:
    each lookup also keeps the batch before's slots, as a prefetch does (``cache_prefetch``)."""
    table_rows, row_starts = [2000, 600, 1300], [0, 2000, 2600]
    data = ZipfBatches(table_rows, [0.8, 1.2, 1.0], batch_size=40, max_bag=4, seed=3)
    host = torch.randn(sum(table_rows), 3, generator=torch.Generator().manual_seed(2))
    capacity = 220 if hold else 150  # two batches' rows where one holds the other's
    steady, general = (TableCaches(host.clone(), table_rows, [capacity] * 3, "lru", CPU) for _ in range(2))
    monkeypatch.setattr(general, "_became_full", lambda: False)
    calls = []
    monkeypatch.setattr(steady, "_assign_steady", lambda *a, _f=steady._assign_steady: calls.append(1) or _f(*a))
    shared = [torch.cat([torch.unique(ids) + s for ids, s in zip(b.ids, row_starts)]) for b in data.batches(0, 60)]
    for rows_of_batch in shared[:15]:
        steady.replay(rows_of_batch)
        general.replay(rows_of_batch)
    assert steady.full
    calls.clear()
    held = None
    for rows_of_batch in shared[15:]:
        for record in (True, False):
            slots = [c.prepare(rows_of_batch, record=record, held=held if record else None) for c in (steady, general)]
            assert torch.equal(*slots)
        held = slots[0] if hold else None
        for c, s in zip((steady, general), slots):
            c.device_rows[s] += 1.0  # updates: dirty rows must be written back on eviction
    assert len(calls) == 2 * len(shared[15:])
    for name in ("slot_of_row", "row_of_slot", "last_use", "use_count", "filled", "device_rows"):
        assert torch.equal(getattr(steady, name), getattr(general, name)), name
    assert steady.counters() == general.counters() and steady.counters()["bytes_d2h"] > 0
    steady.flush()
    general.flush()
    assert torch.equal(steady.host_rows, general.host_rows)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a cache index on the device needs CUDA")
@pytest.mark.parametrize("eviction", ["lru", "lfu"])
@pytest.mark.parametrize("capacities", [[300, 300], [500, 120]], ids=["uniform", "planned"])
def test_a_cache_index_on_the_device_decides_as_one_on_the_host(eviction, capacities):
    """Knob embedding_cache_index: the bookkeeping as kernels on the device gives the same slots, the same moves
    of the weights and of the state riding in their slots, and the same counters, from the warm-up (replay)
    through the evicting steady state."""
    from targets.haste_rec.cache.shared_slot_rows import SharedSlotRows
    cuda = torch.device("cuda")
    table_rows, row_starts = [2000, 600], [0, 2000]
    data = ZipfBatches(table_rows, [0.8, 1.2], batch_size=40, max_bag=4, seed=5)
    host = torch.randn(sum(table_rows), 3, generator=torch.Generator().manual_seed(1))
    caches = {index: TableCaches(host.clone(), table_rows, capacities, eviction, cuda, index_device=index)
              for index in (CPU, cuda)}
    states = {index: SharedSlotRows(caches[index], host[:, :1].clone() + 10) for index in caches}
    shared = [torch.cat([torch.unique(ids) + s for ids, s in zip(b.ids, row_starts)]) for b in data.batches(0, 60)]
    for index, cache in caches.items():
        for rows_of_batch in shared[:20]:
            cache.replay(rows_of_batch)
        cache.load_resident()
        states[index].load_resident()
    got = {}
    for rows_of_batch in shared[20:]:
        for index, cache in caches.items():
            slots = cache.prepare(rows_of_batch)
            assert slots.device.type == "cuda"
            assert torch.equal(states[index].prepare(rows_of_batch), slots)
            cache.device_rows[slots] += 1.0  # updates: dirty rows must be written back on eviction
            states[index].device_rows[slots] -= 1.0
            got[index] = slots
        assert torch.equal(got[CPU], got[cuda])
    assert caches[cuda].slot_of_row.device.type == "cuda" and caches[CPU].slot_of_row.device.type == "cpu"
    for name in ("slot_of_row", "row_of_slot", "last_use", "use_count", "filled", "device_rows"):
        assert torch.equal(getattr(caches[cuda], name).cpu(), getattr(caches[CPU], name).cpu()), name
    assert caches[cuda].counters() == caches[CPU].counters() and caches[CPU].counters()["bytes_d2h"] > 0
    assert states[cuda].counters() == states[CPU].counters()
    for index in caches:
        caches[index].flush()
        states[index].flush()
    assert torch.equal(caches[cuda].host_rows, caches[CPU].host_rows)
    assert torch.equal(states[cuda].host_rows, states[CPU].host_rows)


@pytest.mark.parametrize("behind", [False, True], ids=["blocking", "write-behind"])
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.float64], ids=["packed", "apart"])
def test_arrays_moved_together_end_as_each_moved_alone(behind, state_dtype):
    """The weights and the state riding in their slots cross in one buffer each way (one dtype) or one after the
    other (two): either way every host and device row ends as two separate moves leave it."""
    from targets.haste_rec.cache.cache_overlap import WriteBehind
    from targets.haste_rec.cache.row_cache import RowMoves, move_rows, move_rows_together
    gen = torch.Generator().manual_seed(3)
    arrays = [(torch.randn(12, 3, generator=gen), torch.randn(4, 3, generator=gen)),
              (torch.randn(12, 1, generator=gen).to(state_dtype), torch.randn(4, 1, generator=gen).to(state_dtype))]
    moves = RowMoves(rows(5, 2), rows(3, 0), rows(7, 1, 9), rows(3, 0, 2))  # victims read before their slots load
    alone = [(host.clone(), device.clone()) for host, device in arrays]
    before = [(host.clone(), device.clone()) for host, device in arrays]
    writes = [WriteBehind() if behind else None for _ in range(2)]
    for (host, device), write in zip(alone, writes):
        move_rows(host, device, moves, CPU, False, write)
        if write is not None:
            write.wait()
    together = WriteBehind() if behind else None
    move_rows_together(arrays, moves, CPU, False, together)
    if together is not None:
        together.wait()
    for (host, device), (host_alone, device_alone) in zip(arrays, alone):
        assert torch.equal(host, host_alone) and torch.equal(device, device_alone)
    for (host, device), (host_before, device_before) in zip(arrays, before):  # the moves really moved rows
        assert torch.equal(host[5], device_before[3]) and torch.equal(device[3], host_before[7])
