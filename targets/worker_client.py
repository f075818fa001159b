"""Runs the worker in a subprocess and always returns a WorkerResult, whatever the workload does.

The child gets a scrubbed environment (no API keys or tokens), its own process group and a time
limit. A hang is killed with its whole group and reported as ``timeout``; a crash (signal, hard exit,
no result file) as ``crash`` with the tail of its stderr. The caller never dies with the workload.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Callable, TypeVar

from pydantic import BaseModel

from targets.worker_protocol import Failure, WorkerRequest, WorkerResult

SECRET_NAME = re.compile(r"(KEY|TOKEN|SECRET|PASSWORD|PASSWD|CREDENTIAL|AUTH|COOKIE|SESSION)", re.IGNORECASE)
R = TypeVar("R", bound=BaseModel)
SECRET_PREFIXES = ("OPENAI", "ANTHROPIC", "AZURE", "AWS_", "GOOGLE_", "HF_", "HUGGING")


def scrubbed_env(extra: dict[str, str] | None = None, root: str | None = None) -> dict[str, str]:
    """The parent's environment without anything that looks like a credential.

    The child imports first from ``root`` (default: our working directory), where it also runs. A
    ``root`` elsewhere (another checkout) drops our working directory from the inherited PYTHONPATH, so
    a module missing there fails instead of being imported from here.
    """
    env = {k: v for k, v in os.environ.items()
           if not SECRET_NAME.search(k) and not k.upper().startswith(SECRET_PREFIXES)}
    env.setdefault("PYTHONUNBUFFERED", "1")
    here = os.getcwd()
    inherited = [p for p in env.get("PYTHONPATH", "").split(os.pathsep)
                 if p and (root is None or os.path.abspath(p) != here)]
    # The worker must import the caller's module:attr targets from the working directory.
    env["PYTHONPATH"] = os.pathsep.join([str(root) if root else here, *inherited])
    env.update(extra or {})
    return env


def _signal_name(code: int) -> str:
    try:
        return signal.Signals(-code).name
    except ValueError:
        return f"signal {-code}"


def exit_reason(code: int) -> str:
    """How a child process ended, in words ('was killed by SIGSEGV', 'exited with code 3')."""
    if code < 0:
        name = _signal_name(code)
        hint = " (often the kernel's out-of-memory killer)" if name == "SIGKILL" else ""
        return f"was killed by {name}{hint}"
    return f"exited with code {code}"


def run_child(module: str, request: BaseModel, result_type: type[R], timeout_s: float,
              failed: Callable[[str, str, str], R], env: dict[str, str] | None = None, what: str = "worker",
              cwd: str | None = None) -> R:
    """Run ``python -m module --request F --result F`` in a fresh, scrubbed process group (in ``cwd``,
    importing from it first, when given: see ``scrubbed_env``).

    Returns the child's result record, or ``failed(kind, message, detail)`` for a hang (killed at
    the time limit), a crash, or an unreadable result. Every worker of sg-opt is started here.
    """
    with tempfile.TemporaryDirectory(prefix="sg-opt-worker-") as tmp:
        request_file, result_file = Path(tmp) / "request.json", Path(tmp) / "result.json"
        stderr_file = Path(tmp) / "stderr.txt"
        request_file.write_text(request.model_dump_json())
        cmd = [sys.executable, "-m", module, "--request", str(request_file), "--result", str(result_file)]
        with open(stderr_file, "wb") as err:
            proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err, stdin=subprocess.DEVNULL,
                                    env=scrubbed_env(env, cwd), cwd=cwd, start_new_session=True)
            try:
                code = proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                return failed("timeout", f"the {what} did not finish within {timeout_s:g} s and was killed", "")
        stderr_tail = stderr_file.read_bytes()[-4000:].decode(errors="replace")
        if not result_file.exists():
            return failed("crash", f"the {what} {exit_reason(code)} without a result", stderr_tail)
        try:
            return result_type.model_validate_json(result_file.read_text())
        except ValueError as exc:
            return failed("crash", f"the {what} wrote an unreadable result ({exc})", stderr_tail)


def run_worker(req: WorkerRequest, timeout_s: float = 600.0, env: dict[str, str] | None = None,
               cwd: str | None = None) -> WorkerResult:
    """Run one request in a fresh process (in the code tree ``cwd``, when given); return its result or a
    structured failure."""
    def failed(kind: str, message: str, detail: str) -> WorkerResult:
        return WorkerResult(ok=False, mode=req.mode, target=req.target, size=req.size,
                            failure=Failure(kind=kind, message=message, detail=detail))

    return run_child("targets.worker", req, WorkerResult, timeout_s, failed, env, cwd=cwd)
