"""One timed measurement per device at a time, machine-wide: a lease on a lock file per device.

Two ``sg-opt optimize`` runs side by side on the 2-core CI box made one of them report x61.98 where a quiet
re-measure gave x5.59: each run's timed blocks ran beside the other's workers. Timed side-by-side measurement
(``validators.speedup.measure_ab``) holds its device's lock **exclusive** for its blocks; other worker work on the
device (building a measurement's workers, numerics, profile and kernel-check runs) holds it **shared**, so it
waits while a measurement is timed and never starts beside one:

    with machine_lease(device_keys(request)):          # shared: any number at once
        run_worker(request)
    with machine_lease("cpu", exclusive=True) as lease:  # alone: waits for the shared holders to finish
        ...

The locks are ``flock`` locks on files in ``lock_dir()`` (``$SG_OPT_LOCK_DIR``, else ``sg-opt-locks`` in the
system's temporary folder, open to every user): the kernel drops them when their holder dies, ``kill -9``
included. A waiting exclusive holder passes a **turnstile** (a second lock per device) that new shared holders
must cross first, so a stream of overlapping shared holders cannot starve it. Waits poll and are bounded
(``LeaseTimeout`` names the holders, from ``/proc/locks``); a thread that already holds a key holds it again
for free. The descriptors close on exec but a ``fork()``ed child inherits them, and keeps the lock while it
lives.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Iterator, Sequence

from pydantic import BaseModel

from targets.worker_protocol import WorkerRequest, device_env

LOCK_DIR_ENV = "SG_OPT_LOCK_DIR"
WAIT_S = 900.0  # the longest a lease waits by default: longer than any one measurement's blocks so far
POLL_S = (0.01, 0.25)  # the first and the longest pause between two tries
SAY_AFTER_S = 1.0  # a wait longer than this is said on stderr, once
RUNS_KEY = "runs"  # the presence lock every measuring sg-opt command holds shared (run_presence)

_held = threading.local()  # key -> exclusive?, for the keys this thread holds


class LeaseTimeout(RuntimeError):
    """A device's measurement lock stayed taken for longer than the lease would wait."""


def lock_dir() -> Path:
    """Where the lock files live: ``$SG_OPT_LOCK_DIR``, else a folder of the system's temporary one that every
    user may write (two users' runs on one machine must see each other's locks)."""
    folder = Path(os.environ.get(LOCK_DIR_ENV) or Path(tempfile.gettempdir()) / "sg-opt-locks")
    if not folder.is_dir():
        folder.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(OSError):
            folder.chmod(0o1777)
    return folder


def device_keys(*requests: WorkerRequest | BaseModel) -> list[str]:
    """The lock keys of the devices the requests' workers use: "cpu", or "cuda:<id>" with the physical id (through
    the request's ``gpus`` and CUDA_VISIBLE_DEVICES), one per rank of a ranked request."""
    keys = set()
    for req in requests:
        device = str(getattr(req, "device", "cpu"))
        if not device.startswith("cuda"):
            keys.add("cpu")
            continue
        visible = (device_env(req).get("CUDA_VISIBLE_DEVICES") or os.environ.get("CUDA_VISIBLE_DEVICES") or "")
        ids = [v.strip() for v in visible.split(",") if v.strip()]
        first = int(device.split(":", 1)[1]) if ":" in device else 0
        for ordinal in range(first, first + int(getattr(req, "ranks", 1) or 1)):
            keys.add(f"cuda:{ids[ordinal] if ordinal < len(ids) else ordinal}")
    return sorted(keys)


def _path(key: str, part: str) -> Path:
    return lock_dir() / f"{re.sub(r'[^A-Za-z0-9_.-]', '_', key)}.{part}"


def _open(path: Path) -> int:
    """A descriptor on a lock file, made (readable and writable by all) if missing; flock needs no write access."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
        with contextlib.suppress(OSError):
            os.fchmod(fd, 0o666)
        return fd
    except PermissionError:
        return os.open(path, os.O_RDONLY)


def holders(path: Path) -> list[str]:
    """The processes holding a lock on a file, as "pid (command)", from /proc/locks (empty where it says nothing)."""
    try:
        stat, table = path.stat(), Path("/proc/locks").read_text()
    except OSError:
        return []
    inode = f":{stat.st_ino}"  # by inode alone: an overlay filesystem may name another device than stat does
    found = []
    for line in table.splitlines():
        fields = line.split()
        at = next((i for i, field in enumerate(fields) if field.endswith(inode)), None)
        if "->" in fields or not at:
            continue
        pid = fields[at - 1]
        try:
            command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            command = "?"
        found.append(f"{pid} ({command[:120]})")
    return found


@contextlib.contextmanager
def run_presence() -> Iterator[None]:
    """Held (shared, never waited for) for the life of an sg-opt command that measures (optimize, bench, profile,
    gate): how a measurement knows another run shares the machine (``machine_load.other_runs``). The lock keeps that run's blocks
    out of ours, not its processes from the machine between them."""
    fd = _open(_path(RUNS_KEY, "presence"))
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
        yield
    finally:
        os.close(fd)


def runs_present() -> list[str]:
    """The sg-opt commands holding ``run_presence`` on this machine, as "pid (command)", this one's included."""
    return holders(_path(RUNS_KEY, "presence"))


def _try(fd: int, operation: int, deadline: float, say: str) -> bool:
    """flock `fd` without blocking, again and again, until it is taken or `deadline` passes."""
    pause, said, start = POLL_S[0], False, time.monotonic()
    while True:
        try:
            fcntl.flock(fd, operation | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            pass
        now = time.monotonic()
        if now >= deadline:
            return False
        if not said and now - start > SAY_AFTER_S:
            print(f"sg-opt: waiting for {say}", file=sys.stderr, flush=True)
            said = True
        time.sleep(min(pause, deadline - now))
        pause = min(POLL_S[1], pause * 2)


class Lease:
    """Shared or exclusive hold of some devices' locks, taken in sorted order (no two leases wait on each other
    crosswise); ``waited_s`` is how long taking them took, ``convert`` included."""

    def __init__(self, keys: str | Sequence[str], exclusive: bool = False, timeout_s: float = WAIT_S):
        self.keys = sorted({keys} if isinstance(keys, str) else set(keys))
        self.exclusive, self.timeout_s, self.waited_s = exclusive, timeout_s, 0.0
        self._fds: dict[str, int] = {}

    def __enter__(self) -> "Lease":
        self._take()
        return self

    def __exit__(self, *_: object) -> None:
        self._drop()

    def convert(self, exclusive: bool) -> float:
        """Hold the same keys in the other mode (not atomically: they are let go, then taken again); the seconds
        it waited."""
        before = self.waited_s
        self._drop()
        self.exclusive = exclusive
        self._take()
        return self.waited_s - before

    def _take(self) -> None:
        start, mine = time.monotonic(), _mine()
        deadline = start + self.timeout_s
        try:
            for key in self.keys:
                if key in mine and (mine[key] or not self.exclusive):
                    continue  # this thread holds it already, at least as strongly
                if key in mine:
                    raise RuntimeError(f"this thread holds the {key} measurement lock shared and cannot make it "
                                       f"exclusive inside that lease")
                self._fds[key] = self._lock(key, deadline)
                mine[key] = self.exclusive
        except BaseException:
            self._drop()
            raise
        finally:
            self.waited_s += time.monotonic() - start

    def _lock(self, key: str, deadline: float) -> int:
        """The main lock of `key`, held in this lease's mode, through its turnstile."""
        mode = "exclusive" if self.exclusive else "shared"
        what = f"the {key} measurement lock ({mode})"
        main, gate = _open(_path(key, "lock")), _open(_path(key, "turnstile"))
        try:
            # an exclusive taker holds the turnstile while it waits: shared takers queue behind it there
            if not _try(gate, fcntl.LOCK_EX if self.exclusive else fcntl.LOCK_SH, deadline, what):
                raise LeaseTimeout(_late(key, "turnstile", self.timeout_s, mode))
            if not self.exclusive:
                fcntl.flock(gate, fcntl.LOCK_UN)
            if not _try(main, fcntl.LOCK_EX if self.exclusive else fcntl.LOCK_SH, deadline, what):
                raise LeaseTimeout(_late(key, "lock", self.timeout_s, mode))
        except BaseException:
            os.close(main)
            raise
        finally:
            os.close(gate)  # closing drops the turnstile, taken or not
        return main

    def _drop(self) -> None:
        mine = _mine()
        for key, fd in self._fds.items():
            os.close(fd)  # closing the only descriptor of its open file drops its flock
            mine.pop(key, None)
        self._fds = {}


def _mine() -> dict[str, bool]:
    if not hasattr(_held, "keys"):
        _held.keys = {}
    return _held.keys


def _late(key: str, part: str, timeout_s: float, mode: str) -> str:
    who = holders(_path(key, part))
    return (f"the {key} measurement lock was still taken after {timeout_s:.0f} s (wanted {mode}; held by "
            f"{', '.join(who) if who else 'a process /proc/locks does not name'})")


@contextlib.contextmanager
def machine_lease(keys: str | Sequence[str], exclusive: bool = False, timeout_s: float = WAIT_S) -> Iterator[Lease]:
    """Hold the measurement locks of `keys` ("cpu", "cuda:0": ``device_keys``) for the block: shared for worker
    work beside which no timed measurement may run, exclusive for a timed measurement. Raises ``LeaseTimeout``
    after `timeout_s`."""
    with Lease(keys, exclusive, timeout_s) as lease:
        yield lease
