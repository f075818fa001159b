"""The fine profiler: the tail slots timed on the real tiny trainer's shapes, on a measured roofline."""

from types import SimpleNamespace

import pytest
import torch

from profilers.ceilings import get_ceilings
from profilers.fine import WARMUP_CALLS, place_on_roofline, profile_slots
from profilers.records import Ceilings, CoarseProfile, OpTime
from targets.haste_rec.knobs import KNOB_SPACE
from targets.haste_rec.slot_shapes import SLOT_PHASES as HASTE_REC_SLOT_PHASES
from targets.haste_rec.slot_shapes import slot_dtype as haste_rec_slot_dtype
from targets.haste_rec.slot_shapes import slot_shapes as haste_rec_slot_shapes
from targets.haste_rec.sizes import SIZES
from targets.haste_rec.target import TARGET, build

REPEATS = 5


@pytest.fixture(scope="module")
def tiny_session():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield build(KNOB_SPACE.resolve({}), "tiny", {}, "cpu", 0)
    torch.set_num_threads(threads)


@pytest.fixture
def ceilings(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    return get_ceilings("cpu", quick=True)


def test_slot_shapes_are_read_from_the_session(tiny_session):
    shapes = haste_rec_slot_shapes(tiny_session)
    size, out = SIZES["tiny"], tiny_session.model.output
    assert set(shapes) == set(HASTE_REC_SLOT_PHASES)
    expected = {"B": size.batch_size, "Ht": size.hidden, "K": out.tail_weight.shape[0], "G": size.group_size,
                "F": size.fan_in}
    assert shapes["tail_backward_input"] == expected and shapes["tail_forward"] == {**expected, "bias": 1}
    assert haste_rec_slot_dtype(tiny_session) == torch.float32


def test_autocast_slots_take_the_bias_outside_and_run_in_bf16():
    output = SimpleNamespace(tail_weight=torch.empty(3, 4, 5), tail_index=torch.empty(3, 5), tail_dims=7,
                             backend="slots")
    session = SimpleNamespace(model=SimpleNamespace(output=output), batch_size=2, autocast=True,
                              compute_dtype=torch.float32)
    assert haste_rec_slot_shapes(session)["tail_forward"] == {"B": 2, "Ht": 7, "K": 3, "G": 4, "F": 5, "bias": 0}
    assert haste_rec_slot_dtype(session) == torch.bfloat16
    output.backend = "torch"
    assert haste_rec_slot_shapes(session)["tail_forward"]["bias"] == 1


def test_tail_slots_on_tiny_shapes_are_placed_on_the_roofline(tiny_session, ceilings):
    shapes = haste_rec_slot_shapes(tiny_session)
    coarse = CoarseProfile.model_construct(top_ops=[OpTime(name="aten::mm", self_s=1e-3, calls=2.0, share=0.1)])
    fine = profile_slots(TARGET, shapes, "cpu", torch.float32, repeats=REPEATS, ceilings=ceilings, coarse=coarse,
                         slot_phases=HASTE_REC_SLOT_PHASES)
    assert fine.timing == "perf_counter" and fine.flush_bytes == 0 and fine.ceilings == ceilings
    assert [s.slot for s in fine.slots] == list(shapes)
    assert [op.name for op in fine.top_ops] == ["aten::mm"]
    for timing in fine.slots:
        cost = TARGET.slot(timing.slot).cost(shapes[timing.slot], torch.float32)
        assert (timing.flops, timing.bytes) == (cost.flops, cost.bytes)
        assert timing.implementation == "reference" and timing.repeats == REPEATS
        assert timing.phase == HASTE_REC_SLOT_PHASES[timing.slot]
        assert 0 < timing.p10_s <= timing.median_s <= timing.p90_s
        assert timing.achieved_flops_per_s > 0 and timing.achieved_bytes_per_s > 0
        assert 0 < timing.roofline_fraction <= 1.5, timing


def test_a_given_implementation_is_the_one_timed(tiny_session, ceilings):
    calls = []
    reference = TARGET.slot("tail_forward").reference

    def counted(*args):
        calls.append(1)
        return reference(*args)

    shapes = {"tail_forward": haste_rec_slot_shapes(tiny_session)["tail_forward"]}
    fine = profile_slots(TARGET, shapes, "cpu", torch.float32, kernels={"tail_forward": counted}, repeats=REPEATS,
                         ceilings=ceilings)
    assert len(calls) == WARMUP_CALLS + REPEATS
    assert fine.slots[0].implementation.endswith("counted")


def test_roofline_arithmetic():
    ceilings = Ceilings(device_key="k", device_name="d", torch="t", measured_at="now", quick=True,
                        matmul_flops_per_s={"float32": 1e12}, matmul_size={"float32": 512}, copy_bytes_per_s=1e11,
                        copy_bytes=1 << 20)
    memory = place_on_roofline("s", "reference", {"B": 1}, torch.float32, [0.1, 0.1, 0.3], 2e9, 1e9, ceilings)
    assert memory.bound == "memory" and memory.attainable_flops_per_s == pytest.approx(2e11)
    assert memory.median_s == 0.1 and memory.roofline_fraction == pytest.approx(0.1)
    compute = place_on_roofline("s", "reference", {"B": 1}, torch.bfloat16, [0.5], 1e12, 1e10, ceilings)
    assert compute.bound == "compute" and compute.attainable_flops_per_s == 1e12  # bf16 unmeasured: fp32's roof
    assert compute.roofline_fraction == pytest.approx(2.0)
