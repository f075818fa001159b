"""WriteBehind: write-backs land behind the host's back, and a wait covers exactly the table it names.

The trainer-level contract (overlap trains bitwise as without it) is in test_embeddings; here the ordering
that contract rests on: a gather waits for its table's earlier write-backs, never for another table's.
"""

from __future__ import annotations

import threading

import pytest
import torch

from targets.haste_rec.cache.cache_overlap import CacheStream, WriteBehind
from targets.haste_rec.cache.row_cache import RowMoves, move_rows


class Gate:
    """Stands for the CUDA event after a device->host copy: ``synchronize`` blocks until the test opens it."""

    def __init__(self):
        self.opened = threading.Event()

    def synchronize(self) -> None:
        assert self.opened.wait(timeout=30)


def test_a_write_back_lands_once_its_copy_has_arrived_and_a_wait_names_its_table():
    behind = WriteBehind()
    weights, other = torch.zeros(6, 2), torch.zeros(6, 1)
    gate = Gate()
    behind.submit(weights, torch.tensor([1, 4]), torch.tensor([[1.0, 2.0], [3.0, 4.0]]), gate)
    behind.wait(other)  # another table's wait does not wait for this one (it would block for 30 s)
    assert torch.count_nonzero(weights) == 0  # its copy has not "arrived": nothing written yet
    gate.opened.set()
    behind.wait(weights)
    assert weights[1].tolist() == [1.0, 2.0] and weights[4].tolist() == [3.0, 4.0]


def test_a_failed_write_back_is_raised_at_the_next_wait():
    behind = WriteBehind()
    behind.submit(torch.zeros(3, 2), torch.tensor([5]), torch.ones(1, 2), None)  # row 5 of 3
    with pytest.raises(IndexError):
        behind.wait()


class SlowCopies(WriteBehind):
    """Each write-back's copy "arrives" 0.3 s after it was queued: a gather that did not wait for it would read
    the host's stale row."""

    def submit(self, host, rows, values, copied):
        gate = Gate()
        threading.Timer(0.3, gate.opened.set).start()
        super().submit(host, rows, values, gate)


def test_a_gather_sees_the_rows_an_earlier_prepare_wrote_back():
    """Prepare 1 evicts row 2 from slot 0 (written behind); prepare 2 loads row 2 again into slot 1: it must
    read the written-back value, not the host's stale one."""
    host, cache = torch.zeros(4, 3), torch.zeros(2, 3)
    cache[0] = 7.0  # row 2's trained value, in slot 0
    behind, cpu = SlowCopies(), torch.device("cpu")
    empty = torch.zeros(0, dtype=torch.int64)
    move_rows(host, cache, RowMoves(torch.tensor([2]), torch.tensor([0]), torch.tensor([3]), torch.tensor([0])), cpu,
              False, behind)
    move_rows(host, cache, RowMoves(empty, empty, torch.tensor([2]), torch.tensor([1])), cpu, False, behind)
    assert cache[1].tolist() == [7.0, 7.0, 7.0] and host[2].tolist() == [7.0, 7.0, 7.0]


def test_without_cuda_the_caches_decide_on_the_callers_stream():
    stream = CacheStream(torch.device("cpu"), enabled=True)
    assert not stream.enabled
    with stream.deciding():
        pass
    stream.hand_over(torch.zeros(1))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="streams need CUDA")
def test_an_overlapped_prepare_does_not_wait_for_the_step_stream():
    """The point of the overlap: with the step's stream busy (a kernel spinning for about a second), a prepare that
    evicts and writes back returns while that stream still runs, and decides as a plain prepare does, which waits
    for it (its read-backs run on the step's stream)."""
    import time
    from targets.haste_rec.cache.table_caches import TableCaches
    cuda = torch.device("cuda")
    table_rows, starts = [2000, 600], [0, 2000]
    host = torch.randn(sum(table_rows), 4, generator=torch.Generator().manual_seed(0))
    batches = [torch.cat([torch.randint(0, n, (300,), generator=torch.Generator().manual_seed(i * 7 + t)).unique() + s
                          for t, (n, s) in enumerate(zip(table_rows, starts))]) for i in range(12)]
    caches = {overlap: TableCaches(host.clone(), table_rows, [400, 400], "lru", cuda, pin_memory=True,
                                   index_device=cuda, overlap=overlap) for overlap in (False, True)}
    for cache in caches.values():
        for rows in batches[:8]:
            cache.replay(rows)
        cache.load_resident()
        cache.prepare(batches[8].to(cuda))  # a first prepare: the page-locked staging buffers are allocated here
    rows = batches[9].to(cuda)
    torch.cuda.synchronize()
    slots, still_busy = {}, {}
    for overlap, cache in caches.items():
        torch.cuda._sleep(2_000_000_000)  # the step's stream busy for about a second
        begin = time.perf_counter()
        slots[overlap] = cache.prepare(rows)
        still_busy[overlap] = not torch.cuda.current_stream().query()
        torch.cuda.synchronize()
        assert time.perf_counter() - begin > 0.1  # the spin was long enough to tell the two apart
    assert still_busy == {False: False, True: True}
    assert torch.equal(slots[False], slots[True]) and caches[True].counters()["bytes_d2h"] > 0
    caches[True].flush()
    caches[False].flush()
    assert torch.equal(caches[True].host_rows, caches[False].host_rows)
