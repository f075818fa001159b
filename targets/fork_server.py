"""Worker processes forked from a server that has already imported torch, not started from nothing.

Every measurement starts fresh worker processes (the two sides of an A/B run, numerics and profile
runs), and each new interpreter spends seconds importing torch and, at its first optimizer,
torch._dynamo: a timing worker of a tiny run on a 2-core VM got ready in 2.4 s started anew and in 0.2 s
forked (2026-11-30); at size large on an H200 "start and imports" took 4.0 s of a timing
worker's 12.1 s start-up, before the server existed. The server imports those once, then forks one child
per worker.

A child gets what a fresh ``python -m MODULE ARGS`` would: its own environment, working directory,
sys.path (its working directory, then its PYTHONPATH, then the interpreter's own paths), CPU set,
session and standard streams. The server imports nothing of this project (so a candidate's code tree
imports its own modules), never initialises CUDA (a forked CUDA context is unusable: a server whose
imports called cuInit refuses to serve; merely mapping the driver, as torch's CUDA build does, is fine),
and is started again whenever the caller's environment changes in anything but the per-worker variables, as torch reads some of it at
import. Exit statuses come back through one pipe per child, written by the server when it reaps it.

Every CPU worker, forked or not, runs glibc's allocator with its thresholds fixed (``STATIC_MALLOC``): see
``fixed_allocator_env``. ``SG_OPT_STATIC_MALLOC=0`` leaves them to glibc, as a GPU worker's request does
(``targets.worker_protocol.device_env``).

``SG_OPT_FORK_SERVER=0`` starts every worker as a plain subprocess; so does any failure of the server.
This file is also the server's program (``python fork_server.py FD``), which is why it imports nothing
from the project.
"""

from __future__ import annotations

import atexit
import ctypes
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import IO, Any, Sequence

SWITCH = "SG_OPT_FORK_SERVER"
# Variables that differ from child to child and that no preloaded module reads at import: a change in any
# other one starts a new server, so the preloaded imports always saw the child's environment.
PER_WORKER = ("PYTHONPATH", "CUDA_VISIBLE_DEVICES", "SG_OPT_COLLECTIVE_TIMEOUT_S", "PYTEST_CURRENT_TEST",
              "SG_OPT_CONFINE")
PRELOAD = ("numpy", "pydantic", "torch", "torch._dynamo")
REAP_INTERVAL_S = 0.02
MALLOC_SWITCH = "SG_OPT_STATIC_MALLOC"
# glibc's own starting thresholds (128 KiB), fixed: see fixed_allocator_env. Names as glibc reads them at start-up.
STATIC_MALLOC = {"MALLOC_MMAP_THRESHOLD_": 128 * 1024, "MALLOC_TRIM_THRESHOLD_": 128 * 1024}
MALLOPT = {"MALLOC_TRIM_THRESHOLD_": -1, "MALLOC_MMAP_THRESHOLD_": -3}  # mallopt's M_TRIM_THRESHOLD, M_MMAP_THRESHOLD


# ----------------------------------------------------------------------------- the server

CUDA_ERROR_NOT_INITIALIZED = 3


def _cuda_driver_path() -> str | None:
    """The CUDA driver library this process has mapped, or None."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return None
    return next((line.split()[-1] for line in maps.splitlines() if "/libcuda.so" in line), None)


def _cuda_initialised() -> bool:
    """Whether this process has called cuInit, after which a forked child cannot use CUDA.

    Having the driver mapped is not that: torch's CUDA build maps it at import on the H200 host (2026-11-30:
    the server refused every worker for it). Until cuInit has run, cuDeviceGetCount answers
    CUDA_ERROR_NOT_INITIALIZED and initialises nothing, so it is the question to ask; a driver that cannot be
    asked counts as initialised."""
    path = _cuda_driver_path()
    if path is None:
        return False
    try:
        driver = ctypes.CDLL(path, mode=os.RTLD_NOLOAD)  # the mapped library; never load one here
        count = ctypes.c_int(0)
        return driver.cuDeviceGetCount(ctypes.byref(count)) != CUDA_ERROR_NOT_INITIALIZED
    except (OSError, AttributeError):
        return True


def _become_worker(request: dict[str, Any], fds: list[int], base_path: list[str]) -> None:
    """In the forked child, already in a session of its own: take the request's streams, directory,
    environment, CPUs and sys.path, run the module as __main__, and exit with its status. Never returns.

    The child is single-threaded here (only the forking thread survives a fork), so a worker module confines
    itself at its start (``targets.confinement``: a user namespace needs a single thread); the server never
    confines, and never runs a module's code."""
    code = 1
    try:
        for target, fd in zip((0, 1, 2), fds[:3]):
            os.dup2(fd, target)
        for fd in fds:
            os.close(fd)
        for sig in (signal.SIGCHLD, signal.SIGTERM):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        os.sched_setaffinity(0, request["cpus"])
        python_path = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
        sys.path[:] = [os.getcwd(), *python_path, *base_path]
        if os.environ.get("PYTHONUNBUFFERED"):
            sys.stdout.reconfigure(write_through=True)
            sys.stderr.reconfigure(write_through=True)
        sys.argv = [request["module"], *request["args"]]
        _apply_allocator_env()
        _fresh_process_state()
        import runpy

        runpy._run_module_as_main(request["module"])  # what `python -m` runs
        code = 0
    except SystemExit as stop:
        if stop.code is None or isinstance(stop.code, int):
            code = stop.code or 0
        else:
            print(stop.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - the child reports everything, as an interpreter would
        traceback.print_exc()
    finally:
        try:
            atexit._run_exitfuncs()
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def fixed_allocator_env(env: dict[str, str]) -> dict[str, str]:
    """``env`` with glibc's mmap and trim thresholds fixed at 128 KiB, unless it sets them or ``MALLOC_SWITCH`` is 0.

    Left alone, glibc raises both thresholds as a process frees large blocks, so how many of a step's pages are
    freed to the kernel and fault in again depends on the process's history: at `tiny` on the 2-core VM
    (2026-12-06) six fresh processes faulted 3,460-4,005 pages a step on average (median 4,480; ~2 us each, over
    half the 14 ms step), and six identical workers timed side by side spread by 6.2-6.3% (sd, two threads) and
    2.4-3.4% (one thread). Fixed, every block of 128 KiB or more is mapped anew and returned when freed, in every
    process alike: 2.6-3.2% and 0.5%. Nothing a step allocates is spared its cost (a fixed threshold only charges
    more of it: the step took 19.3 ms there, against 14.5 ms with glibc's moving ones), so a change cannot hide
    an allocation; a change that allocates less saves somewhat more than a default process would."""
    if env.get(MALLOC_SWITCH, "1") in ("0", "false", "no", "off"):
        return env
    return {**{name: str(value) for name, value in STATIC_MALLOC.items()}, **env}


def _apply_allocator_env() -> None:
    """In a forked child: what glibc would have read from the child's environment at start-up (the server's
    allocator was set up before it), set with mallopt."""
    mallopt = _libc_function("mallopt")
    if mallopt is None:
        return
    for name, param in MALLOPT.items():
        if (value := os.environ.get(name, "")).isdigit():
            mallopt(param, int(value))


def _fresh_process_state() -> None:
    """What a fresh interpreter draws anew and a fork would share: numpy's global random state and the
    multiprocessing authentication key (Python's own `random` reseeds itself after a fork); and what it reads
    anew from its environment: the temp folder, which the server's imports looked up in the server's."""
    import multiprocessing
    import tempfile

    import numpy

    numpy.random.seed()
    multiprocessing.current_process().authkey = os.urandom(32)
    tempfile.tempdir = None


def _reap(children: dict[int, int]) -> None:
    """Write the exit status of every finished child to its status pipe."""
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        fd = children.pop(pid, None)
        if fd is not None:
            try:
                os.write(fd, f"{os.waitstatus_to_exitcode(status)}\n".encode())
            except OSError:  # the caller no longer reads it
                pass
            finally:
                os.close(fd)


PR_SET_PDEATHSIG = 1
_libc: dict[str, Any] = {}  # libc functions, looked up before any fork: a child of a threaded parent must not dlopen


def _libc_function(name: str) -> Any:
    """libc's ``name`` (prctl, mallopt), or None where there is none (not Linux, not glibc)."""
    if name not in _libc:
        try:
            _libc[name] = getattr(ctypes.CDLL(None, use_errno=True), name)
        except (OSError, AttributeError):
            _libc[name] = None
    return _libc[name]


def die_with_parent(parent: int, signum: int = signal.SIGKILL) -> None:
    """Have the kernel send ``signum`` to this process when the thread that started it ends, and exit at once if
    ``parent`` died before that was asked: a worker must not outlive a caller killed by SIGKILL (it kept a hung
    worker and its server, 640 MB, running for minutes). A no-op where prctl is missing."""
    prctl = _libc_function("prctl")
    if prctl is None:
        return
    prctl(PR_SET_PDEATHSIG, int(signum), 0, 0, 0)
    if os.getppid() != parent:
        os._exit(1)


def _kill_children(children: dict[int, int]) -> None:
    """SIGKILL every child's session (each leads one: its loader's workers too), once the caller is gone."""
    for pid in list(children):
        try:
            os.killpg(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    deadline = time.monotonic() + 5.0
    while children and time.monotonic() < deadline:
        time.sleep(REAP_INTERVAL_S)
        _reap(children)


def serve(sock: socket.socket, caller: int | None = None) -> None:
    """Import PRELOAD, then fork a child per request until the caller closes its end of ``sock``. Once the
    ``caller`` process is gone (killed: it could not close anything), its children are killed and the server
    ends; a server cannot die with its parent by prctl, which follows the thread that started it (a lane's)."""
    for name in PRELOAD:
        __import__(name)
    if _cuda_initialised():
        sock.sendall(b'{"refused": "the imports initialised the CUDA driver"}')
        return
    sock.sendall(b'{"ready": true}')
    base_path = [p for p in sys.path if p not in os.environ.get("PYTHONPATH", "").split(os.pathsep)]
    children: dict[int, int] = {}
    server = os.getpid()
    for name in ("prctl", "mallopt"):  # before the first fork (die_with_parent, _apply_allocator_env)
        _libc_function(name)
    while True:
        readable, _, _ = select.select([sock], [], [], REAP_INTERVAL_S)
        _reap(children)
        if caller is not None and os.getppid() != caller:  # the caller died: nobody waits for these children
            _kill_children(children)
            return
        if not readable:
            continue
        message, fds, _, _ = socket.recv_fds(sock, 1 << 20, 4)
        if not message:  # the caller is done with us: report the children still running, then go
            while children:
                time.sleep(REAP_INTERVAL_S)
                _reap(children)
                if caller is not None and os.getppid() != caller:
                    _kill_children(children)
            return
        # The pid goes back only once the child leads a session of its own, as subprocess.Popen's
        # start_new_session gives it: a caller that kills the pid's process group at once reaches it (a
        # worker killed right after it started survived the kill, and its wait() hung).
        in_session, says_so = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.setsid()
            die_with_parent(server)  # the server is single-threaded: this lasts as long as it does
            os.close(in_session)
            os.close(says_so)
            sock.close()
            for fd in children.values():
                os.close(fd)
            _become_worker(json.loads(message), fds, base_path)
        os.close(says_so)
        os.read(in_session, 1)  # b"" once the child has closed its end, after setsid
        os.close(in_session)
        for fd in fds[:3]:
            os.close(fd)
        children[pid] = fds[3]
        sock.sendall(f'{{"pid": {pid}}}'.encode())


# ----------------------------------------------------------------------------- the caller's side

class ForkedProcess:
    """A worker forked by the server, handled like a ``subprocess.Popen``: pid, stdin, stdout, poll, wait."""

    def __init__(self, args: list[str], pid: int, status: int, stdin: IO | None, stdout: IO | None):
        self.args, self.pid, self._status, self.stdin, self.stdout = args, pid, status, stdin, stdout
        self.returncode: int | None = None
        self._text = b""

    def _read_status(self, timeout: float | None) -> bool:
        if self.returncode is not None:
            return True
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not select.select([self._status], [], [], left)[0]:
                return False
            chunk = os.read(self._status, 64)
            if chunk:
                self._text += chunk
                continue
            os.close(self._status)
            if self._text.strip():
                self.returncode = int(self._text)
            else:  # the server died first: wait for the child itself, its status unknown
                while Path(f"/proc/{self.pid}").exists():
                    time.sleep(REAP_INTERVAL_S)
                self.returncode = 255
            return True

    def poll(self) -> int | None:
        self._read_status(0.0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self._read_status(timeout):
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def __del__(self) -> None:
        if self.returncode is None:
            try:
                os.close(self._status)
            except OSError:
                pass


class _Server:
    """One running server, started with the environment ``key`` stands for."""

    def __init__(self, env: dict[str, str], key: tuple):
        self.key, self.lock = key, threading.Lock()
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)  # one message per request
        self.proc = subprocess.Popen([sys.executable, __file__, str(theirs.fileno()), str(os.getpid())],
                                     pass_fds=[theirs.fileno()],
                                     env=env, cwd="/", stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL, start_new_session=True)
        theirs.close()
        self.sock = ours
        self.ready: bool | None = None  # known at the first spawn, once its imports are done

    def spawn(self, request: dict[str, Any], fds: Sequence[int]) -> tuple[int, int] | None:
        """(pid, status fd) of a forked child, or None when this server cannot serve."""
        read_status, write_status = os.pipe()
        try:
            with self.lock:
                if self.ready is None:
                    self.ready = bool(json.loads(self.sock.recv(4096) or b"{}").get("ready"))
                if not self.ready:
                    return None
                socket.send_fds(self.sock, [json.dumps(request).encode()], [*fds, write_status])
                reply = json.loads(self.sock.recv(4096) or b"{}")
        except (OSError, ValueError):
            self.ready = False
            reply = {}
        finally:
            os.close(write_status)
        if "pid" not in reply:
            os.close(read_status)
            self.ready = False
            return None
        return int(reply["pid"]), read_status

    def close(self) -> None:
        """Stop taking requests; the server exits once it has reported every child still running."""
        self.sock.close()


_current: _Server | None = None  # the server that takes requests now
_retired: list[_Server] = []  # closed ones, still reporting on their children, polled so none stays a zombie
_servers_lock = threading.Lock()


def _server_for(env: dict[str, str]) -> _Server:
    global _current
    key = tuple(sorted((k, v) for k, v in env.items() if k not in PER_WORKER))
    with _servers_lock:
        _retired[:] = [s for s in _retired if s.proc.poll() is None]
        if _current is not None and (_current.key != key or _current.ready is False):
            _current.close()
            _retired.append(_current)
            _current = None
        if _current is None:
            _current = _Server(env, key)
        return _current


def _close_server() -> None:
    if _current is not None:
        _current.close()


atexit.register(_close_server)


def _fd(stream: Any, mode: str) -> tuple[int, IO | None, int | None]:
    """(fd for the child, our end as a file or None, fd to close in the caller after the spawn)."""
    if stream is subprocess.PIPE:
        read, write = os.pipe()
        ours, theirs = (write, read) if mode == "w" else (read, write)
        return theirs, os.fdopen(ours, mode, buffering=1, encoding="utf-8"), theirs
    if stream is subprocess.DEVNULL or stream is None:
        fd = os.open(os.devnull, os.O_RDWR)
        return fd, None, fd
    return stream.fileno(), None, None


def _forked(cmd: list[str], module: str, args: Sequence[str], env: dict[str, str], cwd: str | None,
            streams: tuple[Any, Any, Any], cpus: list[int] | None) -> ForkedProcess | None:
    """The child forked by the server for this environment, or None where the server cannot serve."""
    ends = [_fd(stream, mode) for stream, mode in zip(streams, ("w", "r", "r"))]
    request = {"module": module, "args": list(args), "env": env, "cwd": os.path.abspath(cwd or os.getcwd()),
               "cpus": cpus if cpus else sorted(os.sched_getaffinity(0))}
    try:
        spawned = _server_for(env).spawn(request, [fd for fd, _, _ in ends])
    finally:
        for _, _, close in ends:
            if close is not None:
                os.close(close)
    if spawned is None:
        for _, ours, _ in ends:
            if ours is not None:
                ours.close()
        return None
    return ForkedProcess(cmd, *spawned, stdin=ends[0][1], stdout=ends[1][1])


def _dies_with_us(signum: int) -> Any:
    """A preexec_fn that ties a plain subprocess to this process (``die_with_parent``), or None off the main
    thread: prctl follows the thread that forks, and a lane's thread ends before the process does. A launcher
    (torchrun) gets SIGTERM, on which it stops its ranks."""
    if threading.current_thread() is not threading.main_thread():
        return None
    parent = os.getpid()
    _libc_function("prctl")  # looked up here, in the parent
    return lambda: die_with_parent(parent, signum)


def start_python(module: str, args: Sequence[str], env: dict[str, str], cwd: str | None = None,
                 stdin: Any = subprocess.DEVNULL, stdout: Any = subprocess.DEVNULL, stderr: Any = subprocess.DEVNULL,
                 cpus: Sequence[int] | None = None, launcher: Sequence[str] = ()) -> ForkedProcess | subprocess.Popen:
    """``python [launcher] -m module *args`` in a session of its own: forked from the server, or a plain
    subprocess under a launcher (torchrun starts fresh interpreters anyway) or where the server is switched
    off or cannot serve. stdin/stdout take PIPE (text, line-buffered), DEVNULL or a file; ``cpus`` pins it
    (default: the calling thread's CPU set, which a child inherits either way)."""
    cmd = [sys.executable, *launcher, "-m", module, *args]
    env = fixed_allocator_env(env)
    pinned = sorted(cpus) if cpus else None
    if not launcher and env.get(SWITCH, "1") not in ("0", "false", "no", "off"):
        if (child := _forked(cmd, module, args, env, cwd, (stdin, stdout, stderr), pinned)) is not None:
            return child
    saved = os.sched_getaffinity(0) if pinned else None
    if saved is not None:
        os.sched_setaffinity(0, pinned)  # the calling thread, while it forks: the child starts pinned
    try:
        return subprocess.Popen(cmd, stdin=stdin, stdout=stdout, stderr=stderr, env=env, cwd=cwd,
                                start_new_session=True, text=True, bufsize=1,
                                preexec_fn=_dies_with_us(signal.SIGTERM if launcher else signal.SIGKILL))
    finally:
        if saved is not None:
            os.sched_setaffinity(0, saved)


if __name__ == "__main__":
    sys.path.pop(0)  # this file's folder: the server imports nothing of the project
    serve(socket.socket(fileno=int(sys.argv[1])), int(sys.argv[2]) if len(sys.argv) > 2 else None)
