"""The agent's state: one typed object that the graph checkpoints after every node.

Everything a resumed run needs lives here or in a file of the run directory that a field names:
the request (target, size, device, tier, limits), the baseline's measurements, the incumbent (the
best configuration accepted so far), the proposals waiting to be tried, the candidate in flight,
and the history of every candidate with its verdict. Bulky records (numerics trajectories,
profiles, A/B timings) are written as JSON files under the run directory and referenced by path,
so a checkpoint stays small and a report can be rebuilt from the directory alone.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (AfterValidator, BaseModel, Field, PlainSerializer, SerializationInfo, ValidationInfo,
                      model_validator)

from profilers.records import Finding
from state_machine.portable import relative_paths
from validators.numerics import ReorderCalibration

STATE_SCHEMA_VERSION = 2  # 2: the candidate in flight is one InFlight (1: flat current_* fields)
RUN_DIR = "run_dir"  # the context key that makes RunPath fields relative (dump) or rooted (validate) there


def _relative_to_run(path: str, info: SerializationInfo) -> str:
    """Dumped with ``context={RUN_DIR: dir}``: relative to ``dir`` when under it, else absolute (so that a relative
    path is never read as one under the run directory)."""
    run_dir = (info.context or {}).get(RUN_DIR)
    if run_dir is None:
        return path
    relative = relative_paths(path, run_dir)
    return relative if relative != path or os.path.isabs(path) else os.path.abspath(path)


def _rooted_in_run(path: str, info: ValidationInfo) -> str:
    """Validated with ``context={RUN_DIR: dir}``: a relative path is taken as one under ``dir``."""
    run_dir = (info.context or {}).get(RUN_DIR)
    if run_dir is None or os.path.isabs(path):
        return path
    return os.path.normpath(os.path.join(run_dir, path))


# A file or folder of the run directory. In memory it is as the nodes made it (under the run directory as given); a
# state file (``state_machine.state_file``) stores it relative to the run directory and reads it back under wherever
# that directory is now. Without a context, it is a plain string both ways (the checkpointer's serializer).
RunPath = Annotated[str, AfterValidator(_rooted_in_run), PlainSerializer(_relative_to_run)]

CandidateKind = Literal["knob", "kernel"]
Stage = Literal["check", "validate", "measure"]
NUMERICS_ORDER = ("exact", "reorder", "precision", "model")  # strictest first


def loosest(classes: list[str] | tuple[str, ...]) -> str:
    """The loosest numerics class among some changes (``exact`` when there are none)."""
    return max(classes, key=NUMERICS_ORDER.index, default="exact")


class Limits(BaseModel):
    """When a run stops: whichever budget runs out first."""

    max_iters: int = Field(25, description="candidates evaluated (checked, validated or measured)")
    max_minutes: float = Field(60.0, description="wall time of the run, resumes included")
    budget_usd: float = Field(0.0, description="LLM spend; 0 for the offline tier")


# Every dtype a run on the device can train in: checked in float32 only, a kernel wrong only in bfloat16 passed its
# check and the training run then blamed precision. bfloat16 is not checked on the CPU, where Triton kernels run
# under its interpreter, which computes bfloat16 wrongly: a correct kernel would fail there.
KERNEL_DTYPES: dict[str, tuple[str, ...]] = {"cuda": ("float32", "bfloat16", "float16"), "cpu": ("float32", "float16")}
KERNEL_DTYPES_SKIPPED: dict[str, dict[str, str]] = {"cpu": {
    "bfloat16": "not checked on the CPU: Triton's interpreter computes bfloat16 wrongly, so a correct Triton kernel "
                "would fail; a bfloat16 run on a GPU checks it"}}


def kernel_dtypes_for(device: str) -> tuple[list[str], dict[str, str]]:
    """(the dtypes kernels are checked in on a device, {dtype: why not} for those a run there cannot check)."""
    kind = device.split(":")[0]
    return list(KERNEL_DTYPES.get(kind, KERNEL_DTYPES["cpu"])), dict(KERNEL_DTYPES_SKIPPED.get(kind, {}))


class EvalPlan(BaseModel):
    """How much measuring each candidate gets; sized so that a verdict is trustworthy, not cheap."""

    numerics_steps: int = Field(20, description="steps of the numerics fingerprint (baseline and candidate)")
    quality_steps: int | None = Field(None, description="training steps of a model-class quality run (None: "
                                                        "the target size's preset)")
    warmup: int = 3
    blocks: int = Field(6, description="interleaved timed blocks per side in one A/B measurement (even)")
    final_blocks: int = Field(20, description="blocks per side of the final baseline-against-best measurement, "
                                              "at least `blocks`: as many as `sg-opt bench --vs` takes by default, "
                                              "so that the quoted figure and its re-measurement are measured alike "
                                              "(20: at `large`, 10 blocks left intervals of -1%/+26% around the "
                                              "figure, and two runs of it 6% apart)")
    final_pairs: int = Field(3, description="fresh worker pairs the final measurement's blocks are spread over "
                                            "and pooled (validators.confirmation.PROCESS_PAIRS: identical workers "
                                            "differ by offsets of their own)")
    block_steps: int | None = Field(None, description="steps per block (None: enough for BLOCK_SECONDS, from "
                                                      "a short timing of the baseline)")
    block_seconds: float = Field(0.3, description="the least a timed block lasts; sizes block_steps on the baseline "
                                                  "when that is None (--block-steps sets it to 0)")
    aa_repeats: int = Field(2, description="A/A runs that set the noise floor")
    aa_blocks: int = Field(40, description="blocks per side of each A/A run, at least `blocks`. The floor is an "
                                           "upper bound on the drift between identical processes (|1 - ratio| + "
                                           "half-width), so it is as loose as the A/A's interval: against a 13.6 ms "
                                           "host-bound incumbent at `large`, 6 blocks gave a half-width of 9.6% and "
                                           "a floor of 16.9% (2026-11-30), under which a candidate measured at "
                                           "0.849 (interval 0.779-0.887) was not a win. On synthetic blocks of that "
                                           "noise (benchmarks/aa_blocks_synthetic.py) a true 15% win is accepted "
                                           "3.4% of the time after 6-block A/A runs, 40% after 20, 70% after 40; "
                                           "an identical candidate never")
    recalibrate_after: float = Field(2.0, description="calibrate the noise floor again on an incumbent this many "
                                                      "times faster than the step of the floor in force (0: never; "
                                                      "nodes.diagnose)")
    profile_steps: int = 5
    fine_profile: bool = Field(False, description="also time kernel slots against the ceilings (CUDA)")
    kernel_dtypes: list[str] | None = Field(None, description="dtypes every replaced kernel is checked in (None: "
                                                              "every one a run on the device can use, set from "
                                                              "the device when the state is made: KERNEL_DTYPES)")
    kernel_dtypes_skipped: dict[str, str] = Field(default_factory=dict, description="dtype -> why kernels are not "
                                                                                     "checked in it on this device")
    timeout_s: float = Field(1800.0, description="upper limit on any one worker; shortened from the baseline's")
    min_timeout_s: float = Field(60.0, description="the shortened limit never goes below this")
    concurrent_timing: bool = Field(True, description="--gpus: whether the lanes' A/B timings may run at once "
                                                      "(set at the baseline from the A/A floors, state_machine.lanes)")
    lanes_note: str | None = Field(None, description="--gpus: how the timing mode was chosen")

    @property
    def calibration_blocks(self) -> int:
        """Blocks per side of an A/A run: ``aa_blocks``, and never fewer than a candidate's measurement."""
        return max(self.blocks, self.aa_blocks)


class Candidate(BaseModel):
    """One proposed change to the incumbent: a knob patch and/or replacement kernel sources."""

    id: int
    kind: CandidateKind
    patch: dict[str, Any] = Field(default_factory=dict, description="knob values changed from the incumbent")
    kernels: dict[str, RunPath] = Field(default_factory=dict, description="slot name -> replacement source file")
    rationale: str
    proposer: str = Field(description="offline:<rule> or llm:<tier>")
    expected_gain: float | None = Field(None, description="the proposer's estimate of the step speedup")
    repair_of: int | None = Field(None, description="the rejected or slower kernel candidate this one repairs, "
                                                    "sent back to the model with its verdict (kernel_repairs)")

    def change(self) -> str:
        """The change in words: 'knob=value, ..., kernel slot' (reports, rationales)."""
        parts = [f"{k}={v}" for k, v in self.patch.items()] + [f"kernel {slot}" for slot in self.kernels]
        return ", ".join(parts) or "(nothing)"


class Verdict(BaseModel):
    """What became of a candidate, and why, in one sentence."""

    accepted: bool
    stage: Stage
    reason: str
    numerics_class: str | None = None
    numerics_detail: str | None = None
    ratio: float | None = Field(None, description="candidate time / incumbent time, side by side (below 1 faster)")
    step_ms: float | None = Field(None, description="the candidate's own step in that measurement: the median of its "
                                                    "block medians, in ms")
    ci_low: float | None = None
    ci_high: float | None = None
    artifacts: dict[str, RunPath] = Field(default_factory=dict, description="name -> file in the run directory")
    wall_s: float = 0.0


class InFlight(BaseModel):
    """The candidate being evaluated and what its nodes have found so far. Replaced as a whole: propose starts a
    fresh one and decide clears it, so nothing found about one candidate is left over for the next."""

    candidate: Candidate
    verdict: Verdict | None = Field(None, description="set by the node that decided it, read by decide")
    numerics_class: str | None = Field(None, description="the loosest class of every change since the baseline, "
                                                         "this one's included (check)")
    digest: str | None = Field(None, description="config_digest of its resolved config (check)")
    numerics_detail: str | None = Field(None, description="what the numerics comparison said (validate)")
    artifacts: dict[str, RunPath] = Field(default_factory=dict, description="name -> file in the run directory")


# The flat fields that held the candidate in flight before InFlight, and the InFlight field each maps to.
FLAT_IN_FLIGHT = {"current_verdict": "verdict", "current_numerics_class": "numerics_class",
                  "current_digest": "digest", "current_numerics_detail": "numerics_detail",
                  "current_artifacts": "artifacts"}


def rejected(state: "RunState", stage: str, reason: str, **fields: Any) -> dict[str, Any]:
    """The state update that rejects the candidate in flight at `stage`."""
    return state.in_flight(verdict=Verdict(accepted=False, stage=stage, reason=reason, **fields))


class Evaluated(BaseModel):
    candidate: Candidate
    verdict: Verdict
    incumbent_id: int | None = Field(description="the candidate id the incumbent came from (None: baseline)")
    config: dict[str, Any] = Field(default_factory=dict, description="the knob overrides the candidate ran with")
    digest: str | None = Field(None, description="config_digest of the candidate (None when it failed to resolve)")


class Incumbent(BaseModel):
    """The best configuration so far: the baseline's overrides plus every accepted change."""

    config: dict[str, Any] = Field(default_factory=dict, description="knob overrides (the rest are defaults)")
    kernels: dict[str, RunPath] = Field(default_factory=dict, description="slot -> accepted source file")
    from_candidate: int | None = None
    est_speedup: float = Field(1.0, description="product of accepted side-by-side speedups (an estimate; the "
                                                "report re-measures baseline against best directly)")


class Lane(BaseModel):
    """Where one candidate is evaluated when several are at once (``--gpus``): its GPUs (one per rank) and
    a disjoint share of the host's CPUs, so that concurrent side-by-side timings do not share cores."""

    index: int
    gpus: list[int]
    cpus: list[int] | None = None


class Baseline(BaseModel):
    numerics_file: RunPath
    quality: dict[str, float] | None = None
    step_ms: float = Field(description="median step time from the A/A calibration blocks")
    noise_floor: float
    calibration_file: RunPath
    reorder: ReorderCalibration = Field(default_factory=ReorderCalibration,
                                        description="the reorder bands calibrated on the baseline")
    resolved_config: dict[str, Any] = Field(default_factory=dict)
    environment: dict[str, Any] = Field(default_factory=dict)
    wall_s: float = 0.0


class Recalibration(BaseModel):
    """The noise floor calibrated again, on an incumbent much faster than the step the last floor came from."""

    after_candidate: int = Field(description="the accepted candidate the incumbent came from")
    step_ms: float = Field(description="median step time of the incumbent in its A/A blocks")
    noise_floor: float
    calibration_file: RunPath


class FinalMeasurement(BaseModel):
    """Baseline against the best configuration, side by side, at the end of the run."""

    ratio: float | None = None
    speedup: float | None = None
    ci_low: float | None = None
    ci_high: float | None = None
    verdict: str
    file: RunPath
    note: str | None = Field(None, description="set when the first final measurement was disturbed and repeated")
    clean: bool = Field(True, description="False: measured beside outside load or without the machine's lock "
                                          "(validators.ab_result.ABResult.clean): not a figure to quote")
    load: str | None = Field(None, description="why it is not clean: the machine's other work beside it")


class RunState(BaseModel):
    version: int = STATE_SCHEMA_VERSION
    run_id: str
    run_dir: RunPath
    target: str
    size: str
    device: str = "cpu"
    data: str | None = None
    threads: int | None = None
    ranks: int = 1  # every worker of the run is a torch.distributed job of this many processes
    gpus: int = Field(1, description="GPUs the run may use: gpus / ranks candidates are evaluated at once")
    lane: Lane | None = Field(None, description="set on the per-candidate copies of the state that a batch "
                                                "evaluates concurrently (state_machine.batch); None: one at a time")
    seed: int = 0
    tier: str = "offline"
    allow_model_changes: bool = False
    limits: Limits = Field(default_factory=Limits)
    plan: EvalPlan = Field(default_factory=EvalPlan)

    baseline_config: dict[str, Any] = Field(default_factory=dict, description="the user's knob overrides")
    baseline: Baseline | None = None
    incumbent: Incumbent = Field(default_factory=Incumbent)
    findings: list[Finding] = Field(default_factory=list)
    profiles: list[RunPath] = Field(default_factory=list, description="profile files, one per diagnosis")
    recalibrations: list[Recalibration] = Field(default_factory=list, description="noise floors calibrated again "
                                                "on faster incumbents (nodes.diagnose); the last one is in force")

    queue: list[Candidate] = Field(default_factory=list, description="proposed, not yet tried")
    current: InFlight | None = Field(None, description="the candidate in flight, and what is known of it so far")
    batch: list[Candidate] = Field(default_factory=list, description="the candidates in flight at once (--gpus)")
    history: list[Evaluated] = Field(default_factory=list)
    next_id: int = 1
    proposal_rounds: int = 0
    proposer_failures: list[str] = Field(default_factory=list)

    elapsed_s: float = Field(0.0, description="wall seconds spent in nodes, summed over resumes")
    node_s: dict[str, float] = Field(default_factory=dict, description="elapsed_s by node (baseline, validate, "
                                                                       "measure, ...)")
    node_max_s: dict[str, float] = Field(default_factory=dict, description="the longest single call of each node "
                                                                           "(what --pause-after expects it to take)")
    candidate_marks: list[float] = Field(default_factory=list, description="the seconds booked to candidates' own "
                                         "nodes (time_budget.CANDIDATE_NODES) when each candidate was decided, in order")
    spent_usd: float = 0.0
    stop_reason: str | None = None
    final: FinalMeasurement | None = None
    report_files: list[RunPath] = Field(default_factory=list)

    @model_validator(mode="before")
    @classmethod
    def _in_flight_from_flat_fields(cls, data: Any) -> Any:
        """A state written before ``InFlight`` (a checkpoint, a state file) held the candidate itself in ``current``
        and what was found of it in flat ``current_*`` fields (FLAT_IN_FLIGHT): they become its InFlight."""
        if not isinstance(data, dict):
            return data
        current = data.get("current")
        flat = isinstance(current, Candidate) or isinstance(current, dict) and "candidate" not in current
        if not flat and not FLAT_IN_FLIGHT.keys() & data.keys():
            return data
        found = {new: data[old] for old, new in FLAT_IN_FLIGHT.items() if data.get(old) is not None}
        data = {k: v for k, v in data.items() if k not in FLAT_IN_FLIGHT} | {"version": STATE_SCHEMA_VERSION}
        if flat:
            data["current"] = {"candidate": current, **found}
        return data

    @model_validator(mode="after")
    def _kernel_dtypes_from_device(self) -> "RunState":
        """A plan that names no kernel dtypes checks every one a run on the device can use."""
        if self.plan.kernel_dtypes is None:
            dtypes, skipped = kernel_dtypes_for(self.device)
            self.plan = self.plan.model_copy(update={"kernel_dtypes": dtypes, "kernel_dtypes_skipped": skipped})
        return self

    def path(self, *parts: str) -> Path:
        """A file or folder under the run directory."""
        return Path(self.run_dir).joinpath(*parts)

    def in_flight(self, **found: Any) -> dict[str, Any]:
        """The update that records what a node found of the candidate in flight (``InFlight``'s fields)."""
        return {"current": self.current.model_copy(update=found)}

    def spent_in(self, node: str, seconds: float) -> dict[str, Any]:
        """The updates that book `seconds` more of wall time to `node`: the run's total, the node's and its longest
        call (the graph's node wrapper books each node once it returns; the report node books its own time so far
        before it writes the report)."""
        return {"elapsed_s": self.elapsed_s + seconds,
                "node_s": {**self.node_s, node: self.node_s.get(node, 0.0) + seconds},
                "node_max_s": {**self.node_max_s, node: max(self.node_max_s.get(node, 0.0), seconds)}}

    @property
    def noise_floor(self) -> float:
        """The floor candidates are judged against now: the last re-calibration's, else the baseline's."""
        return self.recalibrations[-1].noise_floor if self.recalibrations else self.baseline.noise_floor

    @property
    def floor_step_ms(self) -> float:
        """The step time the floor in force was calibrated on."""
        return self.recalibrations[-1].step_ms if self.recalibrations else self.baseline.step_ms

    @property
    def device_kind(self) -> str:
        """"cuda" or "cpu": the run's device without its index."""
        return self.device.split(":")[0]

    @property
    def est_step_ms(self) -> float:
        """The incumbent's step estimated from the baseline's A/A step and the accepted side-by-side ratios."""
        return self.baseline.step_ms / self.incumbent.est_speedup

    @property
    def recalibration_due(self) -> bool:
        """Whether the next diagnose calibrates the noise floor again: the incumbent is estimated
        ``plan.recalibrate_after`` times faster than the step the floor in force was calibrated on."""
        after = self.plan.recalibrate_after
        if self.baseline is None or self.incumbent.from_candidate is None or after <= 0:
            return False
        return self.est_step_ms * after <= self.floor_step_ms

    @property
    def accepted(self) -> list[Evaluated]:
        return [e for e in self.history if e.verdict.accepted]

    @property
    def evaluated(self) -> int:
        return len(self.history)
