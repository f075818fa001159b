"""Confines a worker that runs candidate code: its file system read-only outside its own folders, no network.

Candidate kernels are code an LLM wrote, and they run in worker processes (``targets.worker``, the timing and
kernel-check workers). Linux namespaces confine such a process without privileges: a new user namespace (which
lets an unprivileged process make the others) owning a new mount namespace, where every mount except the
worker's writable folders and /proc is remounted read-only, and a new network namespace, whose one interface is a
loopback that is down. Reading files, using the CPU, memory and devices (device nodes stay openable on a
read-only mount), and writing inside the writable folders (the compile caches among them) stay possible.

It is best effort and never fatal: where the platform cannot (no user namespaces, a seccomp filter, gVisor, a
process already running threads) the record says ``confined=False`` and why, and the run goes on.
``SG_OPT_CONFINE=0`` turns it off. This module imports nothing of the project and no torch, so that
``python -m targets.confinement MODULE ARGS...`` can confine a fresh interpreter before torch starts its threads
(a user namespace needs a single-threaded process) and then run ``MODULE`` as ``python -m MODULE ARGS...``
would. A worker forked by the fork server is single-threaded at its start and confines itself in place.
"""

from __future__ import annotations

import ctypes
import errno
import getpass
import json
import os
import re
import runpy
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

from pydantic import BaseModel, Field

SWITCH = "SG_OPT_CONFINE"
SHARED_MEMORY = "/dev/shm"  # torch's tensors between processes (DataLoader workers) and the loader's ring
RANKS_KEEP_NETWORK = "ranks talk over loopback"
# Mounts left as they are: the CUDA driver writes to /proc at cuInit (a read-only /proc fails it with
# CUDA_ERROR_OPERATING_SYSTEM, measured on an H100), and a process in a user namespace of its own holds no
# capability over the host's, so what it can write there is its own process's state.
LEFT_AS_MOUNTED = ("/proc",)

CLONE_NEWNS, CLONE_NEWUSER, CLONE_NEWNET = 0x00020000, 0x10000000, 0x40000000
MS_RDONLY, MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 1, 32, 4096, 1 << 14, 1 << 18
MS_RELATIME, MS_STRICTATIME, MS_NOATIME = 1 << 21, 1 << 24, 1024
# A remount must repeat the flags the mount has (the kernel locks them on mounts a user namespace inherits).
KEPT_FLAGS = {"nosuid": 2, "nodev": 4, "noexec": 8, "nosymfollow": 256, "noatime": MS_NOATIME, "nodiratime": 2048,
              "relatime": MS_RELATIME}


class Confinement(BaseModel):
    """How a worker's process was confined while it ran candidate code, for its result and the report."""

    confined: bool = Field(False, description="some confinement holds (read_only or network)")
    read_only: bool = Field(False, description="the file system was read-only outside `writable`")
    network: bool = Field(False, description="the network was cut off (True: no network at all, not even loopback)")
    how: str = Field("", description="what was done, in words")
    why_not: str = Field("", description="why some or all of it was not done")
    writable: list[str] = Field(default_factory=list, description="the folders that stayed writable")

    def sentence(self) -> str:
        """One line for a report: 'candidates ran confined: read-only file system, no network', or why not."""
        if self.read_only and self.network:
            return "candidates ran confined: read-only file system, no network"
        if self.read_only:
            return f"candidates ran confined: read-only file system; network kept ({self.why_not})"
        if self.network:
            return f"candidates ran without network, but on a writable file system ({self.why_not})"
        return f"candidates ran unconfined: {self.why_not or 'confinement was not attempted'}"


_record: Confinement | None = None  # this process's, once it tried


def current() -> Confinement | None:
    """This process's confinement, once it was tried (None before, and in processes that are no worker)."""
    return _record


def switched_off() -> bool:
    return os.environ.get(SWITCH, "1").strip().lower() in ("0", "false", "no", "off")


def thread_count() -> int:
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return 0


# ----------------------------------------------------------------------------- the mechanism

def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_void_p]
    return libc


def _unshare(flags: int) -> None:
    if hasattr(os, "unshare"):  # Python 3.12+
        os.unshare(flags)
        return
    if _libc().unshare(flags) != 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code))


def _mount(source: str | None, target: str, flags: int) -> None:
    if _libc().mount(os.fsencode(source) if source else None, os.fsencode(target), None, flags, None) != 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code), target)


def _write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def _unescape(field: str) -> str:
    """A mountinfo path: spaces, tabs, newlines and backslashes are written as octal escapes."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def mounts() -> list[tuple[str, set[str]]]:
    """(mount point, per-mount options) of every mount this process sees, one per mount point: the last listed,
    the one on top, whose options a remount of that path must repeat. Automount points are left out: looking at
    one would ask a daemon outside to mount it."""
    found: dict[str, set[str]] = {}
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        fields = line.split()
        if len(fields) < 7 or "-" not in fields[6:]:
            continue
        point, fstype = _unescape(fields[4]), fields[fields.index("-", 6) + 1]
        found.pop(point, None)
        if fstype != "autofs":
            found[point] = set(fields[5].split(","))
    return list(found.items())


def _within(path: str, folders: list[str]) -> bool:
    return any(path == folder or path.startswith(folder.rstrip("/") + "/") for folder in folders)


def _read_only_flags(options: set[str]) -> int:
    flags = MS_REMOUNT | MS_BIND | MS_RDONLY
    flags |= sum(bit for name, bit in KEPT_FLAGS.items() if name in options)
    if not flags & (MS_NOATIME | MS_RELATIME):
        flags |= MS_STRICTATIME  # absent, the kernel would default to relatime, and refuse to change a locked one
    return flags


def _is_read_only(path: str) -> bool | None:
    """Whether the mount ``path`` lies on is read-only; None where this process cannot reach it."""
    try:
        return bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except OSError:
        return None


def network_cut() -> bool:
    """Whether this process is in a network namespace of its own with no way out: only a loopback, which is down
    (a connection to 127.0.0.1 finds no route)."""
    if [name for _, name in socket.if_nameindex()] != ["lo"]:
        return False
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.settimeout(1.0)
        return probe.connect_ex(("127.0.0.1", 9)) == errno.ENETUNREACH


def _existing(folders: list[str]) -> list[str]:
    """The real paths of the folders, made where missing (a bind mount needs its target); those that cannot be
    made are left out."""
    kept = []
    for folder in folders:
        try:
            os.makedirs(folder, exist_ok=True)
        except OSError:
            continue
        real = os.path.realpath(folder)
        if os.path.isdir(real) and real not in kept:
            kept.append(real)
    return kept


def confine(writable: list[str], keep_network: str = "") -> Confinement:
    """Confine this process, never raising: new user and mount namespaces where every mount is read-only except
    the ``writable`` folders, and a new network namespace unless ``keep_network`` says why the process needs it.

    Once per process: later calls return the first record. Must run before the process starts a thread (the
    kernel refuses a user namespace to a multi-threaded process); its children inherit the confinement."""
    global _record
    if _record is not None and _record.confined:
        return _record
    _record = _confine(writable, keep_network)
    return _record


def _confine(writable: list[str], keep_network: str) -> Confinement:
    if switched_off():
        return Confinement(why_not=f"switched off ({SWITCH}=0)")
    if not sys.platform.startswith("linux"):
        return Confinement(why_not=f"it uses Linux namespaces, and this is {sys.platform}")
    threads = thread_count()
    if threads > 1:
        return Confinement(why_not=f"the process already ran {threads} threads, and the kernel gives a user "
                                   f"namespace only to a single-threaded process")
    folders = _existing(writable)
    uid, gid = os.getuid(), os.getgid()
    try:
        _unshare(CLONE_NEWUSER | CLONE_NEWNS | (0 if keep_network else CLONE_NEWNET))
    except OSError as exc:
        return Confinement(why_not=f"the kernel refused new user namespaces ({exc.strerror}): they are off or "
                                   f"not allowed on this platform")
    network = not keep_network and network_cut()
    why_not = [keep_network] if keep_network else [] if network else ["the new network namespace still reaches out"]
    try:
        if os.path.exists("/proc/self/setgroups"):
            _write("/proc/self/setgroups", "deny")  # the kernel's condition for an unprivileged gid_map
        _write("/proc/self/uid_map", f"{uid} {uid} 1")  # the same ids inside as outside
        _write("/proc/self/gid_map", f"{gid} {gid} 1")
        _mount(None, "/", MS_REC | MS_PRIVATE)  # nothing done here reaches the host's mounts
        for folder in folders:
            _mount(folder, folder, MS_BIND | MS_REC)  # a mount of its own, which the remounts below skip
    except OSError as exc:
        why_not.append(f"the file system stayed writable: {exc.strerror} on {exc.filename or 'the id maps'}")
        return Confinement(confined=network, network=network, how="user and network namespaces" if network else "",
                           why_not="; ".join(why_not), writable=folders)
    failed, kept = [], [*folders, *LEFT_AS_MOUNTED]
    for point, options in mounts():
        if _within(point, kept) or "ro" in options:
            continue
        try:
            _mount(None, point, _read_only_flags(options))
        except OSError as exc:
            failed.append(f"{point} ({exc.strerror})")
    stayed = [p for p, _ in mounts() if not _within(p, kept) and _is_read_only(p) is False]
    if stayed:
        why_not.append(f"mounts stayed writable: {', '.join(stayed[:5])}" + (f" ({'; '.join(failed[:3])})"
                                                                          if failed else ""))
    read_only = not stayed
    parts = [f"read-only outside {', '.join(folders)}" if read_only else "", "no network" if network else ""]
    return Confinement(confined=read_only or network, read_only=read_only, network=network,
                       how=f"user, mount{', network' if not keep_network else ''} namespaces: "
                           + "; ".join(p for p in parts if p),
                       why_not="; ".join(why_not), writable=folders)


# ----------------------------------------------------------------------------- a worker's confinement

def worker_folders(args: list[str]) -> list[str]:
    """The folders a worker writes its own files to: those of its --request and --result files (the folder made
    for it), and that of the trace a profile request asks for."""
    files: dict[str, str] = {}
    for i, arg in enumerate(args):
        for flag in ("--request", "--result"):
            if arg == flag and i + 1 < len(args):
                files[flag] = args[i + 1]
            elif arg.startswith(flag + "="):
                files[flag] = arg.split("=", 1)[1]
    folders = [os.path.dirname(os.path.abspath(path)) for path in files.values()]
    try:
        request = json.loads(Path(files["--request"]).read_text()) if "--request" in files else None
    except (OSError, ValueError):
        request = None
    if isinstance(request, dict) and isinstance(request.get("trace"), str):
        folders.append(os.path.dirname(os.path.abspath(request["trace"])))
    return list(dict.fromkeys(folders))


def inductor_temp_dir() -> str:
    """torch.compile's cache under the temp folder (``torch._inductor.runtime.cache_dir_utils.default_cache_dir``),
    where torch keeps some of its caches (precompiled headers) whatever TORCHINDUCTOR_CACHE_DIR says."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = f"uid_{os.getuid()}"
    return os.path.join(tempfile.gettempdir(), "torchinductor_" + re.sub(r'[\\/:*?"<>|]', "_", user))


def inductor_cache_dir() -> str:
    """Where torch.compile keeps its cache (``torch._inductor.runtime.cache_dir_utils.cache_dir``)."""
    return os.environ.get("TORCHINDUCTOR_CACHE_DIR") or inductor_temp_dir()


def cache_folders() -> list[str]:
    """What a worker writes besides its own folder: torch.compile's and Triton's compile caches, and sg-opt's own
    cache (``targets.protocol.user_cache_dir``: built data, measured ceilings)."""
    home = os.path.expanduser("~")
    triton = os.environ.get("TRITON_CACHE_DIR") or os.path.join(os.environ.get("TRITON_HOME") or home, ".triton",
                                                                "cache")
    sg_opt = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.join(home, ".cache"), "sg-opt")
    return [inductor_cache_dir(), inductor_temp_dir(), triton, sg_opt]


def confine_worker(args: list[str] | None = None, reexec: bool = False) -> Confinement:
    """Confine this worker process, once (later calls return the record), before it loads candidate code.

    Writable: its own folder (``worker_folders`` of ``args``, default its command line, which must name a
    --request or --result file: any other process is no worker and is left alone), shared memory and the
    caches (``cache_folders``); its temp folder moves into its own folder. A rank of a torchrun job
    (WORLD_SIZE > 1) keeps its network. With ``reexec``, at a worker's very start, a process that already runs
    threads (a fresh interpreter after ``import torch``) starts again in its place as ``python -m
    targets.confinement MODULE ARGS``, same pid, which confines before the imports."""
    global _record
    if _record is not None:
        return _record
    args = sys.argv[1:] if args is None else args
    own = worker_folders(args)
    if not own:
        return Confinement(why_not="not a worker process (no --request or --result file on its command line)")
    if reexec and thread_count() > 1 and not switched_off() and sys.platform.startswith("linux"):
        _start_again_confined(args)  # returns only when it could not
    ranked = int(os.environ.get("WORLD_SIZE", "1") or "1") > 1
    inductor, shared = inductor_cache_dir(), inductor_temp_dir()
    shared_memory = [SHARED_MEMORY] if os.path.isdir(SHARED_MEMORY) else []  # never made: it is the host's
    record = confine([*own, *shared_memory, *cache_folders()], RANKS_KEEP_NETWORK if ranked else "")
    if record.read_only:
        _move_temp_folder(own[0], inductor, shared)
    return record


def _move_temp_folder(folder: str, inductor: str, shared: str) -> None:
    """Point the temp folder (Triton's and gcc's files, multiprocessing's sockets) into the worker's own folder,
    keeping torch.compile's caches where they were: its cache folder stays named, and its folder under the temp
    folder, which torch reaches through the temp folder, is the shared one mounted there (in this process's
    mount namespace only: the caller that deletes the worker's folder sees an empty directory)."""
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = inductor
    os.environ["TMPDIR"] = tempfile.tempdir = folder
    moved = inductor_temp_dir()
    try:
        os.makedirs(moved, exist_ok=True)
        _mount(shared, moved, MS_BIND)
    except OSError:
        pass  # torch then builds those caches afresh in the worker's folder


def _start_again_confined(args: list[str]) -> None:
    """Replace this process by ``python -m targets.confinement MODULE ARGS`` (the module this one runs)."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    if spec is None or not spec.name:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execv(sys.executable, [sys.executable, *subprocess._args_from_interpreter_flags(), "-m", __spec__.name,
                                  spec.name, *args])
    except OSError:
        return


def main(argv: list[str] | None = None) -> None:
    """``python -m targets.confinement MODULE ARGS...``: confine this (fresh, single-threaded) interpreter as a
    worker, then run MODULE as __main__ with ARGS."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0].startswith("-"):
        sys.exit("usage: python -m targets.confinement MODULE [ARGS...]")
    confine_worker(argv[1:])
    sys.argv = [argv[0], *argv[1:]]
    runpy.run_module(argv[0], run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    from targets.confinement import main as _main  # the module's own globals then hold the record its worker reads

    _main()
