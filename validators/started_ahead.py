"""Timing workers started ahead of their measurement, and the spare pair for the measurement after it.

On a GPU the agent starts a candidate's measurement workers ahead (``WorkerPool.prestart``), while the candidate's
numerics run is still being judged: a timing worker at `large` on an H200 took 12.1 s to get ready (medians
of 52, 2026-11-30), time that otherwise comes after the verdict, once per measured candidate. The measurement
that asks for exactly those workers (same specs, labels, CPUs and code trees) adopts them from the same pool
(``WorkerPool.adopt``); a rejected candidate's are killed (``WorkerPool.discard``), and whatever is left when the
run ends (``WorkerPool.close``); ``SG_OPT_PRESTART=0`` turns it off. Their timed blocks still run
only after both are ready and the numerics run has ended, so the validation's work never overlaps a
timed block. Where memory allows (``pairs_that_fit``), a second pair starts with them for the measurement
after the first (an extension, a confirmation): the first measurement waits for it to be ready too and stops
the processes below it (loader workers) until its own measurement adopts it.
"""

from __future__ import annotations

import os
import tempfile
import threading
from typing import Any, Iterator, Sequence

from targets.worker_protocol import WorkerRequest
from validators import timing_worker
from validators.timing_worker import TimingWorker, resume, shared_cpus, stop_below

PRESTART_SWITCH = "SG_OPT_PRESTART"  # "0": every measurement starts its own workers when it begins
PAIRS_SWITCH = "SG_OPT_PRESTART_PAIRS"  # "1": only the first measurement's pair is started ahead (pairs_that_fit)
PrestartKey = tuple[str, str, tuple[str, str], tuple[int, ...], tuple[str | None, str | None]]
MEMORY_MARGIN = 1.25  # a candidate's worker may need this much more memory than the largest one seen so far
SPARE_WAIT_S = 60.0  # how long a measurement waits for a spare pair after its own workers are ready


def memory_available() -> int | None:
    """Bytes the host can still give without swapping (MemAvailable); None where /proc does not say."""
    try:
        with open("/proc/meminfo") as info:
            for line in info:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def pairs_that_fit(requested: int) -> int:
    """How many of the `requested` pairs of workers to start ahead: more than one only when all the workers the
    machine then holds at once (two a pair, and the numerics run beside them) fit the host's available memory and
    the device's, at the largest footprint a worker of this process has reported times MEMORY_MARGIN. Before any
    worker has reported, one. ``SG_OPT_PRESTART_PAIRS=1`` keeps it at one."""
    if requested <= 1 or os.environ.get(PAIRS_SWITCH) == "1":
        return min(requested, 1)
    host, peak, total = (timing_worker.largest.get(name, 0) for name in ("host_rss", "device_peak", "device_total"))
    if not host:
        return 1
    workers = 2 * requested + 1
    available = memory_available()
    fits_host = available is not None and workers * host * MEMORY_MARGIN <= available
    fits_device = not total or workers * peak * MEMORY_MARGIN <= total
    return requested if fits_host and fits_device else 1


class Prestarted:
    """Workers started ahead of their measurement, and the folder their requests live in. A pair that waits for a
    later measurement (a spare) is waited for and held by the measurement before it (``wait_and_hold``)."""

    def __init__(self, workers: dict[str, TimingWorker], folder: tempfile.TemporaryDirectory):
        self.workers, self.folder = workers, folder
        self.ready: dict[str, dict[str, Any]] = {}  # ready lines read while it waited as a spare
        self.held: list[int] = []  # the processes below its workers, stopped while it waits as a spare

    def wait_and_hold(self, deadline: float) -> None:
        """Both ready, so that no build runs beside the timed blocks of the measurement before its own; then the
        processes below them stopped (their loaders would refill queues beside those blocks: ``ABRunner._hold``)."""
        for side, worker in self.workers.items():
            if side not in self.ready:
                self.ready[side] = worker.ready_line(deadline)
        for worker in self.workers.values():
            self.held += stop_below(worker.proc.pid)

    def release(self) -> None:
        resume(self.held)
        self.held = []

    def close(self) -> None:
        self.release()
        for worker in self.workers.values():
            worker.close(graceful=False)
        self.folder.cleanup()


def prestart_key(a: WorkerRequest, b: WorkerRequest, labels: tuple[str, str] = ("incumbent", "candidate"),
                 cpus: Sequence[int] | None = None,
                 roots: tuple[str | None, str | None] = (None, None)) -> PrestartKey:
    """The key under which workers for a measurement with these arguments are started ahead (``prestart``)."""
    cpus = list(cpus) if cpus is not None else shared_cpus(a, b)
    return (a.model_dump_json(), b.model_dump_json(), tuple(labels), tuple(cpus), tuple(roots))


class WorkerPool:
    """The workers started ahead for the measurements of one run (or of one command that measures), by key: made by
    whoever builds the run, handed to what starts workers (the validate node, a calibration) and to what adopts them
    (``ABRunner``), and closed when the run ends, which kills and reaps whatever no measurement came to.

    Under one key, the pairs wait in the order they will be adopted: the first measurement's, then spares for the ones
    after it (a measurement extended because it leaned faster, the confirmation of a win), each of which would
    otherwise start its own pair once the one before it has ended (12.7-18.3 s until ready at large-cached on an
    H200, 2026-12-03: 9 of the x12.37 run's 18 measurements). Thread-safe: the lanes of --gpus share one pool."""

    def __init__(self) -> None:
        self._waiting: dict[PrestartKey, list[Prestarted]] = {}
        self._lock = threading.Lock()

    def prestart(self, a: WorkerRequest, b: WorkerRequest, timeout_s: float,
                 labels: tuple[str, str] = ("incumbent", "candidate"), cpus: Sequence[int] | None = None,
                 roots: tuple[str | None, str | None] = (None, None), force: bool = False,
                 pairs: int = 1) -> PrestartKey | None:
        """Start the workers of the coming ``ABRunner``s with these arguments now: `pairs` pairs where they fit in
        memory (``pairs_that_fit``; one for ranked sides), each adopted by one measurement in turn. Only where both
        sides build at once (``overlap_builds``: a GPU; ``force`` for tests), since on a CPU they would take the cores
        of the work they are meant to overlap. Returns the key to ``discard`` them by (None: not started)."""
        if not (force or (timing_worker.overlap_builds(a, b) and os.environ.get(PRESTART_SWITCH, "1") != "0")):
            return None
        cpus = list(cpus) if cpus is not None else shared_cpus(a, b)
        key = prestart_key(a, b, labels, cpus, roots)
        self.discard(key)
        entries = []
        ranked = a.ranks > 1 or b.ranks > 1  # a spare's ranks would wait in their collectives, stopped or not
        for _ in range(pairs_that_fit(1 if ranked else pairs)):
            folder = tempfile.TemporaryDirectory(prefix="sg-opt-ab-")
            entries.append(Prestarted(timing_worker.spawn({"a": a, "b": b}, dict(zip("ab", labels)), folder.name,
                                                          cpus, dict(zip("ab", roots)), timeout_s, ("a", "b")),
                                      folder))
        with self._lock:
            self._waiting[key] = entries
        return key

    def waiting(self, key: PrestartKey) -> list[Prestarted]:
        """The pairs still waiting under `key`, first to be adopted first."""
        with self._lock:
            return list(self._waiting.get(key, []))

    def __len__(self) -> int:
        """How many pairs wait, under every key."""
        with self._lock:
            return sum(len(entries) for entries in self._waiting.values())

    def adopt(self, key: PrestartKey) -> tuple[Prestarted | None, list[Prestarted]]:
        """The next pair started ahead under `key` (None: none), and the spares left after it."""
        with self._lock:
            entries = self._waiting.get(key)
            if not entries:
                return None, []
            entry = entries.pop(0)
            if not entries:
                del self._waiting[key]
            return entry, list(entries)

    def drop(self, key: PrestartKey, entry: Prestarted) -> None:
        """Close one pair started ahead (a spare that failed while it waited), so that its measurement starts
        afresh."""
        with self._lock:
            entries = self._waiting.get(key, [])
            if entry in entries:
                entries.remove(entry)
            if not entries:
                self._waiting.pop(key, None)
        entry.close()

    def discard(self, key: PrestartKey | None) -> None:
        """Kill the workers started ahead under ``key`` (None: nothing), if no measurement adopted them."""
        with self._lock:
            gone = self._waiting.pop(key, []) if key is not None else []
        for entry in gone:
            entry.close()

    def close(self) -> None:
        """Kill and reap every worker still waiting, under every key."""
        with self._lock:
            gone = [entry for entries in self._waiting.values() for entry in entries]
            self._waiting.clear()
        for entry in gone:
            entry.close()

    def __enter__(self) -> "WorkerPool":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
