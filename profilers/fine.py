"""The fine profiler: each kernel slot timed on the running config's real shapes, on a roofline.

The coarse profile says which phase is slow; this says whether the kernel doing that phase's work
is near what the device allows. Each slot implementation (the reference, or a candidate kernel)
is timed on the shapes the training step really uses, with fresh random inputs from the slot's
``make_inputs``. On CUDA each repeat sits between two CUDA events and a write of a buffer far
larger than L2 evicts the previous repeat's operands first, so the kernel is timed from device
memory as in training; on the CPU perf_counter times each call. The median is reported, and the
slot's FLOP/byte model turns it into achieved FLOP/s and bytes/s and a fraction of the attainable
min(peak FLOP/s, intensity x bandwidth) from the measured ceilings.
"""

from __future__ import annotations

import functools
import statistics
from typing import Callable, Mapping

import torch

from profilers.ceilings import dtype_name, get_ceilings, time_calls
from profilers.stats import quantile
from profilers.records import Ceilings, CoarseProfile, FineProfile, SlotTiming
from targets.protocol import KernelSlot, Target

FLUSH_BYTES_MIN = 256 << 20
WARMUP_CALLS = 3  # untimed calls first: compilation, allocator, caches

def _implementation_name(fn: Callable, slot: KernelSlot) -> str:
    if fn is slot.reference:
        return "reference"
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


def _flush_buffer(device: torch.device) -> torch.Tensor | None:
    """A buffer several times the L2 size (at least 256 MiB) on CUDA; none on the CPU."""
    if device.type != "cuda":
        return None
    l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0)
    return torch.empty(max(FLUSH_BYTES_MIN, 4 * l2), dtype=torch.uint8, device=device)


def place_on_roofline(slot: str, implementation: str, shape: Mapping[str, int], dtype: torch.dtype,
                      times: list[float], flops: float, nbytes: float, ceilings: Ceilings,
                      phase: str | None = None) -> SlotTiming:
    """A SlotTiming from measured times and the cost model: achieved rates and roofline fraction."""
    median = statistics.median(times)
    peak, bandwidth = ceilings.peak_flops(dtype_name(dtype)), ceilings.copy_bytes_per_s
    intensity = flops / nbytes if nbytes else float("inf")
    attainable = min(peak, intensity * bandwidth)
    achieved_flops, achieved_bytes = flops / median, nbytes / median
    # A slot without arithmetic is judged on bytes alone.
    fraction = achieved_flops / attainable if flops else achieved_bytes / bandwidth
    return SlotTiming(slot=slot, implementation=implementation, phase=phase, shape=dict(shape),
                      dtype=dtype_name(dtype), repeats=len(times), median_s=median,
                      p10_s=quantile(times, 0.1), p90_s=quantile(times, 0.9), flops=flops, bytes=nbytes,
                      achieved_flops_per_s=achieved_flops, achieved_bytes_per_s=achieved_bytes,
                      intensity=intensity, attainable_flops_per_s=attainable, roofline_fraction=fraction,
                      bound="memory" if intensity * bandwidth < peak else "compute")


def profile_slots(target: Target, slots_shapes: Mapping[str, Mapping[str, int]], device: torch.device | str,
                  dtype: torch.dtype, kernels: Mapping[str, Callable] | None = None, repeats: int = 20, *,
                  ceilings: Ceilings | None = None, coarse: CoarseProfile | None = None,
                  slot_phases: Mapping[str, str] | None = None, seed: int = 0) -> FineProfile:
    """Time each named slot on its shape and place it on the roofline of ``device``.

    ``kernels`` maps slot names to implementations (each slot's reference by default);
    ``ceilings`` defaults to the cached measurement for the device; ``coarse``'s top ops are
    carried along; ``slot_phases`` names the step phase each slot's work belongs to.
    """
    if repeats < 1:
        raise ValueError("time at least one repeat")
    device = torch.device(device)
    ceilings = get_ceilings(device) if ceilings is None else ceilings
    flush = _flush_buffer(device)
    generator = torch.Generator(device=device).manual_seed(seed)
    timings = []
    for name, shape in slots_shapes.items():
        slot = target.slot(name)
        fn = (kernels or {}).get(name, slot.reference)
        inputs = slot.make_inputs(shape, dtype, device, generator)
        with torch.no_grad():
            times = time_calls(functools.partial(fn, *inputs), device, WARMUP_CALLS, repeats,
                               before=None if flush is None else flush.zero_)
        cost = slot.cost(shape, dtype)
        timings.append(place_on_roofline(name, _implementation_name(fn, slot), shape, dtype, times, cost.flops,
                                         cost.bytes, ceilings, (slot_phases or {}).get(name)))
        del inputs
    return FineProfile(device=str(device), timing="cuda-events+l2-flush" if flush is not None else "perf_counter",
                       flush_bytes=0 if flush is None else flush.numel(), ceilings=ceilings, slots=timings,
                       top_ops=list(coarse.top_ops) if coarse else [])
