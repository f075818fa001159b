"""Bottleneck findings: the profiles turned into a ranked list of what is worth attacking.

The agent's proposers read these, so each finding is precise and deterministic: a category, the
phase it lives in, one sentence of evidence with the measured numbers, the share of the step it
takes, a documented headroom (a plausible speedup of that part, not a promise) and the step's
speedup by Amdahl's law if that headroom were realised: ``1 / (1 - share + share / headroom)``.
Findings are ranked by that gain (ties by category, phase, subject), so the first is the most
promising; a part under 1% of the step is not reported.

Headroom per category (in parentheses, what the finding's share measures; H200 figures from
BENCHMARKS.md):

- data-wait (data phase): 3.5 with in-process loading (data_workers 0, no prefetch), else 1.5;
  worker processes with pinned prefetch took data from 9.8 to 2.8 ms.
- optimizer (optimizer phase): 20 with embedding_grad_mode dense (fused row-wise updates took it
  from 48.2 to 1.24 ms, 39x; half of that claimed); 3 with host tables (their row-wise Adagrad runs
  on the host: 41.5 ms a step at large-cached, 4.5 ms with device tables at large, both with
  sparse gradients; a device cache moves the hot rows' updates to the device); 2 with
  default/for-loop optimizers; else 1.3.
- embedding-bound (embed phase): 3 with host or cached tables (rows cross the bus / cache
  bookkeeping); else 2 (one fused pooled gather).
- tail-gather-bound (tail phase): 3 with tail_backend torch (gather + einsum materialise [B, K, F],
  and the logits' byte floor is about 20x below the measured tail); 2 with slots (explicit products,
  the gathered tile still materialised); 1.3 with triton or triton-fused-loss (already a gather-GEMM
  kernel, only its meta-parameters left: tail_block_b=64 made the step 0.891x as long at size large
  on an H200).
- fp32-products (tail phase, Triton tail multiplying fp32 without TF32: precision fp32, tail_fp32_dot
  ieee or tf32x3, or auto at matmul_precision highest): 2.5 with ieee (tl.dot on fp32 runs as CUDA-core
  FMAs, and the fused loss kernel took 7.47 ms at size large's shape against 3.07 as three TF32
  tensor-core products on an H200); 1.5 with tf32x3 (2.95 against 1.92 in one TF32 pass). Only the
  precision rules answer it (no sweep): the tile knobs do not change how it multiplies.
- loss (loss phase): 2; BCE with dense targets moves the logits' size about four times, a fused
  loss twice. 1.2 with tail_backend triton-fused-loss, whose tail kernel already computes the loss.
- backward (backward phase): 3 while the tail differentiates through gather + einsum (tail_backend
  torch: autograd's index_put_ scatter took 50.2 of the 58.9 ms backward at size large on an
  H200), else 1.5 (dense layers' backward GEMMs, near their floor).
- launch/host-bound (device idle fraction, CUDA only, from 20%, less the data phase's host time beyond
  its device work: that wait is data-wait's, an upper estimate of it when loading overlaps the step):
  3 with >= 100 kernels per step (CUDA graphs / compile remove launch gaps), else 1.5; also 1.5 when
  the host works more than 250 us per launch outside the data phase: then it computes rather than
  launches (an H200 `large` step: 96 us a launch; `large-cached`, whose tables are updated on the
  host: 720 us).
- cache-misses (embed phase, cached tables, miss rate from 1%): 1 / (1 - miss_rate / 2), a
  larger, planned or LFU cache halving the misses with embed time proportional to them.
- memory-/compute-bound kernel (slot median / step, one call per step): 0.8 / roofline fraction,
  at most 10 (a tuned kernel reaches about 80% of the roof it sits under); none above 80%.
- communication (share of the step with a collective in flight, one rank of a torch.distributed
  job, from 20%): 1.5, an estimate with no measured figure yet: another sharding plan
  (embedding_sharding, tail_sharding) moves fewer bytes or evens the ranks' load, but collectives that
  overlap compute, or wait for a slower peer, do not all go away. Phases of a ranked step that no
  category names (input_dist, output_dist, loss_sync: mostly collectives) are covered by this finding.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from profilers.records import CoarseProfile, FineProfile, Finding, PhaseTime, SlotTiming
from targets.haste_rec.knobs import tail_dot_precision

MIN_SHARE = 0.01           # parts below 1% of the step are not reported
IDLE_THRESHOLD = 0.2       # device idle share above which the step is launch/host-bound
MANY_LAUNCHES = 100        # kernels per step above which launch overhead is the likely cause
HOST_S_PER_LAUNCH = 250e-6  # host work per launch (outside data) above which the host computes, not launches
KERNEL_EFFICIENCY = 0.8    # share of the roofline a tuned kernel plausibly reaches
MAX_KERNEL_HEADROOM = 10.0
MIN_MISS_RATE = 0.01
COMM_THRESHOLD = 0.2       # share of the step with collectives in flight above which it is communication-bound

# Phase name -> the category its time is evidence for.
PHASE_CATEGORIES = {"data": "data-wait", "optimizer": "optimizer", "embed": "embedding-bound",
                    "tail": "tail-gather-bound", "loss": "loss", "backward": "backward"}


@dataclass(frozen=True)
class Headroom:
    value: float
    basis: str


def amdahl(share: float, headroom: float) -> float:
    """The whole step's speedup when a part taking ``share`` of it becomes ``headroom`` times faster."""
    share = min(max(share, 0.0), 1.0)
    return 1.0 / (1.0 - share + share / headroom)


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f} ms"


def phase_headroom(category: str, knobs: Mapping[str, Any]) -> Headroom:
    """The documented headroom of a phase category under the current knob values (see the table above)."""
    if category == "data-wait":
        if knobs.get("data_workers", 0) == 0 and not knobs.get("prefetch_to_device", False):
            return Headroom(3.5, "batches are built in the training process; worker processes with pinned "
                                 "prefetch took data from 9.8 to 2.8 ms on an H200")
        return Headroom(1.5, "loading already overlaps the step; what is left is the copy and the wait")
    if category == "optimizer":
        if knobs.get("embedding_grad_mode") == "dense":
            return Headroom(20.0, "dense table-sized embedding gradients; fused row-wise updates took the "
                                  "optimizer from 48.2 to 1.24 ms on an H200")
        if knobs.get("embedding_placement") == "host":
            return Headroom(3.0, "row-wise Adagrad over host tables runs on the host's CPUs (41.5 ms a step at "
                                 "large-cached on an H200 host, 4.5 ms with device tables at large, both sparse); "
                                 "a device cache updates the hot rows on the device")
        if knobs.get("optimizer_impl", "default") in ("default", "for-loop"):
            return Headroom(2.0, "one update kernel per parameter; foreach/fused optimizers batch them")
        return Headroom(1.3, "the optimizer is already batched; little is left to fuse")
    if category == "embedding-bound":
        if knobs.get("embedding_placement") in ("host", "cached"):
            return Headroom(3.0, "rows cross the host bus or go through cache bookkeeping; device placement "
                                 "(when the tables fit) or host pooling avoids it")
        return Headroom(2.0, "pooled gathers from device tables; one fused lookup kernel reads each row once")
    if category == "tail-gather-bound":
        backend = knobs.get("tail_backend", "torch")
        if backend in ("triton", "triton-fused-loss"):
            return Headroom(1.3, "the tail is already a gather-GEMM Triton kernel; what is left is its meta-parameters "
                                 "(tail_block_b=64 made the whole step 0.891x as long at size large on an H200)")
        if backend == "slots":
            return Headroom(2.0, "explicit forward/backward products, but the gathered [B, K, F] tile is still "
                                 "materialised; a fused gather-GEMM kernel keeps it in registers")
        return Headroom(3.0, "gather + einsum materialise [B, K, F]; the logits' byte floor is about 20x lower, "
                             "a fused gather-GEMM kernel writes them once")
    if category == "loss":
        if knobs.get("tail_backend") == "triton-fused-loss":
            return Headroom(1.2, "the BCE and its gradient are already fused into the tail kernel; the logits never "
                                 "reach memory")
        return Headroom(2.0, "BCE with materialised dense targets moves the logits' size about four times; "
                             "a fused loss moves it twice")
    if category == "backward":
        if knobs.get("tail_backend", "torch") == "torch":
            return Headroom(3.0, "autograd through the tail's gather scatters its gradient with index_put_ "
                                 "(50.2 of 58.9 ms at size large on an H200); explicit backward kernels avoid it")
        return Headroom(1.5, "the backward's GEMMs and row gradients; little is left beyond kernel tuning")
    raise ValueError(f"no phase headroom for category {category!r}")


def _phase_findings(coarse: CoarseProfile, knobs: Mapping[str, Any]) -> list[Finding]:
    found = []
    for phase, category in PHASE_CATEGORIES.items():
        timing = coarse.phases.get(phase)
        if timing is None or timing.share < MIN_SHARE:
            continue
        room = phase_headroom(category, knobs)
        device = f", {_ms(timing.device_s)} on the device" if timing.device_s is not None else ""
        evidence = (f"{phase} takes {timing.share:.1%} of the {_ms(coarse.step_s)} step "
                    f"({_ms(timing.host_s)} on the host{device}).")
        found.append(_finding(category, phase, None, evidence, timing.share, room,
                              device_fraction=_device_fraction(timing)))
    return found


def _device_fraction(timing: PhaseTime) -> float | None:
    """The phase's device time over its wall time, the host's when longer (None off a GPU): a host-bound phase
    (session 20's `embed` at large-cached: 1.61 ms on the device in 12.07 on the host) gains little from faster
    kernels."""
    if timing.device_s is None:
        return None
    wall = max(timing.host_s, timing.device_s)
    return timing.device_s / wall if wall > 0 else None


def _fp32_products_finding(coarse: CoarseProfile, knobs: Mapping[str, Any]) -> list[Finding]:
    tail = coarse.phases.get("tail")
    dot = tail_dot_precision(knobs) if "tail_fp32_dot" in knobs else None
    fp32_tail = (knobs.get("tail_backend") in ("triton", "triton-fused-loss") and knobs.get("precision") == "fp32"
                 and dot in ("ieee", "tf32x3"))
    if not fp32_tail or tail is None or tail.share < MIN_SHARE:
        return []
    if dot == "ieee":
        room = Headroom(2.5, "tl.dot on fp32 runs as CUDA-core FMAs: the fused loss kernel took 7.47 ms at size "
                             "large's shape against 3.07 as three TF32 tensor-core products (tail_fp32_dot) on an H200")
        how = "exact fp32 on the CUDA cores"
    else:
        room = Headroom(1.5, "three TF32 tensor-core passes where one may do: the fused loss kernel took 2.95 ms "
                             "at size large's shape against 1.92 in one TF32 pass on an H200, if the precision "
                             "band allows")
        how = "fp32 as three TF32 tensor-core products"
    evidence = f"the Triton tail multiplies {how}; tail takes {tail.share:.1%} of the {_ms(coarse.step_s)} step."
    return [_finding("fp32-products", "tail", None, evidence, tail.share, room, device_fraction=_device_fraction(tail))]


def _data_idle_share(coarse: CoarseProfile) -> float:
    """The share of the step the device sits idle while the host builds or waits for the next batch (the
    data phase's host time beyond its own device work): the data-wait finding's, not a launch gap."""
    data = coarse.phases.get("data")
    if data is None or coarse.step_s <= 0:
        return 0.0
    return max(0.0, data.host_s - data.host_wait_s - (data.device_s or 0.0)) / coarse.step_s


def _launch_finding(coarse: CoarseProfile) -> list[Finding]:
    if coarse.device_idle_fraction is None:
        return []
    data_idle = _data_idle_share(coarse)
    idle = max(0.0, coarse.device_idle_fraction - data_idle)
    if idle < IDLE_THRESHOLD:
        return []
    launches = coarse.kernel_launches_per_step
    work_by_phase = {name: max(0.0, p.host_s - p.host_wait_s) for name, p in coarse.phases.items() if name != "data"}
    host_work = sum(work_by_phase.values())
    per_launch = host_work / launches if launches else float("inf")
    if per_launch > HOST_S_PER_LAUNCH:
        room = Headroom(1.5, f"the host works {per_launch * 1e6:.0f} us per kernel launch outside data: it computes "
                             "(host-side tables, say) rather than launches, so fusing launches gains little")
    elif launches >= MANY_LAUNCHES:
        room = Headroom(3.0, "many small kernels; CUDA graphs or torch.compile remove most launch gaps")
    else:
        room = Headroom(1.5, "few kernels, so host work other than launches keeps the device waiting")
    waiting = (f" (of {coarse.device_idle_fraction:.1%} idle, {data_idle:.1%} is the wait for data, counted there)"
               if data_idle > 0 else "")
    by_phase = sorted(((p.launches, name) for name, p in coarse.phases.items() if p.launches), reverse=True)[:3]
    most = ("; most launches from " + ", ".join(f"{name} ({n:.0f})" for n, name in by_phase)) if by_phase else ""
    heaviest = [w for w in coarse.host_work if w.phase != "data"][:3]
    work = ("; the host's largest work: " + ", ".join(f"{w.op} in {w.phase} ({_ms(w.self_s)})" for w in heaviest)
            if heaviest else "")
    evidence = (f"the device is idle {idle:.1%} of the {_ms(coarse.step_s)} step between "
                f"{launches:.0f} kernel launches per step{waiting}{most}{work}.")
    # where the host's time goes: what a change that cuts one phase's launches can reach
    by_phase = {name: work / host_work for name, work in work_by_phase.items()} if host_work > 0 else {}
    return [_finding("launch/host-bound", None, None, evidence, idle, room, host_by_phase=by_phase)]


def _comm_finding(coarse: CoarseProfile) -> list[Finding]:
    share = coarse.comm_share
    if share is None or share < COMM_THRESHOLD:
        return []
    room = Headroom(1.5, "another sharding plan moves fewer bytes or evens the ranks' load; collectives that "
                         "overlap compute or wait for a slower peer do not all go away")
    evidence = (f"collectives are in flight {_ms(coarse.comm_s)} of the {_ms(coarse.step_s)} step ({share:.1%}), "
                f"waiting for peers included.")
    return [_finding("communication", None, None, evidence, share, room)]


def _cache_finding(coarse: CoarseProfile, counters: Mapping[str, float], knobs: Mapping[str, Any]) -> list[Finding]:
    miss_rate = counters.get("miss_rate")
    embed = coarse.phases.get("embed")
    if (knobs.get("embedding_placement") != "cached" or miss_rate is None or miss_rate < MIN_MISS_RATE
            or embed is None or embed.share < MIN_SHARE):
        return []
    room = Headroom(1.0 / (1.0 - miss_rate / 2.0), "a larger, planned or LFU cache halving the misses, with embed "
                                                   "time proportional to them")
    misses, hits = counters.get("misses", 0.0), counters.get("hits", 0.0)
    evidence = (f"the embedding cache missed {miss_rate:.1%} of lookups ({misses:.0f} of {misses + hits:.0f}); "
                f"embed takes {embed.share:.1%} of the {_ms(coarse.step_s)} step.")
    return [_finding("cache-misses", "embed", None, evidence, embed.share, room)]


def _kernel_finding(slot: SlotTiming, step_s: float) -> Finding | None:
    share = min(1.0, slot.median_s / step_s)
    if share < MIN_SHARE or slot.roofline_fraction <= 0:
        return None
    value = min(MAX_KERNEL_HEADROOM, KERNEL_EFFICIENCY / slot.roofline_fraction)
    if value <= 1.0:  # already as close to its roof as a tuned kernel gets
        return None
    room = Headroom(value, f"at {slot.roofline_fraction:.1%} of the {slot.bound} roof; a tuned kernel reaches "
                           f"about {KERNEL_EFFICIENCY:.0%}")
    shape = ", ".join(f"{k}={v}" for k, v in slot.shape.items())
    evidence = (f"{slot.slot} ({slot.implementation}, {slot.dtype}, {shape}) takes {_ms(slot.median_s)}, "
                f"{share:.1%} of the step, at {slot.achieved_flops_per_s / 1e9:.1f} GFLOP/s and "
                f"{slot.achieved_bytes_per_s / 1e9:.1f} GB/s: {slot.roofline_fraction:.1%} of its attainable "
                f"{slot.attainable_flops_per_s / 1e9:.1f} GFLOP/s.")
    category = "memory-bound kernel" if slot.bound == "memory" else "compute-bound kernel"
    return _finding(category, slot.phase, slot.slot, evidence, share, room)


def _finding(category: str, phase: str | None, subject: str | None, evidence: str, share: float,
             room: Headroom, **more: Any) -> Finding:
    """A finding with its Amdahl gain; `more`: the optional fields (host_by_phase, device_fraction)."""
    return Finding(category=category, phase=phase, subject=subject, evidence=evidence, share=share,
                   headroom=room.value, headroom_basis=room.basis, amdahl_gain=amdahl(share, room.value), **more)


def findings(coarse: CoarseProfile, fine: FineProfile | None, counters: Mapping[str, float],
             knobs: Mapping[str, Any]) -> list[Finding]:
    """Every finding the profiles support, the largest Amdahl gain first."""
    found = (_phase_findings(coarse, knobs) + _fp32_products_finding(coarse, knobs) + _launch_finding(coarse)
             + _cache_finding(coarse, counters, knobs) + _comm_finding(coarse))
    if fine is not None:
        found += [f for slot in fine.slots if (f := _kernel_finding(slot, coarse.step_s)) is not None]
    return sorted(found, key=lambda f: (-f.amdahl_gain, f.category, f.phase or "", f.subject or ""))
