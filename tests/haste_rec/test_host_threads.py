"""The host_threads knob: it lowers the trainer's intra-op threads from the worker's count, never raises them,
and leaves a numerics run's single thread single."""

from __future__ import annotations

import pytest
import torch

from targets.haste_rec.host_threads import HOST_THREADS, threads_for
from targets.haste_rec.knobs import KNOB_SPACE
from targets.haste_rec.target import build
from targets.worker import make_deterministic


@pytest.fixture
def threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_the_settings_divide_the_workers_count_and_never_reach_zero():
    assert [threads_for(s, 16) for s in HOST_THREADS] == [16, 8, 4]
    assert [threads_for(s, 1) for s in HOST_THREADS] == [1, 1, 1]
    with pytest.raises(ValueError, match="unknown host_threads 'all'"):
        threads_for("all", 16)


def test_a_session_built_with_half_the_threads_runs_on_half(threads):
    torch.set_num_threads(4)
    build(KNOB_SPACE.resolve({"host_threads": "half"}), "tiny", {}, "cpu", 0)
    assert torch.get_num_threads() == 2
    torch.set_num_threads(4)
    build(KNOB_SPACE.resolve({}), "tiny", {}, "cpu", 0)
    assert torch.get_num_threads() == 4  # auto keeps the worker's count


def test_a_numerics_run_keeps_its_single_thread(threads):
    torch.set_num_threads(4)
    make_deterministic(torch.device("cpu"))
    build(KNOB_SPACE.resolve({"host_threads": "quarter"}), "tiny", {}, "cpu", 0)
    assert torch.get_num_threads() == 1
