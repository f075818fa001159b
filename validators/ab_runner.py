"""The two live workers of a side-by-side measurement, block by block: only the timed side's processes run, and
the parent's clock times each block.

``validators.speedup`` decides what to measure and how to judge it; this module only runs the two timing workers
(``validators.timing_worker``), adopting the ones started ahead for it from the pool it is given
(``validators.started_ahead.WorkerPool``) and holding the spare pair for the measurement after it. On a GPU both
sides build at once; on a CPU one after the other.

A block's time is the parent's: ``time.perf_counter`` here, from just before its run command is written to just
after its answer is read, a window that holds nothing but the timed steps (their untimed drain is a command of its
own, before) and the exchange. The worker's own step times come from a process a candidate's code runs in (one
that slowed ``time.perf_counter`` tenfold was once taken for a 10x win), so they are only checked against that
window (``clock_disagreement``): a worker claiming more time than passed, or far less, fails the block as
``clock``.
"""

from __future__ import annotations

import os
import random
import secrets
import tempfile
import time
from dataclasses import dataclass
from typing import Any, Sequence

from targets.worker_protocol import WorkerRequest
from validators import started_ahead, timing_worker
from validators.machine_load import LoadMeter
from validators.machine_pressure import stall_shares, stall_totals
from validators.started_ahead import Prestarted, WorkerPool, prestart_key
from validators.timing_worker import Side, SideFailed, TimingWorker, resume, shared_cpus, stop_below

CHECK_RATE = 0.5  # the chance that a block of a side with replaced kernels is preceded by a spot-checked step
HOLD_SWITCH = "SG_OPT_HOLD_IDLE_SIDE"  # "0": an idle side's loader workers keep running during the other's block
# The worker's own window around its steps (and their losses' read-back) against the parent's. Over: nothing but
# clock granularity and rates lets a window exceed the time that passed, so 2% and 2 ms. Under: the parent's window
# also holds the exchange (a pipe each way, a JSON line, a thread's wake-up: under 1 ms on the 2-core VM and on an
# H100 host, 2026-12-06, benchmarks/exchange_latency.py; hence 20 ms for a busy scheduler). 25% is far short of a
# clock slowed even 1.5-fold (33% missing). The verdict never uses the worker's times, so the check need not be
# tight: it says that something tampered with the worker's clocks.
CLOCK_OVER = (0.02, 0.002)
CLOCK_UNDER = (0.25, 0.020)


def events_disagreement(step_s: list[float], timed_s: float) -> str | None:
    """Why a worker's per-step times (CUDA events on a GPU) cannot lie inside its own window around them (None:
    they can). They may fall short of it (work on another stream), never exceed it."""
    total = sum(step_s)
    if total > timed_s * (1 + CLOCK_OVER[0]) + CLOCK_OVER[1]:
        return (f"the worker's step times sum to {total * 1e3:.1f} ms, more than its own window around them "
                f"({timed_s * 1e3:.1f} ms)")
    return None


def clock_disagreement(worker_s: float, wall_s: float, slack_s: float = CLOCK_UNDER[1]) -> str | None:
    """Why a worker's sum of step times cannot be the block the parent timed (None: it can)."""
    said = f"the worker timed its steps at {worker_s * 1e3:.1f} ms where the parent timed {wall_s * 1e3:.1f} ms"
    if worker_s > wall_s * (1 + CLOCK_OVER[0]) + CLOCK_OVER[1]:
        return f"{said} from the block's command to its answer: more time than passed"
    if worker_s < wall_s * (1 - CLOCK_UNDER[0]) - slack_s:
        return f"{said} from the block's command to its answer: its clock runs slow, or it left steps out"
    return None


@dataclass(frozen=True)
class Block:
    """One timed block: its steps, the parent's wall seconds around it and the worker's own sum of its steps,
    with what the machine did meanwhile (``machine_pressure`` stall shares, ``machine_load`` figures)."""

    side: Side
    steps: int
    wall_s: float
    worker_s: float
    pressure: dict[str, float] | None = None
    load: dict[str, float] | None = None

    @property
    def step_s(self) -> float:
        """The block's mean step time by the parent's clock: the sample the statistics use."""
        return self.wall_s / self.steps

    @property
    def outside(self) -> float | None:
        """Outside load during the block, in CPUs (None: not counted)."""
        return self.load["outside"] if self.load else None


class ABRunner:
    """Two live workers, started and warmed up (at once on a GPU, else one after the other), always torn
    down on exit; ``roots`` are the code trees they run in (None: the caller's); ``pool`` holds the workers
    started ahead for it, if any (None: it starts its own)."""

    def __init__(self, a: WorkerRequest, b: WorkerRequest, timeout_s: float,
                 labels: tuple[str, str] = ("incumbent", "candidate"), cpus: Sequence[int] | None = None,
                 roots: tuple[str | None, str | None] = (None, None), pool: WorkerPool | None = None):
        self.specs, self.labels, self.timeout_s = {"a": a, "b": b}, dict(zip(("a", "b"), labels)), timeout_s
        self.pool = pool
        self.roots = dict(zip(("a", "b"), roots))
        self.cpus = list(cpus) if cpus is not None else shared_cpus(a, b)
        self.workers: dict[str, TimingWorker] = {}
        self.ready: dict[str, dict[str, Any]] = {}
        self.ready_s: dict[str, float] = {}  # seconds from the start of the workers to each one's ready line
        self.blocks_s = 0.0  # wall seconds of every block so far, from its command to its answer
        self.held: dict[str, list[int]] = {}  # the stopped processes below each idle side (_hold)
        self.blocks_run = {"a": 0, "b": 0}
        self.drained = {"a": 0, "b": 0}  # untimed steps run before blocks to drain banked input (``run``)
        self.spot_checks = {"a": 0, "b": 0}  # replaced kernels' calls checked between blocks (``check``)
        self.draw = random.Random(secrets.randbits(64))  # when to check: never seeded from anything a worker sees
        self.banked: dict[str, int] = {}  # an older code tree's worker: its steps to drain, from its first (``_drain``)

    def __enter__(self) -> "ABRunner":
        self.deadline = time.monotonic() + self.timeout_s
        key = prestart_key(self.specs["a"], self.specs["b"], (self.labels["a"], self.labels["b"]), self.cpus,
                           (self.roots["a"], self.roots["b"]))
        ahead, spares = self.pool.adopt(key) if self.pool is not None else (None, [])
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
            spare_deadline = min(self.deadline, time.monotonic() + started_ahead.SPARE_WAIT_S)
            for spare in spares:
                try:
                    spare.wait_and_hold(spare_deadline)
                except SideFailed:
                    self.pool.drop(key, spare)
        except BaseException as exc:
            self.__exit__(type(exc), exc, None)
            raise
        self.meter = LoadMeter(self.cpus, {side: worker.proc.pid for side, worker in self.workers.items()})
        return self

    def _start(self) -> None:
        start = time.monotonic()
        self._folder = tempfile.TemporaryDirectory(prefix="sg-opt-ab-")
        overlap = timing_worker.overlap_builds(*self.specs.values())
        for side in self.specs:
            self.workers.update(timing_worker.spawn(self.specs, self.labels, self._folder.name, self.cpus, self.roots,
                                       self.timeout_s, (side,)))
            if not overlap:
                self.ready[side] = self.workers[side].ready_line(self.deadline)
                self.ready_s[side] = time.monotonic() - start
        for side, worker in self.workers.items():
            if side not in self.ready:
                self.ready[side] = worker.ready_line(self.deadline)
                self.ready_s[side] = time.monotonic() - start

    def _wait_ready(self, ahead: Prestarted) -> None:
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

    def run(self, side: Side, steps: int) -> Block:
        """One block of ``steps`` steps on one side, timed by the parent. Only this side's processes run meanwhile
        (``_hold``). The worker first drains what its loader may have banked while idle (``_drain``) before the
        side's first block, and before every block of a side that is not held: a held side's loader workers were
        stopped while the other side ran, so what its queues hold at a block's start they built during its own
        previous block, as in training. At `large-cached` on an H200 (2026-12-04) a side with two loader workers
        drained 8 steps before each timed block of 6-7: two A/A runs spent 62.9 and 59.4 s in their blocks for
        25.5 and 23.8 s of timed steps."""
        worker = self.workers[side]
        self._hold("b" if side == "a" else "a")
        self._release(side)
        if self.spot_checking(side) and self.draw.random() < CHECK_RATE:
            self.check(side)
        if self.blocks_run[side] == 0 or not self._holding(side):
            self._drain(side)
        stalls, load = stall_totals(), self.meter.start()  # read before the window: no /proc walk inside it
        start = time.perf_counter()
        worker.send({"cmd": "run", "steps": steps, "drain": False})
        reply = worker.receive(self.deadline, f"a block of {steps} steps")
        seconds = time.perf_counter() - start
        block = Block(side, steps, seconds, float(reply.get("timed_s", sum(reply["step_s"]))),
                      stall_shares(stalls, stall_totals(), seconds), self.meter.block(load, side))
        self.blocks_s += seconds
        self.blocks_run[side] += 1
        self._check(worker, reply)
        # an older code tree's ranked worker sends no timed_s, and its per-step maxima may sum past the window
        spec = self.specs[side]
        problem = None if "timed_s" not in reply and spec.ranks > 1 else clock_disagreement(
            block.worker_s, seconds) or (events_disagreement(reply["step_s"], block.worker_s) if spec.ranks <= 1
                                         else None)
        if problem is not None:
            raise SideFailed(worker.label, "clock", problem)
        return block

    def spot_checking(self, side: Side) -> bool:
        """Whether the side's replaced kernels are checked between its blocks (its spec asks; its worker serves)."""
        return self.specs[side].spot_check is not None and "check" in self.ready[side].get("commands", ())

    def check(self, side: Side) -> int:
        """One untimed step of the side in which every replaced kernel's call is checked (``validators.ab_worker``);
        how many calls were. Run at random before a block (``CHECK_RATE``, drawn where the worker cannot see) and
        after a side's last one, so a kernel cannot tell checked steps from timed ones."""
        worker = self.workers[side]
        worker.send({"cmd": "check"})
        checked = int(worker.receive(self.deadline, "a spot-checked step")["spot_checks"])
        self.spot_checks[side] += checked
        return checked

    def _drain(self, side: Side) -> None:
        """Run the side's banked steps, untimed, in a round trip of their own. A worker of an older code tree (no
        drain command) drains only at the start of a run: its first drain is a run of one step that drains, and
        tells how many steps it banks; later ones are runs of that many steps that do not."""
        worker = self.workers[side]
        if "drain" in self.ready[side].get("commands", ()):
            worker.send({"cmd": "drain"})
            self.drained[side] += int(worker.receive(self.deadline, "the untimed steps before a block")["drained"])
            return
        if side in self.banked and not self.banked[side]:
            return
        command = ({"cmd": "run", "steps": self.banked[side], "drain": False} if side in self.banked
                   else {"cmd": "run", "steps": 1, "drain": True})
        worker.send(command)
        reply = worker.receive(self.deadline, "the untimed steps before a block")
        self._check(worker, reply)
        self.banked.setdefault(side, int(reply.get("drained", 0)))
        self.drained[side] += self.banked[side]

    @staticmethod
    def _check(worker: TimingWorker, reply: dict[str, Any]) -> None:
        if not reply.get("loss_finite", False):
            raise SideFailed(worker.label, "nan", "the loss became non-finite during a timed block")

    def _hold(self, side: Side) -> None:
        """Stop the processes a side's worker started (loader workers: they refill its queues while it idles) until
        its next block, so that they never take cores from the other side's timed block. A trainer over every
        core stalls beside a busy process (``benchmarks/busy_workers.py``: 4-7x on the 2-core VM), so a side
        whose loader refilled during the other's block would slow that block and look faster itself. A ranked
        side is left alone: its ranks are the processes below it, and they talk to each other between blocks."""
        if self._holding(side):
            self.held.setdefault(side, []).extend(stop_below(self.workers[side].proc.pid))

    def _holding(self, side: Side) -> bool:
        """Whether `side`'s helper processes are stopped while it idles (``_hold``)."""
        return self.specs[side].ranks == 1 and os.environ.get(HOLD_SWITCH, "1") != "0"

    def _release(self, side: Side) -> None:
        resume(self.held.pop(side, []))

    def __exit__(self, exc_type: type[BaseException] | None, *_: object) -> None:
        for side in list(self.held):  # a held loader worker would keep its session's graceful quit waiting
            self._release(side)
        for worker in self.workers.values():
            worker.close(graceful=exc_type is None)
        self._folder.cleanup()
