"""Top ops timed per call in situ: FLOP models of the matmul family, and a real run on the tiny trainer."""

import pytest
import torch

from profilers.ceilings import get_ceilings
from profilers.op_timing import input_bytes, matmul_flops, time_top_ops
from targets.haste_rec.knobs import KNOB_SPACE
from targets.haste_rec.target import build


def test_matmul_flop_models():
    assert matmul_flops("aten::mm", [[64, 32], [32, 16]]) == 2 * 64 * 32 * 16
    assert matmul_flops("aten::addmm", [[16], [64, 32], [32, 16], [], []]) == 2 * 64 * 32 * 16
    assert matmul_flops("aten::bmm", [[5, 64, 32], [5, 32, 16]]) == 2 * 5 * 64 * 32 * 16
    assert matmul_flops("aten::add", [[4], [4]]) is None
    assert input_bytes([[4, 8], [8]], ["float", "c10::BFloat16"]) == 4 * 8 * 4 + 8 * 2


def test_top_ops_of_the_tiny_trainer_are_timed_on_their_real_shapes(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    torch.set_num_threads(1)
    session = build(KNOB_SPACE.resolve({}), "tiny", {}, "cpu", 0)
    for _ in range(2):
        session.step()
    timings = time_top_ops(session, torch.device("cpu"), 3, ["aten::addmm", "aten::no_such_op"],
                           get_ceilings("cpu", quick=True))
    assert [t.name for t in timings] == ["aten::addmm"]  # an op that never ran is not invented
    addmm = timings[0]
    assert addmm.median_s > 0 and addmm.calls_per_step == 1  # the busiest signature: one call per step
    assert addmm.flops and addmm.flops > 0 and addmm.achieved_flops_per_s > 0
    batch = 32  # tiny's batch size: the timed call's first operand has it as its rows
    assert any(s and s[0] == batch for s in addmm.shapes)
    assert 0 < addmm.roofline_fraction < 1.5
