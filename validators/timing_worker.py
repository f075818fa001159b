"""One timing worker of a side-by-side measurement: its process, pinning, pipes, footprint and teardown.

Each side of a measurement is a ``validators.ab_worker`` child, pinned to one CPU set (``shared_cpus``), in its
own process group (under torchrun for a ranked side), read line by line against a deadline and killed with
everything below it. ``validators.ab_runner`` runs two of them side by side; ``validators.started_ahead`` starts
them before their measurement.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Any, Literal, Sequence, get_args

from targets.fork_server import start_python
from targets.worker_client import (COLLECTIVE_TIMEOUT_ENV, allowed_cpus, ask_for_stacks, descendants, device_env,
                                   exit_reason, kill_tree, scrubbed_env, torchrun)
from targets.worker_protocol import Failure, FailureKind, WorkerRequest

QUIT_GRACE_S = 10.0
Side = Literal["a", "b"]

largest: dict[str, int] = {}  # the most memory any timing worker of this process reported (``ready_line``)


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


class TimingWorker:
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
        (``started_ahead.pairs_that_fit``)."""
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


def note_footprint(memory: dict[str, Any]) -> None:
    """Remember a worker's footprint (``targets.worker.footprint``) where it exceeds the largest seen: the agent
    notes its baseline's own runs, so that the first calibration may start its spare pair (``started_ahead.pairs_that_fit``)."""
    for name, value in memory.items():
        if isinstance(value, (int, float)):
            largest[name] = max(largest.get(name, 0), int(value))


def spawn(specs: dict[str, WorkerRequest], labels: dict[str, str], folder: str, cpus: Sequence[int] | None,
           roots: dict[str, str | None], timeout_s: float, sides: Sequence[str]) -> dict[str, TimingWorker]:
    """One worker per side of `sides`, their requests written into `folder`."""
    return {side: TimingWorker(specs[side], labels[side], Path(folder) / f"{side}.json", cpus, roots[side], timeout_s)
            for side in sides}


def stop_below(pid: int) -> list[int]:
    """Stop every process below `pid` (loader workers); the ones stopped."""
    stopped = []
    for child in descendants(pid):
        try:
            os.kill(child, signal.SIGSTOP)
            stopped.append(child)
        except ProcessLookupError:
            pass
    return stopped


def resume(pids: Sequence[int]) -> None:
    """Let processes stopped by ``stop_below`` run again."""
    for pid in pids:
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
