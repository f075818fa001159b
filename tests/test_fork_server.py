"""Workers forked from the fork server behave as `python -m` children would, only sooner."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from targets.fork_server import ForkedProcess, start_python
from targets.worker_client import kill_tree, scrubbed_env

PROJECT = ("targets", "sg_opt", "validators", "state_machine", "profilers")

REPORTER = textwrap.dedent("""
    import json, os, random, sys
    import numpy
    line = sys.stdin.readline().strip()
    print(json.dumps({
        "line": line, "argv": sys.argv[1:], "cwd": os.getcwd(), "path": sys.path[:2],
        "x": os.environ.get("CUDA_VISIBLE_DEVICES"), "cpus": sorted(os.sched_getaffinity(0)),
        "own_session": os.getsid(0) == os.getpid(), "name": __name__, "ppid": os.getppid(),
        "project_modules": sorted(m for m in sys.modules if m.split(".")[0] in %r),
        "draws": [random.random(), float(numpy.random.random())]}))
    sys.stdout.flush()
    print("a line for stderr", file=sys.stderr)
    how = sys.argv[1]
    if how == "raise":
        raise RuntimeError("raised on purpose")
    if how == "signal":
        os.kill(os.getpid(), 9)
    if how == "sleep":
        import time
        time.sleep(60)
    sys.exit(int(how))
""" % (PROJECT,))


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    (tmp_path / "reporter_mod.py").write_text(REPORTER)
    return tmp_path


def worker_env(tree: Path, server: str = "1", extra: dict | None = None) -> dict[str, str]:
    """The environment of every other test's workers (the server on, as by default), so that they share the server
    already up (each new environment starts another, seconds of torch imports); and a variable to see that is the
    worker's own, CUDA_VISIBLE_DEVICES (the server is not started again for it, so a forked child has it from its
    request alone)."""
    env = scrubbed_env({"CUDA_VISIBLE_DEVICES": "7", **(extra or {})}, root=str(tree))
    env.pop("SG_OPT_FORK_SERVER", None)
    return env if server == "1" else {**env, "SG_OPT_FORK_SERVER": server}


def run(tree: Path, how: str, server: str = "1", cpus=None, extra: dict | None = None):
    env = worker_env(tree, server, extra)
    err = open(tree / f"stderr-{how}-{server}", "w+b")
    proc = start_python("reporter_mod", [how, "second"], env, cwd=str(tree), stdin=subprocess.PIPE,
                        stdout=subprocess.PIPE, stderr=err, cpus=cpus)
    proc.stdin.write("a line for stdin\n")
    proc.stdin.flush()
    report = json.loads(proc.stdout.readline())
    return proc, report, err


def stderr_of(err) -> str:
    err.flush()
    err.seek(0)
    return err.read().decode()


def test_a_forked_worker_sees_what_a_fresh_interpreter_would(tree):
    forked, seen, err = run(tree, "3")
    plain, expected, _ = run(tree, "3", server="0")
    assert isinstance(forked, ForkedProcess) and isinstance(plain, subprocess.Popen)
    assert forked.wait(30) == plain.wait(30) == 3
    for key in ("line", "argv", "cwd", "path", "x", "cpus", "own_session", "name", "project_modules"):
        assert seen[key] == expected[key], key
    assert seen["path"][0] == str(tree) and seen["project_modules"] == [] and seen["x"] == "7"
    assert seen["draws"] != expected["draws"]
    assert "a line for stderr" in stderr_of(err)


def test_every_forked_worker_draws_its_own_random_numbers(tree):
    draws = []
    for _ in range(2):
        proc, seen, _ = run(tree, "0")
        proc.wait(30)
        draws.append(seen["draws"])
    assert draws[0][0] != draws[1][0] and draws[0][1] != draws[1][1]


def test_a_worker_is_pinned_to_the_cpus_it_is_given(tree):
    one = sorted(os.sched_getaffinity(0))[-1:]
    proc, seen, _ = run(tree, "0", cpus=one)
    assert proc.wait(30) == 0 and seen["cpus"] == one


def test_crashes_signals_and_hangs_end_as_they_would_in_a_subprocess(tree):
    proc, _, err = run(tree, "raise")
    assert proc.wait(30) == 1 and "RuntimeError: raised on purpose" in stderr_of(err)
    proc, _, _ = run(tree, "signal")
    assert proc.wait(30) == -signal.SIGKILL
    proc, _, _ = run(tree, "sleep")
    with pytest.raises(subprocess.TimeoutExpired):
        proc.wait(0.3)
    assert proc.poll() is None
    kill_tree(proc.pid)
    assert proc.wait(30) == -signal.SIGKILL


def test_a_worker_killed_as_soon_as_it_started_is_killed(tree):
    """The pid comes back once the child leads its own session, so killing its process group reaches it even
    before it has run a line of its own (kill_tree right after start)."""
    for _ in range(5):
        proc = start_python("reporter_mod", ["sleep"], worker_env(tree), cwd=str(tree), stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE)
        assert isinstance(proc, ForkedProcess)
        assert os.getsid(proc.pid) == proc.pid
        kill_tree(proc.pid)
        assert proc.wait(10) == -signal.SIGKILL


@pytest.mark.slow
def test_the_server_is_started_again_when_the_environment_changes(tree):
    first = run(tree, "0")  # the environment of every other test's workers: their server, where one is up
    again = run(tree, "0", extra={"PYTEST_CURRENT_TEST": "another test"})
    changed = run(tree, "0", extra={"SG_OPT_TEST_Y": "2"})
    for proc, _, _ in (first, again, changed):
        assert proc.wait(30) == 0
    assert first[1]["ppid"] == again[1]["ppid"] != changed[1]["ppid"]
    assert first[1]["ppid"] != os.getpid()


def test_under_a_launcher_workers_start_as_subprocesses(tree):
    env = scrubbed_env({"SG_OPT_TEST_X": "seen"}, root=str(tree))
    proc = start_python("reporter_mod", ["0"], env, cwd=str(tree), launcher=["-X", "utf8"])
    assert isinstance(proc, subprocess.Popen) and proc.wait(30) == 0
    assert proc.args[:4] == [sys.executable, "-X", "utf8", "-m"]


FAKE_DRIVER = "int cuDeviceGetCount(int *count) { *count = 1; return ANSWER; }\n"
ASK = ("import ctypes, sys; from targets.fork_server import _cuda_initialised; before = _cuda_initialised(); "
       "ctypes.CDLL(sys.argv[1]); print(before, _cuda_initialised())")


@pytest.mark.parametrize("answer, initialised", [(3, False), (0, True), (None, True)])
def test_the_server_asks_the_mapped_driver_whether_cuinit_ran(tmp_path, answer, initialised):
    """A driver mapped but not initialised (torch's CUDA build maps it at import) is no reason to refuse: only
    cuDeviceGetCount's CUDA_ERROR_NOT_INITIALIZED (3) says cuInit has not run. A stand-in libcuda.so.1 gives
    each answer; one without the function cannot be asked and counts as initialised."""
    source = tmp_path / "driver.c"
    source.write_text(FAKE_DRIVER if answer is not None else "int cuSomethingElse(void) { return 0; }\n")
    lib = tmp_path / "lib" / "libcuda.so.1"
    lib.parent.mkdir()
    flags = [f"-DANSWER={answer}"] if answer is not None else []
    subprocess.run(["cc", "-shared", "-fPIC", *flags, "-o", str(lib), str(source)], check=True)
    out = subprocess.run([sys.executable, "-c", ASK, str(lib)], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parents[1], env=scrubbed_env({}))
    assert out.stdout.split() == ["False", str(initialised)]


@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA device")
def test_a_forked_worker_gets_the_gpu_it_is_given(tmp_path):
    """The server never initialises CUDA, so a forked child can; it sees only its CUDA_VISIBLE_DEVICES."""
    (tmp_path / "cuda_mod.py").write_text(
        "import torch\nx = torch.ones(1024, device='cuda')\n"
        "print(int(x.sum()), torch.cuda.device_count(), flush=True)\n")
    env = scrubbed_env({"CUDA_VISIBLE_DEVICES": "0"}, root=str(tmp_path))
    proc = start_python("cuda_mod", [], env, cwd=str(tmp_path), stdout=subprocess.PIPE)
    assert isinstance(proc, ForkedProcess), "the server refused to serve (did its imports load the CUDA driver?)"
    assert proc.stdout.readline().split() == ["1024", "1"] and proc.wait(60) == 0


FAULTER = textwrap.dedent("""
    import ctypes, json, resource
    libc = ctypes.CDLL(None)
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]
    def churn(times):
        for _ in range(times):
            block = libc.malloc(1 << 20)
            ctypes.memset(block, 1, 1 << 20)
            libc.free(block)
    churn(10)  # glibc's moving thresholds rise here: later blocks come from the heap, whose pages stay
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    churn(10)
    print(json.dumps({"faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before}))
""")


@pytest.mark.parametrize("server", ["1", "0"])
def test_every_worker_maps_a_large_block_anew_whatever_it_freed_before(tmp_path, server):
    """Fixed allocator thresholds, forked or not: 10 blocks of 1 MiB fault 256 pages each, every time. Left to
    glibc, the same loop faults hardly at all once its threshold has risen past them (what depends on a
    process's history, and what set identical workers apart by 6%)."""
    (tmp_path / "faulter_mod.py").write_text(FAULTER)

    def faults(extra=None, how=server):
        proc = start_python("faulter_mod", [], worker_env(tmp_path, how, extra), cwd=str(tmp_path),
                            stdout=subprocess.PIPE)
        seen = json.loads(proc.stdout.readline())
        assert proc.wait(30) == 0
        return seen["faults"]
    assert faults() >= 0.9 * 10 * 256
    if server == "0":  # a new environment would start another server (seconds of imports), so plain only
        assert faults({"SG_OPT_STATIC_MALLOC": "0"}) < 256
