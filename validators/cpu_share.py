"""How many CPU threads a timing worker gets on a machine that other work keeps busy.

A CPU worker left to torch's default runs one intra-op thread per allowed CPU, and every parallel op waits for
its slowest thread. Beside a steady neighbour (a busy loop, another job) three runnable threads share two
CPUs, a preempted thread stalls the whole op, and block medians spread: beside a one-core busy loop on the
2-core VM (2026-12-06) the gate's A/A noise floor at `tiny` reached 10.0% after three extensions, twice its 5%
budget, and it could tell neither a no-op nor a 15% slowdown. On the CPU the loop left (one thread), ten gates
failed a 15% slowdown ten times and ten passed a no-op, its floors 1.4-5.0% (2026-12-06,
``benchmarks/gate_reliability.py``).

So before the first timed block, a measurement whose request leaves the thread count open waits for the
outside load to drop (``validators.machine_load.wait_for_quiet``) and, where a steady load outlasts the wait,
times both sides on the CPUs left: ``threads`` = allowed CPUs less the outside load, rounded, at least 1. Both
sides and every A/A run get the same count, so ratios stay like for like; what was chosen, and who was busy, is
said in the result. A request that names its threads, a GPU or a ranked request, and a one-CPU machine are
left as they are.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from targets.worker_client import allowed_cpus
from targets.worker_protocol import WorkerRequest
from validators.machine_load import LoadMeter, LoadPolicy, after_steady_load, snapshot, wait_for_quiet


@dataclass(frozen=True)
class CpuShare:
    """What the wait found: the request to time (its threads set where a steady load took CPUs), the
    policy later measurements take (no second wait where one was waited out), and a sentence for the result
    (None where nothing was changed)."""

    spec: WorkerRequest
    policy: LoadPolicy | None
    note: str | None


def threads_left(cpus: int, outside: float) -> int:
    """The CPUs a steady outside load of ``outside`` CPUs leaves of ``cpus``, rounded half up, at least 1."""
    return max(1, min(cpus, int(cpus - outside + 0.5)))


def share_cpus(spec: WorkerRequest, policy: LoadPolicy | None = None, progress: Callable[[str], None] = lambda _: None,
               who: Callable[[], str] = lambda: snapshot().sentence()) -> CpuShare:
    """Wait for the machine to be quiet; where it stays busy, the threads that fit beside its other work."""
    cpus = allowed_cpus()
    if spec.device != "cpu" or spec.threads or spec.ranks > 1 or not cpus or len(cpus) < 2:
        return CpuShare(spec, policy, None)
    policy = policy or LoadPolicy()
    outside, _, waited = wait_for_quiet(LoadMeter(cpus, {}), [], policy)
    later = after_steady_load(policy, outside)
    if later is policy:
        return CpuShare(spec, policy, None)
    threads = threads_left(len(cpus), outside)
    busy = f"other work kept {outside:.2f} of the {len(cpus)} CPUs busy after a wait of {waited:.0f} s ({who()})"
    if threads >= len(cpus):
        return CpuShare(spec, later, f"{busy}: timed on all {len(cpus)} CPUs still")
    progress(f"{busy}: timing on {threads} thread(s), on the CPUs it leaves ...")
    return CpuShare(spec.model_copy(update={"threads": threads}), later,
                    f"{busy}: both sides were timed on {threads} thread(s) in place of torch's {len(cpus)}, pinned "
                    f"to the CPUs it leaves (a slowdown that shows only with more threads is not seen)")
