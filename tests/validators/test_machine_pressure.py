"""Each timed block records how long the machine made tasks wait (PSI), so that a disturbed measurement can say
whether memory, io or cpu pressure came with its slow blocks."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.validators.test_ab_workers import no_quiet_wait  # noqa: F401 - a fixture, used by pytest
from validators.machine_pressure import pressure_note, stall_shares, stall_totals
from validators.speedup import measure_ab
from targets.worker_protocol import WorkerRequest

SLOW = WorkerRequest(target="tests.fixtures.faulty_target:target", size="tiny", mode="bench", warmup=0,
                     config={"behaviour": "slow"})


def psi(folder: Path, cpu: int, memory: int, io: int) -> Path:
    """A /proc/pressure-like folder with these "some" totals (microseconds)."""
    folder.mkdir(exist_ok=True)
    for name, total in (("cpu", cpu), ("memory", memory), ("io", io)):
        (folder / name).write_text(f"some avg10=0.00 avg60=0.00 avg300=0.00 total={total}\n"
                                   f"full avg10=0.00 avg60=0.00 avg300=0.00 total={total // 2}\n")
    return folder


def test_a_blocks_stall_shares_are_the_growth_of_each_total_over_its_wall_time(tmp_path):
    before = stall_totals(psi(tmp_path / "p", cpu=1_000_000, memory=0, io=5_000))
    after = stall_totals(psi(tmp_path / "p", cpu=1_150_000, memory=300_000, io=5_000))
    assert before == {"cpu": 1_000_000, "memory": 0, "io": 5_000}
    assert stall_shares(before, after, 0.5) == pytest.approx({"cpu": 0.3, "memory": 0.6, "io": 0.0})


def test_without_psi_nothing_is_counted(tmp_path):
    assert stall_totals(tmp_path / "absent") is None
    (tmp_path / "partial").mkdir()
    (tmp_path / "partial" / "cpu").write_text("some avg10=0.00 avg60=0.00 avg300=0.00 total=1\n")
    assert stall_totals(tmp_path / "partial") is None  # no memory file: not a count to trust
    assert stall_shares(None, {"cpu": 1, "memory": 1, "io": 1}, 1.0) is None


def test_the_note_names_only_the_resources_that_held_some_block_back():
    blocks = [{"cpu": 0.01, "memory": 0.0, "io": 0.0}, {"cpu": 0.02, "memory": 0.42, "io": 0.06}, None,
              {"cpu": 0.03, "memory": 0.08, "io": 0.0}]
    assert pressure_note(blocks) == ("the machine stalled tasks waiting for memory 42% of a block at most (2 of 3 "
                                     "blocks over 5%), io 6% of a block at most (1 of 3 blocks over 5%)")
    assert pressure_note([{"cpu": 0.01, "memory": 0.0, "io": 0.0}]) is None and pressure_note([None]) is None


@pytest.mark.skipif(stall_totals() is None, reason="this kernel keeps no pressure stall counts")
def test_a_measurement_records_each_timed_blocks_pressure_and_each_workers_memory():
    result = measure_ab(SLOW, SLOW, blocks=2, steps_per_block=2, timeout_s=60)
    assert result.failure is None
    for side in (result.a, result.b):
        assert len(side.block_pressure) == len(side.block_medians) == 2  # the timed blocks, not the settling ones
        assert all(set(p) == {"cpu", "memory", "io"} and all(0.0 <= v for v in p.values()) for p in side.block_pressure)
        assert side.memory["host_rss"] > 0
