"""Data loading for the trainer: a deterministic batch stream, optional worker processes, pinned
memory and a side-stream prefetcher. Every knob here changes only when and where a batch is built,
never its contents, so all settings yield the same batches in the same order (class ``exact``)."""

from __future__ import annotations

from typing import Any, Callable, Iterator, Protocol

import os
import sys

import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from targets.haste_rec.data.batch import Batch
from targets.haste_rec.data.shared_ring import RingLoader, RingUnavailable
from targets.worker_client import cpu_count

RING_SWITCH = "SG_OPT_LOADER_RING"  # "0": packed batches cross from loader workers as DataLoader storages

PREFETCH_FACTOR = 4  # batches each loader worker builds ahead


class BatchSource(Protocol):
    def train_batch(self, index: int) -> Batch: ...


class BatchStream(IterableDataset):
    """Yields train batches start, start+1, ...; with n workers, worker w builds every n-th one.

    DataLoader takes from its workers round-robin, so the order seen by the trainer is the same
    for any number of workers. ``prepare`` (e.g. ``TableLayout.pack``) runs where the batch is built,
    in the worker when there are workers.
    """

    def __init__(self, source: BatchSource, start: int = 0, prepare: Callable[[Batch], Any] | None = None):
        self.source, self.start, self.prepare = source, start, prepare

    def __iter__(self) -> Iterator[Any]:
        info = get_worker_info()
        worker, workers = (0, 1) if info is None else (info.id, info.num_workers)
        index = self.start + worker
        while True:
            batch = self.source.train_batch(index)
            yield batch if self.prepare is None else self.prepare(batch)
            index += workers


def _pin(batch: Batch) -> Batch:
    return batch.pin_memory()


def leave_cores_to_workers(workers: int) -> None:
    """With ``workers`` loader processes busy beside it, the trainer's intra-op threads leave them a core each.

    With a thread on every core, a busy worker preempts one thread of the trainer's OpenMP team and every parallel
    region then waits at its barrier for that thread's next time slice. On the 2-core VM, steps of short
    parallel gathers, write-backs and top-k took 400 and 696 ms with two threads beside one busy process, 110 ms
    with one thread (``python benchmarks/busy_workers.py``). At large-cached on an H200 (2026-12-01), whose step
    does such host work on 16 threads of 16 CPUs, two and four loader workers made it 1.45x and 2.49x slower.
    Never raises the count (a numerics run's single thread stays single)."""
    if workers:
        torch.set_num_threads(max(1, min(torch.get_num_threads(), cpu_count() - workers)))


def _ring_or_none(source: BatchSource, prepare: Callable[[Batch], Any], workers: int, start: int,
                  pin: bool) -> RingLoader | None:
    """The shared-slot loader, or None (the DataLoader's hand-over, the same batches) where its slots would not fit
    this machine's shared memory; it says so on stderr."""
    try:
        return RingLoader(source, prepare, workers, start, PREFETCH_FACTOR, pin=pin)
    except RingUnavailable as exc:
        print(f"note: {exc}; packed batches cross as storages instead", file=sys.stderr)
        return None


class DeviceBatches:
    """Batches on the training device, built per the data knobs.

    ``prefetch`` (CUDA only) copies batch i+1 to the device on a side stream while step i runs;
    without it each batch is copied when it is needed. ``prepare`` turns each built batch into what the
    trainer takes (a ``PackedBatch`` under pack_batches), in the loader's workers when it has any; packed
    batches from workers cross through shared slots made once (``shared_ring.RingLoader``), other
    batches as DataLoader storages.
    """

    def __init__(self, source: BatchSource, device: torch.device, workers: int = 0, pin_memory: bool = False,
                 prefetch: bool = False, start: int = 0, sparse_on_device: bool = True,
                 prepare: Callable[[Batch], Any] | None = None):
        cuda = device.type == "cuda"
        self.device, self.sparse_on_device = device, sparse_on_device
        self.pin = pin_memory and cuda
        self.ring = (_ring_or_none(source, prepare, workers, start, self.pin)
                     if workers and prepare is not None and os.environ.get(RING_SWITCH, "1") != "0" else None)
        self.loader = self.ring if self.ring is not None else iter(DataLoader(
            BatchStream(source, start, prepare), batch_size=None, num_workers=workers, pin_memory=self.pin,
            prefetch_factor=PREFETCH_FACTOR if workers else None, persistent_workers=workers > 0))
        leave_cores_to_workers(workers)
        self.stream = torch.cuda.Stream(device) if (prefetch and cuda) else None
        # Batches that can be built ahead of the step: the DataLoader keeps up to workers x PREFETCH_FACTOR
        # outstanding (built, being built or being pinned), the ring every slot it does not hold; the side
        # stream copies one more ahead.
        built_ahead = self.ring.ahead if self.ring is not None else workers * PREFETCH_FACTOR
        self.depth = built_ahead + (1 if self.stream else 0)
        self._next: Batch | None = None
        if self.stream is not None:
            self._next = self._copy_async(next(self.loader))

    def _to_device(self, batch: Batch) -> Batch:
        """The batch on the training device; a pinned ring slot's copy is asynchronous, so the slot waits for it."""
        moved = batch.to(self.device, non_blocking=self.pin, sparse=self.sparse_on_device)
        if self.ring is not None and self.ring.pinned:
            event = torch.cuda.Event()
            event.record()
            self.ring.copied(event)
        return moved

    def _copy_async(self, batch: Batch) -> Batch:
        with torch.cuda.stream(self.stream):
            return self._to_device(batch)

    def __next__(self) -> Batch:
        if self.stream is None:
            return self._to_device(next(self.loader))
        torch.cuda.current_stream(self.device).wait_stream(self.stream)
        batch = self._next
        for t in batch.tensors():
            if t.is_cuda:
                t.record_stream(torch.cuda.current_stream(self.device))
        self._next = self._copy_async(next(self.loader))
        return batch

    def __iter__(self) -> "DeviceBatches":
        return self
