"""The worker: runs one target with one config in this (child) process and writes a JSON result.

``python -m targets.worker --request REQ.json --result RES.json``. Every failure the workload can
cause (bad config, exception, NaN, out of memory) is caught and written as a structured Failure;
a crash or hang is detected by the parent (``targets.worker_client``), which never shares a process
with the workload. The measurement loop lives here, never in a candidate's code.
"""

from __future__ import annotations

import argparse
import faulthandler
import importlib.util
import math
import os
import platform
import resource
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import torch

from targets.protocol import ConfigError, Session, Target
from targets.ranks import RankContext, inject_fault
from targets.registry import resolve_target
from targets.spot_check import CheckedKernel, SpotCheckFailed, checked_calls, tolerances_from
from targets.worker_client import cpu_count
from targets.worker_protocol import (STACKS_SIGNAL, BenchData, Environment, Failure, NumericsData, QualityData,
                                     SpotCheckSpec, WorkerRequest, WorkerResult)


class NonFiniteLoss(RuntimeError):
    """The training loss became NaN or infinite."""


def load_kernels(directory: str | None, target: Target,
                 spot_check: SpotCheckSpec | None = None) -> dict[str, Callable[..., Any]]:
    """Import ``<slot>.py`` files from a directory; each must define a function named after its slot. Given a
    ``spot_check``, each is wrapped to check calls against its slot's reference as it runs (``targets.spot_check``)."""
    if not directory:
        return {}
    path = Path(directory)
    if not path.is_dir():
        raise ConfigError(f"kernel directory {directory} does not exist")
    kernels: dict[str, Callable[..., Any]] = {}
    for file in sorted(path.glob("*.py")):
        slot = target.slot(file.stem)
        spec = importlib.util.spec_from_file_location(f"sg_opt_candidate_{slot.name}", file)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        fn = getattr(module, slot.name, None)
        if not callable(fn):
            raise ConfigError(f"kernel file {file} defines no function {slot.name}({slot.signature})")
        kernels[slot.name] = fn if spot_check is None else CheckedKernel(
            slot, fn, spot_check.rate, tolerances_from(spot_check.tolerances))
    return kernels


def sync_device(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _check_finite(losses: list[float], first_step: int = 0) -> None:
    for i, loss in enumerate(losses):
        if not math.isfinite(loss):
            raise NonFiniteLoss(f"loss is {loss} at step {first_step + i}")


def time_steps(session: Session, device: torch.device, steps: int) -> tuple[list[float], list[torch.Tensor]]:
    """(seconds, loss) of each of ``steps`` steps: CUDA events on a GPU, perf_counter on the CPU; the device
    is synchronised once at the end, so steps overlap as in training. Every timed loop of sg-opt is this one."""
    losses: list[torch.Tensor] = []
    if device.type == "cuda":
        events = [torch.cuda.Event(enable_timing=True) for _ in range(steps + 1)]
        events[0].record()
        for i in range(steps):
            losses.append(session.step())
            events[i + 1].record()
        torch.cuda.synchronize(device)
        return [events[i].elapsed_time(events[i + 1]) / 1e3 for i in range(steps)], losses
    step_s = []
    for _ in range(steps):
        start = time.perf_counter()
        losses.append(session.step())
        step_s.append(time.perf_counter() - start)
    return step_s, losses


def banked_steps(session: Session) -> int:
    """Steps' input the session can prepare ahead while it is not stepping (loader workers' queues, a prefetched
    batch). A timed window first runs that many steps untimed: a side-by-side block follows the other side's
    block, during which this side's loader workers kept building batches; timed at once, its steps would
    take batches built in the other side's time, and a data knob would look faster than it runs in training."""
    return int(getattr(session, "banked_steps", 0))


def run_bench(session: Session, req: WorkerRequest, device: torch.device) -> BenchData:
    """Warm up (and drain what the loader banked meanwhile), then time each step (``time_steps``), then one
    timed-phase pass."""
    for _ in range(req.warmup + banked_steps(session)):
        session.step()
    sync_device(device)
    step_s, losses = time_steps(session, device, req.steps)
    values = [float(x) for x in losses]
    _check_finite(values, req.warmup)
    session.timer.timing = True
    for _ in range(req.phase_steps):
        session.step()
    session.timer.timing = False
    phase_totals = session.timer.take()
    phase_s = {name: total / max(req.phase_steps, 1) for name, total in phase_totals.items()}
    return BenchData(step_s=step_s, phase_s=phase_s, samples_per_step=getattr(session, "batch_size", 0),
                     final_loss=values[-1] if values else float("nan"), counters=session.counters())


FP32_UNIT_ROUNDOFF = 2.0 ** -24  # the relative size of one rounding in fp32


def make_deterministic(device: torch.device) -> None:
    """A numerics fingerprint must not vary between runs of the same config, or no band means anything.

    On the CPU, torch's multi-threaded reductions change their association with the thread schedule
    (haste-rec @ small with 2 threads: the same config's loss differs by 4e-7 and its probe by 1.4e-5
    between two runs; with 1 thread it is bitwise repeatable), so numerics runs use one thread. On
    CUDA, deterministic algorithms are requested (ops without one warn and stay as they are).
    """
    if device.type == "cpu":
        torch.set_num_threads(1)
    else:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)


def run_numerics(session: Session, req: WorkerRequest) -> NumericsData:
    """Loss and grad norms per step, then probe outputs and a parameter digest, all at a fixed seed.

    A ``reassociate`` run also nudges every dense parameter by one fp32 rounding before every step (where the
    session offers ``perturb``): a kernel that sums in another order differs by a rounding at every step, not
    once. Nudged only before the first step, `xl`'s baseline on an H200 (2026-11-30) drifted from itself by
    8.1e-6 at step 16 while the Triton tails, correct to their references, drifted by 4.8e-5 and 9.6e-5 there.

    Under the request's ``spot_check`` a random share of the replaced kernels' calls, throughout the steps and the
    probe, is checked against their references (``targets.spot_check``); the run is untimed, so the checks cost
    nothing that is measured. ``spot_checks`` says how many were."""
    checked_before = checked_calls()
    losses, norms = [], []
    session.record_grad_norms = True
    nudge = getattr(session, "perturb", None) if req.reassociate else None
    start = time.perf_counter()
    for step in range(req.steps):
        if nudge is not None:
            nudge(FP32_UNIT_ROUNDOFF, req.seed + 1 + step)
        losses.append(float(session.step()))
        norms.append(session.grad_norms())
    _check_finite(losses)
    stepped = time.perf_counter()
    probe = session.probe()
    probed = time.perf_counter()
    digest = session.param_digest()
    stages = {"steps": stepped - start, "probe": probed - stepped, "digest": time.perf_counter() - probed}
    return NumericsData(losses=losses, grad_norms=norms, probe=probe, digest=digest, counters=session.counters(),
                        stage_s=stages, spot_checks=checked_calls() - checked_before)


def run_quality(session: Session, req: WorkerRequest) -> QualityData:
    loss = torch.tensor(float("nan"))
    for _ in range(req.steps):
        loss = session.step()
    _check_finite([float(loss)], req.steps - 1)
    return QualityData(steps=req.steps, final_loss=float(loss), metrics=session.quality())


def environment(device: torch.device, ranks: int = 1) -> Environment:
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else (platform.processor() or platform.machine())
    return Environment(device=str(device), device_name=name, torch=torch.__version__, triton=triton_version,
                       python=platform.python_version(), threads=torch.get_num_threads(), ranks=ranks)


def resolve_device(name: str) -> torch.device:
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError("device cuda was asked for but torch sees no CUDA device here")
    if name != "cpu" and not name.startswith("cuda"):
        raise ConfigError(f"unknown device {name!r}; use cpu or cuda")
    return torch.device(name)


CUDA_HOST_THREADS = 16  # the most CPU threads a GPU run's worker takes unless its request names a count


def default_threads(device: str, cpus: int) -> int:
    """CPU threads of a GPU worker (or of a rank) whose request leaves the count open, given its CPUs.

    With a GPU the host only builds batches and launches kernels, and a thread on every core made its
    steps stall, so at most CUDA_HOST_THREADS: on the 32-core host of two H200s (2026-11-29),
    haste-rec @ large with 32 threads stepped in 216 ms median, 336 ms p90 (bimodal), with 16 or 8
    threads in 117 ms with p90 within 1%. On the CPU the math runs on them: every one.
    """
    cpus = max(1, cpus)
    return cpus if device == "cpu" else min(cpus, CUDA_HOST_THREADS)


def open_device(req: WorkerRequest) -> torch.device:
    """Apply the request's CPU thread count and resolve its device: the first thing every worker does.
    Without a count, a CPU run keeps torch's own default (one per physical core) and a GPU run takes
    ``default_threads``."""
    if req.threads:
        torch.set_num_threads(req.threads)
    elif req.device != "cpu":
        torch.set_num_threads(default_threads(req.device, cpu_count()))
    return resolve_device(req.device)


def build_session(req: WorkerRequest, device: torch.device,
                  job: RankContext | None = None) -> tuple[Target, dict[str, Any], dict, Session]:
    """(target, resolved config, loaded kernels, session) for a request; ConfigError on bad input.

    Every worker (bench, profile, A/B) builds its session here, so they all read a request alike. Given
    the ``job`` of a ranked run (``targets.rank_worker``), the session is this rank's (``build_ranked``).
    A worker not yet confined is confined here, before its candidate kernels load (``targets.confinement``).
    """
    from targets.confinement import confine_worker

    confine_worker()
    target = resolve_target(req.target)
    target.check_size(req.size)
    target.check_ranks(job.world_size if job else 1)
    config = target.knob_space.resolve(req.config)
    kernels = load_kernels(req.kernels_dir, target, req.spot_check)
    extra = {}
    if req.data:
        if not target.data_formats:
            raise ConfigError(f"target {target.name} reads no data files; drop --data")
        if not Path(req.data).is_file():
            raise ConfigError(f"data file {req.data} does not exist")
        extra["data"] = req.data
    if job is not None:
        return target, config, kernels, target.build_ranked(config, req.size, kernels, device, req.seed, job, **extra)
    return target, config, kernels, target.build(config, req.size, kernels, device, req.seed, **extra)


CPU_ALLOCATOR_OOM = ("can't allocate memory", "Cannot allocate memory")  # torch's CPU allocator, ENOMEM


def out_of_memory(exc: BaseException) -> bool:
    """Whether ``exc`` is a memory limit hit: torch's or Python's out-of-memory errors, or the plain RuntimeError
    torch's CPU allocator raises when a memory cap (ulimit -v, a container's limit) refuses it memory."""
    if isinstance(exc, (torch.OutOfMemoryError, MemoryError)):
        return True
    return isinstance(exc, RuntimeError) and any(words in str(exc) for words in CPU_ALLOCATOR_OOM)


def failure_of(exc: BaseException) -> Failure:
    """The structured failure for an exception the workload raised."""
    if isinstance(exc, ConfigError):
        return Failure(kind="config", message=str(exc))
    if isinstance(exc, NonFiniteLoss):
        return Failure(kind="nan", message=str(exc))
    if isinstance(exc, SpotCheckFailed):
        return Failure(kind="spot-check", message=str(exc), detail=traceback.format_exc()[-4000:])
    detail = traceback.format_exc()[-4000:]
    if out_of_memory(exc):
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        return Failure(kind="oom", message=f"out of memory: {first}", detail=detail)
    return Failure(kind="exception", message=f"{type(exc).__name__}: {exc}".splitlines()[0][:500], detail=detail)


def write_result(path: str | Path, record: Any) -> None:
    """Write a pydantic record as JSON atomically: a killed worker leaves no half-written result."""
    tmp = Path(path).with_suffix(".tmp")
    tmp.write_text(record.model_dump_json(indent=1))
    os.replace(tmp, path)


def measure(req: WorkerRequest, device: torch.device, result: WorkerResult, job: RankContext | None = None) -> None:
    """Build the request's session (this rank's, given a job) and run its mode, filling ``result`` in."""
    from targets.confinement import confine_worker

    result.confinement = confine_worker()
    if req.mode == "numerics" and not req.reassociate:
        make_deterministic(device)
    start = time.perf_counter()
    result.environment = environment(device, job.world_size if job else 1)
    _, result.config, _, session = build_session(req, device, job)
    sync_device(device)
    result.build_s = time.perf_counter() - start
    if job is not None:
        inject_fault(session, job.rank)
    if req.mode == "bench":
        result.bench = run_bench(session, req, device)
    elif req.mode == "numerics":
        result.numerics = run_numerics(session, req)
    else:
        result.quality = run_quality(session, req)


def footprint(device: torch.device) -> dict[str, int]:
    """This worker's memory: its peak resident host memory, and on a GPU the device memory its allocator has held
    at most and the device's total (what ``validators.started_ahead.pairs_that_fit`` reads)."""
    memory = {"host_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}  # KiB on Linux
    if device.type == "cuda":
        memory |= {"device_peak": torch.cuda.max_memory_reserved(device),
                   "device_total": torch.cuda.get_device_properties(device).total_memory}
    return memory


def execute(req: WorkerRequest) -> WorkerResult:
    """Run the request; every failure the workload raises becomes a structured result."""
    start = time.perf_counter()
    result = WorkerResult(ok=False, mode=req.mode, target=req.target, size=req.size)
    try:
        if req.ranks > 1:
            raise ConfigError(f"ranks {req.ranks} run under torchrun (targets.rank_worker), not in this worker")
        device = open_device(req)
        measure(req, device, result)
        result.memory = footprint(device)
        result.ok = True
    except Exception as exc:  # noqa: BLE001 - any workload error is a structured failure
        result.failure = failure_of(exc)
    result.wall_s = time.perf_counter() - start
    return result


def answer_stack_requests() -> None:
    """Write every thread's Python stack to stderr on STACKS_SIGNAL, from this process and from any it forks (a
    loader's workers inherit the handler): a worker that never answers, killed at its time limit, then leaves
    where each of its processes waited. On 2026-11-30 a timing worker at `large` on an H200 sent no ready line
    in 401 s and was killed without a trace of why."""
    faulthandler.register(STACKS_SIGNAL, file=sys.stderr, all_threads=True)


def serve_request_file(prog: str, request_type: type, run: Callable[[Any], Any], argv: list[str] | None) -> int:
    """The command line every file-based worker shares: read --request, run it, write --result. Started from its
    command line (``argv`` None), the worker is confined first, before it loads candidate code
    (``targets.confinement``), and its result says how."""
    from targets.confinement import confine_worker, current

    if argv is None:
        confine_worker(reexec=True)
    answer_stack_requests()
    parser = argparse.ArgumentParser(prog=prog, description="runs one request in this process, writes its result")
    parser.add_argument("--request", required=True, help=f"JSON file holding a {request_type.__name__}")
    parser.add_argument("--result", required=True, help="where to write the result JSON")
    args = parser.parse_args(argv)
    record = run(request_type.model_validate_json(Path(args.request).read_text()))
    if getattr(record, "confinement", False) is None:  # a result that can say it and does not yet
        record.confinement = current()
    write_result(args.result, record)
    sys.stdout.flush()
    return 0


def main(argv: list[str] | None = None) -> int:
    return serve_request_file("python -m targets.worker", WorkerRequest, execute, argv)


if __name__ == "__main__":
    sys.exit(main())
