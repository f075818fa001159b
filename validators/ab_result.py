"""The records of a side-by-side measurement: each side's summary, the A/B result with its verdict and the
machine's state during it, an A/A noise floor, and the digest that ties a side to the request it ran
(``validators.speedup`` makes them; reports, the gate and the agent read them)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, Field

from targets.worker_protocol import Failure, WorkerRequest
from validators.ab_stats import CONFIDENCE, RESAMPLES, Verdict
from validators.machine_load import LoadRecord
from validators.machine_pressure import pressure_note
from validators.timing_worker import Side


def spec_digest(spec: WorkerRequest) -> str:
    """sha256 of what defines a side's workload, kernel sources included (their contents, not paths)."""
    kernels: dict[str, str] | str | None = None
    if spec.kernels_dir:
        folder = Path(spec.kernels_dir)
        kernels = ({f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(folder.glob("*.py"))}
                   if folder.is_dir() else "missing")
    identity = {"target": spec.target, "size": spec.size, "config": spec.config, "kernels": kernels,
                "data": spec.data, "device": spec.device, "seed": spec.seed, "threads": spec.threads,
                "warmup": spec.warmup, **({"ranks": spec.ranks} if spec.ranks > 1 else {})}
    return hashlib.sha256(json.dumps(identity, sort_keys=True, default=str).encode()).hexdigest()


class SideSummary(BaseModel):
    label: str
    digest: str = Field(description="spec_digest of the spec this side ran")
    spec: WorkerRequest
    config: dict[str, Any] = Field(default_factory=dict, description="the resolved config the worker reported")
    block_medians: list[float] = Field(default_factory=list, description="each timed block's step seconds: its wall "
                                       "time by the parent's clock over its steps (saved runs from before, whose "
                                       "clock is the worker's: the median of its per-step times)")
    cpus: list[int] | None = Field(None, description="the CPUs the worker reported it may run on")
    root: str | None = Field(None, description="the code tree the worker ran in (None: the caller's)")
    ready_s: float | None = Field(None, description="seconds from the start of the measurement's workers to this "
                                                    "one's ready line (started, built, warmed up)")
    startup: dict[str, float] | None = Field(None, description="this worker's own start-up, in seconds: "
                                             "interpreter and imports (start), session build (build), warm-up "
                                             "steps (warmup); ABRunner.startup")
    build_parts: dict[str, float] = Field(default_factory=dict, description="its build split into the parts the "
                                          "session timed, in seconds (targets.protocol.BuildClock)")
    memory: dict[str, int] = Field(default_factory=dict, description="the worker's footprint in bytes as its ready "
                                   "line reported it: host_rss (peak), device_peak, device_total")
    spot_checks: int = Field(0, description="calls of its replaced kernels checked against their references in "
                                            "untimed steps between its blocks (ABRunner.check)")
    confinement: dict[str, Any] | None = Field(None, description="how the worker was confined before it loaded "
                                               "candidate code (targets.confinement.Confinement; None: not said)")
    block_pressure: list[dict[str, float] | None] = Field(
        default_factory=list, description="per timed block, the share of its wall time in which some task waited "
                                          "for cpu, memory or io (validators.machine_pressure; None: not counted)")
    block_load: list[dict[str, float] | None] = Field(
        default_factory=list, description="per timed block, in CPUs: the outside load on the pinned CPUs and what the "
                                          "other (idle) side's workers used meanwhile (validators.machine_load; "
                                          "None: not counted)")
    clock_agreement: float | None = Field(None, description="of its timed blocks, the worker's own sum of step times "
                                          "over the parent's wall time furthest from 1 (a little below 1: the "
                                          "exchange; see ab_runner.clock_disagreement)")


class ABResult(BaseModel):
    a: SideSummary
    b: SideSummary
    ratio_definition: str
    ratio: float | None = None
    speedup: float | None = Field(None, description="1 / ratio: above 1 means b is faster")
    ci_low: float | None = None
    ci_high: float | None = None
    confidence: float = CONFIDENCE
    resamples: int = RESAMPLES
    floor: float
    verdict: Verdict
    order: list[Side] = Field(description="the order the blocks ran in")
    blocks: int
    steps_per_block: int
    block_seconds: float = Field(0.0, description="the least a timed block lasts (0: steps_per_block alone)")
    side_steps: dict[str, int] | None = Field(None, description="steps per timed block of each side (equal_time_steps)")
    cpus: list[int] | None = Field(None, description="the CPU set both workers were pinned to (None: not pinned)")
    failure: Failure | None = None
    failed_side: str | None = Field(None, description="the label of the side whose worker failed (\"incumbent\", "
                                                     "\"candidate\", ...): not always the side being judged")
    wall_s: float = 0.0
    blocks_s: float = Field(0.0, description="wall seconds of its blocks, settling ones included, from each block's "
                                             "command to its answer: wall_s less the start-up, this and close_s is "
                                             "the protocol's own cost")
    close_s: float = Field(0.0, description="wall seconds from its last block's end until both workers had exited")
    pools: int = Field(1, description="how many measurements, each in fresh workers, this result's blocks come "
                                      "from (see validators.confirmation.pooled)")
    started_ahead: bool = Field(False, description="its workers were started before it, while the candidate's "
                                                   "numerics run was judged (started_ahead.WorkerPool)")
    note: str | None = Field(None, description="why this run is the one quoted, when another was made (see "
                                               "validators.steadiness.steadier_of_two), or why it ran fewer blocks "
                                               "than asked (measure_ab's settled_below)")
    clock: Literal["worker", "parent"] = Field("worker", description="whose clock timed the blocks: the parent's "
                                               "since it judges them; saved runs from before, the worker's")
    waited_s: float = Field(0.0, description="seconds waited for the device's measurement lock "
                                             "(targets.machine_lease), "
                                             "included in wall_s")
    load: LoadRecord | None = Field(None, description="the machine's other work during it and whether that leaves "
                                                      "it clean (None: not recorded, runs from before)")

    @property
    def clean(self) -> bool:
        """Whether no outside load or missing lock taints it: a win may be accepted only from a clean result."""
        return self.load is None or self.load.clean

    @property
    def quotable(self) -> bool:
        """Whether it may be quoted as a result: clean, and no other sg-opt run beside it (``LoadRecord.quotable``)."""
        return self.load is None or self.load.quotable

    def load_note(self) -> str | None:
        """A sentence on the machine's other work during it, when there is something to say (``LoadRecord``)."""
        return self.load.sentence() if self.load is not None else None

    def stalls(self) -> str | None:
        """A sentence on what the machine stalled tasks on during its blocks, both sides' (``pressure_note``)."""
        return pressure_note(self.a.block_pressure + self.b.block_pressure)

    def step_ms(self, side: Side) -> float | None:
        """A side's step time in this measurement: the median of its block medians, in ms (None: no blocks)."""
        medians = getattr(self, side).block_medians
        return 1e3 * float(np.median(medians)) if medians else None

    @property
    def medians_s(self) -> float:
        """Seconds of its timed blocks as their medians tell them (each block's median step times its steps, both
        sides): what is left of wall_s besides the start-up, blocks_s and close_s is the protocol's own."""
        steps = self.side_steps or {"a": self.steps_per_block, "b": self.steps_per_block}
        return sum(sum(getattr(self, side).block_medians) * steps[side] for side in ("a", "b"))


class NoiseFloor(BaseModel):
    floor: float
    rule: str = "max(MIN_FLOOR, max over A/A runs of |1 - ratio| + CI half-width)"
    runs: list[ABResult]

    @property
    def block_medians(self) -> list[float]:
        """Every block median of its A/A runs, both sides: the calibrated spec's step time, many times over."""
        return [m for run in self.runs for m in run.a.block_medians + run.b.block_medians]

    @property
    def step_ms(self) -> float:
        """The calibrated spec's step time: the median of every A/A block, in ms."""
        return 1e3 * float(np.median(self.block_medians))


class SidesMismatch(RuntimeError):
    """An A/B result does not belong to the incumbent and candidate it is being used for."""


def assert_sides(result: ABResult, incumbent: WorkerRequest, candidate: WorkerRequest) -> None:
    """Raise SidesMismatch unless side a ran the incumbent's spec and side b the candidate's."""
    want, got = (spec_digest(incumbent), spec_digest(candidate)), (result.a.digest, result.b.digest)
    if got == want:
        return
    if got == want[::-1]:
        raise SidesMismatch(f"the sides are swapped: {result.a.label!r} ran the candidate and {result.b.label!r} "
                            f"the incumbent, so the ratio {result.ratio_definition!r} would be read inverted")
    names = [n for n, g, w in (("a", got[0], want[0]), ("b", got[1], want[1])) if g != w]
    raise SidesMismatch(f"side {' and '.join(names)} of the result ran another spec than the one given "
                        f"({', '.join(g[:12] for g in got)} vs {', '.join(w[:12] for w in want)})")
