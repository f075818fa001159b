"""Knob embedding_cache_prefetch: the next batch's lookup is prepared on a thread while the step runs.

The contract: the trained numbers are bitwise those without it (decisions differ, values never), the rows of the
batch before are never evicted by the prefetch that holds them, and a cache too small for two batches says so.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from targets.haste_rec.cache.table_caches import TableCaches
from targets.haste_rec.embeddings.embeddings import EmbeddingStore
from targets.protocol import ConfigError
from targets.worker import build_session, open_device
from targets.worker_protocol import WorkerRequest
from tests.haste_rec.cache.test_cache import one_intra_op_thread  # noqa: F401 (autouse)
from tests.haste_rec.embeddings.test_embeddings import (BASE, DEVICES, DIM, MAX_UNIQUE, SEED, STEPS, TABLE_ROWS,
                                                        Trajectory, assert_same, train)


def train_prefetching(cfg, device: torch.device) -> Trajectory:
    """``test_embeddings.train``, which hands a prefetching store each next batch as the session does."""
    trajectory = train(cfg, device)
    assert trajectory.counters["cache_prefetched"] == STEPS - 1  # every step but the first took its lookup from it
    return trajectory


@pytest.mark.parametrize("device", DEVICES, ids=str)
@pytest.mark.parametrize("index", ["host", "device"])
@pytest.mark.parametrize("grad_mode", ["sparse", "fused"])
@pytest.mark.parametrize("fractions", [(0.01, 0.01), (0.01, 0.3)], ids=["riding", "apart"])
@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlap"])
def test_prefetch_trains_bitwise_as_without_it(device, index, grad_mode, fractions, overlap):
    """Small caches (each table's floor: two batches' distinct rows), so that most steps evict and write back rows
    the next batches need again."""
    if index == "device" and device.type == "cpu":
        pytest.skip("on a CPU both indexes are the same place")
    cfg = replace(BASE, placement="cached", grad_mode=grad_mode, cache_index=index, cache_fraction=fractions[0],
                  opt_state_cache_fraction=fractions[1], cache_overlap=overlap, pin_memory=device.type == "cuda")
    prefetched, plain = train_prefetching(replace(cfg, cache_prefetch=True), device), train(cfg, device)
    assert_same(prefetched, plain, exact=True)
    assert prefetched.counters["bytes_d2h"] > 0  # rows were evicted and written back


def test_a_prefetch_never_evicts_the_rows_it_holds():
    """Two tables of 4 cache slots each. Batch A takes 2 slots of each; batch B, prepared holding A's slots, misses
    2 rows per table: they must go to the 2 slots A does not use, though A's are the oldest."""
    host = torch.arange(40, dtype=torch.float32).view(20, 2)
    caches = TableCaches(host, (10, 10), (4, 4), "lru", torch.device("cpu"))
    caches.prepare(torch.tensor([0, 1, 2, 3, 10, 11, 12, 13]))  # fills both tables
    a_rows = torch.tensor([0, 1, 10, 11])
    a_slots = caches.prepare(a_rows)
    caches.prepare(torch.tensor([2, 3, 12, 13]))  # A's rows are now the least recently used
    b_slots = caches.prepare(torch.tensor([4, 5, 14, 15]), held=a_slots)
    assert torch.equal(caches.slot_of_row[a_rows], a_slots)  # A's rows stayed where A's update will write them
    assert not set(b_slots.tolist()) & set(a_slots.tolist())
    assert torch.equal(caches.device_rows[b_slots], host[[4, 5, 14, 15]])
    # the same prepare without the hold evicts A's rows, the oldest
    plain = TableCaches(host, (10, 10), (4, 4), "lru", torch.device("cpu"))
    for rows in ([0, 1, 2, 3, 10, 11, 12, 13], [0, 1, 10, 11], [2, 3, 12, 13], [4, 5, 14, 15]):
        plain.prepare(torch.tensor(rows))
    assert (plain.slot_of_row[a_rows] < 0).all()


def test_two_batches_that_do_not_fit_are_a_config_error():
    caches = TableCaches(torch.zeros(20, 2), (10, 10), (4, 4), "lru", torch.device("cpu"))
    held = caches.prepare(torch.tensor([0, 1, 2, 10]))
    with pytest.raises(ConfigError, match="two batches need 5 distinct rows.*embedding_cache_prefetch off"):
        caches.prepare(torch.tensor([3, 4, 11]), held=held)


def test_the_cache_floor_is_two_batches_with_prefetch():
    cfg = replace(BASE, placement="cached", grad_mode="fused", cache_fraction=0.01, opt_state_cache_fraction=0.01)
    plain = EmbeddingStore(TABLE_ROWS, DIM, cfg, torch.device("cpu"), SEED, max_unique_per_batch=MAX_UNIQUE)
    ahead = EmbeddingStore(TABLE_ROWS, DIM, replace(cfg, cache_prefetch=True), torch.device("cpu"), SEED,
                           max_unique_per_batch=MAX_UNIQUE)
    assert plain.cache_rows == MAX_UNIQUE
    assert ahead.cache_rows == [min(2 * u, rows) for u, rows in zip(MAX_UNIQUE, TABLE_ROWS)]


def tiny_session(knobs: dict):
    """A tiny trainer session on the CPU, built as a worker builds it."""
    req = WorkerRequest(target="haste-rec", size="tiny", mode="bench", config=knobs, device="cpu")
    return build_session(req, open_device(req), None)[3]


def session_trajectory(knobs: dict, steps: int = 6, probe_every: int = 0) -> tuple[list[float], list, dict, dict]:
    """Losses, probes (every `probe_every` steps, between them, as a numerics run reads them), the final parameter
    digest and counters of a tiny session on the CPU."""
    session = tiny_session(knobs)
    losses, probes = [], []
    for step in range(steps):
        losses.append(float(session.step()))
        if probe_every and step % probe_every == 0:
            probes.append(session.probe())
    return losses, probes, session.param_digest(), session.counters()


KNOBS = {"embedding_placement": "cached", "embedding_grad_mode": "fused", "embedding_cache_fraction": 0.05,
         "embedding_opt_state_cache_fraction": 0.05}


def test_the_trainer_with_prefetch_trains_bitwise_as_without_it():
    """The session hands each next batch to the store (``HasteRecSession._next_batch``): same losses and
    parameters, and every step after the first used a prefetched lookup."""
    plain_losses, _, plain_digest, _ = session_trajectory(KNOBS)
    losses, _, digest, counters = session_trajectory(KNOBS | {"embedding_cache_prefetch": True})
    assert losses == plain_losses and digest == plain_digest
    assert counters["cache_prefetched"] == 5 and counters["bytes_d2h"] > 0


def test_probes_between_steps_leave_the_prefetch_exact():
    """A probe between two steps looks up its own rows while the next batch's prefetched lookup waits: it may evict
    that batch's rows, which the step then prepares again. Probes, losses and parameters as without prefetch."""
    plain = session_trajectory(KNOBS, steps=8, probe_every=2)
    prefetched = session_trajectory(KNOBS | {"embedding_cache_prefetch": True}, steps=8, probe_every=2)
    assert prefetched[:3] == plain[:3]
    assert prefetched[3]["cache_prefetched"] == 7


def test_the_prepared_lookup_counts_as_a_banked_step():
    """While the other side of a measurement runs its block, the prefetch thread prepares this side's next lookup:
    like a batch the loader built meanwhile, the first step of the next block would take it for free, so the
    timed window first runs one more step untimed (``targets.worker.banked_steps``)."""
    plain, ahead = tiny_session(KNOBS), tiny_session(KNOBS | {"embedding_cache_prefetch": True})
    plain.step()
    ahead.step()
    assert ahead.banked_steps == plain.banked_steps + 1
