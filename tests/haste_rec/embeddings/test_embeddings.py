"""EmbeddingStore: every allowed mode trains like the dense baseline; counters, errors, init.

The trajectory test is the contract that lets sg-opt treat placement, grad mode and caching as
speed knobs: ten steps of pooled tables -> fixed linear map -> MSE, compared with device+dense.
A mode is `exact` (bitwise equal) where the arithmetic is the same, else `reorder` (the same
math summed in another order: allclose at a tight tolerance). Which applies is declared below.
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass, replace

import pytest
import torch

from targets.haste_rec.cache.shared_slot_rows import SharedSlotRows
from targets.haste_rec.cache.table_caches import TableCaches
from targets.haste_rec.embeddings.embeddings import EmbeddingConfig, EmbeddingStore
from targets.protocol import ConfigError
from tests.haste_rec.cache.test_cache import ZipfBatches, access_counts, one_intra_op_thread  # noqa: F401 (autouse)

TABLE_ROWS = (60, 90, 150)
DIM, BATCH, MAX_BAG, STEPS, SEED = 8, 16, 5, 10, 5
WORKLOAD = ZipfBatches(TABLE_ROWS, (0.8, 1.1, 1.3), BATCH, MAX_BAG, seed=7, weighted_tables=(1,))
BATCHES = WORKLOAD.batches(0, STEPS)
COUNTS = access_counts(BATCHES, TABLE_ROWS)
MAX_UNIQUE = [max(int(b.ids[t].unique().numel()) for b in BATCHES) for t in range(len(TABLE_ROWS))]
DEVICES = [torch.device("cpu")] + ([torch.device("cuda")] if torch.cuda.is_available() else [])
BASE = EmbeddingConfig(lr=0.05, init_std=0.1, cache_fraction=0.35, opt_state_cache_fraction=0.25)
RTOL, ATOL = 1e-5, 1e-6  # reorder: ten fp32 steps of weights ~0.1 differ by ~1e-7 when sums are reordered


@dataclass
class Trajectory:
    losses: list[float]
    grad_sq: list[float]
    tables: list[torch.Tensor]
    states: list[torch.Tensor]
    counters: dict[str, float]


def linear_task(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The fixed linear map and the MSE target every trajectory here trains towards."""
    gen = torch.Generator().manual_seed(1)
    return (torch.randn(len(TABLE_ROWS) * DIM, 3, generator=gen).to(device),
            torch.randn(BATCH, 3, generator=gen).to(device))


def train(cfg: EmbeddingConfig, device: torch.device, batches_per_step: int = 1) -> Trajectory:
    """STEPS // batches_per_step optimizer steps of pooled -> fixed linear -> MSE. A store that prefetches
    (cache_prefetch) is handed each next batch before a lookup, as the trainer's session does."""
    store = EmbeddingStore(TABLE_ROWS, DIM, cfg, device, SEED, access_counts=COUNTS, max_unique_per_batch=MAX_UNIQUE)
    head, target = linear_task(device)
    losses, grad_sq = [], []
    for step in range(STEPS // batches_per_step):
        store.zero_grad()
        for index in range(step * batches_per_step, (step + 1) * batches_per_step):
            batch = BATCHES[index]
            if store.prefetches and index + 1 < len(BATCHES):
                store.prefetch_next(BATCHES[index + 1])
            pooled = store(batch)
            assert pooled.shape == (BATCH, len(TABLE_ROWS) * DIM) and pooled.device.type == device.type
            loss = (pooled @ head - target).pow(2).mean()
            loss.backward()
            losses.append(float(loss.detach()))
        grad_sq.append(store.grad_sq_norm())
        store.optimizer_step()
    return Trajectory(losses, grad_sq, store.full_tables(), store.full_optimizer_states(), store.counters())


@functools.cache
def reference(device: torch.device, grad_mode: str = "dense") -> Trajectory:
    return train(replace(BASE, grad_mode=grad_mode), device)


def allowed_configs() -> list[EmbeddingConfig]:
    """Every placement x grad_mode x cache_plan x eviction x pool_on_host the config accepts."""
    out = []
    for placement, mode, plan, eviction, pool in itertools.product(
            ("device", "host", "cached"), ("dense", "sparse", "fused"), ("uniform", "planned"), ("lru", "lfu"),
            (False, True)):
        try:
            out.append(replace(BASE, placement=placement, grad_mode=mode, cache_plan=plan, eviction=eviction,
                               pool_on_host=pool))
        except ConfigError:
            assert mode == "dense" and placement != "device"
    return out


def config_id(cfg: EmbeddingConfig) -> str:
    pooling = "hostpool" if cfg.pool_on_host else "devpool"
    return f"{cfg.placement}-{cfg.grad_mode}-{cfg.cache_plan}-{cfg.eviction}-{pooling}"


# -- numerics declarations -------------------------------------------------------------------------
def numerics_vs_dense(cfg: EmbeddingConfig) -> str:
    """dense is the reference itself (the knobs it ignores change nothing): exact. Every other mode
    is reorder: torch's dense embedding_bag backward sums a row's contributions in its own order,
    the row-gradient modes sum them once each in position order (segment sum)."""
    return "exact" if cfg.grad_mode == "dense" else "reorder"


def exact_vs_device_fused(cfg: EmbeddingConfig, device: torch.device) -> bool:
    """Whether a row-gradient mode reproduces device+fused bit for bit.

    sparse forms the same sums (torch's per-occurrence sparse gradient, segment-summed in position
    order) and caching, eviction and planning only move rows verbatim: exact. Host placement runs
    Adagrad on the CPU (and, with pool_on_host, pooling and the row sums too), so it is exact only
    when the compute device is the CPU; on CUDA it is reorder.
    """
    return cfg.placement != "host" or device.type == "cpu"


def assert_same(got: Trajectory, want: Trajectory, exact: bool) -> None:
    pairs = list(zip(got.tables + got.states, want.tables + want.states))
    if exact:
        assert got.losses == want.losses and got.grad_sq == want.grad_sq
        assert all(torch.equal(a, b) for a, b in pairs)
        return
    assert got.losses == pytest.approx(want.losses, rel=RTOL) and got.grad_sq == pytest.approx(want.grad_sq, rel=RTOL)
    for a, b in pairs:
        torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("device", DEVICES, ids=str)
@pytest.mark.parametrize("cfg", allowed_configs(), ids=config_id)
def test_every_mode_follows_the_dense_trajectory(cfg: EmbeddingConfig, device: torch.device):
    got = train(cfg, device)
    if cfg.placement == "cached":  # the caches really evicted (and wrote back) rows along the way
        assert got.counters["param_bytes_d2h"] > 0 and got.counters["state_bytes_d2h"] > 0
    assert_same(got, reference(device), exact=numerics_vs_dense(cfg) == "exact")
    if cfg.grad_mode != "dense":
        assert_same(got, reference(device, "fused"), exact=exact_vs_device_fused(cfg, device))


def test_the_reference_really_trains():
    first = EmbeddingStore(TABLE_ROWS, DIM, BASE, torch.device("cpu"), SEED).full_tables()
    trained = reference(torch.device("cpu"))
    assert not torch.equal(first[0], trained.tables[0])
    assert trained.losses[-1] < trained.losses[0]


@pytest.mark.parametrize("placement", ["device", "host", "cached"])
def test_gradients_of_several_backwards_add_up_before_one_step(placement: str):
    sparse = train(replace(BASE, placement=placement, grad_mode="sparse"), torch.device("cpu"), batches_per_step=2)
    dense = train(BASE, torch.device("cpu"), batches_per_step=2)
    assert_same(sparse, dense, exact=False)


def test_cache_fractions_and_pinning_do_not_change_the_numbers():
    cpu = torch.device("cpu")
    want = train(replace(BASE, placement="cached", grad_mode="fused"), cpu)
    for fractions in ((1.0, 0.01), (0.01, 1.0), (0.3, 0.3)):  # the last: the state rides in the weights' slots
        cfg = replace(BASE, placement="cached", grad_mode="fused", cache_fraction=fractions[0],
                      opt_state_cache_fraction=fractions[1], pin_memory=True)  # pinning is skipped without CUDA
        assert_same(train(cfg, cpu), want, exact=True)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned host memory needs CUDA")
@pytest.mark.parametrize("placement", ["host", "cached"])
def test_pinned_host_rows_and_gradients_give_the_same_numbers_on_cuda(placement: str):
    """Pinned, the rows go up and the gradients and evicted rows come down through page-locked buffers."""
    cuda = torch.device("cuda")
    cfg = replace(BASE, placement=placement, grad_mode="sparse" if placement == "host" else "fused",
                  cache_fraction=0.01, opt_state_cache_fraction=0.01)  # small caches: rows are written back
    assert_same(train(replace(cfg, pin_memory=True), cuda), train(cfg, cuda), exact=True)


def test_a_cache_index_is_on_the_host_or_the_device():
    """Where the batch's ids go, for the loader (ahead) and the store alike: to the device with the tables or with
    the caches' bookkeeping, else to the host. (On a CPU both are the same place, so the numbers are compared on
    CUDA only, below.)"""
    with pytest.raises(ConfigError, match="cache_index must be one of host, device, not 'gpu'"):
        replace(BASE, cache_index="gpu")
    cached_on = {index: replace(BASE, placement="cached", grad_mode="fused", cache_index=index)
                 for index in ("host", "device")}
    assert cached_on["device"].ids_on_device and not cached_on["host"].ids_on_device
    assert replace(BASE, placement="device").ids_on_device
    assert not replace(BASE, placement="host", grad_mode="sparse", cache_index="device").ids_on_device


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a cache index on the device needs CUDA")
@pytest.mark.parametrize("grad_mode", ["sparse", "fused"])
@pytest.mark.parametrize("fractions", [(0.01, 0.01), (0.01, 0.3)], ids=["riding", "apart"])
def test_a_cache_index_on_the_device_gives_the_same_numbers_and_counters(grad_mode, fractions):
    """Knob embedding_cache_index device: the batch's ids, its distinct rows and every cache decision on the
    device; the trained values bitwise those of the host's bookkeeping, and the same traffic."""
    cuda = torch.device("cuda")
    cfg = replace(BASE, placement="cached", grad_mode=grad_mode, cache_fraction=fractions[0],
                  opt_state_cache_fraction=fractions[1])  # small caches: rows are evicted and written back
    on_device, on_host = train(replace(cfg, cache_index="device"), cuda), train(cfg, cuda)
    assert_same(on_device, on_host, exact=True)
    assert on_device.counters == on_host.counters and on_host.counters["bytes_d2h"] > 0


@pytest.mark.parametrize("device", DEVICES, ids=str)
@pytest.mark.parametrize("index", ["host", "device"])
@pytest.mark.parametrize("grad_mode", ["sparse", "fused"])
@pytest.mark.parametrize("fractions", [(0.01, 0.01), (0.01, 0.3)], ids=["riding", "apart"])
def test_cache_overlap_gives_the_same_numbers_and_counters(device, index, grad_mode, fractions):
    """Knob embedding_cache_overlap: decisions on the caches' own stream (CUDA, index on the device) and write-backs
    from a worker thread (everywhere) move the same rows between the same slots: bitwise the same training and
    traffic. Small caches, so that most steps evict and write back, and rows evicted at one step come back."""
    if index == "device" and device.type == "cpu":
        pytest.skip("on a CPU both indexes are the same place")
    cfg = replace(BASE, placement="cached", grad_mode=grad_mode, cache_index=index, cache_fraction=fractions[0],
                  opt_state_cache_fraction=fractions[1], pin_memory=device.type == "cuda")
    overlapped, plain = train(replace(cfg, cache_overlap=True), device), train(cfg, device)
    assert_same(overlapped, plain, exact=True)
    assert overlapped.counters == plain.counters and plain.counters["bytes_d2h"] > 0


def test_cache_overlap_keeps_the_ids_on_the_host_for_the_caches_to_copy():
    """With cache_overlap the loader leaves the ids on the host: the caches copy them on their own stream, where a
    copy on the step's stream would queue behind the previous step."""
    cfg = replace(BASE, placement="cached", grad_mode="fused", cache_index="device")
    assert cfg.ids_on_device and not replace(cfg, cache_overlap=True).ids_on_device


# -- counters ------------------------------------------------------------------------------------
UNIQUE_LOOKUPS = sum(int(b.ids[t].unique().numel()) for b in BATCHES for t in range(len(TABLE_ROWS)))


def cached(**kw) -> EmbeddingConfig:
    return replace(BASE, placement="cached", grad_mode="fused", **kw)


def test_small_cache_misses_and_hits_and_moves_bytes():
    c = train(cached(cache_fraction=0.01, opt_state_cache_fraction=0.01), torch.device("cpu")).counters
    assert c["misses"] > 0 and c["hits"] > 0 and c["bytes_h2d"] > 0 and c["bytes_d2h"] > 0
    assert c["hits"] + c["misses"] == UNIQUE_LOOKUPS
    assert c["state_hits"] + c["state_misses"] == UNIQUE_LOOKUPS  # one state update per looked-up row
    assert c["miss_rate"] == pytest.approx(c["misses"] / UNIQUE_LOOKUPS)
    assert c["cache_rows"] == sum(MAX_UNIQUE) == sum(c[f"cache_rows_t{t}"] for t in range(len(TABLE_ROWS)))
    assert c["bytes_h2d"] == c["param_bytes_h2d"] + c["state_bytes_h2d"]
    assert c["param_bytes_h2d"] == c["param_misses"] * DIM * 4 and c["state_bytes_h2d"] == c["state_misses"] * 4


def test_equal_caches_share_their_slots():
    """With equal capacities the optimizer state rides in the weights' slots (one set of decisions a step): its
    hits and misses are the weights', its bytes its own rows', and every trained value is bitwise that of two
    caches deciding apart (a state cache one row per table larger)."""
    cpu = torch.device("cpu")
    same, larger = cached(cache_fraction=0.3, opt_state_cache_fraction=0.3), cached(
        cache_fraction=0.3, opt_state_cache_fraction=0.3 + 1.5 / min(TABLE_ROWS))
    assert isinstance(EmbeddingStore(TABLE_ROWS, DIM, same, cpu, SEED)._rows.states, SharedSlotRows)
    assert isinstance(EmbeddingStore(TABLE_ROWS, DIM, larger, cpu, SEED)._rows.states, TableCaches)
    got = train(same, cpu)
    assert_same(got, train(larger, cpu), exact=True)
    c = got.counters
    assert (c["state_hits"], c["state_misses"]) == (c["param_hits"], c["param_misses"])
    assert c["state_bytes_h2d"] == c["state_misses"] * 4 and c["state_bytes_d2h"] > 0


def test_an_update_after_its_rows_were_evicted_prepares_them_again(monkeypatch):
    """Backward's fused update reuses the slots its lookup prepared when no row has been evicted since; two
    lookups before one backward can evict the first's rows (small caches), and then its update prepares them
    again. The trained tables are bitwise those of caches that hold every row, where every update reused its
    lookup's slots."""
    cpu = torch.device("cpu")
    again = []
    prepare = TableCaches.prepare
    monkeypatch.setattr(TableCaches, "prepare", lambda self, rows, record=True, held=None: (
        again.append(rows.numel()) if not record else None) or prepare(self, rows, record, held))

    def two_lookups_a_step(fraction: float) -> tuple[list[torch.Tensor], int]:
        again.clear()
        store = EmbeddingStore(TABLE_ROWS, DIM, cached(cache_fraction=fraction, opt_state_cache_fraction=fraction),
                               cpu, SEED, max_unique_per_batch=MAX_UNIQUE)
        head, target = linear_task(cpu)
        for step in range(0, STEPS, 2):
            store.zero_grad()
            sum((store(batch) @ head - target).pow(2).mean() for batch in BATCHES[step:step + 2]).backward()
            store.optimizer_step()
        return store.full_tables() + store.full_optimizer_states(), len(again)

    (small, prepared_again), (whole, reused_all) = two_lookups_a_step(0.01), two_lookups_a_step(1.0)
    assert prepared_again > 0 and reused_all == 0
    assert all(torch.equal(a, b) for a, b in zip(small, whole))


def test_the_current_tables_of_a_cache_are_its_host_rows_written_back():
    """What the parameter digest reads: for a cache, the host rows once every cached row is written back, without
    a copy. Equal to full_tables() mid-training (with dirty rows cached), and training goes on bitwise as
    without the look."""
    cpu, cfg = torch.device("cpu"), cached(cache_fraction=0.01, opt_state_cache_fraction=0.01)
    store = EmbeddingStore(TABLE_ROWS, DIM, cfg, cpu, SEED, access_counts=COUNTS, max_unique_per_batch=MAX_UNIQUE)
    head, target = linear_task(cpu)
    for step, batch in enumerate(BATCHES):
        store.zero_grad()
        (store(batch) @ head - target).pow(2).mean().backward()
        store.optimizer_step()
        if step == STEPS // 2:
            current = store.current_tables()
            assert all(torch.equal(a, b) for a, b in zip(current, store.full_tables()))
            assert current[0].data_ptr() == store._rows.params.host_rows.data_ptr()  # no copy
    assert all(torch.equal(a, b) for a, b in zip(store.full_tables(), train(cfg, cpu).tables))


def test_bigger_cache_misses_less_and_caches_are_independent():
    cpu = torch.device("cpu")
    small = train(cached(cache_fraction=0.01, opt_state_cache_fraction=0.9), cpu).counters
    big = train(cached(cache_fraction=0.9, opt_state_cache_fraction=0.01), cpu).counters
    assert big["misses"] < small["misses"] and big["state_misses"] > small["state_misses"]
    assert big["cache_rows"] > small["cache_rows"] and big["state_cache_rows"] < small["state_cache_rows"]


def test_device_placement_has_no_misses_and_no_traffic():
    c = reference(torch.device("cpu")).counters
    assert c["hits"] == c["misses"] == c["bytes_h2d"] == c["bytes_d2h"] == c["cache_rows"] == 0


@pytest.mark.parametrize("pool_on_host", [False, True])
def test_host_lookup_traffic(pool_on_host: bool):
    c = train(replace(BASE, placement="host", grad_mode="sparse", pool_on_host=pool_on_host),
              torch.device("cpu")).counters
    per_vector = DIM * 4
    if pool_on_host:  # pooled vectors go up, their gradients come down
        assert c["bytes_h2d"] == c["bytes_d2h"] == STEPS * len(TABLE_ROWS) * BATCH * per_vector
    else:  # each distinct row goes up once, its gradient comes down once
        assert c["bytes_h2d"] == c["bytes_d2h"] == UNIQUE_LOOKUPS * per_vector
    assert c["misses"] == 0


def test_evaluation_lookups_are_not_counted_and_change_nothing():
    store = EmbeddingStore(TABLE_ROWS, DIM, cached(), torch.device("cpu"), SEED, max_unique_per_batch=MAX_UNIQUE)
    with torch.no_grad():
        first = store(BATCHES[0])
        second = store(BATCHES[0])
    assert torch.equal(first, second) and store.counters()["hits"] + store.counters()["misses"] == 0


# -- construction ----------------------------------------------------------------------------------
def test_initial_weights_are_identical_across_placements():
    cpu = torch.device("cpu")
    tables = [EmbeddingStore(TABLE_ROWS, DIM, replace(BASE, placement=p, grad_mode="fused"), cpu, SEED,
                             max_unique_per_batch=MAX_UNIQUE).full_tables() for p in ("device", "host", "cached")]
    for other in tables[1:]:
        assert all(torch.equal(a, b) for a, b in zip(tables[0], other))
    assert not torch.equal(tables[0][0][:50], tables[0][1][:50])     # tables are drawn independently
    assert float(torch.cat([t.flatten() for t in tables[0]]).std()) == pytest.approx(BASE.init_std, rel=0.1)


def test_the_store_owns_its_tables():
    dense = EmbeddingStore(TABLE_ROWS, DIM, BASE, torch.device("cpu"), SEED)
    fused = EmbeddingStore(TABLE_ROWS, DIM, replace(BASE, grad_mode="fused"), torch.device("cpu"), SEED)
    assert list(dense.parameters()) == [] and list(fused.parameters()) == []  # never in a trainer's Adam
    assert [p.shape for p in dense.dense_parameters()] == [(sum(TABLE_ROWS), DIM)]  # one shared row space
    assert fused.dense_parameters() == []


@pytest.mark.parametrize("placement", ["host", "cached"])
def test_dense_gradients_need_device_placement(placement: str):
    with pytest.raises(ConfigError, match="grad_mode dense needs placement device"):
        EmbeddingConfig(placement=placement, grad_mode="dense")


@pytest.mark.parametrize("field,value", [("placement", "gpu"), ("grad_mode", "adam"), ("eviction", "fifo"),
                                         ("cache_plan", "greedy"), ("cache_fraction", 0.0), ("lr", -1.0)])
def test_bad_values_are_config_errors(field: str, value):
    with pytest.raises(ConfigError):
        replace(BASE, **{field: value})


def test_cache_smaller_than_a_batch_is_a_config_error():
    store = EmbeddingStore(TABLE_ROWS, DIM, cached(cache_fraction=0.01), torch.device("cpu"), SEED)
    with pytest.raises(ConfigError, match="row cache holds 1 rows but one batch needs"):
        store(BATCHES[0])


def test_planned_cache_needs_access_counts():
    with pytest.raises(ConfigError, match="needs access_counts"):
        EmbeddingStore(TABLE_ROWS, DIM, cached(cache_plan="planned"), torch.device("cpu"), SEED)


def test_rowwise_adagrad_in_place_rounds_as_the_formula_reads():
    """One temporary instead of four, the same bits: each operation is the formula's, in its order."""
    from targets.haste_rec.embeddings.row_ops import apply_rowwise_adagrad_
    gen = torch.Generator().manual_seed(5)
    weight, state = torch.randn(50, 16, generator=gen), torch.rand(50, 1, generator=gen)
    index, grads = torch.tensor([1, 4, 9, 30, 49]), torch.randn(5, 16, generator=gen)
    lr, eps = 0.05, 1e-8
    want_state = state[index] + grads.pow(2).mean(dim=1, keepdim=True)
    want_rows = weight[index] - lr * grads / (want_state.sqrt() + eps)
    got_w, got_s = weight.clone(), state.clone()
    apply_rowwise_adagrad_(got_w, index, got_s, index, grads, lr, eps)
    assert torch.equal(got_w[index], want_rows) and torch.equal(got_s[index], want_state)
    untouched = torch.ones(50, dtype=torch.bool).index_fill_(0, index, False)
    assert torch.equal(got_w[untouched], weight[untouched]) and torch.equal(got_s[untouched], state[untouched])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="device syncs exist on CUDA only")
def test_segment_sums_and_the_fused_update_never_wait_on_the_device():
    """The fused update's backward queues its work without reading anything back (segment_reduce's own checks
    of the lengths would read two values back: ``row_ops.segment_sum``)."""
    from targets.haste_rec.embeddings.row_ops import segment_sum, unique_ids
    cuda = torch.device("cuda")
    ids = torch.randint(0, 50, (400,), device=cuda)
    rows, inverse, counts = unique_ids(ids)  # the one read-back a data-dependent row count needs
    values = torch.randn(400, 8, device=cuda)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        summed = segment_sum(values, inverse, counts)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    expected = torch.zeros(rows.numel(), 8, device=cuda).index_add_(0, inverse, values)
    torch.testing.assert_close(summed, expected)
