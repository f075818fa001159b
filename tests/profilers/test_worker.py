"""The profiling worker through its client (a subprocess): a full ProfileResult for the tiny
reference trainer, a structured failure for a bad config, a crash or a hang; and, in process, the
failure kinds the worker maps workload errors to."""

from pathlib import Path

import pytest
import torch

from profilers.client import run_profile
from profilers.records import ProfileRequest, ProfileResult
from profilers.worker import execute, failure_of
from targets.protocol import ConfigError
from targets.worker import NonFiniteLoss

FAULTY = "tests.fixtures.faulty_target:target"


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """A cache folder of the module's own, one for all its workers: their environments are then the same, so they
    share one fork server (each new environment starts another, seconds of torch imports)."""
    return {"XDG_CACHE_HOME": str(tmp_path_factory.mktemp("cache"))}


@pytest.mark.slow
def test_tiny_reference_trainer_is_profiled_end_to_end(env, tmp_path):
    cache = Path(env["XDG_CACHE_HOME"]) / "sg-opt"
    assert not cache.exists()  # made by this run's ceilings, below
    trace = tmp_path / "trace.json"
    req = ProfileRequest(target="haste-rec", size="tiny", threads=1, warmup=2, profile_steps=5, fine=True,
                         fine_repeats=3, quick_ceilings=True, trace=str(trace))
    result = run_profile(req, timeout_s=300, env=env)
    assert isinstance(result, ProfileResult) and result.ok, result.failure
    assert result.coarse.steps == 5 and result.coarse.attributed_share > 0.5 and trace.stat().st_size > 0
    assert [s.slot for s in result.fine.slots] == ["tail_forward", "tail_backward_weight", "tail_backward_input"]
    assert result.fine.ceilings.quick and cache.is_dir()
    gains = [f.amdahl_gain for f in result.findings]
    assert gains and gains == sorted(gains, reverse=True)
    assert result.config["precision"] == "fp32" and result.counters["steps"] == 2 + 5 + 1 + 5 + 5
    assert result.environment.threads == 1


def test_bad_config_is_a_structured_failure(env):
    result = run_profile(ProfileRequest(target="haste-rec", size="tiny", config={"precision": "fp64"}), env=env)
    assert not result.ok and result.failure.kind == "config" and "precision" in result.failure.message
    assert result.coarse is None and result.findings == []


def test_a_crash_is_a_structured_failure(env):
    req = ProfileRequest(target=FAULTY, size="tiny", config={"behaviour": "crash"}, warmup=0, profile_steps=3)
    result = run_profile(req, timeout_s=60, env=env)
    assert not result.ok and result.failure.kind == "crash" and "SIGABRT" in result.failure.message


@pytest.mark.slow
def test_a_hang_is_killed(env):
    req = ProfileRequest(target=FAULTY, size="tiny", config={"behaviour": "hang"}, warmup=0, profile_steps=3)
    result = run_profile(req, timeout_s=2, env=env)
    assert not result.ok and result.failure.kind == "timeout"


def test_nan_loss_in_the_profiled_steps_fails_as_nan():
    threads = torch.get_num_threads()
    result = execute(ProfileRequest(target=FAULTY, size="tiny", config={"behaviour": "nan"}, warmup=0,
                                    profile_steps=3, threads=threads))
    assert not result.ok and result.failure.kind == "nan" and "profiled step" in result.failure.message


def test_a_target_without_known_slot_shapes_skips_the_fine_profile(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    result = execute(ProfileRequest(target=FAULTY, size="tiny", warmup=1, profile_steps=3, fine=True,
                                    threads=torch.get_num_threads()))
    assert result.ok and result.fine is None and "slot shapes" in result.notes[0]
    assert set(result.coarse.phases) == {"step"} and result.coarse.attributed_share > 0


@pytest.mark.parametrize("exc,kind", [(ConfigError("bad"), "config"), (NonFiniteLoss("loss is nan"), "nan"),
                                      (torch.OutOfMemoryError("CUDA out of memory"), "oom"),
                                      (RuntimeError("boom"), "exception")])
def test_failure_kinds(exc, kind):
    failure = failure_of(exc)
    assert failure.kind == kind and failure.message
