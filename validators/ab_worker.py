"""A long-lived timing worker: one built session that runs blocks of steps on command.

``python -m validators.ab_worker --request REQ.json``. The side-by-side benchmark
(``validators.speedup``) keeps two of these alive, one per config, and alternates blocks between
them, so both sides see the same machine state over the same minutes. Building once and timing many
blocks is what makes the interleaving possible; the measurement loop lives here, never in a
candidate's code.

Protocol, one JSON object per line. After the session is built and warmed up the worker prints
``{"ready": true, "config": {...resolved...}, "device": ..., "threads": n, "cpus": [...], "stamps": {...}}``
(``stamps``: wall-clock seconds when serving began, after the imports, when the session was built and when
it was warm, so the parent can split its start-up; ``build_parts``: the session's own split of its build;
``memory``: its footprint, ``footprint``; ``commands``: those it serves). It then reads commands on stdin:

* ``{"cmd": "drain"}`` runs, untimed, the steps whose input the session banked while it idled and answers
  ``{"drained": n}`` once the device is idle again (``drain_bank``);
* ``{"cmd": "run", "steps": k, "drain": bool}`` runs k steps (after a drain when asked, as older runners did)
  and answers ``{"step_s": [...], "timed_s": s, "loss_finite": bool, "drained": n}``: per-step seconds from
  CUDA events on a GPU, perf_counter on the CPU, the device synchronised at the block's end (``run_block``),
  and ``timed_s`` the host's perf_counter window around them and their losses' read-back (a ranked job's: its
  slowest rank's own; the read-back's first call loaded CUDA modules for 31 ms on an H100, outside any earlier
  window). On a GPU the events' sum may fall short of that window (work on a stream the events are not recorded
  on), so the window, not the sum, is what the parent's clock checks;
* ``{"cmd": "check"}`` runs one untimed step in which every call of a replaced kernel is checked against its
  slot's reference (``targets.spot_check.checked_step``; a kernel that turns wrong after its validation, e.g. a
  cached output after 120 honest calls, fails as ``spot-check``) and answers ``{"spot_checks": n}``;
* ``{"cmd": "quit"}`` exits.

Any failure is one line ``{"error": kind, "message": ...}`` and the process exits. The protocol owns the real
stdout: everything the workload prints (Python or native) is sent to stderr.

These times are the worker's word, and a candidate's code runs in this process: the parent judges a block by
its own clock, from the command to the answer, and only checks them against it (``validators.ab_runner``).
So a run command does nothing but the timed steps between reading the command and answering it.

A request with ``ranks`` > 1 runs under torchrun (``validators.speedup`` starts it so), every rank on
the same stdin and stdout: rank 0 reads the commands and passes them on, every rank runs the block,
and rank 0 answers with each step's slowest rank (``targets.rank_worker.per_step_max``). Commands and
times travel on a gloo group of their own, so a side waiting for its next block waits on a socket,
not in a device kernel beside the other side's. Any rank that fails writes its own error line.
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
import torch.distributed as dist

from targets.confinement import confine_worker
from targets.protocol import ConfigError, Session
from targets.spot_check import SpotCheckFailed, checked_step
from targets.rank_worker import join_job, per_step_max
from targets.ranks import RankContext, leave
from targets.worker import (answer_stack_requests, banked_steps, build_session as build_target_session, footprint,
                            open_device, out_of_memory, sync_device, time_steps)
from targets.worker_client import allowed_cpus
from targets.worker_protocol import WorkerRequest

COMMANDS = ("run", "drain", "check", "quit")  # what this worker serves, in its ready line (a runner asks older trees less)


def claim_stdout() -> IO[str]:
    """Keep the real stdout for the protocol and point fd 1 (and sys.stdout) at stderr."""
    sys.stdout.flush()
    protocol = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return protocol


def build_session(req: WorkerRequest, job: RankContext | None = None) -> tuple[Session, torch.device, dict[str, Any]]:
    """The request's session (this rank's, given a job), built as every worker builds it
    (``targets.worker.build_session``)."""
    device = open_device(req) if job is None else job.device
    _, config, _, session = build_target_session(req, device, job)
    return session, device, config


def drain_bank(session: Session, device: torch.device) -> dict[str, Any]:
    """Run, untimed, the steps whose input may have been banked while the other side ran its block
    (``banked_steps``), and wait for the device: the next block starts on an idle device and an empty bank."""
    drained = banked_steps(session)
    for _ in range(drained):
        session.step()
    sync_device(device)
    return {"drained": drained}


def run_block(session: Session, device: torch.device, steps: int, drain: bool = False) -> dict[str, Any]:
    """Time ``steps`` steps one by one (``targets.worker.time_steps``: synchronised once, at the end), after
    ``drain_bank`` when asked (a runner that sends no drain command: ``ABRunner._drain``)."""
    drained = drain_bank(session, device)["drained"] if drain else 0
    start = time.perf_counter()
    step_s, losses = time_steps(session, device, steps)
    finite = all_finite(losses)  # inside the window: the parent's clock counts the read-back too
    timed_s = time.perf_counter() - start
    return {"step_s": step_s, "timed_s": timed_s, "loss_finite": finite, "drained": drained}


def all_finite(losses: list[Any]) -> bool:
    """Whether every loss is finite, read back from the device in one transfer where they stack (a ``float()``
    each is one transfer a step, inside the block the parent times)."""
    if not losses:
        return True
    try:
        stacked = torch.stack([torch.as_tensor(loss).detach().float().reshape(()) for loss in losses])
        return bool(torch.isfinite(stacked).all())
    except (RuntimeError, TypeError, ValueError):  # mixed devices, a non-tensor, a loss of several elements
        return all(math.isfinite(float(loss)) for loss in losses)


class Ranks:
    """This rank's part in a ranked worker: rank 0 reads the commands and answers for all."""

    def __init__(self, job: RankContext):
        self.lead = job.rank == 0
        self.control = dist.new_group(backend="gloo", timeout=job.timeout)

    def share(self, command: dict[str, Any] | None) -> dict[str, Any] | None:
        """Rank 0's command (None: stop), on every rank."""
        box = [command]
        dist.broadcast_object_list(box, src=0, group=self.control)
        return box[0]

    def gather(self, answer: dict[str, Any]) -> dict[str, Any]:
        """The job's answer, once every rank has its own: a block's each step's slowest rank (finite only if every
        rank's loss was; ``timed_s`` the largest rank's own sum, each of which lies inside the parent's window where
        a sum of per-step maxima may not), a drain's largest count."""
        answers: list[Any] = [None] * dist.get_world_size(self.control)
        dist.all_gather_object(answers, answer, group=self.control)
        if "spot_checks" in answer:
            return {"spot_checks": sum(a["spot_checks"] for a in answers)}
        if "step_s" not in answer:
            return {"drained": max(a["drained"] for a in answers)}
        return {"step_s": per_step_max([a["step_s"] for a in answers]), "timed_s": max(a["timed_s"] for a in answers),
                "loss_finite": all(a["loss_finite"] for a in answers), "drained": max(a["drained"] for a in answers)}


def next_command(commands: IO[str]) -> dict[str, Any] | None:
    """The next run or drain command from the input; None on quit or at its end."""
    for line in commands:
        if not line.strip():
            continue
        command = json.loads(line)
        if command.get("cmd") == "quit":
            return None
        if command.get("cmd") in ("drain", "check"):
            return command
        if (command.get("cmd") != "run" or not isinstance(command.get("steps"), int) or command["steps"] < 1
                or not isinstance(command.get("drain", False), bool)):
            raise ValueError(f"unknown command {line.strip()[:200]}")
        return command
    return None


def serve(req: WorkerRequest, out: IO[str], commands: IO[str]) -> None:
    """Build, warm up, announce readiness, then answer commands until quit or end of input."""
    stamps = {"serving": time.time()}
    job = join_job(req) if req.ranks > 1 else None
    session, device, config = build_session(req, job)
    sync_device(device)
    stamps["built"] = time.time()
    ranks = Ranks(job) if job is not None else None
    lead = ranks is None or ranks.lead
    for _ in range(req.warmup):
        session.step()
    sync_device(device)
    stamps["warm"] = time.time()
    cpus = allowed_cpus()
    if lead:
        reply(out, {"ready": True, "config": config, "device": str(device), "threads": torch.get_num_threads(),
                    "cpus": cpus, "stamps": stamps, "build_parts": getattr(session, "build_parts", {}),
                    "memory": footprint(device), "commands": list(COMMANDS),
                    "confinement": confine_worker().model_dump()})
    while True:
        command = next_command(commands) if lead else None
        if ranks is not None:
            command = ranks.share(command)
        if command is None:
            return
        if command["cmd"] == "check":  # untimed: one step with every replaced kernel's call checked
            answer = {"spot_checks": checked_step(session) if req.spot_check is not None else 0}
            sync_device(device)
        elif command["cmd"] == "drain":
            answer = drain_bank(session, device)
        else:
            answer = run_block(session, device, command["steps"], command.get("drain", False))
        if ranks is not None:
            answer = ranks.gather(answer)
        if lead:
            reply(out, answer)


def reply(out: IO[str], message: dict[str, Any]) -> None:
    out.write(json.dumps(message) + "\n")
    out.flush()


def failure_kind(exc: BaseException) -> str:
    """The ``targets.worker_protocol.FailureKind`` an exception is reported as."""
    if isinstance(exc, ConfigError):
        return "config"
    if isinstance(exc, SpotCheckFailed):
        return "spot-check"
    if out_of_memory(exc):
        return "oom"
    return "exception"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m validators.ab_worker", description=__doc__.splitlines()[0])
    parser.add_argument("--request", required=True, help="JSON file holding a WorkerRequest")
    args = parser.parse_args(argv)
    answer_stack_requests()
    confine_worker(argv, reexec=True)  # before the candidate's code is imported (targets.confinement)
    out = claim_stdout()
    try:
        serve(WorkerRequest.model_validate_json(Path(args.request).read_text()), out, sys.stdin)
    except Exception as exc:  # noqa: BLE001 - every workload error becomes one structured line
        traceback.print_exc(file=sys.stderr)
        where = f"rank {os.environ['RANK']} of {os.environ['WORLD_SIZE']}: " if "WORLD_SIZE" in os.environ else ""
        reply(out, {"error": failure_kind(exc),
                    "message": f"{where}{type(exc).__name__}: {exc}".splitlines()[0][:500]})
        sys.stderr.flush()
        os._exit(1)  # no clean-up: under torchrun, a process group with a failed peer may block in its destructor
    leave()
    return 0


if __name__ == "__main__":
    sys.exit(main())
