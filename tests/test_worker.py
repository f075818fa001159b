"""The worker returns a structured result for every way a workload can fail, and runs the
reference trainer end to end in a subprocess."""

import pytest

from targets.worker_client import run_worker, scrubbed_env
from targets.worker_protocol import WorkerRequest

FAULTY = "tests.fixtures.faulty_target:target"


def _run(behaviour: str, timeout: float = 60.0, mode: str = "bench", env=None):
    req = WorkerRequest(target=FAULTY, size="tiny", mode=mode, config={"behaviour": behaviour}, steps=5, warmup=1,
                        phase_steps=1)
    return run_worker(req, timeout_s=timeout, env=env)


def test_ok_bench_returns_step_times():
    result = _run("ok")
    assert result.ok, result.failure
    assert len(result.bench.step_s) == 5 and all(t > 0 for t in result.bench.step_s)
    assert result.bench.phase_s["step"] > 0
    assert result.memory["host_rss"] > 1 << 20  # its footprint, for the agent's fit of spare timing workers


@pytest.mark.parametrize("behaviour,kind,words", [
    ("crash", "crash", "SIGABRT"),
    ("exit", "crash", "code 3"),
    ("raise", "exception", "raised on purpose"),
    ("oom", "oom", "out of memory"),
    ("nan", "nan", "nan"),
])
def test_failures_are_structured(behaviour, kind, words):
    result = _run(behaviour)
    assert not result.ok
    assert result.failure.kind == kind
    assert words in result.failure.message


@pytest.mark.slow
def test_hang_is_killed_and_reported_with_where_it_waited():
    result = _run("hang", timeout=4.0)  # timed from its fork: a sound worker of this request ends within 0.4 s
    assert not result.ok and result.failure.kind == "timeout"
    assert "most recent call first" in result.failure.detail and "in _misbehave" in result.failure.detail


def test_bad_config_is_a_config_failure():
    req = WorkerRequest(target=FAULTY, size="tiny", mode="bench", config={"behaviour": "explode"})
    result = run_worker(req, timeout_s=60)
    assert result.failure.kind == "config" and "behaviour" in result.failure.message


def test_unknown_target_is_a_config_failure():
    req = WorkerRequest(target="no-such-target", size="tiny", mode="bench")
    result = run_worker(req, timeout_s=60)
    assert result.failure.kind == "config" and "unknown target" in result.failure.message


def test_worker_environment_has_no_secrets_and_no_compile_pool(monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", "sk-test-not-real")
    monkeypatch.setenv("MY_SERVICE_TOKEN", "tok")
    monkeypatch.setenv("TORCHINDUCTOR_COMPILE_THREADS", "16")  # the caller's, which workers must not inherit
    env = scrubbed_env()
    assert "OPENAI_API_KEY" not in env and "MY_SERVICE_TOKEN" not in env and "PATH" in env
    result = _run("env")
    assert result.ok, result.failure


def test_numerics_mode_of_the_reference_trainer_is_deterministic():
    req = WorkerRequest(target="haste-rec", size="tiny", mode="numerics", steps=4, threads=1)
    first, second = run_worker(req, timeout_s=300), run_worker(req, timeout_s=300)
    assert first.ok, first.failure
    assert first.numerics.losses == second.numerics.losses
    assert first.numerics.digest["sha256"] == second.numerics.digest["sha256"]
    assert all(set(norms) == {"encoder", "head", "tail", "embeddings"} for norms in first.numerics.grad_norms)
    assert all(norms["tail"] > 0 for norms in first.numerics.grad_norms)  # step 1 included
    # where a worker's time goes: the build within its own wall time, within the process's as the parent saw it
    assert 0 < first.build_s < first.wall_s < first.process_s
    stages = first.numerics.stage_s  # and the rest: the steps, the probe and the digest, each within the wall time
    assert set(stages) == {"steps", "probe", "digest"} and first.build_s + sum(stages.values()) < first.wall_s


def test_quality_mode_of_the_reference_trainer():
    req = WorkerRequest(target="haste-rec", size="tiny", mode="quality", steps=3, threads=1)
    result = run_worker(req, timeout_s=300)
    assert result.ok, result.failure
    assert 0.0 <= result.quality.metrics["P@1"] <= 1.0


def test_default_threads_cap_a_gpu_workers_host_threads_only():
    from targets.worker import CUDA_HOST_THREADS, default_threads
    assert default_threads("cpu", 64) == 64  # the math runs on the CPU: every core
    assert default_threads("cuda", 64) == CUDA_HOST_THREADS
    assert default_threads("cuda", 8) == 8
    assert default_threads("cuda", 0) == 1


def test_a_cpu_worker_without_a_thread_count_keeps_torchs_default():
    # OMP_NUM_THREADS sets torch's default below this machine's CPU count, so a worker that picked its own
    # count (one per CPU) would report more
    result = _run("ok", env={**scrubbed_env(), "OMP_NUM_THREADS": "1"})
    assert result.ok, result.failure
    assert result.environment.threads == 1


class _CountingSession:
    """Just enough of a Session to see when run_numerics nudges it."""

    record_grad_norms = False

    def __init__(self):
        self.events: list[tuple] = []

    def perturb(self, relative: float, seed: int) -> None:
        self.events.append(("perturb", relative, seed))

    def step(self) -> float:
        self.events.append(("step",))
        return 1.0

    def grad_norms(self) -> dict:
        return {"all": 1.0}

    def probe(self) -> dict:
        return {"out": [1.0]}

    def param_digest(self) -> dict:
        return {"sha256": "x"}

    def counters(self) -> dict:
        return {}


@pytest.mark.parametrize("reassociate", [False, True])
def test_a_reassociated_numerics_run_is_nudged_by_a_rounding_before_every_step(reassociate):
    from targets.worker import FP32_UNIT_ROUNDOFF, run_numerics
    session = _CountingSession()
    run_numerics(session, WorkerRequest(target="haste-rec", size="tiny", mode="numerics", steps=3, seed=5,
                                        reassociate=reassociate))
    if reassociate:
        assert session.events == [e for s in range(3) for e in (("perturb", FP32_UNIT_ROUNDOFF, 6 + s), ("step",))]
    else:
        assert session.events == [("step",)] * 3
