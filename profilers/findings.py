"""Bottleneck findings: the profiles turned into a ranked list of what is worth attacking.

The agent's proposers read these, so each finding is precise and deterministic: a category, the
phase it lives in, one sentence of evidence with the measured numbers, the share of the step it
takes, a documented headroom (a plausible speedup of that part, not a promise) and the step's
speedup by Amdahl's law if that headroom were realised: ``1 / (1 - share + share / headroom)``.
Findings are ranked by that gain (ties by category, phase, subject), so the first is the most
promising; a part under 1% of the step is not reported.

Headroom per category: the target's own model first (``Target.headroom``: the bundled trainer's knows which of
its backends are already fused), else the generic figures of ``GENERIC_HEADROOM``; a headroom of 1 or less means
nothing to win, and no finding. Each finding also says which knob categories attack it (``ATTACKED_BY``), for the
proposers' sweeps. Phases are read by name (``PHASE_CATEGORIES``), causes from the profile's marks
(``profilers.causes``), and a target may add findings of its own on a phase (``Target.target_findings``), found
where its headroom returns one. The generic figures, in parentheses what the finding's share measures:

- data-wait (data phase): 2, loader workers and prefetch overlap it with the step; optimizer, embedding-bound,
  tail-gather-bound, forward, loss, backward (their phases): 1.5, what is left beyond kernel choices with no
  knowledge of the target's.
- dense-embedding-grads (the optimizer phase and half the backward): 5; sparse gradients write and update only
  the looked-up rows (the job adapter's DLRM example at size small on a 2-core CPU: optimizer 21.6 -> 6.4 ms a
  step with sparse gradients, their optimizer's loop included).
- unfused-optimizer (the optimizer phase): 3; Adam's loop makes about nine passes over each parameter and its
  state, a fused update one (the same example: 21.6 -> 3.3 ms a step).
- host-sync (time the host waits on the device outside data, at most the device's idle share): 1.5.
- unpinned-copies (pageable copies' device time, or the data phase's wait when longer): 2; a pinned copy runs at
  bus speed, asynchronously.
- fp32-products: no generic figure; a target's own finding.
- launch/host-bound (device idle fraction, CUDA only, from 20%, less the data phase's host time beyond
  its device work: that wait is data-wait's, an upper estimate of it when loading overlaps the step):
  3 with >= 100 kernels per step (CUDA graphs / compile remove launch gaps), else 1.5; also 1.5 when
  the host works more than 250 us per launch outside the data phase: then it computes rather than
  launches (on an H200, 96 us a launch for a step with device tables; 720 us for one whose tables
  are updated on the host).
- cache-misses (embed phase, a session counting its cache's miss_rate, from 1%): 1 / (1 - miss_rate
  / 2), a larger, planned or LFU cache halving the misses with embed time proportional to them.
- memory-/compute-bound kernel (slot median / step, one call per step): 0.8 / roofline fraction,
  at most 10 (a tuned kernel reaches about 80% of the roof it sits under); none above 80%.
- communication (share of the step with a collective in flight, one rank of a torch.distributed
  job, from 20%): 1.5, an estimate with no measured figure yet: another sharding plan
  (embedding_sharding, tail_sharding) moves fewer bytes or evens the ranks' load, but collectives that
  overlap compute, or wait for a slower peer, do not all go away. Phases of a ranked step that no
  category names (input_dist, output_dist, loss_sync: mostly collectives) are covered by this finding.
"""

from __future__ import annotations

from typing import Any, Mapping

from profilers.causes import causes
from profilers.records import CoarseProfile, FineProfile, Finding, PhaseTime, SlotTiming
from targets.protocol import Target
from targets.tuning import Headroom

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
                    "tail": "tail-gather-bound", "loss": "loss", "backward": "backward", "forward": "forward"}

GENERIC_HEADROOM: dict[str, Headroom] = {
    "data-wait": Headroom(2.0, "batches are built or copied inside the step; loader workers and prefetch overlap "
                               "them with it"),
    **{category: Headroom(1.5, "what is left beyond kernel choices; the target gives no figure of its own")
       for category in ("optimizer", "embedding-bound", "tail-gather-bound", "loss", "backward", "forward")},
    "dense-embedding-grads": Headroom(5.0, "sparse gradients write and update only the looked-up rows (a DLRM-style "
                                           "job on a 2-core CPU: optimizer 21.6 -> 6.4 ms a step)"),
    "unfused-optimizer": Headroom(3.0, "a fused update makes one pass over parameters and state where the loop makes "
                                       "about nine (a DLRM-style job on a 2-core CPU: 21.6 -> 3.3 ms a step)"),
    "host-sync": Headroom(1.5, "deferred reads let the host queue the next steps while the device works"),
    "unpinned-copies": Headroom(2.0, "page-locked copies run at bus speed and asynchronously"),
}

# Finding category -> the knob categories that attack it (the proposers' sweeps). Launch gaps: compile and the
# host's threads and reads (tile sizes cut no launches). fp32-products: only a target's precision rules answer it.
ATTACKED_BY: dict[str, tuple[str, ...]] = {
    "data-wait": ("data",), "optimizer": ("kernel", "embedding"), "embedding-bound": ("embedding", "kernel"),
    "tail-gather-bound": ("kernel", "precision"), "loss": ("kernel", "precision"), "backward": ("kernel", "precision"),
    "forward": ("compile", "precision", "kernel"), "launch/host-bound": ("compile", "host"),
    "cache-misses": ("embedding",), "memory-bound kernel": ("kernel", "precision"),
    "compute-bound kernel": ("kernel", "precision"), "communication": ("distributed",), "fp32-products": (),
    "dense-embedding-grads": ("embedding",), "unfused-optimizer": ("kernel",), "host-sync": ("host", "compile"),
    "unpinned-copies": ("data",),
}


def amdahl(share: float, headroom: float) -> float:
    """The whole step's speedup when a part taking ``share`` of it becomes ``headroom`` times faster."""
    share = min(max(share, 0.0), 1.0)
    return 1.0 / (1.0 - share + share / headroom)


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f} ms"


def attacked_by(finding: Finding) -> tuple[str, ...]:
    """The knob categories that attack a finding: its own list, or, for one recorded before findings said so, its
    category's."""
    if finding.knob_categories is not None:
        return tuple(finding.knob_categories)
    return ATTACKED_BY.get(finding.category, ())


def _room(category: str, knobs: Mapping[str, Any], target: Target | None) -> Headroom | None:
    """The target's headroom for a category, else the generic one (None: neither has one)."""
    own = target.headroom(category, knobs) if target is not None and target.headroom is not None else None
    return own if own is not None else GENERIC_HEADROOM.get(category)


def _phase_findings(coarse: CoarseProfile, knobs: Mapping[str, Any], target: Target | None) -> list[Finding]:
    found = []
    for phase, category in PHASE_CATEGORIES.items():
        timing = coarse.phases.get(phase)
        room = _room(category, knobs, target)
        if timing is None or timing.share < MIN_SHARE or room is None or room.value <= 1.0:
            continue
        device = f", {_ms(timing.device_s)} on the device" if timing.device_s is not None else ""
        evidence = (f"{phase} takes {timing.share:.1%} of the {_ms(coarse.step_s)} step "
                    f"({_ms(timing.host_s)} on the host{device}).")
        found.append(_finding(category, phase, None, evidence, timing.share, room,
                              device_fraction=_device_fraction(timing)))
    return found


def _device_fraction(timing: PhaseTime) -> float | None:
    """The phase's device time over its wall time, the host's when longer (None off a GPU): a host-bound phase
    (an `embed` phase at 1.61 ms on the device in 12.07 on the host) gains little from faster kernels."""
    if timing.device_s is None:
        return None
    wall = max(timing.host_s, timing.device_s)
    return timing.device_s / wall if wall > 0 else None


def _target_findings(coarse: CoarseProfile, knobs: Mapping[str, Any], target: Target | None) -> list[Finding]:
    """The target's own (phase, category) findings, where its headroom returns one under these knobs."""
    found = []
    for phase, category in (target.target_findings if target is not None else ()):
        timing = coarse.phases.get(phase)
        room = target.headroom(category, knobs) if target.headroom is not None else None
        if room is None or room.value <= 1.0 or timing is None or timing.share < MIN_SHARE:
            continue
        evidence = f"{room.cause}; {phase} takes {timing.share:.1%} of the {_ms(coarse.step_s)} step."
        found.append(_finding(category, phase, None, evidence, timing.share, room,
                              device_fraction=_device_fraction(timing)))
    return found


def _cause_findings(coarse: CoarseProfile, knobs: Mapping[str, Any], target: Target | None) -> list[Finding]:
    found = []
    for cause in causes(coarse):
        room = _room(cause.category, knobs, target)
        if room is not None and room.value > 1.0 and cause.share >= MIN_SHARE:
            found.append(_finding(cause.category, cause.phase, None, cause.evidence, cause.share, room))
    return found


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


def _cache_finding(coarse: CoarseProfile, counters: Mapping[str, float], knobs: Mapping[str, Any],
                   target: Target | None) -> list[Finding]:
    """From a session that counts cache misses (``miss_rate``), unless its target says it has no cache to win."""
    miss_rate = counters.get("miss_rate")
    embed = coarse.phases.get("embed")
    own = _room("cache-misses", knobs, target)
    if (own is not None and own.value <= 1.0 or miss_rate is None or miss_rate < MIN_MISS_RATE
            or embed is None or embed.share < MIN_SHARE):
        return []
    room = own or Headroom(1.0 / (1.0 - miss_rate / 2.0), "a larger, planned or LFU cache halving the misses, with "
                                                          "embed time proportional to them")
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
                   headroom=room.value, headroom_basis=room.basis, amdahl_gain=amdahl(share, room.value),
                   knob_categories=list(ATTACKED_BY.get(category, ())), **more)


def findings(coarse: CoarseProfile, fine: FineProfile | None, counters: Mapping[str, float],
             knobs: Mapping[str, Any], target: Target | None = None) -> list[Finding]:
    """Every finding the profiles support, the largest Amdahl gain first; ``target``: its own headroom model and
    findings (None: the generic figures alone)."""
    found = (_phase_findings(coarse, knobs, target) + _target_findings(coarse, knobs, target)
             + _cause_findings(coarse, knobs, target) + _launch_finding(coarse)
             + _cache_finding(coarse, counters, knobs, target) + _comm_finding(coarse))
    if fine is not None:
        found += [f for slot in fine.slots if (f := _kernel_finding(slot, coarse.step_s)) is not None]
    return sorted(found, key=lambda f: (-f.amdahl_gain, f.category, f.phase or "", f.subject or ""))
