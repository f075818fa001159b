"""Figures saved by `sg-opt bench --save FILE`, and how a later run is compared with them.

Where a second build of the code cannot run beside the first (one build per CI job, a machine that
cannot check out the old revision), the gate compares a fresh run with figures saved earlier on the
same kind of machine. That comparison is weaker than the interleaved one: the two sides are separate
processes minutes or days apart, so nothing cancels drift or a process's bias, and no A/A run can be
made against a file. Its noise floor is therefore wider, and estimated from both sides themselves.
Each side is ``RUNS`` bench runs in fresh processes (the same request, one after the other), because
what separates two processes is the noise that matters here: on the shared 2-core CI box six fresh
runs of a 30 ms step had medians 27.3 to 32.7 ms (20% apart), while each run's own steps looked tight.

* **Ratio.** median(current steps) / median(saved steps), all runs of a side pooled: below 1 is faster.
* **Interval.** A bootstrap over steps (each side's pooled per-step times resampled independently,
  ``RESAMPLES`` seeded resamples, 95% percentile interval of the ratio of medians). It covers
  step-to-step jitter only, not shifts between processes; the floor is for those.
* **Floor.** ``UNPAIRED_MIN_FLOOR`` (2%: twice the interleaved ``MIN_FLOOR``, a process bias on each
  side, none cancelled) + spread(saved) + spread(current), where a side's spread is half the range of
  its block medians (the medians of ``SPREAD_BLOCKS`` consecutive quarters of each run), relative to
  their median: how far a side's processes and quarters wandered is how far another run may land.
* **Different machines are refused.** Figures from another device kind, device name or (on the CPU)
  CPU model are not comparable: ``machine_mismatch`` names the difference in one sentence; so are
  figures of a job on another number of ranks (``ranks_mismatch``). A different torch version or
  thread count is only warned about (they are what a gate may be asked to judge).

The file is versioned JSON (``BASELINE_SCHEMA_VERSION``) holding the bench request, the step-time
samples, their block medians, the numerics fingerprint, the environment and the host's CPU.
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path
from typing import Literal

import numpy as np
from pydantic import BaseModel, Field, ValidationError

from sg_opt.run_machine import HostInfo, host_info
from targets.protocol import ConfigError
from targets.worker_client import run_worker
from targets.worker_protocol import Environment, NumericsData, WorkerRequest, WorkerResult
from validators.ab_stats import CONFIDENCE, MIN_FLOOR, RESAMPLES

BASELINE_SCHEMA_VERSION = 1
NUMERICS_STEPS = 10
RUNS = 2
SPREAD_BLOCKS = 4
UNPAIRED_MIN_FLOOR = 2 * MIN_FLOOR


class SavedBaseline(BaseModel):
    version: int = BASELINE_SCHEMA_VERSION
    kind: Literal["sg-opt-baseline"] = "sg-opt-baseline"
    created: str = Field(description="when it was measured, ISO 8601 local time")
    commit: str | None = Field(None, description="git HEAD of the working directory, '+dirty' if it had changes")
    request: WorkerRequest = Field(description="the bench request; a gate re-runs exactly this, on as many "
                                               "ranks as it was measured with (its ranks)")
    numerics_steps: int
    environment: Environment
    host: HostInfo
    step_s: list[list[float]] = Field(description="per-step seconds of the timed steps, one list per fresh process")
    block_medians: list[float] = Field(description=f"medians of the {SPREAD_BLOCKS} consecutive blocks of each run")
    numerics: NumericsData

    @property
    def ranks(self) -> int:
        """The processes of the torch.distributed job the figures were measured on (1: no job)."""
        return self.request.ranks


class SaveFailed(RuntimeError):
    """A run needed for a saved baseline failed (the workload's fault: exit 1)."""


def git_commit(where: str | Path = ".") -> str | None:
    """HEAD of the repository holding ``where``, with '+dirty' for uncommitted changes; None outside git."""
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(where), *args], capture_output=True, text=True, check=True,
                              timeout=30).stdout.strip()
    try:
        return git("rev-parse", "HEAD") + ("+dirty" if git("status", "--porcelain", "--untracked-files=no") else "")
    except (OSError, subprocess.SubprocessError):
        return None


def numerics_request(bench: WorkerRequest, steps: int) -> WorkerRequest:
    return bench.model_copy(update={"mode": "numerics", "steps": steps})


# -- statistics of two separate runs ---------------------------------------------------------------

def block_medians(runs: list[list[float]], blocks: int = SPREAD_BLOCKS) -> list[float]:
    """The medians of ``blocks`` consecutive blocks of each run, all runs together."""
    return [float(np.median(chunk)) for run in runs
            for chunk in np.array_split(np.asarray(run, float), min(blocks, len(run)))]


def spread(medians: list[float]) -> float:
    """Half the range of a run's block medians, relative to their median."""
    return float((max(medians) - min(medians)) / (2.0 * np.median(medians)))


def unpaired_floor(saved_medians: list[float], current_medians: list[float]) -> float:
    return UNPAIRED_MIN_FLOOR + spread(saved_medians) + spread(current_medians)


def unpaired_ratio(saved_runs: list[list[float]], current_runs: list[list[float]], resamples: int = RESAMPLES,
                   confidence: float = CONFIDENCE, seed: int = 0) -> tuple[float, float, float]:
    """(ratio, low, high): current over saved median step time, runs pooled, and its bootstrap interval
    over steps."""
    saved, current = (np.concatenate([np.asarray(r, float) for r in runs]) for runs in (saved_runs, current_runs))
    rng = np.random.default_rng(seed)
    medians = [np.median(x[rng.integers(0, x.size, size=(resamples, x.size))], axis=1) for x in (saved, current)]
    tail = (1.0 - confidence) / 2.0
    low, high = np.quantile(medians[1] / medians[0], [tail, 1.0 - tail])
    return float(np.median(current) / np.median(saved)), float(low), float(high)


# -- the file --------------------------------------------------------------------------------------

def check_writable(path: str) -> None:
    folder = Path(path).resolve().parent
    if not folder.is_dir():
        raise ConfigError(f"cannot save to {path}: the folder {folder} does not exist")


def more_runs(request: WorkerRequest, done: list[WorkerResult], runs: int, timeout_s: float) -> list[WorkerResult]:
    """``done`` followed by fresh bench runs of ``request`` up to ``runs`` in all, stopping at a failure."""
    results = list(done)
    while len(results) < runs and (not results or results[-1].ok):
        results.append(run_worker(request, timeout_s=timeout_s))
    return results


def save(path: str, request: WorkerRequest, bench: WorkerResult, timeout_s: float, runs: int = RUNS,
         numerics_steps: int = NUMERICS_STEPS) -> SavedBaseline:
    """Time ``runs`` - 1 more fresh processes after ``bench``, take the numerics fingerprint, write all to ``path``."""
    results = more_runs(request, [bench], runs, timeout_s)
    numerics = run_worker(numerics_request(request, numerics_steps), timeout_s=timeout_s)
    for what, result in (("timed", results[-1]), ("numerics", numerics)):
        if not result.ok:
            raise SaveFailed(f"the {what} run for the saved baseline failed ({result.failure.kind}): "
                             f"{result.failure.message}")
    step_s = [result.bench.step_s for result in results]
    record = SavedBaseline(created=time.strftime("%Y-%m-%dT%H:%M:%S%z"), commit=git_commit(), request=request,
                           numerics_steps=numerics_steps, environment=bench.environment, host=host_info(),
                           step_s=step_s, block_medians=block_medians(step_s), numerics=numerics.numerics)
    Path(path).write_text(record.model_dump_json(indent=1))
    return record


def load(path: str) -> SavedBaseline:
    """Read a saved baseline; ConfigError (one sentence) if it is missing, unreadable or of another version."""
    file = Path(path)
    if not file.is_file():
        raise ConfigError(f"baseline file {path} does not exist")
    try:
        record = SavedBaseline.model_validate_json(file.read_text())
    except (ValidationError, ValueError, UnicodeDecodeError) as exc:
        first = str(exc).splitlines()[0]
        raise ConfigError(f"baseline file {path} is not a figures file of sg-opt bench --save "
                          f"version {BASELINE_SCHEMA_VERSION} ({first})") from None
    return record


def _kind(device: str) -> str:
    return device.split(":")[0]


def machine_mismatch(saved: SavedBaseline, env: Environment | None, host: HostInfo) -> str | None:
    """One sentence if figures of ``saved`` cannot be compared with a run on this machine (``env``: the
    run's environment, None before it ran), else None."""
    was = saved.environment
    if env is not None and _kind(env.device) != _kind(was.device):
        return (f"the baseline was measured on device {was.device} and this run is on {env.device}, which cannot "
                f"be compared")
    if env is not None and env.device_name != was.device_name:
        return (f"the baseline was measured on {was.device_name!r} and this machine's {env.device} is "
                f"{env.device_name!r}, which cannot be compared")
    if _kind(was.device) == "cpu" and host.cpu_model != saved.host.cpu_model:
        return (f"the baseline was measured on the CPU {saved.host.cpu_model!r} and this machine's is "
                f"{host.cpu_model!r}, which cannot be compared")
    return None


def ranks_mismatch(saved: SavedBaseline, ranks: int | None) -> str | None:
    """One sentence if a gate asked for ``ranks`` (None: as saved) cannot use figures of ``saved``, else None:
    a job on another number of ranks has another step."""
    if ranks is None or ranks == saved.ranks:
        return None
    return (f"the baseline was measured on {_ranks_text(saved.ranks)} and this gate asks for {_ranks_text(ranks)}, "
            f"which cannot be compared: save a baseline with sg-opt bench --ranks {ranks} --save FILE")


def _ranks_text(ranks: int) -> str:
    return f"{ranks} rank{'s' if ranks != 1 else ''}"


def environment_warnings(saved: SavedBaseline, env: Environment, host: HostInfo) -> list[str]:
    """Differences worth knowing that do not make the figures incomparable."""
    was, notes = saved.environment, []
    for what, old, new in (("torch", was.torch, env.torch), ("triton", was.triton, env.triton),
                           ("python", was.python, env.python), ("torch threads", was.threads, env.threads),
                           ("CPU count", saved.host.cpu_count, host.cpu_count)):
        if old != new:
            notes.append(f"{what} was {old} in the baseline and is {new} now")
    if _kind(was.device) != "cpu" and host.cpu_model != saved.host.cpu_model:
        notes.append(f"the host CPU was {saved.host.cpu_model!r} and is {host.cpu_model!r} now")
    return notes
