"""A command killed by SIGKILL takes its workers with it: it cannot unwind, so its fork server and the workers
the server forked must notice on their own (PR_SET_PDEATHSIG, the server watching its parent)."""

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from targets.fork_server import SWITCH
from targets.worker_client import kill_tree
from tests.fixtures.fork_server_up import FAULTY
from tests.fixtures.orphans import survivors
from tests.test_cli import _processes_once_the_worker_waits

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow  # each starts sg-opt bench in a fresh interpreter and waits for its worker


SERVERS = ["1", "0"]  # a worker forked by the fork server, or a plain subprocess


@pytest.fixture(scope="module")
def hung_benches():
    """Both commands, started at once: each spends seconds importing torch (its fork server more) before its worker
    hangs, and two cores start them side by side. Each test kills its own; what a failed test left is killed here."""
    procs = {server: subprocess.Popen([sys.executable, "-m", "sg_opt.cli", "bench", "--target", FAULTY, "--size",
                                       "tiny", "--set", "behaviour=hang", "--timeout", "300"], cwd=ROOT,
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
                                      env={**os.environ, SWITCH: server})
             for server in SERVERS}
    try:
        yield procs
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                kill_tree(proc.pid)
                proc.kill()
                proc.wait()


@pytest.mark.parametrize("server", SERVERS)
def test_bench_killed_with_a_hung_worker_leaves_no_process_behind(server, hung_benches):
    proc = hung_benches[server]
    below = _processes_once_the_worker_waits(proc.pid)
    assert len(below) >= (2 if server == "1" else 1), "the hung worker never started"
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=10)
    assert survivors(below) == []
