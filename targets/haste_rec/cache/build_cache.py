"""An on-disk cache of the trainer's deterministic set-up products, shared by every worker.

At size large one worker spends ~12 s of CPU grouping 650K tail labels (k-means over label
features drawn from 1,024 batches), and an agent run starts dozens of workers with the same
grouping. The result is a pure function of the data spec, the seed, the model-shape knobs and the
code that computes it, so it is computed once and read back by the others. The key hashes all of
these, including the source of the modules that produce the result, so an edit to the grouping
code or the data model never reads a stale entry. Candidates cannot reach this cache: it sits below
the kernel slots and holds only the label layout, which no kernel computes.

Entries are written to a temporary file and renamed, so concurrent workers never read half a
file; an unreadable entry is recomputed and rewritten. ``SG_OPT_BUILD_CACHE=0`` turns it off.

Workers that miss at once compute one at a time (``computing``: an advisory lock on the cache folder), and each
looks again once it holds the lock: the first computes, the others read its entry. On an H200 (2026-12-01) a
cached candidate's numerics worker and its timing worker, started ahead beside it, replayed the same warm-up
batches at once (``model.CACHE_WARM_BATCHES``), each with a thread per CPU, beside the incumbent's build: the
numerics worker's build took 342 s, where alone it took 21.6 s. Torch's thread teams on oversubscribed cores
wait at every parallel region's barrier for a preempted thread: on the 2-core VM three such builds at once
(`medium`, cached, two threads each, the cache off) took 114-121 s each, one alone 8.9 s.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import tempfile
import threading
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import torch

from targets.protocol import user_cache_dir

ENV_SWITCH = "SG_OPT_BUILD_CACHE"
_holding = threading.local()  # .held: this thread holds ``computing``'s lock


def enabled() -> bool:
    return os.environ.get(ENV_SWITCH, "1") not in ("0", "false", "no", "off")


def source_digest(modules: Sequence[Any]) -> str:
    """A digest of the source files of `modules`: the code version part of a cache key."""
    h = hashlib.blake2b(digest_size=16)
    for module in modules:
        h.update(Path(module.__file__).read_bytes())
    return h.hexdigest()


def entry_path(kind: str, key: Sequence[Any]) -> Path:
    digest = hashlib.blake2b(repr(tuple(key)).encode(), digest_size=16).hexdigest()
    return user_cache_dir() / "haste_rec" / f"{kind}-{digest}.pt"


def _read(path: Path) -> Any | None:
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception:  # missing, truncated or written by another torch: recompute
        return None


def _write(path: Path, value: Any) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    except OSError:  # no cache folder can be made or written here: every build computes its own
        return
    try:
        with os.fdopen(fd, "wb") as out:
            torch.save(value, out)
        os.replace(tmp, path)
    except OSError:  # a full or read-only disk costs the cache, never the build
        Path(tmp).unlink(missing_ok=True)


@contextlib.contextmanager
def computing(folder: Path) -> Iterator[None]:
    """Held while this process computes an entry for `folder`: one process at a time, machine-wide. The kernel
    drops the lock with its holder, so a killed worker never blocks the next. Without a lock file (the folder
    cannot be made or written) everyone computes, as without the cache. A compute that reads another entry
    (nested) already holds it: a second flock of this process would wait on itself."""
    if getattr(_holding, "held", False):
        yield
        return
    try:
        folder.mkdir(parents=True, exist_ok=True)
        lock = open(folder / "computing.lock", "a")
    except OSError:
        yield
        return
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        _holding.held = True
        try:
            yield
        finally:
            _holding.held = False
            fcntl.flock(lock, fcntl.LOCK_UN)


def cached(kind: str, key: Sequence[Any], compute: Callable[[], Any]) -> Any:
    """`compute()`, or its value saved under (kind, key) by an earlier call (tensors and containers); a call
    that misses while another process computes waits for it and reads what it wrote."""
    if not enabled():
        return compute()
    path = entry_path(kind, key)
    value = _read(path)
    if value is not None:
        return value
    with computing(path.parent):
        value = _read(path)  # written while this process waited
        if value is None:
            value = compute()
            _write(path, value)
    return value
