"""The step's top ops timed per call, on the shapes and data the running config really gives them.

Replaying an arbitrary op in isolation needs valid inputs (index ops read out of bounds on random
indices), so the top ops are timed in situ instead: a few more training steps run under the
profiler with shapes recorded, each call of a top op is timed (its kernels' device time on CUDA,
self CPU time on the CPU), calls are grouped by input signature, and the busiest signature of each
op gives a median per call. Matmul-family ops get a FLOP model (2*M*N*K) and so a place on the
roofline; the others are placed by the bytes of their inputs against the copy ceiling.
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from typing import Any, Sequence

import torch
from torch.profiler import ProfilerActivity, profile

from profilers.records import Ceilings, OpTiming
from profilers.stats import quantile
from targets.protocol import Session

ELEMENT_BYTES = {"float": 4, "double": 8, "c10::Half": 2, "c10::BFloat16": 2, "long int": 8, "int": 4,
                 "bool": 1, "unsigned char": 1, "signed char": 1, "short int": 2}
MATMUL_OPS = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm"}


def matmul_flops(name: str, shapes: Sequence[Sequence[int]]) -> float | None:
    """2*M*N*K (times the batch for bmm) from the input shapes of a matmul-family op, else None."""
    dims = [list(s) for s in shapes if s]
    if name in ("aten::mm",) and len(dims) >= 2:
        (m, k), (_, n) = dims[0], dims[1]
        return 2.0 * m * n * k
    if name == "aten::addmm" and len(dims) >= 3:
        (m, k), (_, n) = dims[1], dims[2]
        return 2.0 * m * n * k
    if name in ("aten::bmm", "aten::baddbmm"):
        a, b = (dims[0], dims[1]) if name == "aten::bmm" else (dims[1], dims[2])
        return 2.0 * a[0] * a[1] * a[2] * b[2]
    return None


def input_bytes(shapes: Sequence[Sequence[int]], dtypes: Sequence[str]) -> float:
    return float(sum(math.prod(s) * ELEMENT_BYTES.get(d, 4) for s, d in zip(shapes, dtypes) if s and d))


def _call_seconds(evt: Any, on_cuda: bool) -> float:
    if on_cuda:
        return sum(k.duration for k in evt.kernels) / 1e6
    return evt.self_cpu_time_total / 1e6


def time_top_ops(session: Session, device: torch.device, steps: int, names: Sequence[str],
                 ceilings: Ceilings) -> list[OpTiming]:
    """Per-call medians of the named ops over ``steps`` profiled training steps (see the module doc)."""
    on_cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_cuda else [])
    with profile(activities=activities, record_shapes=True) as prof:
        for _ in range(steps):
            session.step()
        if on_cuda:
            torch.cuda.synchronize(device)
    calls: dict[tuple, list[float]] = defaultdict(list)
    wanted = set(names)
    kineto_dtypes = _kineto_dtypes(prof)
    for evt in prof.events():
        if evt.name in wanted and evt.device_type == torch.autograd.DeviceType.CPU:
            dtypes = getattr(evt, "input_dtypes", None) or kineto_dtypes.get(evt.id, ())
            key = (evt.name, tuple(tuple(s) for s in evt.input_shapes), tuple(dtypes))
            calls[key].append(_call_seconds(evt, on_cuda))
    timings = []
    for name in names:
        signatures = [k for k in calls if k[0] == name]
        if not signatures:
            continue
        key = max(signatures, key=lambda k: sum(calls[k]))
        times = sorted(calls[key])
        median = statistics.median(times)
        shapes, dtypes = [list(s) for s in key[1]], list(key[2])
        flops, nbytes = matmul_flops(name, shapes), input_bytes(shapes, dtypes)
        flops_rate = flops / median if flops is not None and median > 0 else None
        bytes_rate = nbytes / median if median > 0 else 0.0
        if flops_rate is not None:
            peak = ceilings.peak_flops(_dtype_name(dtypes))
            attainable = min(peak, flops / max(nbytes, 1.0) * ceilings.copy_bytes_per_s)
            fraction = flops_rate / attainable
        else:
            fraction = bytes_rate / ceilings.copy_bytes_per_s
        timings.append(OpTiming(name=name, shapes=shapes, dtypes=dtypes, calls_per_step=len(times) / steps,
                                median_s=median, p10_s=quantile(times, 0.1),
                                p90_s=quantile(times, 0.9), flops=flops, input_bytes=nbytes,
                                achieved_flops_per_s=flops_rate, achieved_bytes_per_s=bytes_rate,
                                roofline_fraction=fraction))
    return timings


def _kineto_dtypes(prof: profile) -> dict[int, list[str]]:
    """Input dtypes by event id, read from the kineto events: torch before 2.12 records them there but
    does not copy them onto its FunctionEvents (whose id is the kineto correlation id)."""
    try:
        return {e.correlation_id(): list(e.dtypes()) for e in prof.profiler.kineto_results.events()}
    except AttributeError:
        return {}


def _dtype_name(dtypes: Sequence[str]) -> str:
    """The torch dtype name of the first floating input, for the matching matmul ceiling."""
    for d in dtypes:
        if d in ("c10::BFloat16",):
            return "bfloat16"
        if d in ("c10::Half",):
            return "float16"
        if d == "double":
            return "float64"
    return "float32"
