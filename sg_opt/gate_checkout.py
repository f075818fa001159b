"""The ``--ref`` side's code: a detached git worktree of the revision, made for one gate and removed after it, and
those of gates killed before their cleanup found and removed by the next."""

from __future__ import annotations

import contextlib
import fcntl
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Iterator

from sg_opt.gate import GateSetupError


def _git(repo: Path | str, *args: str) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, timeout=120)
    except FileNotFoundError:
        raise GateSetupError("git is not installed here, and --ref needs it (or use --baseline FILE)") from None


def resolve_ref(rev: str, where: Path) -> tuple[Path, str]:
    """(repository top level, full commit id of ``rev``); GateSetupError if either cannot be found."""
    top = _git(where, "rev-parse", "--show-toplevel")
    if top.returncode != 0:
        raise GateSetupError(f"{where} is not inside a git repository, so --ref {rev} has nothing to check out "
                             f"(use --baseline FILE)")
    commit = _git(where, "rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}")
    if commit.returncode != 0 or not commit.stdout.strip():
        raise GateSetupError(f"--ref {rev!r} is not a commit of the repository at {top.stdout.strip()}")
    return Path(top.stdout.strip()).resolve(), commit.stdout.strip()


CHECKOUT_PREFIX = "sg-opt-gate-"  # ref_checkout's folders: <tmp>/sg-opt-gate-XXXX/ref, with the owner's lock
OWNER_LOCK = "owner.lock"


def _owner_gone(folder: Path) -> bool:
    """Whether the gate that made ``folder`` has ended: its lock is free (the kernel drops a killed process's
    locks) or was never taken. A running gate, in this repository or another, keeps its lock."""
    try:
        with open(folder / OWNER_LOCK, "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    except OSError:  # no folder or no lock: nothing runs there
        return True
    return True


def prune_left_behind(repo: Path) -> list[Path]:
    """Remove the worktrees of gates killed before their cleanup (SIGKILL, a lost machine): git keeps them
    registered, and ``git worktree prune`` alone never drops one whose folder is still there. Returns them."""
    listed = _git(repo, "worktree", "list", "--porcelain")
    removed = []
    for line in listed.stdout.splitlines() if listed.returncode == 0 else ():
        tree = Path(line.removeprefix("worktree "))
        if (line.startswith("worktree ") and tree.name == "ref" and tree.parent.name.startswith(CHECKOUT_PREFIX)
                and _owner_gone(tree.parent)):
            _git(repo, "worktree", "remove", "--force", str(tree))
            shutil.rmtree(tree.parent, ignore_errors=True)
            removed.append(tree)
    _git(repo, "worktree", "prune")
    return removed


@contextlib.contextmanager
def ref_checkout(repo: Path, commit: str) -> Iterator[Path]:
    """A detached worktree of ``commit`` in a temporary folder, removed (and pruned) on the way out; those that
    killed gates left behind are removed first. The folder's lock, held while it is used, tells them apart."""
    prune_left_behind(repo)
    folder = Path(tempfile.mkdtemp(prefix=CHECKOUT_PREFIX))
    tree = folder / "ref"
    lock = open(folder / OWNER_LOCK, "w")
    fcntl.flock(lock, fcntl.LOCK_EX)
    try:
        added = _git(repo, "worktree", "add", "--detach", str(tree), commit)
        if added.returncode != 0:
            why = (added.stderr.strip().splitlines() or ["no reason given"])[-1]
            raise GateSetupError(f"git could not check out {commit[:12]}: {why}")
        yield tree
    finally:
        _git(repo, "worktree", "remove", "--force", str(tree))
        shutil.rmtree(folder, ignore_errors=True)
        _git(repo, "worktree", "prune")
        lock.close()


