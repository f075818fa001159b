"""Preparing the next batch's cache lookup on a thread of its own while the step runs (knob
embedding_cache_prefetch), TorchRec's prefetch pipeline for SparseGear's device caches.

At `large-cached` the best configuration found on 2026-12-03 was host-bound: of a step's 12.1 ms of host time,
5.5 went to the embedding lookup, 4.2 of it to the caches' prepare (deciding slots, gathering missed rows from
the host tables, copying them in; ``benchmarks/embed_host.py`` on an H200, 2026-12-04), where its 2026-12-03 profile
had the device busy 1.4 ms in `embed`. That work needs only the next batch's ids, so it can run on a second host
thread beside the current step's dense forward, backward and optimizer, which are also host-bound: torch releases
the GIL inside each operation, and the gathers are long operations. Side by side on the H200 (``sg-opt bench
--vs``, 2026-12-04) that configuration stepped in 9.25 ms with it against 11.84 without (ratio 0.788).

What keeps it exact: batch k+1's prepare runs before batch k's update, so it must not evict a row of batch k
(its slot would then hold another row when the update writes it). The prepare therefore holds batch k's slots as
if it used them (``TableCaches.prepare(held=...)``); a table must hold both batches' rows, checked at each
prepare. Rows it evicts are not in batch k or k+1, so their last writes were queued before it started, on the
same stream its read-back of their values is queued on. Nothing else touches the caches' metadata while it runs:
every other use waits for it first (``wait``). The decisions differ from a run without prefetch (two batches'
rows are held, not one), but a row's value is the same wherever it sits, so the numbers are identical
(``tests/haste_rec/cache/test_cache_prefetch.py`` compares the trajectories bit for bit).
"""

from __future__ import annotations

import functools
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable

import torch


class PrefetchThread:
    """One worker thread and at most one job on it: the lookup of the batch `key` names, being prepared."""

    def __init__(self, device: torch.device):
        self.device = device
        self._pool: ThreadPoolExecutor | None = None
        self._pending: Future | None = None
        self._key: Any = None
        self.taken = 0  # lookups the trainer took from the thread

    def _start(self) -> None:
        """The thread (on first use), on the trainer's CUDA device: the current device is per thread (a device
        named without an index is the caller's current one)."""
        initializer = None
        if self.device.type == "cuda":
            index = torch.cuda.current_device() if self.device.index is None else self.device.index
            initializer = functools.partial(torch.cuda.set_device, index)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="cache-prefetch", initializer=initializer)

    def submit(self, key: Any, prepare: Callable[..., Any], *args: Any) -> None:
        """Run ``prepare(*args)`` on the thread for the batch `key` (after the job before it, if any)."""
        self.drain()
        if self._pool is None:
            self._start()
        self._pending, self._key = self._pool.submit(_without_grad, prepare, *args), key

    def take(self, key: Any) -> Any:
        """The prepared lookup of batch `key` (waiting for it), or None if the job running is for another batch or
        there is none (that job is finished first and its lookup dropped)."""
        if self._pending is None or self._key is not key:
            self.drain()
            return None
        pending, self._pending, self._key = self._pending, None, None
        lookup = pending.result()
        self.taken += 1
        return lookup

    def wait(self) -> None:
        """Wait for the job, if any, keeping its lookup for ``take``; re-raises its error."""
        if self._pending is not None:
            self._pending.result()

    def drain(self) -> None:
        """Wait for the job, if any, and drop its lookup; re-raises its error."""
        pending, self._pending, self._key = self._pending, None, None
        if pending is not None:
            pending.result()


def _without_grad(fn: Callable[..., Any], *args: Any) -> Any:
    with torch.no_grad():  # grad mode is per thread
        return fn(*args)
