"""A long-lived timing worker: one built session that runs blocks of steps on command.

``python -m validators.ab_worker --request REQ.json``. The side-by-side benchmark
(``validators.speedup``) keeps two of these alive, one per config, and alternates blocks between
them, so both sides see the same machine state over the same minutes. Building once and timing many
blocks is what makes the interleaving possible; the measurement loop lives here, never in a
candidate's code.

Protocol, one JSON object per line. After the session is built and warmed up the worker prints
``{"ready": true, "config": {...resolved...}, "device": ..., "threads": n, "cpus": [...]}``. It then reads commands
on stdin: ``{"cmd": "run", "steps": k}`` runs k steps and answers
``{"step_s": [...], "loss_finite": bool}`` (per-step seconds from CUDA events on a GPU, perf_counter
on the CPU, the device synchronised at the block's end); ``{"cmd": "quit"}`` exits. Any failure is
one line ``{"error": kind, "message": ...}`` and the process exits. The protocol owns the real
stdout: everything the workload prints (Python or native) is sent to stderr.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import traceback
from pathlib import Path
from typing import IO, Any

import torch

from targets.protocol import ConfigError, Session
from targets.worker import build_session as build_target_session, open_device, sync_device
from targets.worker_protocol import WorkerRequest


def claim_stdout() -> IO[str]:
    """Keep the real stdout for the protocol and point fd 1 (and sys.stdout) at stderr."""
    sys.stdout.flush()
    protocol = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return protocol


def build_session(req: WorkerRequest) -> tuple[Session, torch.device, dict[str, Any]]:
    """The request's session, built as every worker builds it (``targets.worker.build_session``)."""
    device = open_device(req)
    _, config, _, session = build_target_session(req, device)
    return session, device, config


def run_block(session: Session, device: torch.device, steps: int) -> dict[str, Any]:
    """Time ``steps`` steps one by one; synchronise once at the end, so steps overlap as in training."""
    losses: list[torch.Tensor] = []
    if device.type == "cuda":
        events = [torch.cuda.Event(enable_timing=True) for _ in range(steps + 1)]
        events[0].record()
        for i in range(steps):
            losses.append(session.step())
            events[i + 1].record()
        torch.cuda.synchronize(device)
        step_s = [events[i].elapsed_time(events[i + 1]) / 1e3 for i in range(steps)]
    else:
        step_s = []
        for _ in range(steps):
            start = time.perf_counter()
            losses.append(session.step())
            step_s.append(time.perf_counter() - start)
    finite = all(math.isfinite(float(loss)) for loss in losses)
    return {"step_s": step_s, "loss_finite": finite}


def serve(req: WorkerRequest, out: IO[str], commands: IO[str]) -> None:
    """Build, warm up, announce readiness, then answer commands until quit or end of input."""
    session, device, config = build_session(req)
    for _ in range(req.warmup):
        session.step()
    sync_device(device)
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    reply(out, {"ready": True, "config": config, "device": str(device), "threads": torch.get_num_threads(),
                "cpus": cpus})
    for line in commands:
        if not line.strip():
            continue
        command = json.loads(line)
        if command.get("cmd") == "quit":
            return
        if command.get("cmd") != "run" or not isinstance(command.get("steps"), int) or command["steps"] < 1:
            raise ValueError(f"unknown command {line.strip()[:200]}")
        reply(out, run_block(session, device, command["steps"]))


def reply(out: IO[str], message: dict[str, Any]) -> None:
    out.write(json.dumps(message) + "\n")
    out.flush()


def failure_kind(exc: BaseException) -> str:
    """The ``targets.worker_protocol.FailureKind`` an exception is reported as."""
    if isinstance(exc, ConfigError):
        return "config"
    if isinstance(exc, (torch.OutOfMemoryError, MemoryError)):
        return "oom"
    return "exception"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m validators.ab_worker", description=__doc__.splitlines()[0])
    parser.add_argument("--request", required=True, help="JSON file holding a WorkerRequest")
    args = parser.parse_args(argv)
    out = claim_stdout()
    try:
        serve(WorkerRequest.model_validate_json(Path(args.request).read_text()), out, sys.stdin)
    except Exception as exc:  # noqa: BLE001 - every workload error becomes one structured line
        traceback.print_exc(file=sys.stderr)
        reply(out, {"error": failure_kind(exc), "message": f"{type(exc).__name__}: {exc}".splitlines()[0][:500]})
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
