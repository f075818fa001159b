"""The dense part of the fused-loss step as CUDA graphs (knob dense_cuda_graph): where it applies, the one
sentence where it does not, and, on a GPU, training along the eager step's trajectory across a rewire."""

from __future__ import annotations

import inspect

import pytest
import torch

from targets.haste_rec.dense_graph import check_dense_graph
from targets.haste_rec.knobs import KNOB_SPACE
from targets.haste_rec.target import build
from targets.protocol import ConfigError
from tests.haste_rec.tail.test_triton_tail import GPU_ONLY
from tests.haste_rec.test_trainer import one_thread  # noqa: F401 (autouse fixture: bitwise-repeatable sums)

FUSED = {"tail_backend": "triton-fused-loss"}


def test_the_knob_is_in_effect_only_where_it_can_capture():
    knob = KNOB_SPACE["dense_cuda_graph"]
    assert knob.category == "compile" and knob.numerics == "reorder" and knob.default is False
    assert knob.is_active(KNOB_SPACE.resolve(FUSED))
    for off in ({}, {**FUSED, "precision": "bf16-autocast"}, {**FUSED, "compile_encoder": True}):
        assert not knob.is_active(KNOB_SPACE.resolve(off)), off


@pytest.mark.parametrize("config, device, words", [
    (FUSED, "cpu", "dense_cuda_graph needs a CUDA device"),
    ({"tail_backend": "triton"}, "cuda", "dense_cuda_graph needs tail_backend triton-fused-loss"),
    ({**FUSED, "precision": "bf16-autocast"}, "cuda", "cannot capture bf16 autocast or a compiled encoder"),
    ({**FUSED, "compile_encoder": True}, "cuda", "cannot capture bf16 autocast or a compiled encoder"),
])
def test_where_it_cannot_capture_it_says_so_in_one_sentence(config, device, words):
    with pytest.raises(ConfigError, match=words):
        check_dense_graph(KNOB_SPACE.resolve({**config, "dense_cuda_graph": True}), torch.device(device))


def test_a_cpu_session_refuses_it_before_starting_its_loader(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(ConfigError, match="needs a CUDA device"):
        build(KNOB_SPACE.resolve({**FUSED, "dense_cuda_graph": True, "data_workers": 2}), "tiny", {}, "cpu", 0)


def _trajectory(graphed: bool, steps: int, data: dict) -> tuple[list[float], list[torch.Tensor], object]:
    config = KNOB_SPACE.resolve({**FUSED, **data, "dense_cuda_graph": graphed, "rewire_every": 3})
    session = build(config, "tiny", {}, "cuda", 0)
    losses = [float(session.step()) for _ in range(steps)]
    params = [p.detach().clone() for p in (*session.model.encoder.parameters(),
                                           *session.model.output.head_parameters(),
                                           *session.model.output.tail_parameters())]
    return losses, params, session


@GPU_ONLY
@pytest.mark.parametrize("data", [{}, {"data_workers": 2, "pin_memory": True, "prefetch_to_device": True}],
                         ids=["in-process", "pinned-workers"])  # the pin-memory thread runs during the captures
def test_graphs_train_along_the_eager_trajectory_across_a_rewire(data):
    eager_losses, eager_params, _ = _trajectory(False, 8, data)
    losses, params, session = _trajectory(True, 8, data)
    assert session.dense_graphs.captures == 3  # at the first step, then after the rewires at steps 3 and 6
    assert losses == pytest.approx(eager_losses, rel=1e-5, abs=1e-6)
    for got, want in zip(params, eager_params):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert losses[-1] != losses[0]  # it trained


@GPU_ONLY
def test_a_replayed_step_launches_fewer_kernels():
    from torch.profiler import ProfilerActivity, profile

    def launches(graphed: bool) -> tuple[int, int]:
        """(kernel launch calls, graph launch calls) of one step after three."""
        session = build(KNOB_SPACE.resolve({**FUSED, "dense_cuda_graph": graphed}), "tiny", {}, "cuda", 0)
        for _ in range(3):
            session.step()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            session.step()
            torch.cuda.synchronize()
        events = prof.key_averages()
        return (sum(e.count for e in events if "LaunchKernel" in e.key),  # runtime and driver API calls
                sum(e.count for e in events if "GraphLaunch" in e.key))
    (eager, none), (graphed, graphs) = launches(False), launches(True)
    assert none == 0 and graphs == 8  # each part's forward and backward graph, replayed once
    # what the graphs replace: at least the encoder's, head's, tail's and losses' forward kernels
    assert graphed <= eager - 8, (graphed, eager)


def test_the_graphed_step_computes_the_eager_step_on_the_cpu(monkeypatch):
    """Everything but the capture itself, on the CPU (Triton's interpreter): the parts, their parameters,
    the positives as a bitmask, the phases, a replay without a recapture and the recapture after a rewire.
    make_graphed_callables is replaced by one that returns the parts as they are, so the step must equal the
    eager one bit for bit. Groups of 16: half as many tail groups, each a slow program in the interpreter."""
    import targets.haste_rec.dense_graph as dense_graph
    import targets.haste_rec.session as session_module
    from targets.haste_rec.tail.triton_tail import interpreter_active
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    if not interpreter_active():
        pytest.skip("Triton's interpreter was not enabled before the kernels were imported")
    captured, graph = [], torch.cuda.graph

    def uncaptured(parts, samples, **kwargs):
        assert torch.cuda.graph.keywords == {"capture_error_mode": "thread_local"}  # other threads go on
        captured.append([sorted(id(p) for p in part.parameters()) for part in parts])
        for part, args in zip(parts, samples):  # as make_graphed_callables checks its sample arguments
            assert len(args) == len(inspect.signature(part.fn).parameters)
        return parts
    monkeypatch.setattr(dense_graph.torch.cuda, "make_graphed_callables", uncaptured)
    monkeypatch.setattr(session_module, "check_dense_graph", lambda config, device: None)

    def run(graphed: bool):
        config = {**FUSED, "dense_cuda_graph": graphed, "rewire_every": 2, "group_size": 16}
        session = build(KNOB_SPACE.resolve(config), "tiny", {}, "cpu", 0)
        return [float(session.step()) for _ in range(3)], session
    eager, _ = run(False)
    graphed, session = run(True)
    assert graphed == eager and torch.cuda.graph is graph  # the mode is put back after each capture
    assert session.dense_graphs.captures == len(captured) == 2  # first step (not the second), after the rewire at 2
    model, out = session.model, session.model.output
    assert captured[0] == [sorted(id(p) for p in ps) for ps in (model.encoder.parameters(), out.head_parameters(),
                                                                 out.tail_parameters(), ())]
