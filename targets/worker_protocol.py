"""The records that cross the worker's process boundary: one request in, one result out.

Both are versioned pydantic models written as JSON files, so a worker killed mid-run leaves no
half-parsed state in the caller, and a result always says which failure happened and why.
"""

from __future__ import annotations

import os
import signal
from typing import Any, Literal

from pydantic import BaseModel, Field

from targets.confinement import Confinement
from targets.fork_server import MALLOC_SWITCH

WORKER_SCHEMA_VERSION = 1

Mode = Literal["bench", "numerics", "quality"]
FailureKind = Literal["config", "crash", "timeout", "nan", "oom", "exception", "spot-check", "clock"]
# On this signal every process of a worker writes its threads' Python stacks to its stderr (``targets.worker.
# answer_stack_requests``): a worker stopped at its time limit is asked first, so its failure says where it waited.
STACKS_SIGNAL = signal.SIGUSR1


class SpotCheckSpec(BaseModel):
    """Replaced kernels checked against their slot's reference as they run (``targets.spot_check``)."""

    rate: float = Field(0.0, ge=0.0, le=1.0, description="the share of calls checked, drawn at random (0: only "
                                                         "those of a forced checked step)")
    tolerances: dict[str, tuple[float, float]] = Field(description="dtype name -> (rel, elem) bounds "
                                                                   "(validators.kernel.spot_check_spec)")


class WorkerRequest(BaseModel):
    version: int = WORKER_SCHEMA_VERSION
    target: str
    size: str
    mode: Mode
    config: dict[str, Any] = Field(default_factory=dict, description="knob overrides; the rest take defaults")
    kernels_dir: str | None = Field(None, description="directory of <slot>.py files replacing kernel slots")
    data: str | None = Field(None, description="a data file, for targets that read one (see Target.data_formats)")
    device: str = "cpu"
    seed: int = 0
    steps: int = 20
    warmup: int = 5
    phase_steps: int = 5
    threads: int | None = Field(None, description="torch intra-op threads on the CPU (None: torch's default; "
                                                  "under torchrun, whose default is 1 per rank)")
    ranks: int = Field(1, ge=1, description="processes of a torch.distributed job (torchrun, one device each); "
                                            "above 1 the target needs a build_ranked")
    gpus: list[int] | None = Field(None, description="the GPUs this worker may use, as indices into the caller's "
                                                    "visible devices (CUDA_VISIBLE_DEVICES); None: all of them")
    cpus: list[int] | None = Field(None, description="the CPUs a timed side-by-side worker is pinned to; None: the "
                                                    "A/B runner's own choice (validators.timing_worker.shared_cpus)")
    reassociate: bool = Field(False, description="numerics mode only: skip the deterministic set-up (one CPU thread, "
                                                 "deterministic CUDA algorithms), so float association may change, "
                                                 "and nudge the dense parameters by one fp32 rounding before "
                                                 "every step if the session can (Session.perturb)")
    spot_check: SpotCheckSpec | None = Field(None, description="check replaced kernels against their references "
                                                              "while running (None: never)")


class Failure(BaseModel):
    kind: FailureKind
    message: str
    detail: str = ""


class BenchData(BaseModel):
    step_s: list[float]
    phase_s: dict[str, float] = Field(description="mean seconds per step in each phase (synchronised pass)")
    samples_per_step: int
    final_loss: float
    counters: dict[str, float] = Field(default_factory=dict)
    rank_step_s: list[list[float]] | None = Field(None, description="ranked runs: each rank's own step seconds; "
                                                                    "step_s is their per-step maximum")
    rank_median_s: list[float] | None = Field(None, description="ranked runs: each rank's median step seconds "
                                                                "(phase_s and counters are the slowest rank's)")


class NumericsData(BaseModel):
    losses: list[float]
    grad_norms: list[dict[str, float]]
    probe: dict[str, list[float]]
    digest: dict[str, Any]
    counters: dict[str, float] = Field(default_factory=dict)
    stage_s: dict[str, float] = Field(default_factory=dict, description="seconds of the steps, the probe and the "
                                                                        "digest (the build is WorkerResult.build_s)")
    spot_checks: int = Field(0, description="calls to replaced kernels checked against their references meanwhile "
                                            "(WorkerRequest.spot_check)")


class QualityData(BaseModel):
    steps: int
    final_loss: float
    metrics: dict[str, float]


class Environment(BaseModel):
    device: str
    device_name: str
    torch: str
    triton: str | None = None
    python: str
    threads: int
    ranks: int = 1


class RunResult(BaseModel):
    """What every worker's result says: which run, whether it worked, and where it ran."""

    ok: bool
    target: str
    size: str
    config: dict[str, Any] = Field(default_factory=dict, description="the full resolved config")
    failure: Failure | None = None
    environment: Environment | None = None
    wall_s: float = 0.0
    build_s: float = Field(0.0, description="of wall_s, the seconds until the session was built (data, model, "
                                            "kernels): at `large` on an H200 a 20-step numerics run took 14.8 s")
    process_s: float = Field(0.0, description="seconds from the process's spawn to its exit, as its parent saw "
                                              "them (the interpreter's start and imports included)")
    confinement: Confinement | None = Field(None, description="how the worker's process was confined while it "
                                                              "ran candidate code (targets.confinement)")

    def failure_text(self) -> str:
        """``kind: message`` of its failure, for a sentence."""
        return f"{self.failure.kind}: {self.failure.message}" if self.failure else "unknown failure"


class WorkerResult(RunResult):
    version: int = WORKER_SCHEMA_VERSION
    mode: Mode
    memory: dict[str, int] = Field(default_factory=dict, description="the worker's footprint in bytes when it was "
                                   "done (targets.worker.footprint): host_rss (peak), device_peak, device_total")
    bench: BenchData | None = None
    numerics: NumericsData | None = None
    quality: QualityData | None = None


def device_env(request: BaseModel) -> dict[str, str]:
    """CUDA_VISIBLE_DEVICES for a worker that may use only some GPUs (a request's ``gpus``: indices into the
    caller's own visible devices, so that a caller restricted to GPUs 2,3 hands out 2 and 3); and, for a GPU
    worker, glibc's own adaptive allocator unless the caller chose (``targets.fork_server.fixed_allocator_env``
    fixes its thresholds for CPU workers, whose per-process page faults set the A/A offsets; a host-bound GPU step
    would pay faults its training job does not, and the GPU figures were measured without it)."""
    env = {}
    if str(getattr(request, "device", "cpu")).startswith("cuda") and MALLOC_SWITCH not in os.environ:
        env[MALLOC_SWITCH] = "0"
    gpus = getattr(request, "gpus", None)
    if gpus is None:
        return env
    parent = os.environ.get("CUDA_VISIBLE_DEVICES")
    visible = parent.split(",") if parent else []
    return {**env, "CUDA_VISIBLE_DEVICES": ",".join(visible[i] if i < len(visible) else str(i) for i in gpus)}
