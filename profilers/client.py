"""Runs the profiling worker in a subprocess and always returns a ProfileResult.

Like ``targets.worker_client``, the child gets a scrubbed environment (``scrubbed_env``: no keys
or tokens), its own process group and a time limit: a hang is killed with its whole group and
reported as ``timeout``, a crash (signal, hard exit, no or unreadable result) as ``crash`` with
the tail of its stderr. The caller never dies with the workload.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from profilers.records import ProfileRequest, ProfileResult
from targets.worker_client import scrubbed_env
from targets.worker_protocol import Failure

DEFAULT_TIMEOUT_S = 900.0


def _failed(req: ProfileRequest, kind: str, message: str, detail: str = "") -> ProfileResult:
    return ProfileResult(ok=False, target=req.target, size=req.size,
                         failure=Failure(kind=kind, message=message, detail=detail))


def _exit_reason(code: int) -> str:
    if code >= 0:
        return f"exited with code {code}"
    try:
        return f"was killed by {signal.Signals(-code).name}"
    except ValueError:
        return f"was killed by signal {-code}"


def run_profile(req: ProfileRequest, timeout_s: float = DEFAULT_TIMEOUT_S,
                env: dict[str, str] | None = None) -> ProfileResult:
    """Profile one config in a fresh process; return its result or a structured failure."""
    with tempfile.TemporaryDirectory(prefix="sg-opt-profile-") as tmp:
        request_file, result_file, stderr_file = (Path(tmp) / name for name in ("request.json", "result.json",
                                                                                  "stderr.txt"))
        request_file.write_text(req.model_dump_json())
        cmd = [sys.executable, "-m", "profilers.worker", "--request", str(request_file), "--result", str(result_file)]
        with open(stderr_file, "wb") as err:
            proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err, stdin=subprocess.DEVNULL,
                                    env=scrubbed_env(env), start_new_session=True)
            try:
                code = proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                return _failed(req, "timeout", f"the profiler did not finish within {timeout_s:g} s and was killed")
        stderr_tail = stderr_file.read_bytes()[-4000:].decode(errors="replace")
        if not result_file.exists():
            return _failed(req, "crash", f"the profiler {_exit_reason(code)} without a result", stderr_tail)
        try:
            return ProfileResult.model_validate_json(result_file.read_text())
        except ValueError as exc:
            return _failed(req, "crash", f"the profiler wrote an unreadable result ({exc})", stderr_tail)
