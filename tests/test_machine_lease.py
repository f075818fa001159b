"""The machine-wide measurement lock: shared holders together, an exclusive one alone, a waiting exclusive holder
not starved by new shared ones (the turnstile), a dead holder's lock gone with it, and the keys of a request's
devices."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from targets.worker_protocol import WorkerRequest
from targets.machine_lease import LOCK_DIR_ENV, LeaseTimeout, _path, device_keys, holders, machine_lease

HOLDER = """
import sys
from targets.machine_lease import LeaseTimeout, machine_lease
try:
    with machine_lease(sys.argv[1], exclusive=sys.argv[2] == "exclusive", timeout_s=float(sys.argv[3])):
        print("held", flush=True)
        sys.stdin.read()
except LeaseTimeout:
    print("timed out", flush=True)
"""


@pytest.fixture(autouse=True)
def lock_dir(tmp_path, monkeypatch) -> Path:
    """Locks of their own, apart from any real measurement's."""
    monkeypatch.setenv(LOCK_DIR_ENV, str(tmp_path))
    return tmp_path


def holder(mode: str, timeout_s: float = 30.0, key: str = "cpu") -> tuple[subprocess.Popen, str]:
    """Another process asking for the lock: it is returned with its first line ("held" or "timed out"); it
    holds the lock until its input closes."""
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, key, mode, str(timeout_s)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, cwd=Path.cwd(), env=os.environ.copy())
    return proc, proc.stdout.readline().strip()


def let_go(proc: subprocess.Popen) -> None:
    proc.stdin.close()
    proc.wait(30)


def until(condition, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "the condition never came"
        time.sleep(0.02)


def test_shared_holders_share_and_an_exclusive_one_waits_for_them():
    other, said = holder("shared")
    assert said == "held"
    with machine_lease("cpu", timeout_s=5) as lease:  # shared beside shared
        assert lease.keys == ["cpu"]
    with pytest.raises(LeaseTimeout, match=f"cpu measurement lock was still taken .* held by {other.pid} "):
        with machine_lease("cpu", exclusive=True, timeout_s=0.2):
            pass
    let_go(other)
    with machine_lease("cpu", exclusive=True, timeout_s=5) as lease:
        assert lease.waited_s >= 0


def test_an_exclusive_holder_keeps_everyone_else_out_until_it_dies():
    """Killed with SIGKILL, it lets go: the kernel drops a dead process's flock."""
    other, said = holder("exclusive")
    assert said == "held"
    for exclusive in (False, True):
        with pytest.raises(LeaseTimeout):
            with machine_lease("cpu", exclusive=exclusive, timeout_s=0.2):
                pass
    with machine_lease("cuda:0", exclusive=True, timeout_s=5):  # another device's lock is another lock
        pass
    os.kill(other.pid, signal.SIGKILL)
    other.wait(30)
    with machine_lease("cpu", exclusive=True, timeout_s=5):
        pass


def test_a_waiting_exclusive_holder_is_not_starved_by_new_shared_ones(lock_dir):
    first, said = holder("shared")
    assert said == "held"
    got = threading.Event()

    def exclusive() -> None:
        with machine_lease("cpu", exclusive=True, timeout_s=60):
            got.set()
    waiter = threading.Thread(target=exclusive)
    waiter.start()
    until(lambda: holders(_path("cpu", "turnstile")))  # it waits at the turnstile's far side
    late, said = holder("shared", timeout_s=0.5)  # the lock itself is only shared: without the turnstile, it'd get in
    assert said == "timed out" and not got.is_set()
    let_go(late)
    let_go(first)
    waiter.join(60)
    assert got.is_set()


def test_a_thread_holding_a_key_holds_it_again_for_free():
    with machine_lease("cpu", exclusive=True, timeout_s=1):
        with machine_lease("cpu", timeout_s=0.2) as inner:
            assert inner.waited_s < 0.2
    with machine_lease("cpu", timeout_s=1):
        with pytest.raises(RuntimeError, match="cannot make it exclusive"):
            with machine_lease("cpu", exclusive=True, timeout_s=0.2):
                pass
    with machine_lease("cpu", exclusive=True, timeout_s=1):  # and every lease let go on the way out
        pass


def test_a_lease_turns_exclusive_once_the_others_let_go():
    other, said = holder("shared")
    assert said == "held"
    with machine_lease("cpu", timeout_s=5) as lease:
        with pytest.raises(LeaseTimeout):
            lease.timeout_s = 0.2
            lease.convert(exclusive=True)
        let_go(other)
        lease.timeout_s = 5
        lease.convert(exclusive=True)
        other, said = holder("shared", timeout_s=0.2)
        assert said == "timed out"
        let_go(other)


def test_device_keys_name_physical_devices(monkeypatch):
    cpu = WorkerRequest(target="t", size="tiny", mode="bench")
    assert device_keys(cpu, cpu) == ["cpu"]
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    gpu = cpu.model_copy(update={"device": "cuda"})
    assert device_keys(gpu) == ["cuda:0"] and device_keys(gpu.model_copy(update={"device": "cuda:1"})) == ["cuda:1"]
    assert device_keys(gpu.model_copy(update={"ranks": 2}), cpu) == ["cpu", "cuda:0", "cuda:1"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6")
    assert device_keys(gpu) == ["cuda:4"] and device_keys(gpu.model_copy(update={"gpus": [2]})) == ["cuda:6"]
