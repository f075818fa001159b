"""Runs the worker in a subprocess and always returns a WorkerResult, whatever the workload does.

The child gets a scrubbed environment (no API keys or tokens), its own process group and a time
limit. A hang is killed with its whole group and reported as ``timeout``; a crash (signal, hard exit,
no result file) as ``crash`` with the tail of its stderr. The caller never dies with the workload.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, TypeVar

from pydantic import BaseModel

from targets.fork_server import start_python
from targets.machine_lease import Lease, LeaseTimeout, device_keys
from targets.worker_protocol import STACKS_SIGNAL, Failure, RunResult, WorkerRequest, WorkerResult, device_env


def allowed_cpus() -> list[int] | None:
    """The CPUs this process may run on, sorted (a lane's share when it is pinned); None where the OS
    cannot say. The one place workers, ranks, lanes and the A/B runner read their CPU set from."""
    return sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None


def cpu_count() -> int:
    """How many CPUs this process may run on."""
    cpus = allowed_cpus()
    return len(cpus) if cpus else (os.cpu_count() or 1)

SECRET_NAME = re.compile(r"(KEY|TOKEN|SECRET|PASSWORD|PASSWD|CREDENTIAL|AUTH|COOKIE|SESSION)", re.IGNORECASE)
R = TypeVar("R", bound=BaseModel)
SECRET_PREFIXES = ("OPENAI", "ANTHROPIC", "AZURE", "AWS_", "GOOGLE_", "HF_", "HUGGING")
COLLECTIVE_TIMEOUT_ENV = "SG_OPT_COLLECTIVE_TIMEOUT_S"  # a ranked run's collective timeout: its own time limit
RANK_FAILED_EXIT = 3  # a rank that wrote its failure exits with this (targets.rank_worker)
TORCHRUN_FAILURE = re.compile(r"rank\s*:\s*(\d+)\s*\(local_rank:\s*\d+\)\s*exitcode\s*:\s*(-?\d+)")


# What every worker's environment sets, whatever the caller's says. A torch.compile'd model (knob compile_encoder)
# otherwise starts inductor's pool of compile processes, one per CPU, at its first Triton kernel; the pool is not
# ready for that compile, which runs in the worker anyway, so the pool only starts up (each process importing torch)
# beside the steps that follow. On the H200 (2026-12-04, the large-cached TPE oracle) 10 of 12 fresh timing sides
# with the compiled encoder and no loader workers timed their first one to three blocks at 525-801 ms a step
# against 43-104 in their last blocks; sides started ahead, which waited out their first seconds, had none. The
# pool is the likely cause (``benchmarks/compile_transient.py`` checks it).
WORKER_ENV = {"TORCHINDUCTOR_COMPILE_THREADS": "1"}


def scrubbed_env(extra: dict[str, str] | None = None, root: str | None = None) -> dict[str, str]:
    """The parent's environment without anything that looks like a credential, with ``WORKER_ENV``.

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
    env.update(WORKER_ENV)
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


def parent_of(pid: int) -> int | None:
    """The parent of process ``pid``, from /proc (None: gone, or no /proc)."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def _below(pid: int) -> dict[int, int]:
    """Every process below ``pid`` with its parent, read from /proc in one pass (empty where there is no /proc)."""
    children: dict[int, list[int]] = {}
    proc = Path("/proc")
    for entry in proc.iterdir() if proc.is_dir() else ():
        if entry.name.isdigit() and (ppid := parent_of(int(entry.name))) is not None:  # None: it exited meanwhile
            children.setdefault(ppid, []).append(int(entry.name))
    found, todo = {}, [pid]
    while todo:
        parent = todo.pop()
        for child in children.get(parent, []):
            found[child] = parent
            todo.append(child)
    return found


def descendants(pid: int) -> list[int]:
    """Every process below ``pid``, read from /proc (none where there is no /proc)."""
    return list(_below(pid))


def kill_tree(pid: int) -> None:
    """SIGKILL the process group of ``pid`` and that of every process below it: torchrun starts each rank
    in a session of its own, out of reach of a kill of the launcher's group alone."""
    groups = {pid}
    for child in descendants(pid):
        try:
            groups.add(os.getpgid(child))
        except ProcessLookupError:
            pass
    groups.discard(os.getpgrp())  # never our own
    for group in groups:
        try:
            os.killpg(group, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


STACKS_WAIT_S = 1.5   # the longest a hung worker's process gets to write its stacks before the next is asked
STACKS_SETTLED_S = 0.2  # a dump is whole once its stderr has stopped growing for this long
STACKS_TAIL = 24000   # characters of stacks a timeout's failure keeps


def _catches(pid: int, signum: int) -> bool:
    """Whether process ``pid`` has a handler for ``signum`` (its SigCgt mask in /proc): only those are asked,
    since the signal's default action would end the others (a torchrun launcher) before the kill."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    caught = next((line.split()[1] for line in status.splitlines() if line.startswith("SigCgt:")), "0")
    return bool(int(caught, 16) >> (signum - 1) & 1)


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def ask_for_stacks(pid: int, stderr: Path) -> str:
    """Where a hung worker waits: ``pid`` and every process below it that answers STACKS_SIGNAL (a worker, its
    ranks, its loader's workers: ``targets.worker.answer_stack_requests``) write their Python stacks to
    ``stderr``, the file they share, one after the other so they do not interleave; returns those stacks, each
    under its process (empty when none answers). Called on a hung worker just before its kill."""
    parents = {pid: parent_of(pid), **_below(pid)}
    sections = []
    for process, parent in parents.items():
        if not _catches(process, STACKS_SIGNAL):
            continue
        before = _size(stderr)
        try:
            os.kill(process, STACKS_SIGNAL)
        except ProcessLookupError:
            continue
        deadline, last, settled_at = time.monotonic() + STACKS_WAIT_S, before, time.monotonic()
        while time.monotonic() < deadline:
            time.sleep(0.02)
            size = _size(stderr)
            if size != last:
                last, settled_at = size, time.monotonic()
            elif size > before and time.monotonic() - settled_at >= STACKS_SETTLED_S:
                break
        with open(stderr, "rb") as f:
            f.seek(before)
            dump = f.read(last - before).decode(errors="replace")
        role = "the worker" if process == pid else f"a process below it (parent {parent})"
        sections.append(f"--- process {process}, {role}:\n{dump.strip()}")
    return "\n".join(sections)[-STACKS_TAIL:]


def torchrun(ranks: int) -> list[str]:
    """The interpreter arguments that start a module as ``ranks`` processes of one local job (torchrun
    on a free port; a failed rank fails the job at once, with no restart)."""
    return ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ranks), "--max-restarts", "0"]


def lost_rank(stderr: str) -> str | None:
    """Which rank died without writing its failure, from torchrun's failure summary (None: none did).

    torchrun's "root cause" is whichever failure it saw first, often a peer that only failed because its
    connection closed. A rank that caught its own failure exits with RANK_FAILED_EXIT, and torchrun stops
    the rest with SIGTERM; any other exit is a rank that crashed (a signal, a hard exit), the real cause.
    """
    for rank, code in TORCHRUN_FAILURE.findall(stderr):
        if int(code) not in (RANK_FAILED_EXIT, -signal.SIGTERM):
            return f"rank {rank} {exit_reason(int(code))} without a result"
    return None


def _kill_with_stacks(proc: Any, stderr_file: Path) -> str:
    """Ask a worker's processes where they are, kill them all and reap the worker; returns the stacks."""
    stacks = ask_for_stacks(proc.pid, stderr_file)
    kill_tree(proc.pid)
    proc.wait()
    return stacks


def run_child(module: str, request: BaseModel, result_type: type[R], timeout_s: float,
              failed: Callable[[str, str, str], R], env: dict[str, str] | None = None, what: str = "worker",
              cwd: str | None = None, launcher: list[str] | None = None,
              lost: Callable[[str], str | None] | None = None) -> R:
    """Run ``python [launcher] -m module --request F --result F`` in a fresh, scrubbed process group (in
    ``cwd``, importing from it first, when given: see ``scrubbed_env``); ``launcher`` is e.g. ``torchrun(2)``,
    and ``lost(stderr)`` then says which of its processes crashed, if one did, when it exits non-zero.

    Returns the child's result record, or ``failed(kind, message, detail)`` for a hang (killed at
    the time limit, with every process below it), a crash, or an unreadable result. Every worker of
    sg-opt is started here.
    """
    with tempfile.TemporaryDirectory(prefix="sg-opt-worker-") as tmp:
        request_file, result_file = Path(tmp) / "request.json", Path(tmp) / "result.json"
        stderr_file = Path(tmp) / "stderr.txt"
        request_file.write_text(request.model_dump_json())
        spawned = time.monotonic()
        held = contextlib.ExitStack()  # shared: no other run's timed blocks on this device beside this worker
        try:
            held.enter_context(Lease(device_keys(request)))
        except LeaseTimeout as exc:
            return failed("timeout", f"the {what} could not start: {exc}", "")
        with held, open(stderr_file, "wb") as err:
            proc = start_python(module, ["--request", str(request_file), "--result", str(result_file)],
                                scrubbed_env({**device_env(request), **(env or {})}, cwd), cwd=cwd, stderr=err,
                                launcher=launcher or ())
            try:
                code = proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                stacks = _kill_with_stacks(proc, stderr_file)
                return failed("timeout", f"the {what} did not finish within {timeout_s:g} s and was killed", stacks)
            except BaseException:
                # The caller is stopping (Ctrl-C, SIGTERM). The worker runs in a session of its own and would run
                # on, orphaned; and without this a stopped caller took the worker's stacks with it (an agent's
                # slice ended by `timeout`, 2026-12-01). So: kill it, and say where it was.
                stacks = _kill_with_stacks(proc, stderr_file)
                print(f"stopped while a {what} was running (pid {proc.pid}); where it was:\n{stacks or '(no stacks)'}",
                      file=sys.stderr, flush=True)
                raise
        stderr = stderr_file.read_bytes()[-64000:].decode(errors="replace")
        stderr_tail = stderr[-4000:]
        if code != 0 and lost is not None and (crashed := lost(stderr)):
            return failed("crash", f"the {what} failed: {crashed}", stderr_tail)
        if not result_file.exists():
            return failed("crash", f"the {what} {exit_reason(code)} without a result", stderr_tail)
        try:
            result = result_type.model_validate_json(result_file.read_text())
        except ValueError as exc:
            return failed("crash", f"the {what} wrote an unreadable result ({exc})", stderr_tail)
        if isinstance(result, RunResult):
            result.process_s = time.monotonic() - spawned
        return result


def run_worker(req: WorkerRequest, timeout_s: float = 600.0, env: dict[str, str] | None = None,
               cwd: str | None = None) -> WorkerResult:
    """Run one request in a fresh process, or ``req.ranks`` of them under torchrun (in the code tree ``cwd``,
    when given); return its result or a structured failure.

    A ranked run has the same time limit and failures: a rank that fails writes its failure and a rank
    that dies is named (torchrun stops the others either way); one that hangs is killed at the time limit
    with every process of the job (the ranks' collective timeout is that limit too)."""
    def failed(kind: str, message: str, detail: str) -> WorkerResult:
        return WorkerResult(ok=False, mode=req.mode, target=req.target, size=req.size,
                            failure=Failure(kind=kind, message=message, detail=detail))

    return run_one_or_ranked(("targets.worker", "targets.rank_worker"), req, WorkerResult, timeout_s, failed, env,
                             cwd, what="worker")


def run_one_or_ranked(modules: tuple[str, str], req: WorkerRequest, result_type: type[R], timeout_s: float,
                      failed: Callable[[str, str, str], R], env: dict[str, str] | None = None,
                      cwd: str | None = None, what: str = "worker") -> R:
    """``run_child`` of modules[0] for a one-process request, or of modules[1] as ``req.ranks`` processes under
    torchrun, with the time limit as the ranks' collective timeout and a rank that died named."""
    if req.ranks == 1:
        return run_child(modules[0], req, result_type, timeout_s, failed, env, what=what, cwd=cwd)
    return run_child(modules[1], req, result_type, timeout_s, failed,
                     {COLLECTIVE_TIMEOUT_ENV: f"{timeout_s:g}", **(env or {})}, what=f"{req.ranks}-rank {what}",
                     cwd=cwd, launcher=torchrun(req.ranks), lost=lost_rank)
