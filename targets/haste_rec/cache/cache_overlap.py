"""Taking the device caches' bookkeeping and write-backs off the step's critical path (knob
embedding_cache_overlap).

With the caches' metadata on the device (cache_index device), a prepare is a few dozen small kernels and
about ten read-backs of sizes (how many rows missed, how many each table evicts). On the stream the step runs
on, the first read-back waits for every kernel queued before it: the previous step's tail and backward. The
host then decides and moves rows while the device idles. An H200 profile of large-cached's best
configuration (2026-12-02) had 12.07 ms of host time in `embed` a step, 3.40 of it waiting, while the
device ran 1.61 ms of it.

``CacheStream`` runs the decisions on a high-priority side stream of their own, so that their read-backs wait
only for the bookkeeping: the host decides batch k+1 while the device still runs step k. Every operation on the
caches' metadata runs there (prepares, warming, adoption); the rows' data never moves there: reads and writes
of the cached rows stay on the step's stream, in the step's order, after the main stream has waited for the
decisions (``hand_over``, an event, no host wait).

``WriteBehind`` takes the write-back of evicted rows off the host's path: their values are copied to a
page-locked buffer on the step's stream without waiting, and a worker thread writes them into the host
table once that copy has finished. A gather of host rows first waits for the table's earlier write-backs (a
row evicted at one step may be missed again at the next), never for the one the same prepare queued (the rows
it writes back and the rows it loads are disjoint).

Neither changes a decision or a value: the same rows move between the same slots, in the same order on the
device; only when the host waits for them changes. On the H200 (2026-12-02) that best step ran 1.29x faster
with both (`sg-opt bench --vs`, BENCHMARKS.md).
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import nullcontext

import torch

from targets.haste_rec.cache.row_cache import flat_rows


class CacheStream:
    """A side stream for the caches' decisions on a CUDA `device` when `enabled`, starting after what the
    caller's stream has queued so far (the metadata's initialisation); otherwise every method is a no-op and the
    decisions run where the caller does."""

    def __init__(self, device: torch.device, enabled: bool):
        use = enabled and device.type == "cuda" and torch.cuda.is_available()
        self.device = device
        # Highest priority: its small kernels are scheduled before the waiting blocks of the step's large ones.
        self.stream = torch.cuda.Stream(device, priority=torch.cuda.Stream.priority_range()[1]) if use else None
        if self.stream is not None:
            self.stream.wait_stream(torch.cuda.current_stream(device))

    @property
    def enabled(self) -> bool:
        return self.stream is not None

    def deciding(self):
        """Context in which the decisions' kernels and read-backs run (the side stream when enabled)."""
        return torch.cuda.stream(self.stream) if self.stream is not None else nullcontext()

    def hand_over(self, *tensors: torch.Tensor | None) -> None:
        """The step's stream waits (on the device) for every decision made so far; `tensors` made on the side
        stream are used on the step's stream from here on, so the allocator must not reuse them before it is done."""
        if self.stream is None:
            return
        main = torch.cuda.current_stream(self.device)
        main.wait_stream(self.stream)
        for t in tensors:
            if t is not None and t.is_cuda:
                t.record_stream(main)


class WriteBehind:
    """Write-backs of evicted rows into host tables, carried out by one worker thread after their copies from
    the device have finished; ``wait(host)`` returns once every write-back queued for `host` has landed."""

    def __init__(self):
        self._pool: ThreadPoolExecutor | None = None
        self._pending: dict[int, list[Future]] = {}
        self._lock = threading.Lock()

    def submit(self, host: torch.Tensor, rows: torch.Tensor, values: torch.Tensor,
               copied: torch.cuda.Event | None) -> None:
        """host[rows] = values once `copied` (the event after the device->host copy of values; None: ready)."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="cache-write-behind")

        def write() -> None:
            if copied is not None:
                copied.synchronize()
            flat_rows(host).index_copy_(0, rows, flat_rows(values))

        future = self._pool.submit(write)
        with self._lock:
            self._pending.setdefault(id(host), []).append(future)

    def wait(self, host: torch.Tensor | None = None) -> None:
        """Block until the write-backs queued for `host` (every host table when None) have landed; re-raises a
        failed one's error."""
        with self._lock:
            keys = list(self._pending) if host is None else [id(host)]
            futures = [f for key in keys for f in self._pending.pop(key, [])]
        for future in futures:
            future.result()
