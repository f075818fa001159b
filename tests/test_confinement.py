"""Workers that run candidate code are confined: read-only outside their own folders, no network; where the
platform cannot confine, the record says why and the run goes on."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from targets.confinement import Confinement, _read_only_flags, mounts, worker_folders
from targets.worker_client import run_worker, scrubbed_env
from targets.worker_protocol import WorkerRequest
from validators.kernel_worker import run_kernel_check

PROJECT = Path(__file__).resolve().parents[1]
TINY = dict(target="haste-rec", size="tiny", mode="bench", device="cpu", steps=3, warmup=1, phase_steps=1)

# Runs in a fresh interpreter (single-threaded: no torch), confines it with argv[1] writable, then tries what a
# candidate might: write inside and outside, connect out.
PROBE = textwrap.dedent("""
    import json, os, socket, sys, threading
    from targets.confinement import confine, confine_worker
    if sys.argv[3] == "thread":
        threading.Thread(target=threading.Event().wait, daemon=True).start()
    if sys.argv[3] == "worker":
        record = confine_worker(["--request", os.path.join(sys.argv[1], "request.json")])
    else:
        record = confine([sys.argv[1]])
    seen = {"record": record.model_dump(), "tmpdir": os.environ.get("TMPDIR")}
    for name, path in (("inside", os.path.join(sys.argv[1], "inside.txt")), ("outside", sys.argv[2]),
                       ("project", os.path.join(os.getcwd(), "sg_opt_confinement_probe.txt"))):
        try:
            with open(path, "w") as f:
                f.write("x")
            seen[name] = "written"
            if name == "project":
                os.unlink(path)
        except OSError as exc:
            seen[name] = exc.errno
    try:  # /proc stays as mounted: the CUDA driver writes there at its start
        with open("/proc/self/comm", "w") as f:
            f.write("confined-probe")
        seen["proc"] = "written"
    except OSError as exc:
        seen["proc"] = exc.errno
    listener = socket.socket()
    try:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        socket.create_connection(listener.getsockname(), timeout=2).close()
        seen["loopback"] = "connected"
    except OSError as exc:
        seen["loopback"] = exc.errno
    print(json.dumps(seen))
""")


def probe(tmp_path: Path, how: str = "confine", env: dict[str, str] | None = None) -> dict:
    writable = tmp_path / "writable"
    writable.mkdir(exist_ok=True)
    done = subprocess.run([sys.executable, "-c", PROBE, str(writable), str(tmp_path / "outside.txt"), how],
                          cwd=PROJECT, env=scrubbed_env(env, root=str(PROJECT)), capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


@pytest.fixture(scope="module")
def confinable(tmp_path_factory) -> dict:
    """What the plain probe saw; the tests that need a platform that confines skip where this one cannot."""
    return probe(tmp_path_factory.mktemp("probe"))


def needs_confinement(seen: dict) -> None:
    if not seen["record"]["confined"]:
        pytest.skip(f"this platform cannot confine: {seen['record']['why_not']}")


def test_outside_the_writable_folder_the_file_system_is_read_only_and_there_is_no_network(confinable):
    needs_confinement(confinable)
    record = Confinement.model_validate(confinable["record"])
    assert record.read_only and record.network, record.why_not
    assert record.sentence() == "candidates ran confined: read-only file system, no network"
    assert confinable["inside"] == "written"
    assert confinable["outside"] == 30 and confinable["project"] == 30  # EROFS: /tmp elsewhere, the project
    assert confinable["loopback"] == 101  # ENETUNREACH: not even loopback
    assert confinable["proc"] == "written"  # a read-only /proc fails cuInit (CUDA_ERROR_OPERATING_SYSTEM)


def test_switched_off_nothing_is_confined(tmp_path):
    seen = probe(tmp_path, env={"SG_OPT_CONFINE": "0"})
    assert not seen["record"]["confined"] and "SG_OPT_CONFINE=0" in seen["record"]["why_not"]
    assert seen["outside"] == "written" and seen["loopback"] == "connected"


def test_a_process_that_runs_threads_cannot_confine_and_says_why(tmp_path):
    seen = probe(tmp_path, how="thread")
    assert not seen["record"]["confined"] and "threads" in seen["record"]["why_not"]
    assert seen["outside"] == "written"
    assert "unconfined" in Confinement.model_validate(seen["record"]).sentence()


def test_a_rank_keeps_loopback_and_its_temp_folder_moves_into_its_own(tmp_path, confinable):
    needs_confinement(confinable)
    seen = probe(tmp_path, how="worker", env={"WORLD_SIZE": "2"})
    record = seen["record"]
    assert record["read_only"] and not record["network"] and record["why_not"] == "ranks talk over loopback"
    assert seen["loopback"] == "connected" and seen["outside"] == 30
    assert seen["tmpdir"] == str((tmp_path / "writable").resolve())
    assert "/dev/shm" in record["writable"]


def test_a_worker_writes_its_own_folder_and_a_profile_trace_folder(tmp_path):
    request = tmp_path / "job" / "request.json"
    request.parent.mkdir()
    request.write_text(json.dumps({"trace": str(tmp_path / "traces" / "trace.json")}))
    assert worker_folders(["--request", str(request), f"--result={tmp_path / 'job' / 'result.json'}"]) == [
        str(tmp_path / "job"), str(tmp_path / "traces")]
    assert worker_folders(["--steps", "3"]) == []


def test_a_remount_repeats_the_flags_the_kernel_locks():
    flags = _read_only_flags({"rw", "nosuid", "nodev", "relatime"})
    assert flags & 1 and flags & 2 and flags & 4 and flags & (1 << 21) and not flags & (1 << 24)
    assert _read_only_flags({"rw"}) & (1 << 24)  # strictatime, which mountinfo leaves unsaid
    assert any(point == "/" for point, _ in mounts())


def test_a_kernel_check_candidate_cannot_write_or_connect(tmp_path, confinable):
    needs_confinement(confinable)
    escaped = tmp_path / "escaped.txt"
    source = textwrap.dedent(f"""
        import socket

        def tail_forward(h, idx, w, bias):
            try:
                socket.create_connection(("127.0.0.1", 9), timeout=1)
                reached = "connected"
            except OSError as exc:
                reached = exc.strerror
            try:
                with open({str(escaped)!r}, "w") as f:
                    f.write(reached)
                wrote = "written"
            except OSError as exc:
                wrote = exc.strerror
            raise RuntimeError(f"{{reached}}; {{wrote}}")
    """)
    verdict = run_kernel_check("haste-rec", "tail_forward", source, "cpu", "float32", 120.0, seed=1)
    assert not verdict.ok and verdict.check == "exception"
    assert "Network is unreachable; Read-only file system" in verdict.reason, verdict.reason
    assert not escaped.exists()


def test_the_tiny_trainer_runs_confined_and_a_candidate_that_writes_at_import_fails(tmp_path, confinable):
    needs_confinement(confinable)
    result = run_worker(WorkerRequest(**TINY, config={"data_workers": 1}), timeout_s=300)
    assert result.ok, result.failure
    assert result.confinement.read_only and result.confinement.network, result.confinement
    kernels = tmp_path / "kernels"
    kernels.mkdir()
    escaped = tmp_path / "escaped.txt"
    (kernels / "tail_forward.py").write_text(f"open({str(escaped)!r}, 'w').write('x')\n"
                                             "def tail_forward(h, idx, w, bias):\n    raise AssertionError\n")
    writer = run_worker(WorkerRequest(**TINY, config={"tail_backend": "slots"}, kernels_dir=str(kernels)),
                        timeout_s=300)
    assert not writer.ok and "Read-only file system" in writer.failure.message, writer.failure
    assert not escaped.exists()


@pytest.mark.slow
def test_a_worker_started_without_the_fork_server_starts_again_confined(confinable):
    """A fresh interpreter runs torch's threads once it imported torch; the worker then starts again as
    ``python -m targets.confinement targets.worker ...``, which confines before the imports."""
    needs_confinement(confinable)
    req = WorkerRequest(target="tests.fixtures.faulty_target:target", size="tiny", mode="bench",
                        config={"behaviour": "ok"}, steps=2, warmup=0, phase_steps=1)
    result = run_worker(req, timeout_s=300, env={"SG_OPT_FORK_SERVER": "0"})
    assert result.ok, result.failure
    assert result.confinement.read_only and result.confinement.network, result.confinement
