"""How busy the machine was with work that is not ours while a measurement ran: the figures the load policy of
``validators.speedup`` (its "Outside load") judges blocks by, and the snapshot a result keeps of who was busy.

**Outside load** over a stretch of time is the CPU time the pinned CPUs spent busy (``/proc/stat``'s per-CPU
user, nice, system, irq, softirq and steal) less the CPU time of our own workers' process trees (``/proc/PID/stat``
utime, stime and their reaped children's, for each worker and every process below it), over the wall time: in
CPUs, 1.0 being one CPU kept busy throughout by someone else. Both counts come in clock ticks (``TICK_S``, 10 ms),
so each figure is less ``SLACK_TICKS`` per CPU plus two (the readings' rounding) and kept at 0 or above: a block
of 0.3 s on 2 CPUs cannot tell outside load below 0.13 CPUs, and a longer stretch can tell more. A GPU's
utilisation comes from ``nvidia-smi`` where there is one (skipped otherwise): it says nothing of whose work it was,
so it is asked only while our workers are idle (before the blocks).

Readers take a ``proc`` folder (``/proc``) so that the arithmetic is tested on synthetic readings.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, Iterable, Mapping, Sequence

from pydantic import BaseModel, Field

from targets.machine_lease import runs_present
from targets.protocol import ConfigError
from targets.worker_client import descendants, parent_of

PROC = Path("/proc")
TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")
SLACK_TICKS = 1  # per CPU, plus two for our trees' counts: what rounding to whole ticks can make up
BUSY_FIELDS = (0, 1, 2, 5, 6, 7)  # user nice system irq softirq steal (idle and iowait, 3 and 4, are not busy)
LIMIT_CPUS = 0.3  # outside load above this in a block makes it loaded (speedup's "Outside load")
GPU_LIMIT = 0.10  # a GPU busier than this while our workers idle is in someone else's use
SNAPSHOT_S = 0.25  # the interval over which a snapshot counts each process's CPU time
BUSIEST = 5  # processes a snapshot names
SG_OPT_MARKS = ("sg-opt", "sg_opt", "validators.ab_worker", "targets.worker", "fork_server.py")


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None


def busy_ticks(cpus: Sequence[int] | None, proc: Path = PROC) -> int | None:
    """Ticks `cpus` (None: all) have spent busy since boot; None where ``/proc/stat`` has no per-CPU lines."""
    text = _read(proc / "stat")
    if text is None:
        return None
    total, seen = 0, False
    wanted = None if cpus is None else set(cpus)
    for line in text.splitlines():
        name, _, rest = line.partition(" ")
        if not name.startswith("cpu") or name == "cpu" or (wanted is not None and int(name[3:]) not in wanted):
            continue
        values = [int(v) for v in rest.split()]
        total += sum(values[i] for i in BUSY_FIELDS if i < len(values))
        seen = True
    return total if seen else None


def _stat_fields(pid: int, proc: Path) -> tuple[str, list[str]] | None:
    """A process's name and the fields after it in ``/proc/PID/stat`` (None: gone)."""
    text = _read(proc / str(pid) / "stat")
    if text is None or ")" not in text:
        return None
    head, _, rest = text.rpartition(")")
    return head.partition("(")[2], rest.split()


def process_ticks(pids: Iterable[int], proc: Path = PROC) -> int:
    """CPU ticks of these processes, each with its reaped children's (a child that exits moves its time there, so
    a tree's total does not drop as its processes end); a gone process counts 0."""
    total = 0
    for pid in pids:
        fields = _stat_fields(pid, proc)
        if fields is not None:
            total += sum(int(v) for v in fields[1][11:15])  # utime stime cutime cstime (fields 14-17)
    return total


def tree(pid: int) -> list[int]:
    """A process and every process below it."""
    return [pid, *descendants(pid)]


@dataclass
class Reading:
    """Counts at one moment: the pinned CPUs' busy ticks and each of our trees' processes and ticks."""

    at: float
    busy: int | None
    pids: dict[str, list[int]] = field(default_factory=dict)
    own: dict[str, int] = field(default_factory=dict)


def outside_cpus(before: Reading, after: Reading, cpus: int) -> float | None:
    """The outside load between two readings, in CPUs, rounding slack taken off (at least 0); None without counts."""
    seconds = after.at - before.at
    if before.busy is None or after.busy is None or seconds <= 0:
        return None
    ours = sum(after.own.get(name, 0) - before.own.get(name, 0) for name in after.own)
    slack = SLACK_TICKS * cpus + 2
    return max(0.0, (after.busy - before.busy - ours - slack) * TICK_S / seconds)


class LoadMeter:
    """Reads the outside load on `cpus` (None: all) around stretches of time, our trees being those of the root
    processes named in `roots`."""

    def __init__(self, cpus: Sequence[int] | None, roots: Mapping[str, int], proc: Path = PROC,
                 trees: Callable[[int], list[int]] = tree, clock: Callable[[], float] = time.monotonic):
        self.cpus, self.roots, self.proc, self.trees, self.clock = cpus, dict(roots), proc, trees, clock
        self.width = len(cpus) if cpus else (os.cpu_count() or 1)

    def start(self) -> Reading:
        """Counts before a stretch: our trees' first (listing them reads all of /proc), the CPUs' last."""
        pids = {name: self.trees(root) for name, root in self.roots.items()}
        own = {name: process_ticks(p, self.proc) for name, p in pids.items()}
        return Reading(busy=busy_ticks(self.cpus, self.proc), pids=pids, own=own, at=self.clock())

    def stop(self, before: Reading) -> Reading:
        """Counts after a stretch: the CPUs' first, then our trees', with the processes they had at its start
        (those that ended meanwhile left their time to their parents)."""
        at, busy = self.clock(), busy_ticks(self.cpus, self.proc)
        pids = {name: sorted(set(self.trees(root)) | set(before.pids.get(name, ())))
                for name, root in self.roots.items()}
        return Reading(at=at, busy=busy, pids=pids, own={name: process_ticks(p, self.proc) for name, p in pids.items()})

    def block(self, before: Reading, timed: str) -> dict[str, float] | None:
        """A block's figures, in CPUs: ``outside`` load, and ``other_side``, what the trees other than the `timed`
        one used meanwhile (an idle side's should be near 0); None without counts."""
        after = self.stop(before)
        outside = outside_cpus(before, after, self.width)
        if outside is None:
            return None
        seconds = after.at - before.at
        idle = sum(after.own[n] - before.own.get(n, 0) for n in after.own if n != timed)
        return {"outside": outside, "other_side": max(0.0, idle * TICK_S / seconds)}

    def sample(self, seconds: float) -> float | None:
        """The outside load over the next `seconds`."""
        before = self.start()
        time.sleep(seconds)
        return outside_cpus(before, self.stop(before), self.width)


QUIET_WAIT_ENV = "SG_OPT_QUIET_WAIT_S"  # the default wait for outside load to drop (a test suite may set 0)
SAMPLE_ENV = "SG_OPT_LOAD_SAMPLE_S"  # the stretch one reading before the blocks covers (a test suite may shorten it)


LOAD_LIMIT_ENV = "SG_OPT_LOAD_LIMIT_CPUS"  # the outside load a block may see (a user's knowingly busy machine)


def _env_number(name: str, default: float, unit: str, positive: bool = False) -> float:
    """A setting from the environment; a bad one is the user's ``ConfigError`` (one sentence, exit 2)."""
    value = os.environ.get(name) or str(default)
    try:
        number = float(value)
    except ValueError:
        raise ConfigError(f"{name} must be a number of {unit}, not {value!r}") from None
    if positive and number <= 0:
        raise ConfigError(f"{name} must be a positive number of {unit}, not {number:g}")
    return number


def _quiet_wait_s() -> float:
    return _env_number(QUIET_WAIT_ENV, 60, "seconds")


def _sample_s() -> float:
    return _env_number(SAMPLE_ENV, 0.5, "seconds", positive=True)  # a reading over no time divides by it


def _limit_cpus() -> float:
    """The outside load a block may see before it counts as loaded: ``LIMIT_CPUS`` unless the user set
    ``$SG_OPT_LOAD_LIMIT_CPUS``; whatever it is, each result records it (``LoadRecord.limit_cpus``)."""
    return _env_number(LOAD_LIMIT_ENV, LIMIT_CPUS, "CPUs")


@dataclass(frozen=True)
class LoadPolicy:
    """How ``measure_ab`` treats outside load: blocks loaded past `limit_cpus` are run again (at most `reruns`
    pairs; None: as many as the measurement has pairs), and before the blocks it waits up to `wait_s` (default
    ``$SG_OPT_QUIET_WAIT_S``, else 60 s) for the load to drop, sampling it `sample_s` (``$SG_OPT_LOAD_SAMPLE_S``,
    else 0.5 s) at a time. A shorter sample tells less (its counts lose ``SLACK_TICKS`` per CPU plus two to
    rounding): 0.1 s on 2 CPUs reads a busy loop of one CPU as 0.6."""

    limit_cpus: float = field(default_factory=_limit_cpus)
    wait_s: float = field(default_factory=_quiet_wait_s)
    sample_s: float = field(default_factory=_sample_s)
    reruns: int | None = None


def after_steady_load(policy: LoadPolicy | None, outside: float | None) -> LoadPolicy | None:
    """The policy for the runs after one whose wait ended with ``outside`` CPUs still busy: no wait where that load
    outlasted the wait (a steady load, which both blocks of a pair see and whose ratio it cancels, while uneven
    blocks are still run again), else ``policy`` unchanged. Beside a one-core busy loop every run of a gate at
    `tiny` on the 2-core VM waited its 60 s, and a gate of ten runs took over 12 minutes."""
    given = policy or LoadPolicy()
    if outside is None or outside <= given.limit_cpus:
        return policy
    return replace(given, wait_s=0.0)  # its limits kept


def wait_for_quiet(meter: LoadMeter, gpus: Sequence[str], policy: LoadPolicy,
                   gpu: Callable[[str], float | None] | None = None) -> tuple[float | None, float | None, float]:
    """Sample the outside load (and the GPUs' utilisation, our workers idle) until both are under their limits or
    ``policy.wait_s`` has passed: (the last outside load, the last GPU utilisation, seconds waited beyond the
    first sample)."""
    gpu = gpu or gpu_busy
    start = time.monotonic()
    first = None
    while True:
        outside = meter.sample(policy.sample_s)
        first = first if first is not None else time.monotonic() - start
        busy = max((b for g in gpus if (b := gpu(g)) is not None), default=None)
        quiet = (outside is None or outside <= policy.limit_cpus) and (busy is None or busy <= GPU_LIMIT)
        waited = time.monotonic() - start - first
        if quiet or waited >= policy.wait_s:
            return outside, busy, waited


# -- the GPU ---------------------------------------------------------------------------------------

def _smi(args: Sequence[str], timeout_s: float = 10.0) -> list[list[str]] | None:
    """nvidia-smi's CSV rows (no header, no units); None without nvidia-smi or when it fails."""
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        out = subprocess.run(["nvidia-smi", *args, "--format=csv,noheader,nounits"], capture_output=True, text=True,
                             timeout=timeout_s, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return [[cell.strip() for cell in line.split(",")] for line in out.splitlines() if line.strip()]


def gpu_busy(gpu: str, smi: Callable[[Sequence[str]], list[list[str]] | None] = _smi) -> float | None:
    """The share of nvidia-smi's last sample period in which `gpu` (an index or UUID) ran a kernel; None unknown."""
    rows = smi(["--query-gpu=utilization.gpu", f"--id={gpu}"])
    try:
        return float(rows[0][0]) / 100.0 if rows else None
    except (ValueError, IndexError):
        return None


def gpu_users(gpu: str, smi: Callable[[Sequence[str]], list[list[str]] | None] = _smi) -> list[tuple[int, str]]:
    """The processes with a compute context on `gpu`, as (pid, name); empty where nvidia-smi says nothing."""
    rows = smi(["--query-compute-apps=pid,process_name", f"--id={gpu}"]) or []
    return [(int(row[0]), row[1]) for row in rows if len(row) >= 2 and row[0].isdigit()]


# -- a snapshot of who is busy ---------------------------------------------------------------------

class ProcessLoad(BaseModel):
    pid: int
    name: str
    cpus: float = Field(0.0, description="CPUs it kept busy over the snapshot's interval (1.0: one CPU throughout)")
    command: str = Field("", description="its command line, cut short (sg-opt processes only)")


class MachineSnapshot(BaseModel):
    """The machine as a measurement began: who else was busy, and which other sg-opt processes were running."""

    loadavg: list[float] = Field(default_factory=list, description="1, 5 and 15 minute load averages")
    cpus: int = Field(0, description="CPUs online")
    busiest: list[ProcessLoad] = Field(default_factory=list, description="the busiest processes that are neither "
                                       "this process's own (itself, its ancestors and descendants) nor sg-opt's")
    sg_opt: list[ProcessLoad] = Field(default_factory=list, description="other sg-opt processes (their command "
                                      "line names sg-opt, its workers or its fork server)")
    gpu_users: list[ProcessLoad] = Field(default_factory=list, description="other processes with a context on the "
                                         "measured GPUs (nvidia-smi)")

    def sentence(self) -> str:
        said = [f"load average {self.loadavg[0]:.2f} on {self.cpus} CPUs" if self.loadavg else "no load average"]
        if self.busiest:
            said.append("busiest others " + ", ".join(f"{p.name} ({p.pid}) {p.cpus:.2f}" for p in self.busiest))
        if self.sg_opt:
            said.append(f"{len(self.sg_opt)} other sg-opt processes using {sum(p.cpus for p in self.sg_opt):.2f} CPUs")
        if self.gpu_users:
            said.append("on the GPU also " + ", ".join(f"{p.name} ({p.pid})" for p in self.gpu_users))
        return "; ".join(said)


def _all_ticks(proc: Path) -> dict[int, tuple[str, int]]:
    found = {}
    for entry in proc.iterdir() if proc.is_dir() else ():
        if entry.name.isdigit() and (fields := _stat_fields(int(entry.name), proc)) is not None:
            found[int(entry.name)] = (fields[0], sum(int(v) for v in fields[1][11:13]))  # utime stime
    return found


def _ours(pid: int) -> set[int]:
    """This process, its ancestors and its descendants."""
    mine, up = {pid, *descendants(pid)}, parent_of(pid)
    while up and up not in mine:
        mine.add(up)
        up = parent_of(up)
    return mine


def other_runs() -> list[str]:
    """The other sg-opt runs on this machine ("pid (command)"): holders of the presence lock
    (``targets.machine_lease.run_presence``) that are neither this process nor its ancestors or descendants."""
    ours = _ours(os.getpid())
    return [run for run in runs_present() if int(run.split(" ", 1)[0]) not in ours]


def snapshot(gpus: Sequence[str] = (), interval_s: float = SNAPSHOT_S, proc: Path = PROC,
             ours: set[int] | None = None, sleep: Callable[[float], None] = time.sleep,
             smi: Callable[[Sequence[str]], list[list[str]] | None] = _smi) -> MachineSnapshot:
    """Who keeps the machine busy now, counted over `interval_s`; `ours` (default: this process's own, ``_ours``)
    are left out."""
    first = _all_ticks(proc)
    sleep(interval_s)
    second = _all_ticks(proc)
    ours = _ours(os.getpid()) if ours is None else ours
    busiest, sg_opt = [], []
    for pid, (name, ticks) in second.items():
        if pid in ours:
            continue
        used = (ticks - first.get(pid, (name, ticks))[1]) * TICK_S / interval_s
        command = (_read(proc / str(pid) / "cmdline") or "").replace("\0", " ").strip()
        if any(mark in command for mark in SG_OPT_MARKS):
            sg_opt.append(ProcessLoad(pid=pid, name=name, cpus=round(used, 3), command=command[:160]))
        elif used >= 0.05:
            busiest.append(ProcessLoad(pid=pid, name=name, cpus=round(used, 3)))
    others = [ProcessLoad(pid=pid, name=name) for gpu in gpus for pid, name in gpu_users(gpu, smi) if pid not in ours]
    try:
        loadavg = [round(v, 2) for v in os.getloadavg()]
    except OSError:
        loadavg = []
    return MachineSnapshot(loadavg=loadavg, cpus=os.cpu_count() or 0,
                           busiest=sorted(busiest, key=lambda p: -p.cpus)[:BUSIEST],
                           sg_opt=sorted(sg_opt, key=lambda p: -p.cpus), gpu_users=others)


# -- what a measurement keeps ----------------------------------------------------------------------

class LoadRecord(BaseModel):
    """What a measurement saw of the machine's other work, and whether its result may be trusted for a win."""

    limit_cpus: float = Field(LIMIT_CPUS, description="outside load above which a block counted as loaded")
    counted: bool = Field(True, description="whether the machine gave the counts (False: nothing was judged)")
    before: MachineSnapshot | None = Field(None, description="the machine as the blocks were about to start")
    outside_before: float | None = Field(None, description="outside load in CPUs in the last sample before the "
                                                           "blocks")
    gpu_before: float | None = Field(None, description="the GPU's utilisation in the last sample before the blocks, "
                                                       "our workers idle (None: no nvidia-smi, or a CPU run)")
    waited_s: float = Field(0.0, description="seconds waited before the blocks for outside load to drop")
    reruns: int = Field(0, description="block pairs run again because a block of theirs was loaded")
    rerun_load: list[float] = Field(default_factory=list, description="the larger outside load of each pair run "
                                                                      "again, in CPUs")
    loaded_pairs: int = Field(0, description="pairs kept with a loaded block, once the re-runs allowed were spent")
    steady_cpus: float = Field(0.0, description="the most outside load both blocks of a kept pair saw alike, in "
                                                "CPUs: it slowed both sides and cancels in the pair's ratio")
    unlocked: str | None = Field(None, description="why the blocks ran without the device's measurement lock")
    clean: bool = Field(True, description="no loaded pair kept and the lock held: a win from it may be accepted")
    beside_runs: int = Field(0, description="other sg-opt runs alive as the blocks began (targets.machine_lease."
                                            "other_runs): the lock keeps their blocks out of ours, but they share the "
                                            "machine between blocks")

    @property
    def quotable(self) -> bool:
        """Whether a figure from it may be quoted as the machine's own: clean, and no other sg-opt run beside it.
        Two `tiny` runs at once on the 2-core VM quoted 0.272 where a later quiet `bench --vs` measured 0.228
        (2026-12-06), though the other run sat idle through the blocks."""
        return self.clean and self.beside_runs == 0

    def sentence(self) -> str | None:
        """Why the result is not clean, or what it took to keep it so; None when there is nothing to say."""
        said = []
        if self.unlocked:
            said.append(f"it ran without the measurement lock: {self.unlocked}")
        if self.loaded_pairs:
            said.append(f"{self.loaded_pairs} block pairs ran with more than {self.limit_cpus:.2f} CPUs of other "
                        f"work on its CPUs after {self.reruns} were run again")
        elif self.reruns:
            said.append(f"{self.reruns} block pairs were run again for outside load (up to "
                        f"{max(self.rerun_load):.2f} CPUs)")
        if self.steady_cpus > self.limit_cpus:
            said.append(f"a steady {self.steady_cpus:.2f} CPUs of other work ran beside both sides alike")
        if self.waited_s >= 1.0:
            said.append(f"it waited {self.waited_s:.0f} s for outside load to drop first")
        if self.beside_runs:
            said.append(f"{self.beside_runs} other sg-opt run(s) shared the machine")
        if self.limit_cpus != LIMIT_CPUS:
            said.append(f"its blocks were allowed {self.limit_cpus:.2f} CPUs of other work ({LOAD_LIMIT_ENV}; "
                        f"default {LIMIT_CPUS:.2f})")
        if not self.clean and self.before is not None:
            said.append(f"as it began: {self.before.sentence()}")
        return "; ".join(said) or None


def pooled_load(records: Sequence[LoadRecord | None]) -> LoadRecord | None:
    """One record for the blocks of several measurements pooled together: clean only if each was (one without a
    record, from before records, counts as clean, as ``ABResult.clean`` says)."""
    kept = [r for r in records if r is not None]
    if not kept:
        return None
    unlocked = [r.unlocked for r in kept if r.unlocked]
    return kept[0].model_copy(update=dict(
        counted=all(r.counted for r in kept), waited_s=sum(r.waited_s for r in kept),
        reruns=sum(r.reruns for r in kept), rerun_load=[x for r in kept for x in r.rerun_load],
        loaded_pairs=sum(r.loaded_pairs for r in kept), unlocked="; ".join(unlocked) or None,
        steady_cpus=max(r.steady_cpus for r in kept), beside_runs=max(r.beside_runs for r in kept),
        clean=all(r.clean for r in kept)))
