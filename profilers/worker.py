"""The profiling worker: builds one config of a target in this (child) process and profiles it.

``python -m profilers.worker --request REQ.json --result RES.json`` reads a ProfileRequest, runs
the coarse profile, then (when asked) the fine profile of the kernel slots against the device's
ceilings, derives the ranked findings and writes a ProfileResult. As in ``targets.worker``, the
workload never shares a process with the caller: every failure it raises is written as a
structured Failure, and a crash or hang is caught by ``profilers.client``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch

from profilers.ceilings import get_ceilings
from profilers.coarse import profile_session
from profilers.fine import HASTE_REC_SLOT_PHASES, haste_rec_slot_dtype, haste_rec_slot_shapes, profile_slots
from profilers.findings import findings
from profilers.records import FineProfile, ProfileRequest, ProfileResult
from targets.protocol import ConfigError, Session, Target
from targets.registry import resolve_target
from targets.worker import NonFiniteLoss, _device, environment, load_kernels
from targets.worker_protocol import Failure


def build_session(req: ProfileRequest, device: torch.device) -> tuple[Target, dict[str, Any], dict, Session]:
    """(target, resolved config, loaded kernels, session) for a request; ConfigError on bad input."""
    target = resolve_target(req.target)
    target.check_size(req.size)
    config = target.knob_space.resolve(req.config)
    kernels = load_kernels(req.kernels_dir, target)
    extra = {}
    if req.data:
        if not target.data_formats:
            raise ConfigError(f"target {target.name} reads no data files; drop --data")
        if not Path(req.data).is_file():
            raise ConfigError(f"data file {req.data} does not exist")
        extra["data"] = req.data
    return target, config, kernels, target.build(config, req.size, kernels, device, req.seed, **extra)


def _fine(req: ProfileRequest, target: Target, kernels: dict, session: Session, device: torch.device,
          result: ProfileResult) -> FineProfile | None:
    if target.name != "haste-rec":  # the only target whose slot shapes can be read from a session yet
        result.notes.append(f"fine profile skipped: slot shapes of target {target.name} are unknown")
        return None
    return profile_slots(target, haste_rec_slot_shapes(session), device, haste_rec_slot_dtype(session), kernels,
                         req.fine_repeats, ceilings=get_ceilings(device, quick=req.quick_ceilings),
                         coarse=result.coarse, slot_phases=HASTE_REC_SLOT_PHASES, seed=req.seed)


def failure_of(exc: BaseException) -> Failure:
    """The structured failure for an exception the workload raised (same kinds as targets.worker)."""
    if isinstance(exc, ConfigError):
        return Failure(kind="config", message=str(exc))
    if isinstance(exc, NonFiniteLoss):
        return Failure(kind="nan", message=str(exc))
    detail = traceback.format_exc()[-4000:]
    if isinstance(exc, (torch.OutOfMemoryError, MemoryError)):
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        return Failure(kind="oom", message=f"out of memory: {first}", detail=detail)
    return Failure(kind="exception", message=f"{type(exc).__name__}: {exc}".splitlines()[0][:500], detail=detail)


def execute(req: ProfileRequest) -> ProfileResult:
    """Profile the request's config; every failure the workload raises becomes a structured result."""
    start = time.perf_counter()
    result = ProfileResult(ok=False, target=req.target, size=req.size)
    try:
        if req.threads:
            torch.set_num_threads(req.threads)
        device = _device(req.device)
        result.environment = environment(device)
        target, result.config, kernels, session = build_session(req, device)
        result.coarse = profile_session(session, device, req.warmup, req.profile_steps, req.trace)
        result.counters = session.counters()
        result.fine = _fine(req, target, kernels, session, device, result) if req.fine else None
        result.findings = findings(result.coarse, result.fine, result.counters, result.config)
        result.ok = True
    except Exception as exc:  # noqa: BLE001 - any workload error is a structured failure
        result.failure = failure_of(exc)
    result.wall_s = time.perf_counter() - start
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m profilers.worker", description=__doc__.splitlines()[0])
    parser.add_argument("--request", required=True, help="JSON file holding a ProfileRequest")
    parser.add_argument("--result", required=True, help="where to write the ProfileResult JSON")
    args = parser.parse_args(argv)
    result = execute(ProfileRequest.model_validate_json(Path(args.request).read_text()))
    tmp = Path(args.result).with_suffix(".tmp")
    tmp.write_text(result.model_dump_json(indent=1))
    os.replace(tmp, args.result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
