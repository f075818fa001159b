"""Device ceilings for the roofline, measured once per device and cached.

A kernel's time means little without what the device can do: the fine profiler places each
kernel slot under min(peak FLOP/s, intensity x bandwidth). Datasheet numbers overstate both, so
the ceilings are measured here with two micro-benchmarks on buffers far larger than any cache:

- matmul: n x n x n, bf16 and fp32 at n = 8192 on CUDA; fp32 on the CPU at the n that takes
  about 0.2 s (calibrated on a small matmul first);
- copy: a device-to-device copy of 1 GiB on CUDA, a 256 MiB memcpy on the CPU; read and written
  bytes both count.

Each figure is the median of repeats after warm-up, timed with CUDA events on the GPU and
perf_counter on the CPU. Results are cached as JSON in ``$XDG_CACHE_HOME/sg-opt`` (default
``~/.cache``), keyed by device name and torch version (and thread count on the CPU, which sets
its ceilings); a file that does not parse or was written by another schema is measured afresh.
``quick`` measures with small sizes for tests and is cached under its own name, so it never
stands in for a full measurement.
"""

from __future__ import annotations

import datetime as dt
import os
import platform
import re
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from profilers.records import PROFILE_SCHEMA_VERSION, Ceilings
from targets.protocol import user_cache_dir

CPU_MATMUL_TARGET_S = 0.2


@dataclass(frozen=True)
class _Plan:
    """Sizes and repeats of one measurement: a fixed matmul n on CUDA, a target time on the CPU."""

    matmul_n: int
    matmul_target_s: float
    copy_bytes: int
    warmup: int
    repeats: int


PLANS = {  # (device type, quick) -> plan
    ("cuda", False): _Plan(matmul_n=8192, matmul_target_s=0.0, copy_bytes=1 << 30, warmup=3, repeats=10),
    ("cpu", False): _Plan(matmul_n=0, matmul_target_s=CPU_MATMUL_TARGET_S, copy_bytes=256 << 20, warmup=1,
                          repeats=5),
    ("cuda", True): _Plan(matmul_n=2048, matmul_target_s=0.0, copy_bytes=64 << 20, warmup=1, repeats=3),
    ("cpu", True): _Plan(matmul_n=0, matmul_target_s=0.005, copy_bytes=16 << 20, warmup=1, repeats=3),
}


# ----------------------------------------------------------------------------- cache

cache_dir = user_cache_dir


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def device_key(device: torch.device) -> str:
    """A file-name-safe key: device name, torch version, and the thread count on a CPU."""
    parts = [device_name(device), f"torch-{torch.__version__}"]
    if device.type == "cpu":
        parts.append(f"{torch.get_num_threads()}-threads")
    return re.sub(r"[^a-z0-9.]+", "-", "-".join(parts).lower()).strip("-")


def cache_path(device: torch.device, quick: bool = False) -> Path:
    return cache_dir() / f"ceilings-{device_key(device)}{'-quick' if quick else ''}.json"


def _read(path: Path, key: str, quick: bool) -> Ceilings | None:
    try:
        cached = Ceilings.model_validate_json(path.read_text())
    except (OSError, ValueError):  # missing, unreadable or corrupt (pydantic's errors are ValueErrors)
        return None
    if cached.version != PROFILE_SCHEMA_VERSION or cached.device_key != key or cached.quick != quick:
        return None
    return cached


def _write(path: Path, ceilings: Ceilings) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(ceilings.model_dump_json(indent=1))
    os.replace(tmp, path)


def get_ceilings(device: torch.device | str, refresh: bool = False, quick: bool = False) -> Ceilings:
    """The device's ceilings from the cache, measuring (and caching) them when absent, stale or asked."""
    device = _concrete(torch.device(device))
    path = cache_path(device, quick)
    if not refresh:
        cached = _read(path, device_key(device), quick)
        stale = cached is not None and device.type == "cuda" and cached.bus_bytes_per_s is None  # pre-bus record
        if cached is not None and not stale:
            return cached
    ceilings = measure_ceilings(device, quick)
    _write(path, ceilings)
    return ceilings


# ----------------------------------------------------------------------------- measurement

def dtype_name(dtype: torch.dtype) -> str:
    """'bfloat16' for torch.bfloat16: the key of a dtype in Ceilings.matmul_flops_per_s."""
    return str(dtype).removeprefix("torch.")


def _concrete(device: torch.device) -> torch.device:
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def time_calls(fn: Callable[[], object], device: torch.device, warmup: int, repeats: int,
               before: Callable[[], object] | None = None) -> list[float]:
    """Seconds of each of ``repeats`` calls after ``warmup`` untimed ones: CUDA events on the GPU,
    perf_counter on the CPU. ``before`` runs untimed ahead of each timed call (e.g. an L2 flush)."""
    for _ in range(warmup):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        pairs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(repeats)]
        for start, end in pairs:
            if before is not None:
                before()
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize(device)
        return [start.elapsed_time(end) / 1e3 for start, end in pairs]
    times = []
    for _ in range(repeats):
        if before is not None:
            before()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def median_seconds(fn: Callable[[], object], device: torch.device, warmup: int, repeats: int) -> float:
    return statistics.median(time_calls(fn, device, warmup, repeats))


def _matmul_seconds(n: int, dtype: torch.dtype, device: torch.device, warmup: int, repeats: int) -> float:
    gen = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(n, n, generator=gen, device=device, dtype=dtype)
    b = torch.randn(n, n, generator=gen, device=device, dtype=dtype)
    out = torch.empty(n, n, device=device, dtype=dtype)
    return median_seconds(lambda: torch.mm(a, b, out=out), device, warmup, repeats)


def _cpu_matmul_n(target_s: float) -> int:
    """The n (a multiple of 64) whose fp32 n^3 matmul takes about target_s here."""
    probe = 256
    rate = 2 * probe ** 3 / _matmul_seconds(probe, torch.float32, torch.device("cpu"), 1, 3)
    n = (target_s * rate / 2) ** (1 / 3)
    return int(min(8192, max(probe, round(n / 64) * 64)))


def _copy_bytes_per_s(nbytes: int, device: torch.device, warmup: int, repeats: int) -> float:
    src = torch.ones(nbytes, dtype=torch.uint8, device=device)  # touched, so no zero-page reads
    dst = torch.empty_like(src)
    seconds = median_seconds(lambda: dst.copy_(src), device, warmup, repeats)
    return 2 * nbytes / seconds


def _bus_bytes_per_s(nbytes: int, device: torch.device, warmup: int, repeats: int) -> float:
    """Host-to-device bandwidth of a pinned copy: what cache misses and host rows cross at best."""
    src = torch.ones(nbytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    return nbytes / median_seconds(lambda: dst.copy_(src, non_blocking=True), device, warmup, repeats)


def measure_ceilings(device: torch.device | str, quick: bool = False) -> Ceilings:
    """Run the micro-benchmarks now (no cache)."""
    device = _concrete(torch.device(device))
    plan = PLANS[device.type, quick]
    if device.type == "cuda":
        sizes = {torch.bfloat16: plan.matmul_n, torch.float32: plan.matmul_n}
    else:
        sizes = {torch.float32: _cpu_matmul_n(plan.matmul_target_s)}
    flops, matmul_size = {}, {}
    for dtype, n in sizes.items():
        flops[dtype_name(dtype)] = 2 * n ** 3 / _matmul_seconds(n, dtype, device, plan.warmup, plan.repeats)
        matmul_size[dtype_name(dtype)] = n
    bandwidth = _copy_bytes_per_s(plan.copy_bytes, device, plan.warmup, plan.repeats)
    bus = _bus_bytes_per_s(plan.copy_bytes // 4, device, plan.warmup, plan.repeats) if device.type == "cuda" else None
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return Ceilings(device_key=device_key(device), device_name=device_name(device), torch=torch.__version__,
                    measured_at=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), quick=quick,
                    matmul_flops_per_s=flops, matmul_size=matmul_size, copy_bytes_per_s=bandwidth,
                    copy_bytes=plan.copy_bytes, bus_bytes_per_s=bus)
