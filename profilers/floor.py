"""The step's roofline floor: each phase's least work (the target's work model) at the measured ceilings.

A phase's floor is max(FLOPs / matmul ceiling of its dtype, bytes / copy ceiling), plus its
host<->device bytes over the measured bus bandwidth (a copy cannot hide under the work it feeds
at the floor). Phases run one after another, so the step's floor is their sum. Set beside the
measured phase times it says how far each phase is from the hardware, and which one holds the
step back. On a CPU the "device" is the host: there is no bus term.
"""

from __future__ import annotations

from typing import Mapping

from profilers.records import Ceilings, CoarseProfile, PhaseFloor, StepFloor
from targets.protocol import PhaseWork


def phase_floor(work: PhaseWork, ceilings: Ceilings) -> PhaseFloor:
    terms = {"compute": work.flops / ceilings.peak_flops(work.dtype),
             "memory": work.bytes / ceilings.copy_bytes_per_s,
             "bus": work.bus_bytes / ceilings.bus_bytes_per_s if ceilings.bus_bytes_per_s else 0.0}
    device_s = max(terms["compute"], terms["memory"])
    floor_s = device_s + terms["bus"]
    bound = "none" if floor_s == 0 else max(terms, key=terms.get)
    return PhaseFloor(flops=work.flops, bytes=work.bytes, bus_bytes=work.bus_bytes, dtype=work.dtype,
                      floor_s=floor_s, bound=bound)


def step_floor(work: Mapping[str, PhaseWork], ceilings: Ceilings, coarse: CoarseProfile | None = None) -> StepFloor:
    """The floor of every phase and of the step; with a coarse profile, the measured times beside them."""
    phases = {name: phase_floor(w, ceilings) for name, w in work.items()}
    if coarse is not None:
        for name, floor in phases.items():
            measured = coarse.phases.get(name)
            if measured is not None:
                floor.measured_s = measured.share * coarse.step_s
    return StepFloor(phases=phases, floor_s=sum(p.floor_s for p in phases.values()),
                     measured_s=coarse.unprofiled_step_s if coarse is not None else None,
                     ceilings_quick=ceilings.quick)


def held_back_by(floor: StepFloor) -> str | None:
    """The phase whose measured time exceeds its floor by the most seconds: what keeps the step off its floor."""
    excess = {name: p.measured_s - p.floor_s for name, p in floor.phases.items() if p.measured_s is not None}
    return max(excess, key=excess.get) if excess else None


def floor_sentence(floor: StepFloor) -> str:
    """One line: the step's floor, the measured step over it, and the phase furthest from its floor."""
    text = f"roofline floor {1e3 * floor.floor_s:.3f} ms per step"
    if floor.ratio is not None:
        text += f"; measured {1e3 * floor.measured_s:.2f} ms = x{floor.ratio:.1f} the floor"
    if (phase := held_back_by(floor)) is not None:
        p = floor.phases[phase]
        text += f"; furthest: {phase} ({1e3 * p.measured_s:.2f} ms against {1e3 * p.floor_s:.3f} ms, {p.bound}-bound)"
    return text + (" (quick test ceilings)" if floor.ceilings_quick else "")
