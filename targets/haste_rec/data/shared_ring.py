"""Loader workers that write packed batches into shared-memory slots made once, instead of handing each batch
over as a new shared-memory storage.

torch's DataLoader moves every batch from a worker to the trainer as a fresh storage: the worker creates a
shared-memory segment, the trainer receives its file descriptor over a socket and maps it. On the 2-core VM
that took 4.6 ms a batch even for a 16-byte tensor (a socket connect and a descriptor passed per batch), and
at `large` on an H200 host the data phase of the tuned step spent 1.74 ms of host work on it, in a step
bound by its host. Here the slots exist before the workers are forked, so they share them; a batch crosses
as a slot number and its layout (a few small integers through a pipe).

Worker w builds batches start + w, start + w + n, ... in order, each into a free slot of its own, and the
trainer takes them round-robin: the order, and every byte, are those of the DataLoader path (class
``exact``). A slot comes back to its worker only when the trainer has taken ``HOLD`` more batches, and, when
its bytes were copied to the GPU asynchronously (pinned slots), after that copy has finished (``copied``).
A batch larger than its slot (bags vary around their mean) crosses as a storage of its own, as before.
"""

from __future__ import annotations

import math
import multiprocessing as mp
import os
import weakref
from collections import deque
from multiprocessing.connection import Connection
from typing import Any, Callable

import torch

from targets.haste_rec.data.batch import PackedBatch

SHM = "/dev/shm"
SHM_SHARE = 0.25  # the most of /dev/shm's free space one ring takes (the other side's ring and storages need room)
HOLD = 3          # batches the trainer takes before a slot is reused (the one in use, one prefetched, a spare)
SLOT_HEADROOM = 2  # slot bytes over the first batch's: bags and label lists vary around their means
PAGE = 4096
POLL_S = 1.0      # how often a waiting trainer checks that its workers are still alive


class RingUnavailable(RuntimeError):
    """The slots would not fit this machine's shared memory: the caller hands batches over as storages instead."""


def shared_memory_free() -> int | None:
    """Bytes free in /dev/shm, where the slots live (None where there is no such file system). A container's
    default is 64 MB, and a write to a shared page it cannot back kills the writer with SIGBUS."""
    try:
        stats = os.statvfs(SHM)
    except OSError:
        return None
    return stats.f_bavail * stats.f_frsize


def _worker(source: Any, prepare: Callable[[Any], PackedBatch], slots: torch.Tensor, first: int, step: int,
            free: Connection, filled: Connection, trainers: list[Connection]) -> None:
    """Build batches first, first + step, ... into the slots the trainer hands back, until it goes away.
    ``trainers``: the trainer's ends of this worker's pipes and of those forked before it, closed here, so that
    the worker sees its pipe close when the trainer closes it."""
    for conn in trainers:
        conn.close()
    torch.set_num_threads(1)
    index = first
    try:
        while True:
            slot = free.recv()
            packed = prepare(source.train_batch(index))
            size = packed.buffer.numel()
            if packed.apart is None and size <= slots.shape[1]:
                slots[slot, :size].copy_(packed.buffer)
                filled.send(("slot", slot, packed.layout, size))
            else:  # larger than a slot: as a storage of its own, and the slot straight back to the queue
                packed.buffer.share_memory_()
                filled.send(("own", slot, packed))
            index += step
    except (EOFError, OSError, KeyboardInterrupt):  # the trainer closed its ends: done
        return
    except Exception as exc:  # noqa: BLE001 - the trainer raises it
        try:
            filled.send(("error", type(exc).__name__, str(exc)))
        except OSError:
            pass


class RingLoader:
    """``workers`` processes writing packed batches into ``slots_per_worker`` shared slots each (see the module
    docstring); iterate it for the batches, in order. ``pin`` (a CUDA trainer's, ``loader.DeviceBatches``):
    page-lock the slots once the workers are forked, so copies to the GPU are asynchronous."""

    def __init__(self, source: Any, prepare: Callable[[Any], PackedBatch], workers: int, start: int = 0,
                 slots_per_worker: int = 4, pin: bool = False):
        if workers < 1:
            raise ValueError("a RingLoader needs at least one worker")
        first = prepare(source.train_batch(start))  # sizes the slots (built again by its worker: same bytes)
        slot_bytes = math.ceil(first.buffer.numel() * SLOT_HEADROOM / PAGE) * PAGE
        self.workers, self.per_worker = workers, slots_per_worker + -(-HOLD // workers)
        need, free = workers * self.per_worker * slot_bytes, shared_memory_free()
        if free is not None and need > SHM_SHARE * free:
            raise RingUnavailable(f"the loader's shared slots need {need / 2**20:.0f} MiB of {SHM}, more than "
                                  f"{SHM_SHARE:.0%} of the {free / 2**20:.0f} MiB free there")
        self.slots = torch.empty((workers * self.per_worker, slot_bytes), dtype=torch.uint8).share_memory_()
        ctx = mp.get_context("fork")  # the slots are inherited, not passed
        self.procs, self.free, self.filled = [], [], []
        for w in range(workers):
            free_recv, free_send = ctx.Pipe(duplex=False)
            filled_recv, filled_send = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=_worker, args=(source, prepare, self.slots, start + w, workers, free_recv,
                                                     filled_send, [*self.free, *self.filled, free_send, filled_recv]),
                               daemon=True, name=f"haste-rec-loader-{w}")
            proc.start()
            free_recv.close()
            filled_send.close()
            self.procs.append(proc)
            self.free.append(free_send)
            self.filled.append(filled_recv)
            for s in range(self.per_worker):
                free_send.send(w * self.per_worker + s)
        self.pinned = False
        if pin:  # page-locked once, so each batch's copy to the GPU is asynchronous and direct
            status = torch.cuda.cudart().cudaHostRegister(self.slots.data_ptr(), self.slots.numel(), 0)
            self.pinned = int(status) == 0  # if refused, copies stay synchronous (and correct)
        self.taken = 0
        self.out: deque[list[Any]] = deque()  # [worker, slot, copy event or None] of the batches taken, in order
        self._finalizer = weakref.finalize(self, RingLoader._shut, self.procs, self.free, self.filled,
                                           self.slots if self.pinned else None)

    def __iter__(self) -> "RingLoader":
        return self

    @property
    def ahead(self) -> int:
        """How many batches the workers can have built ahead of the trainer: every slot but the HOLD held."""
        return self.workers * self.per_worker - HOLD

    def __next__(self) -> PackedBatch:
        while len(self.out) >= HOLD:
            worker, slot, event = self.out.popleft()
            if event is not None:
                event.synchronize()
            self._give_back(worker, slot)
        worker = self.taken % self.workers
        message = self._receive(worker)
        if message[0] == "error":
            raise RuntimeError(f"loader worker {worker} failed: {message[1]}: {message[2]}")
        self.taken += 1
        if message[0] == "own":
            _, slot, packed = message
            self._give_back(worker, slot)
            return packed
        _, slot, layout, size = message
        self.out.append([worker, slot, None])
        return PackedBatch(self.slots[slot, :size], layout)

    def copied(self, event: "torch.cuda.Event") -> None:
        """The last batch taken was copied to the GPU asynchronously: its slot waits for ``event``."""
        if self.out:
            self.out[-1][2] = event

    def _give_back(self, worker: int, slot: int) -> None:
        """Return a slot to its worker. One that has exited takes nothing back: if it failed, its error waits in
        its pipe, and ``__next__`` raises it when that worker's turn comes (on an H200 a failed worker had exited
        before the trainer returned its last slot, and the trainer raised a broken pipe instead, 2026-12-01)."""
        try:
            self.free[worker].send(slot)
        except (BrokenPipeError, ConnectionResetError):
            pass

    def _receive(self, worker: int) -> tuple:
        conn, proc = self.filled[worker], self.procs[worker]
        try:
            while not conn.poll(POLL_S):
                if not proc.is_alive():
                    raise EOFError
            return conn.recv()
        except EOFError:
            proc.join(timeout=POLL_S)
            raise RuntimeError(f"loader worker {worker} exited (code {proc.exitcode}) before its next batch") from None

    def close(self) -> None:
        self._finalizer()

    @staticmethod
    def _shut(procs: list, free: list[Connection], filled: list[Connection], pinned: torch.Tensor | None) -> None:
        for conn in free + filled:
            conn.close()
        for proc in procs:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
                proc.join()
        if pinned is not None:
            try:
                torch.cuda.cudart().cudaHostUnregister(pinned.data_ptr())
            except RuntimeError:  # at interpreter exit the CUDA context may be gone already
                pass
