"""The roofline floor: phase work at the measured ceilings, and haste-rec's work model read off a session."""

import pytest

from profilers.floor import floor_sentence, held_back_by, phase_floor, step_floor
from profilers.records import Ceilings
from targets.haste_rec.knobs import KNOB_SPACE
from targets.haste_rec.target import build
from targets.protocol import PhaseWork

CEILINGS = Ceilings(device_key="k", device_name="d", torch="t", measured_at="now", quick=False,
                    matmul_flops_per_s={"float32": 1e12, "bfloat16": 4e12}, matmul_size={"float32": 8192},
                    copy_bytes_per_s=1e12, copy_bytes=1 << 30, bus_bytes_per_s=5e10)


def test_a_phase_floor_is_the_slower_of_compute_and_memory_plus_the_bus():
    compute = phase_floor(PhaseWork(flops=4e9, bytes=1e6), CEILINGS)
    assert compute.bound == "compute" and compute.floor_s == pytest.approx(4e-3)
    bf16 = phase_floor(PhaseWork(flops=4e9, bytes=1e6, dtype="bfloat16"), CEILINGS)
    assert bf16.floor_s == pytest.approx(1e-3)
    memory = phase_floor(PhaseWork(flops=1e6, bytes=2e9), CEILINGS)
    assert memory.bound == "memory" and memory.floor_s == pytest.approx(2e-3)
    bus = phase_floor(PhaseWork(bytes=1e9, bus_bytes=1e9), CEILINGS)
    assert bus.bound == "bus" and bus.floor_s == pytest.approx(1e-3 + 2e-2)
    no_bus = phase_floor(PhaseWork(bus_bytes=1e9), CEILINGS.model_copy(update={"bus_bytes_per_s": None}))
    assert no_bus.floor_s == 0.0 and no_bus.bound == "none"  # on a CPU the tables are local


def test_the_step_floor_sums_its_phases_and_names_the_furthest():
    work = {"embed": PhaseWork(bytes=1e9), "tail": PhaseWork(flops=2e9), "loss": PhaseWork()}
    floor = step_floor(work, CEILINGS)
    assert floor.floor_s == pytest.approx(3e-3) and floor.ratio is None
    for name, measured in (("embed", 2e-3), ("tail", 20e-3), ("loss", 1e-3)):
        floor.phases[name].measured_s = measured
    floor.measured_s = 25e-3
    assert held_back_by(floor) == "tail" and floor.phases["tail"].ratio == pytest.approx(10.0)
    assert floor.phases["loss"].ratio is None  # no floor: no ratio
    assert floor.ratio == pytest.approx(25 / 3)
    assert "furthest: tail (20.00 ms against 2.000 ms, compute-bound)" in floor_sentence(floor)


def test_haste_rec_work_model_follows_the_shapes_and_the_precision():
    session = build(KNOB_SPACE.resolve({}), "tiny", {}, "cpu")
    size, out = session.size, session.model.output
    work = session.work_model(bus_bytes_per_step=1234.0)
    assert list(work) == list(session.phase_names)
    B, in_dim = size.batch_size, size.num_tables * size.embedding_dim + size.num_dense
    assert work["encoder"].flops == 2 * B * (in_dim * size.encoder_hidden + size.encoder_hidden * size.hidden)
    K, G, F = out.tail_weight.shape
    assert work["tail"].flops == 2 * B * K * G * F and work["head"].flops == 2 * B * size.hidden * out.n_head
    assert work["backward"].flops == 2 * (work["encoder"].flops + work["head"].flops + work["tail"].flops)
    assert work["embed"].bus_bytes == 1234.0 and work["data"].bus_bytes > 0 and work["loss"] == PhaseWork()
    bf16 = build(KNOB_SPACE.resolve({"precision": "bf16"}), "tiny", {}, "cpu").work_model()
    assert bf16["tail"].dtype == "bfloat16" and bf16["tail"].bytes < work["tail"].bytes
    assert bf16["embed"].bytes == work["embed"].bytes  # tables stay fp32 whatever the precision
