"""The two live workers of a side-by-side measurement: their processes, pinning, pipes and teardown.

``validators.speedup`` decides what to measure and how to judge it; this module only runs the two
``validators.ab_worker`` children: pinned to one CPU set (``shared_cpus``), each in its own process
group (under torchrun for a ranked side), read line by line against one deadline, killed with
everything below them on exit. On a GPU both sides build at once; on a CPU one after the other.

On a GPU the agent starts a candidate's measurement workers ahead (``prestart``), while the candidate's
numerics run is still being judged: a timing worker at `large` on an H200 took 12.1 s to get ready (medians
of 52, 2026-11-30), time that otherwise comes after the verdict, once per measured candidate. The measurement
that asks for exactly those workers (same specs, labels, CPUs and code trees) adopts them; a rejected
candidate's are killed (``discard``); ``SG_OPT_PRESTART=0`` turns it off. Their timed blocks still run
only after both are ready and the numerics run has ended, so the validation's work never overlaps a
timed block. Where memory allows (``pairs_that_fit``), a second pair starts with them for the measurement
after the first (an extension, a confirmation): the first measurement waits for it to be ready too and stops
the processes below it (loader workers) until its own measurement adopts it.
"""

from __future__ import annotations

import atexit
import json
import os
import queue
import signal
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Literal, Sequence, get_args

from targets.fork_server import start_python
from targets.worker_client import (COLLECTIVE_TIMEOUT_ENV, allowed_cpus, ask_for_stacks, descendants, device_env,
                                   exit_reason, kill_tree, scrubbed_env, torchrun)
from targets.worker_protocol import Failure, FailureKind, WorkerRequest
from validators.machine_pressure import stall_shares, stall_totals

QUIT_GRACE_S = 10.0
PRESTART_SWITCH = "SG_OPT_PRESTART"  # "0": every measurement starts its own workers when it begins
HOLD_SWITCH = "SG_OPT_HOLD_IDLE_SIDE"  # "0": an idle side's loader workers keep running during the other's block
PAIRS_SWITCH = "SG_OPT_PRESTART_PAIRS"  # "1": only the first measurement's pair is started ahead (pairs_that_fit)
Side = Literal["a", "b"]


class SideFailed(RuntimeError):
    """One side of a measurement failed; carries the structured Failure, its message led by the side's label."""

    def __init__(self, label: str, kind: str, message: str, detail: str = ""):
        super().__init__(f"{label}: {message}")
        self.label = label
        known = kind if kind in get_args(FailureKind) else "exception"
        self.failure = Failure(kind=known, message=f"{label}: {message}", detail=detail)


def shared_cpus(a: WorkerRequest, b: WorkerRequest) -> list[int] | None:
    """The CPU set both sides run on: the last ``threads`` allowed CPUs (CPU 0 takes most interrupts),
    all allowed CPUs when a spec leaves the thread count to torch, None where affinity is unsupported.
    A request's own ``cpus`` (an agent's evaluation lane) are the allowed ones."""
    allowed = sorted(a.cpus) if a.cpus else allowed_cpus()  # a lane's CPUs (--gpus), or all
    if allowed is None:
        return None
    wanted = max(a.threads, b.threads) if a.threads and b.threads else len(allowed)
    return allowed[-min(wanted, len(allowed)):]


class _Worker:
    """One ``validators.ab_worker`` child in its own process group, read line by line with deadlines."""

    def __init__(self, spec: WorkerRequest, label: str, request: Path, cpus: Sequence[int] | None,
                 root: str | None = None, timeout_s: float = 1800.0):
        self.label = label
        request.write_text(spec.model_dump_json())
        self.stderr = open(request.with_suffix(".stderr"), "w+b")
        self.spawned = time.time()  # wall clock, to split the start-up with the worker's own stamps
        launcher = torchrun(spec.ranks) if spec.ranks > 1 else []  # every rank shares the pipes
        self.proc = start_python("validators.ab_worker", ["--request", str(request)],
                                 scrubbed_env({COLLECTIVE_TIMEOUT_ENV: f"{timeout_s:g}", **device_env(spec)}, root),
                                 cwd=root, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.stderr,
                                 cpus=cpus, launcher=launcher)
        self.lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put(None)

    def _stderr_tail(self) -> str:
        self.stderr.flush()
        self.stderr.seek(0)
        return self.stderr.read()[-4000:].decode(errors="replace")

    def send(self, command: dict[str, Any]) -> None:
        try:
            self.proc.stdin.write(json.dumps(command) + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            raise SideFailed(self.label, "crash", "the worker's input closed: it has exited",
                             self._stderr_tail()) from None

    def receive(self, deadline: float, what: str) -> dict[str, Any]:
        try:
            line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:  # where it waited, from each of its processes, before the kill (by the caller's exit)
            stacks = ask_for_stacks(self.proc.pid, Path(self.stderr.name))
            raise SideFailed(self.label, "timeout", f"no {what} before the time limit; the worker was killed",
                             stacks) from None
        if line is None:
            code = self.proc.wait()
            raise SideFailed(self.label, "crash", f"the worker {exit_reason(code)} while we waited for {what}",
                             self._stderr_tail())
        try:
            message = json.loads(line)
        except json.JSONDecodeError:
            raise SideFailed(self.label, "crash", f"the worker wrote a non-protocol line: {line[:200]!r}") from None
        if "error" in message:
            raise SideFailed(self.label, str(message["error"]), str(message.get("message", "")), self._stderr_tail())
        return message

    def ready_line(self, deadline: float) -> dict[str, Any]:
        """The worker's ready line, once it has built and warmed up; its memory footprint is remembered
        (``pairs_that_fit``)."""
        ready = self.receive(deadline, "ready line")
        note_footprint(ready.get("memory") or {})
        return ready

    def close(self, graceful: bool) -> None:
        """Ask politely (when graceful), then kill the whole process tree (it may hold data-loader children, or
        torchrun's ranks, each in a session of its own)."""
        if graceful and self.proc.poll() is None:
            try:
                self.send({"cmd": "quit"})
                self.proc.wait(timeout=QUIT_GRACE_S)
            except (SideFailed, subprocess.TimeoutExpired):
                pass
        kill_tree(self.proc.pid)
        self.proc.wait()
        self.proc.stdin.close()
        self.stderr.close()


def overlap_builds(a: WorkerRequest, b: WorkerRequest) -> bool:
    """Whether the two sides may build and warm up at the same time: on a GPU, where their sessions are
    built mostly on the device and the host has cores to spare (at size large on an H200 a build takes
    ~15 s, twice per A/B run). On a CPU they go one at a time: two builds and warm-ups sharing the same
    cores oversubscribe them (2 x torch's threads), which took a 2-core box 5x longer."""
    return a.device.startswith("cuda") and b.device.startswith("cuda")


PrestartKey = tuple[str, str, tuple[str, str], tuple[int, ...], tuple[str | None, str | None]]
MEMORY_MARGIN = 1.25  # a candidate's worker may need this much more memory than the largest one seen so far
SPARE_WAIT_S = 60.0  # how long a measurement waits for a spare pair after its own workers are ready

_largest: dict[str, int] = {}  # the most memory any timing worker of this process reported (``_Worker.ready_line``)


def note_footprint(memory: dict[str, Any]) -> None:
    """Remember a worker's footprint (``targets.worker.footprint``) where it exceeds the largest seen: the agent
    notes its baseline's own runs, so that the first calibration may start its spare pair (``pairs_that_fit``)."""
    for name, value in memory.items():
        if isinstance(value, (int, float)):
            _largest[name] = max(_largest.get(name, 0), int(value))


def _memory_available() -> int | None:
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
    host, peak, total = (_largest.get(name, 0) for name in ("host_rss", "device_peak", "device_total"))
    if not host:
        return 1
    workers = 2 * requested + 1
    available = _memory_available()
    fits_host = available is not None and workers * host * MEMORY_MARGIN <= available
    fits_device = not total or workers * peak * MEMORY_MARGIN <= total
    return requested if fits_host and fits_device else 1


def _stop_below(pid: int) -> list[int]:
    """Stop every process below `pid` (loader workers); the ones stopped."""
    stopped = []
    for child in descendants(pid):
        try:
            os.kill(child, signal.SIGSTOP)
            stopped.append(child)
        except ProcessLookupError:
            pass
    return stopped


def _continue(pids: Sequence[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass


class _Prestarted:
    """Workers started ahead of their measurement, and the folder their requests live in. A pair that waits for a
    later measurement (a spare) is waited for and held by the measurement before it (``wait_and_hold``)."""

    def __init__(self, workers: dict[str, _Worker], folder: tempfile.TemporaryDirectory):
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
            self.held += _stop_below(worker.proc.pid)

    def release(self) -> None:
        _continue(self.held)
        self.held = []

    def close(self) -> None:
        self.release()
        for worker in self.workers.values():
            worker.close(graceful=False)
        self.folder.cleanup()


# Pairs started ahead for the measurements of one key, in the order they will be adopted: the first measurement's,
# then spares for the ones after it (a measurement extended because it leaned faster, the confirmation of a win),
# each of which would otherwise start its own pair once the one before it has ended (12.7-18.3 s until ready at
# large-cached on an H200, 2026-12-03: 9 of session 27's 18 measurements).
_prestarted: dict[PrestartKey, list[_Prestarted]] = {}
_prestarted_lock = threading.Lock()


def prestart_key(a: WorkerRequest, b: WorkerRequest, labels: tuple[str, str] = ("incumbent", "candidate"),
                 cpus: Sequence[int] | None = None,
                 roots: tuple[str | None, str | None] = (None, None)) -> PrestartKey:
    """The key under which workers for a measurement with these arguments are started ahead (``prestart``)."""
    cpus = list(cpus) if cpus is not None else shared_cpus(a, b)
    return (a.model_dump_json(), b.model_dump_json(), tuple(labels), tuple(cpus), tuple(roots))


def _spawn(specs: dict[str, WorkerRequest], labels: dict[str, str], folder: str, cpus: Sequence[int] | None,
           roots: dict[str, str | None], timeout_s: float, sides: Sequence[str]) -> dict[str, _Worker]:
    return {side: _Worker(specs[side], labels[side], Path(folder) / f"{side}.json", cpus, roots[side], timeout_s)
            for side in sides}


def prestart(a: WorkerRequest, b: WorkerRequest, timeout_s: float,
             labels: tuple[str, str] = ("incumbent", "candidate"), cpus: Sequence[int] | None = None,
             roots: tuple[str | None, str | None] = (None, None), force: bool = False,
             pairs: int = 1) -> PrestartKey | None:
    """Start the workers of the coming ``ABRunner``s with these arguments now: `pairs` pairs where they fit in
    memory (``pairs_that_fit``; one for ranked sides), each adopted by one measurement in turn. Only where both
    sides build at once (``overlap_builds``: a GPU; ``force`` for tests), since on a CPU they would take the cores
    of the work they are meant to overlap. Returns the key to ``discard`` them by (None: not started)."""
    if not (force or (overlap_builds(a, b) and os.environ.get(PRESTART_SWITCH, "1") != "0")):
        return None
    cpus = list(cpus) if cpus is not None else shared_cpus(a, b)
    key = prestart_key(a, b, labels, cpus, roots)
    discard(key)
    entries = []
    ranked = a.ranks > 1 or b.ranks > 1  # a spare's ranks would wait in their collectives, stopped or not
    for _ in range(pairs_that_fit(1 if ranked else pairs)):
        folder = tempfile.TemporaryDirectory(prefix="sg-opt-ab-")
        entries.append(_Prestarted(_spawn({"a": a, "b": b}, dict(zip("ab", labels)), folder.name, cpus,
                                          dict(zip("ab", roots)), timeout_s, ("a", "b")), folder))
    with _prestarted_lock:
        _prestarted[key] = entries
    return key


def _adopt(key: PrestartKey) -> tuple[_Prestarted | None, list[_Prestarted]]:
    """The next pair started ahead under `key` (None: none), and the spares left after it."""
    with _prestarted_lock:
        entries = _prestarted.get(key)
        if not entries:
            return None, []
        entry = entries.pop(0)
        if not entries:
            del _prestarted[key]
        return entry, list(entries)


def _drop(key: PrestartKey, entry: _Prestarted) -> None:
    """Close one pair started ahead (a spare that failed while it waited), so that its measurement starts afresh."""
    with _prestarted_lock:
        entries = _prestarted.get(key, [])
        if entry in entries:
            entries.remove(entry)
        if not entries:
            _prestarted.pop(key, None)
    entry.close()


def discard(key: PrestartKey | None = None) -> None:
    """Kill the workers started ahead under ``key`` (None: all of them), if no measurement adopted them."""
    with _prestarted_lock:
        gone = [_prestarted.pop(k) for k in ([key] if key is not None else list(_prestarted)) if k in _prestarted]
    for entries in gone:
        for entry in entries:
            entry.close()


atexit.register(discard)


class ABRunner:
    """Two live workers, started and warmed up (at once on a GPU, else one after the other), always torn
    down on exit; ``roots`` are the code trees they run in (None: the caller's)."""

    def __init__(self, a: WorkerRequest, b: WorkerRequest, timeout_s: float,
                 labels: tuple[str, str] = ("incumbent", "candidate"), cpus: Sequence[int] | None = None,
                 roots: tuple[str | None, str | None] = (None, None)):
        self.specs, self.labels, self.timeout_s = {"a": a, "b": b}, dict(zip(("a", "b"), labels)), timeout_s
        self.roots = dict(zip(("a", "b"), roots))
        self.cpus = list(cpus) if cpus is not None else shared_cpus(a, b)
        self.workers: dict[str, _Worker] = {}
        self.ready: dict[str, dict[str, Any]] = {}
        self.ready_s: dict[str, float] = {}  # seconds from the start of the workers to each one's ready line
        self.blocks_s = 0.0  # wall seconds of every block so far, from its command to its answer
        self.held: dict[str, list[int]] = {}  # the stopped processes below each idle side (_hold)
        self.blocks_run = {"a": 0, "b": 0}
        self.drained = {"a": 0, "b": 0}  # untimed steps run before blocks to drain banked input (``run``)
        self.last_pressure: dict[str, float] | None = None  # the last block's stall shares (machine_pressure)

    def __enter__(self) -> "ABRunner":
        self.deadline = time.monotonic() + self.timeout_s
        key = prestart_key(self.specs["a"], self.specs["b"], (self.labels["a"], self.labels["b"]), self.cpus,
                           (self.roots["a"], self.roots["b"]))
        ahead, spares = _adopt(key)
        self.started_ahead = False
        if ahead is not None:
            try:
                self._wait_ready(ahead)
                self.started_ahead = True
            except SideFailed:  # e.g. out of memory while building beside the numerics run: start afresh
                ahead.close()
                self.workers, self.ready, self.ready_s = {}, {}, {}
        try:
            if not self.started_ahead:
                self._start()
            # Spares ready and held before the first timed block. Built beside this measurement's workers, they
            # get SPARE_WAIT_S more at most, so that a stuck one costs this measurement none of its own time limit;
            # one that fails or is late is dropped (its measurement starts afresh).
            spare_deadline = min(self.deadline, time.monotonic() + SPARE_WAIT_S)
            for spare in spares:
                try:
                    spare.wait_and_hold(spare_deadline)
                except SideFailed:
                    _drop(key, spare)
        except BaseException as exc:
            self.__exit__(type(exc), exc, None)
            raise
        return self

    def _start(self) -> None:
        start = time.monotonic()
        self._folder = tempfile.TemporaryDirectory(prefix="sg-opt-ab-")
        overlap = overlap_builds(*self.specs.values())
        for side in self.specs:
            self.workers.update(_spawn(self.specs, self.labels, self._folder.name, self.cpus, self.roots,
                                       self.timeout_s, (side,)))
            if not overlap:
                self.ready[side] = self.workers[side].ready_line(self.deadline)
                self.ready_s[side] = time.monotonic() - start
        for side, worker in self.workers.items():
            if side not in self.ready:
                self.ready[side] = worker.ready_line(self.deadline)
                self.ready_s[side] = time.monotonic() - start

    def _wait_ready(self, ahead: _Prestarted) -> None:
        """Take over workers started ahead (and held, if they waited as a spare); their ready time is the worker's
        own (its stamps), from its spawn."""
        self.workers, self._folder = ahead.workers, ahead.folder
        ahead.release()
        for side, worker in ahead.workers.items():
            self.ready[side] = ahead.ready.get(side) or worker.ready_line(self.deadline)
            stamps = self.ready[side].get("stamps") or {}
            self.ready_s[side] = stamps["warm"] - worker.spawned if "warm" in stamps else 0.0

    def startup(self, side: Side) -> dict[str, float] | None:
        """Where a side's start-up went, in seconds: the interpreter and imports ("start": from the spawn until
        the worker began serving), building the session ("build") and its warm-up steps ("warmup"); None
        from a worker that sends no stamps (an older code tree's)."""
        stamps = self.ready.get(side, {}).get("stamps")
        if not stamps:
            return None
        return {"start": stamps["serving"] - self.workers[side].spawned, "build": stamps["built"] - stamps["serving"],
                "warmup": stamps["warm"] - stamps["built"]}

    def run(self, side: Side, steps: int) -> list[float]:
        """One block of ``steps`` steps on one side; its per-step seconds. Only this side's processes run meanwhile
        (``_hold``). The worker first drains what its loader may have banked while idle (``run_block``) before the
        side's first block, and before every block of a side that is not held: a held side's loader workers were
        stopped while the other side ran, so what its queues hold at a block's start they built during its own
        previous block, as in training. At `large-cached` on an H200 (2026-12-04) a side with two loader workers
        drained 8 steps before each timed block of 6-7: two A/A runs spent 62.9 and 59.4 s in their blocks for
        25.5 and 23.8 s of timed steps."""
        worker = self.workers[side]
        self._hold("b" if side == "a" else "a")
        self._release(side)
        drain = self.blocks_run[side] == 0 or not self._holding(side)
        stalls, start = stall_totals(), time.monotonic()
        worker.send({"cmd": "run", "steps": steps, "drain": drain})
        reply = worker.receive(self.deadline, f"a block of {steps} steps")
        seconds = time.monotonic() - start
        self.last_pressure = stall_shares(stalls, stall_totals(), seconds)
        self.blocks_s += seconds
        self.blocks_run[side] += 1
        self.drained[side] += int(reply.get("drained", 0))
        if not reply.get("loss_finite", False):
            raise SideFailed(worker.label, "nan", "the loss became non-finite during a timed block")
        return [float(t) for t in reply["step_s"]]

    def _hold(self, side: Side) -> None:
        """Stop the processes a side's worker started (loader workers: they refill its queues while it idles) until
        its next block, so that they never take cores from the other side's timed block. A trainer over every
        core stalls beside a busy process (``benchmarks/busy_workers.py``: 4-7x on the 2-core VM), so a side
        whose loader refilled during the other's block would slow that block and look faster itself. A ranked
        side is left alone: its ranks are the processes below it, and they talk to each other between blocks."""
        if self._holding(side):
            self.held.setdefault(side, []).extend(_stop_below(self.workers[side].proc.pid))

    def _holding(self, side: Side) -> bool:
        """Whether `side`'s helper processes are stopped while it idles (``_hold``)."""
        return self.specs[side].ranks == 1 and os.environ.get(HOLD_SWITCH, "1") != "0"

    def _release(self, side: Side) -> None:
        _continue(self.held.pop(side, []))

    def __exit__(self, exc_type: type[BaseException] | None, *_: object) -> None:
        for side in list(self.held):  # a held loader worker would keep its session's graceful quit waiting
            self._release(side)
        for worker in self.workers.values():
            worker.close(graceful=exc_type is None)
        self._folder.cleanup()
