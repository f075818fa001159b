"""The coarse profiler: torch.profiler over whole training steps, reduced to where the time goes.

A session names its phases with ``record_function`` ranges (``PhaseTimer``), so the profile can
say how much of the step each phase takes on the host and, on CUDA, how much device time the
kernels launched inside it take. Kernels are attributed by launch time, not by the event tree:
on CUDA the autograd engine runs backward on its own thread, outside the main thread's ``backward``
range in the tree but inside it in time. The rest is the evidence the findings need: top ops by
self time, device idle time between kernels, launches per step, peak memory, host<->device bytes,
the share of the step the named phases cover, and the profiler's own overhead, measured against
the same number of steps run without it just before and just after.

On one rank of a torch.distributed job it also measures how much of the step collectives take: the
union of their intervals, so that concurrent ones count once. torch.profiler reports them on CUDA as
NCCL kernels (``ncclDevKernel_AllReduce_Sum_f32_RING_LL``, and ``ncclDevKernel_SendRecv`` for an
all-to-all: device time, seen with torch 2.11 on two H200s), whose host side (``c10d::`` ops,
``record_param_comms``, ``nccl:`` ranges) only launches them; on the CPU with gloo (torch 2.13) as
two events each: the ``c10d::`` op on the calling thread (``c10d::allreduce_``,
``c10d::alltoall_base_``: the call and its enqueue) and a ``gloo:`` range on gloo's worker thread
(``gloo:all_reduce``, ``gloo:all_to_all``: the exchange itself, recorded as a user annotation). Either
way the time includes waiting for the peers (an NCCL kernel spins until they arrive), and DDP's
gradient all-reduces run while backward goes on: the share is of time with communication in flight,
not only time the step waits for it.
"""

from __future__ import annotations

import bisect
import math
import re
import resource
import statistics
import sys
from collections import defaultdict
from typing import Any, Callable, Iterable, Sequence

import torch
import torch.distributed as dist
from torch.autograd import DeviceType

from profilers.profiled_window import STEP_RANGE, least_distorted_window, sync
from profilers.records import CoarseProfile, HostWait, HostWork, OpTime, PhaseTime
from targets.protocol import Session
from targets.worker import banked_steps

TOP_OPS = 15
_DEVICE_KINDS = {"kernel": "kernel", "gpu_memcpy": "memcpy", "gpu_memset": "memset"}
_BYTES_FIELD = re.compile(r'"bytes"\s*:\s*(\d+)')
# CUDA runtime calls in which the host waits for the device: time spent in them inside a phase is
# the device's time showing up on the host (a pageable copy waits for the stream to drain), not
# the phase's own host work, and must not make the phase look host-bound.
BLOCKING_RUNTIME = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy",
                    "cudaMemcpyAsync", "cudaMemcpy2DAsync")
COLLECTIVE_KERNEL = "nccl"  # in the name of every NCCL kernel
COLLECTIVE_HOST = ("c10d::", "gloo:")  # the host events of a collective on the CPU (see the module docstring)


# ----------------------------------------------------------------------------- interval helpers

def union_length(intervals: Iterable[tuple[float, float]]) -> float:
    """Total length covered by possibly overlapping [start, end] intervals."""
    total, start, end = 0.0, None, None
    for lo, hi in sorted(intervals):
        if end is None or lo > end:
            if end is not None:
                total += end - start
            start, end = lo, hi
        else:
            end = max(end, hi)
    return total + (end - start if end is not None else 0.0)


class PhaseIndex:
    """Finds the innermost named range that contains a host timestamp."""

    def __init__(self, ranges: Sequence[tuple[float, float, str]]):
        self.ranges = sorted(ranges, key=lambda r: (r[0], -r[1]))
        self.outer: list[int] = []  # indices of ranges not inside an earlier one
        reach = -math.inf
        for i, (start, end, _) in enumerate(self.ranges):
            if start >= reach:
                self.outer.append(i)
                reach = end
            reach = max(reach, end)
        self._outer_starts = [self.ranges[i][0] for i in self.outer]

    def locate(self, t: float) -> str | None:
        j = bisect.bisect_right(self._outer_starts, t) - 1
        if j < 0:
            return None
        first = self.outer[j]
        stop = self.outer[j + 1] if j + 1 < len(self.outer) else len(self.ranges)
        found = None
        for start, end, name in self.ranges[first:stop]:
            if start > t:
                break
            if end >= t:
                found = name  # a later start that still contains t is nested deeper
        return found


# ----------------------------------------------------------------------------- reading events

def device_kind(evt: Any, annotations: set[str]) -> str | None:
    """'kernel', 'memcpy' or 'memset' for device activity; None for GPU-side annotations and host events."""
    if evt.device_type == DeviceType.CPU:
        return None
    activity = getattr(evt, "activity_type", None)  # absent in older torch: fall back on names
    if activity:
        return _DEVICE_KINDS.get(activity)
    if getattr(evt, "is_user_annotation", False) or evt.name in annotations:
        return None
    return "memcpy" if evt.name.startswith("Memcpy") else "memset" if evt.name.startswith("Memset") else "kernel"


def memcpy_bytes(evt: Any) -> int:
    """Bytes of a device memcpy event, from its metadata (0 when the profiler did not record them)."""
    meta = getattr(evt, "event_metadata", None)
    if meta is not None and getattr(meta, "bytes", None) is not None:
        return int(meta.bytes)
    raw = vars(evt).get("_metadata_json") or vars(evt).get("metadata_json") or ""
    match = _BYTES_FIELD.search(raw)
    return int(match.group(1)) if match else 0


def _is_annotation(evt: Any) -> bool:
    return bool(getattr(evt, "is_user_annotation", False))


def is_op(evt: Any) -> bool:
    """A host operator call: not a named range, nor a CUDA runtime/driver call, nor device activity."""
    activity = getattr(evt, "activity_type", None)
    if activity:
        return activity == "cpu_op"
    return evt.device_type == DeviceType.CPU and not _is_annotation(evt) and not evt.name.startswith("cu")


def _ranked(index: PhaseIndex, events: Iterable[Any], name: Callable[[Any], tuple[str, ...]],
            amount_us: Callable[[Any], float], steps: int, limit: int) -> list[tuple[tuple[str, ...], float, float]]:
    """The `limit` largest (phase, *name(event)) keys by summed amount, each with seconds and calls per step
    (events outside phases dropped; ties broken by key)."""
    total_us: dict[tuple[str, ...], float] = defaultdict(float)
    calls: dict[tuple[str, ...], int] = defaultdict(int)
    for e in events:
        phase = index.locate(e.time_range.start)
        if phase is not None:
            key = (phase, *name(e))
            total_us[key] += amount_us(e)
            calls[key] += 1
    keys = sorted(total_us, key=lambda k: (-total_us[k], k))[:limit]
    return [(k, total_us[k] / 1e6 / steps, calls[k] / steps) for k in keys]


class _Window:
    """The events of the timed steps, split into phase ranges, host ops and device activity."""

    def __init__(self, events: Sequence[Any], phase_names: Sequence[str]):
        self.host = host = [e for e in events if e.device_type == DeviceType.CPU]
        steps = [e for e in host if e.name == STEP_RANGE]
        if not steps:
            raise RuntimeError(f"the profiler recorded no {STEP_RANGE!r} range; nothing to analyse")
        self.steps = sorted((e.time_range.start, e.time_range.end) for e in steps)
        self.start = self.steps[0][0]
        host_end = max(end for _, end in self.steps)
        self.inside = inside = [e for e in host if self.start <= e.time_range.start <= host_end]
        self.annotations = {e.name for e in host if _is_annotation(e)} | {STEP_RANGE, *phase_names}
        self.phases = [e for e in inside if e.name in phase_names and e.name != STEP_RANGE]
        self.ops = [e for e in inside if is_op(e) and e.name not in self.annotations]
        self.launchers = [e for e in inside if e.kernels]
        self.waits = [e for e in inside if e.name in BLOCKING_RUNTIME]
        self.device = [(e, kind) for e in events if e.time_range.start >= self.start
                       and (kind := device_kind(e, self.annotations)) is not None]
        self.end = max([host_end] + [e.time_range.end for e, _ in self.device])

    def index(self) -> PhaseIndex:
        return PhaseIndex([(e.time_range.start, e.time_range.end, e.name) for e in self.phases])

    def attributed_share(self) -> float:
        """Median over the timed steps of the share of the step's range covered by named phases.

        The median, so that one preemption or garbage collection landing between two phases on a
        busy machine does not stand for the whole profile.
        """
        shares = []
        for start, end in self.steps:
            inside = [(e.time_range.start, e.time_range.end) for e in self.phases if start <= e.time_range.start <= end]
            shares.append(union_length(inside) / (end - start) if end > start else 0.0)
        return statistics.median(shares)

    def host_us(self) -> dict[str, float]:
        totals: dict[str, float] = defaultdict(float)
        for e in self.phases:
            totals[e.name] += e.time_range.elapsed_us()
        return totals

    @staticmethod
    def _by_phase(index: PhaseIndex, events: Iterable[Any], amount: Callable[[Any], float]) -> dict[str, float]:
        """amount(event) summed by the phase each event starts in (events outside phases dropped)."""
        totals: dict[str, float] = defaultdict(float)
        for e in events:
            phase = index.locate(e.time_range.start)
            if phase is not None:
                totals[phase] += amount(e)
        return totals

    def host_wait_us(self, index: PhaseIndex) -> dict[str, float]:
        """Host time blocked in CUDA synchronisations and copies, summed by the phase it falls in."""
        return self._by_phase(index, self.waits, lambda e: e.time_range.elapsed_us())

    def host_waits(self, index: PhaseIndex, steps: int, limit: int) -> list[HostWait]:
        """The largest host waits, each named by its phase and by the nearest operator above the blocking call:
        a phase's host_wait_s says how long the host waited, this says who asked it to (an ``.item()``, a
        pageable copy, an op whose output size lives on the device)."""
        def named(e: Any) -> tuple[str, str]:
            op = getattr(e, "cpu_parent", None)
            while op is not None and not (is_op(op) and op.name not in self.annotations):
                op = getattr(op, "cpu_parent", None)
            return (e.name if op is None else op.name, e.name)

        ranked = _ranked(index, self.waits, named, lambda e: e.time_range.elapsed_us(), steps, limit)
        return [HostWait(phase=phase, op=op, call=call, wait_s=s, calls=n) for (phase, op, call), s, n in ranked]

    def host_work(self, index: PhaseIndex, steps: int, limit: int) -> list[HostWork]:
        """The largest host self times by (phase, op), over operators and the CUDA runtime calls that do not
        wait (launches, allocations): a phase's host time less its waits, taken apart. Where ``ops`` says
        how many calls a host-bound phase makes, this says which of them cost (a host gather of cache rows,
        a per-element scatter, 300 launches)."""
        work = [e for e in self.inside if e.name not in self.annotations and e.name not in BLOCKING_RUNTIME
                and (is_op(e) or e.name.startswith("cu"))]
        ranked = _ranked(index, work, lambda e: (e.name,), lambda e: e.self_cpu_time_total, steps, limit)
        return [HostWork(phase=phase, op=op, self_s=s, calls=n) for (phase, op), s, n in ranked]

    def ops_by_phase(self, index: PhaseIndex) -> dict[str, float]:
        """Host operator calls made directly in each phase (an op called by another op is not counted)."""
        parent = lambda e: getattr(e, "cpu_parent", None)  # noqa: E731
        direct = [e for e in self.ops
                  if parent(e) is None or not is_op(parent(e)) or parent(e).name in self.annotations]
        return self._by_phase(index, direct, lambda e: 1.0)

    def op_calls_by_phase(self, index: PhaseIndex, steps: int) -> dict[str, dict[str, float]]:
        """Operator calls per step by phase and name, any nesting: the marks a cause leaves (a dense embedding
        backward, an optimizer's loop of elementwise ops)."""
        calls: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
        for e in self.ops:
            phase = index.locate(e.time_range.start)
            if phase is not None:
                calls[phase][e.name] += 1.0 / steps
        return {phase: dict(ops) for phase, ops in calls.items()}

    def pageable_copy_us(self) -> float:
        """Device time of host-to-device copies from pageable memory (their names say so: 'Pageable -> Device')."""
        return sum(e.time_range.elapsed_us() for e, kind in self.device
                   if kind == "memcpy" and "HtoD" in e.name and "Pageable" in e.name)

    def launches_by_phase(self, index: PhaseIndex) -> dict[str, float]:
        """Kernels launched from each phase."""
        return self._by_phase(index, self.launchers,
                              lambda e: float(sum(k.name not in self.annotations for k in e.kernels)))

    def device_us_by_phase(self, index: PhaseIndex) -> dict[str, float]:
        """Device time of each launching op's kernels, summed by the phase its launch falls in."""
        return self._by_phase(index, self.launchers,
                              lambda e: sum(k.duration for k in e.kernels if k.name not in self.annotations))

    def device_us(self) -> float:
        """Device time of every kernel, copy and memset in the window (overlaps counted twice)."""
        return sum(e.time_range.elapsed_us() for e, _ in self.device)

    def top_ops(self, on_device: bool, steps: int, step_s: float, limit: int) -> list[OpTime]:
        self_us: dict[str, float] = defaultdict(float)
        calls: dict[str, int] = defaultdict(int)
        for e in self.ops:
            self_us[e.name] += e.self_device_time_total if on_device else e.self_cpu_time_total
            calls[e.name] += 1
        ranked = sorted(self_us, key=lambda name: (-self_us[name], name))[:limit]
        return [OpTime(name=name, self_s=self_us[name] / 1e6 / steps, calls=calls[name] / steps,
                       share=self_us[name] / 1e6 / steps / step_s) for name in ranked]

    def memcpy_bytes(self, direction: str) -> int:
        return sum(memcpy_bytes(e) for e, kind in self.device if kind == "memcpy" and direction in e.name)

    def collective_us(self, on_device: bool) -> float:
        """Time in the window during which a collective runs (NCCL kernels on a device, else their host
        events on any thread), overlaps counted once."""
        if on_device:
            spans = [e.time_range for e, kind in self.device if COLLECTIVE_KERNEL in e.name.lower()]
        else:
            spans = [e.time_range for e in self.host if e.name.startswith(COLLECTIVE_HOST)]
        return union_length((max(r.start, self.start), min(r.end, self.end)) for r in spans
                            if r.end > self.start and r.start < self.end)


def _trace_memcpy_bytes(prof: Any, trace_path: str | None) -> dict[str, int]:
    """Bytes of device memcpys by direction, read from the Chrome trace's event args.

    Some torch versions keep the byte count only in the exported trace, not on the FunctionEvent;
    the trace covers everything the profiler saw (the settling step included).
    """
    import json
    import os
    import tempfile

    path = trace_path
    if path is None:
        handle, path = tempfile.mkstemp(suffix=".json")
        os.close(handle)
        prof.export_chrome_trace(path)
    try:
        with open(path) as f:
            events = json.load(f).get("traceEvents", [])
    finally:
        if trace_path is None:
            os.unlink(path)
    totals: dict[str, int] = defaultdict(int)
    for e in events:
        if e.get("cat") == "gpu_memcpy":
            direction = "HtoD" if "HtoD" in e.get("name", "") else "DtoH" if "DtoH" in e.get("name", "") else ""
            totals[direction] += int(e.get("args", {}).get("bytes", 0) or 0)
    return totals


# ----------------------------------------------------------------------------- the profile

def _peak_memory(device: torch.device) -> tuple[int, str]:
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device)), "device-max-allocated"
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return int(rss if sys.platform == "darwin" else rss * 1024), "host-max-rss"


def _counter_rate(before: dict[str, float], after: dict[str, float], key: str, steps: int) -> float | None:
    if key not in before or key not in after:
        return None
    return (after[key] - before[key]) / steps


def profile_session(session: Session, device: torch.device | str, warmup: int, steps: int,
                    trace_path: str | None = None, top: int = TOP_OPS) -> CoarseProfile:
    """Profile ``steps`` training steps after ``warmup`` untimed ones; see the module docstring.

    The same number of steps runs without the profiler just before and just after the profiled
    ones; their mean is the overhead's denominator, so a drifting step time cancels out. A distorted
    window (overhead over DISTORTED_OVERHEAD) is profiled again (``least_distorted_window``).
    """
    if steps < 1:
        raise ValueError("profile at least one step")
    device = torch.device(device)
    on_cuda = device.type == "cuda"
    for _ in range(warmup + banked_steps(session)):  # what the loader banked while the session was built
        session.step()
    sync(device)
    kept, overheads = least_distorted_window(session, device, steps)
    prof, profiled_s, unprofiled_s, values = kept.prof, kept.profiled_s, kept.unprofiled_s, kept.losses
    before, after = kept.before, kept.after
    if trace_path:
        prof.export_chrome_trace(trace_path)
    copied = _trace_memcpy_bytes(prof, trace_path) if on_cuda else {}
    peak, peak_kind = _peak_memory(device)

    window = _Window(prof.events(), session.phase_names)
    index = window.index()
    # memcpy bytes come from the trace when the events lack them: those cover the settling step too
    steps_in_profiler = steps if window.memcpy_bytes("HtoD") or window.memcpy_bytes("DtoH") else steps + 1
    step_s = profiled_s / steps
    host = window.host_us()
    device_us = window.device_us_by_phase(index) if on_cuda else {}
    waits = window.host_wait_us(index) if on_cuda else {}
    ops, launches = window.ops_by_phase(index), window.launches_by_phase(index) if on_cuda else {}
    phases = {}
    for name in session.phase_names:
        host_s = host.get(name, 0.0) / 1e6 / steps
        wait_s = min(host_s, waits.get(name, 0.0) / 1e6 / steps)
        dev_s = device_us.get(name, 0.0) / 1e6 / steps if on_cuda else None
        phases[name] = PhaseTime(host_s=host_s, host_wait_s=wait_s, device_s=dev_s,
                                 share=max(host_s - wait_s, dev_s or 0.0) / step_s, ops=ops.get(name, 0.0) / steps,
                                 launches=launches.get(name, 0.0) / steps if on_cuda else None)
    busy_us = union_length((e.time_range.start, e.time_range.end) for e, _ in window.device)
    all_device_us = window.device_us()
    comm_s = window.collective_us(on_cuda) / 1e6 / steps if dist.is_available() and dist.is_initialized() else None
    return CoarseProfile(
        device=str(device), time_basis="device" if on_cuda else "cpu", warmup=warmup, steps=steps,
        step_s=step_s, unprofiled_step_s=unprofiled_s / steps, profiler_overhead=profiled_s / unprofiled_s,
        overheads_tried=overheads,
        phases=phases, attributed_share=window.attributed_share(),
        device_attributed_share=(min(1.0, sum(device_us.values()) / all_device_us)
                                 if on_cuda and all_device_us > 0 else None),
        top_ops=window.top_ops(on_cuda, steps, step_s, top),
        host_waits=window.host_waits(index, steps, top) if on_cuda else [],
        host_work=window.host_work(index, steps, top),
        device_busy_s=busy_us / 1e6 / steps if on_cuda else None,
        device_idle_fraction=(max(0.0, 1.0 - busy_us / (window.end - window.start))
                              if on_cuda and window.end > window.start else None),
        kernel_launches_per_step=sum(kind == "kernel" for _, kind in window.device) / steps,
        ops_per_step=len(window.ops) / steps, peak_memory_bytes=peak, peak_memory_kind=peak_kind,
        memcpy_h2d_bytes_per_step=(window.memcpy_bytes("HtoD") or copied.get("HtoD", 0)) / steps_in_profiler,
        memcpy_d2h_bytes_per_step=(window.memcpy_bytes("DtoH") or copied.get("DtoH", 0)) / steps_in_profiler,
        session_bytes_h2d_per_step=_counter_rate(before, after, "bytes_h2d", steps),
        session_bytes_d2h_per_step=_counter_rate(before, after, "bytes_d2h", steps),
        comm_s=comm_s, comm_share=None if comm_s is None else min(1.0, comm_s / step_s),
        final_loss=values[-1], trace_path=trace_path,
        phase_ops=window.op_calls_by_phase(index, steps),
        pageable_copy_s=window.pageable_copy_us() / 1e6 / steps if on_cuda else None,
    )
