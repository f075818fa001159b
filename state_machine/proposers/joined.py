"""Proposals that join changes which each leaned faster without clearing the noise floor (the offline rules').

Host and device together: a GPU step builds batches and launches kernels on the host while the device
runs the kernels queued before, so it takes the longer of the two. When they are about as long, a change
that shortens only one side shows little alone. After a host-side change (a data or compile knob) and a
device-side one each measured no-difference while leaning faster, the two are proposed as one candidate,
expected to gain the product of their speedups. At `large` on an H200 (2026-11-30, the incumbent at 13 ms
with 13.6 ms of host work in a 15.3 ms profiled step and 8.7 ms of tail on the device) 3xTF32 leaned 0.933
and two loader workers 0.968; before the step lost a device sync (about 25 ms, device-bound) each had been
a win alone (0.68-0.78 and 0.73-0.77), and runs holding both reached 8.8-10.3 ms. Such a pair's rejection
does not rule out its parts. The same reasoning on any device: once at least three changes have leaned faster
without clearing the noise floor, all of them are proposed as one (``_bundle_proposals``), and two that no pair
joins when together they would clear it.
"""

from __future__ import annotations

import math
from typing import Any, Iterator, Mapping

from state_machine.proposers import Pairs, Proposal, patch_pairs
from state_machine.state import Evaluated, RunState
from targets.protocol import KnobSpace

HOST_SIDE = ("data", "host", "compile")  # knob categories that shorten a GPU step's host side (batches, launches)
HOST_AND_DEVICE = "offline:host-and-device"  # the proposer of a leaning host change joined to a leaning device one
LEANING_BUNDLE = "offline:leaning-bundle"  # the proposer of every leaning change at once
JOINED = (HOST_AND_DEVICE, LEANING_BUNDLE)  # proposers whose rejection does not rule out the parts they joined
BUNDLE_MIN = 3  # leaning changes a bundle joins at least (two on either side of the step: the pair's case)


def joined_proposals(state: RunState, space: KnobSpace) -> Iterator[Proposal]:
    """The host-and-device pairs (GPU runs) and the bundle of every leaning change."""
    current = space.resolve(state.incumbent.config)
    leaned = [e for e in leaning(state) if not _held(current, e.candidate.patch)]
    yield from _host_and_device_proposals(state, space, leaned)
    yield from _bundle_proposals(state, space, leaned)


def _held(current: Mapping[str, Any], patch: Mapping[str, Any]) -> bool:
    """Whether the incumbent already holds every knob value of `patch` (taken since as part of another change): joined
    to another, it would be that other alone (the x12.37 `large-cached` run of 2026-12-03, after the overlap came in
    with two loader workers)."""
    return all(k in current and current[k] == v for k, v in patch.items())


def side(space: KnobSpace, patch: Mapping[str, Any]) -> str | None:
    """"host" or "device": the side of a GPU step every knob of ``patch`` shortens (None: mixed or unknown)."""
    if not set(patch) <= {k.name for k in space}:
        return None
    sides = {"host" if space[k].category in HOST_SIDE else "device" for k in patch}
    return sides.pop() if len(sides) == 1 else None


def leaning(state: RunState) -> list[Evaluated]:
    """The knob patches (not joined ones) whose last timing said no-difference with a ratio below 1."""
    last: dict[Pairs, Evaluated] = {}
    for e in state.history:
        if e.candidate.patch and not e.candidate.kernels and e.candidate.proposer not in JOINED:
            last[patch_pairs(e.candidate.patch)] = e
    return [e for e in last.values() if not e.verdict.accepted and e.verdict.stage == "measure"
            and e.verdict.ratio is not None and e.verdict.ratio < 1.0]


def _host_and_device_proposals(state: RunState, space: KnobSpace, leaned: list[Evaluated]) -> Iterator[Proposal]:
    """Each leaning host-side rejection joined to each leaning device-side one (GPU runs only)."""
    if state.device_kind != "cuda":
        return
    for host in (e for e in leaned if side(space, e.candidate.patch) == "host"):
        for device in (e for e in leaned if side(space, e.candidate.patch) == "device"):
            h, d = host.candidate, device.candidate
            yield Proposal(kind="knob", patch={**h.patch, **d.patch}, proposer=HOST_AND_DEVICE,
                           expected_gain=1.0 / (host.verdict.ratio * device.verdict.ratio),
                           rationale=f"#{h.id} ({h.change()}, host side) leaned {host.verdict.ratio:.3f} and "
                                     f"#{d.id} ({d.change()}, device side) {device.verdict.ratio:.3f}, "
                                     f"neither proven alone: a GPU step takes the longer of its host and device "
                                     f"work, so shortening one side shows little while the other is as long; "
                                     f"both at once")


def _two_unpaired_clear_the_floor(state: RunState, space: KnobSpace, parts: list[Evaluated]) -> bool:
    """Two leaning changes that no host-and-device pair joins (both on one side of a GPU step, or any two on a CPU),
    whose product clears the noise floor in force: a sum a floor would not hide. The 2026-12-04 `large-cached` run
    ended with pinned memory (0.876) and packed batches (0.925), both on the host side, leaning under a 7.7%
    floor: together 0.810, never tried."""
    if len(parts) != 2 or state.baseline is None:
        return False
    sides = {side(space, e.candidate.patch) for e in parts}
    joined_elsewhere = state.device_kind == "cuda" and sides == {"host", "device"}
    return not joined_elsewhere and math.prod(e.verdict.ratio for e in parts) < 1.0 - state.noise_floor


def _bundle_proposals(state: RunState, space: KnobSpace, leaned: list[Evaluated]) -> Iterator[Proposal]:
    """Every leaning rejection at once, when there are at least BUNDLE_MIN: each of them measured no difference
    alone, but a noise floor hides a small gain, not a sum of them (at large-cached on an H200, 2026-12-03, the
    cache overlap leaned 0.926, packed batches 0.954 and TF32 tail products 0.956 under a 4.7% floor; a
    hand-composed configuration with the overlap, packed batches, 3xTF32 tail products and two loader workers had
    measured x14.7 over the baseline the day before, where that run's best reached x7.29). Where two set the same
    knob, the one that leaned further goes in. Its rejection does not rule out its parts."""
    names = {k.name for k in space}
    patch: dict[str, Any] = {}
    parts: list[Evaluated] = []
    for e in sorted(leaned, key=lambda e: e.verdict.ratio):  # none the incumbent holds (joined_proposals)
        change = e.candidate.patch
        if set(change) & set(patch) or not set(change) <= names:
            continue
        patch.update(change)
        parts.append(e)
    if len(parts) < BUNDLE_MIN and not _two_unpaired_clear_the_floor(state, space, parts):
        return
    gain = 1.0 / math.prod(e.verdict.ratio for e in parts)
    leaned = ", ".join(f"#{e.candidate.id} ({e.candidate.change()}) {e.verdict.ratio:.3f}" for e in parts)
    yield Proposal(kind="knob", patch=patch, proposer=LEANING_BUNDLE, expected_gain=gain,
                   rationale=f"{leaned}: each leaned faster without clearing the noise floor alone; together they "
                             f"would gain x{gain:.2f}, which a floor of a few percent does not hide")
