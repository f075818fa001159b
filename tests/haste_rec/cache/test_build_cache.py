"""The build cache: a second build reads the first's label layout, bit for bit, and never a stale one."""

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from targets.haste_rec.cache import build_cache
from targets.haste_rec.model import ModelShape, label_layout, synthetic_data
from targets.haste_rec.sizes import get_size


def _layout(seed=0, grouping="semantic", group_size=8):
    size = get_size("tiny")
    return label_layout(synthetic_data(size, seed), grouping, ModelShape(group_size, 8, 0.05), seed, size.batch_size)


def test_second_build_reads_the_cached_layout(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    first = _layout()
    entries = list((tmp_path / "sg-opt" / "haste_rec").glob("layout-*.pt"))
    assert len(entries) == 1
    calls = []
    monkeypatch.setattr("targets.haste_rec.model._compute_layout", lambda *a: calls.append(a))
    second = _layout()
    assert not calls, "the cached layout was recomputed"
    assert all(torch.equal(a, b) for a, b in zip(first, second))


def test_key_separates_seeds_groupings_and_shapes(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    layouts = [_layout(), _layout(seed=1), _layout(grouping="random"), _layout(group_size=16)]
    assert len(list((tmp_path / "sg-opt" / "haste_rec").glob("layout-*.pt"))) == 4
    assert layouts[0][1].shape[1] == 8 and layouts[3][1].shape[1] == 16
    assert not torch.equal(layouts[0][1], layouts[2][1])


def test_corrupt_entry_is_recomputed_and_disabled_cache_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    reference = _layout()
    (entry,) = (tmp_path / "sg-opt" / "haste_rec").glob("layout-*.pt")
    entry.write_bytes(b"not a tensor file")
    again = _layout()
    assert all(torch.equal(a, b) for a, b in zip(reference, again))
    assert entry.stat().st_size > 100  # rewritten
    monkeypatch.setenv("SG_OPT_BUILD_CACHE", "0")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "off"))
    _layout()
    assert not (tmp_path / "off").exists()


def test_code_edits_change_the_key(tmp_path, monkeypatch):
    module = tmp_path / "mod.py"
    module.write_text("x = 1\n")
    fake = type("M", (), {"__file__": str(module)})
    before = build_cache.source_digest([fake])
    module.write_text("x = 2\n")
    assert build_cache.source_digest([fake]) != before


def test_a_cache_folder_that_cannot_be_made_costs_the_cache_not_the_build(tmp_path, monkeypatch):
    blocked = tmp_path / "a-file"  # a file where the cache folder would go: no folder below it (root or not)
    blocked.write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocked))
    reference = _layout()
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert all(torch.equal(a, b) for a, b in zip(reference, _layout()))


def test_a_second_cached_session_adopts_the_first_ones_warmed_caches(tmp_path, monkeypatch):
    """The caches' replay before training (model.CACHE_WARM_BATCHES) is a pure function of the data and the
    caches' shapes: a second build reads its decisions back, replays nothing, and holds the same rows in the same
    slots; other capacities get their own entry."""
    from targets.haste_rec.knobs import KNOB_SPACE
    from targets.haste_rec.cache.table_caches import TableCaches
    from targets.haste_rec.target import build
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    cached = {"embedding_placement": "cached", "embedding_grad_mode": "fused", "embedding_cache_fraction": 0.3}

    def caches(overrides: dict) -> TableCaches:
        return build(KNOB_SPACE.resolve(overrides), "tiny", {}, "cpu", 0).model.embeddings._rows.params

    first = caches(cached)
    assert len(list((tmp_path / "sg-opt" / "haste_rec").glob("cache-warm-*.pt"))) == 1
    caches({**cached, "embedding_cache_fraction": 0.4})
    assert len(list((tmp_path / "sg-opt" / "haste_rec").glob("cache-warm-*.pt"))) == 2
    replays = []
    monkeypatch.setattr(TableCaches, "replay", lambda self, rows: replays.append(rows))
    second = caches(cached)
    assert not replays, "the warmed caches were replayed again"
    for name in ("slot_of_row", "row_of_slot", "last_use", "use_count", "filled", "device_rows"):
        assert torch.equal(getattr(first, name), getattr(second, name)), name
    assert first.clock == second.clock > 0


MISSING_AT_ONCE = """
import sys, time
from targets.haste_rec.cache import build_cache

def compute():
    with open(sys.argv[1], "a") as log:
        log.write("computed\\n")
    time.sleep(1.0)  # long enough for every other process to miss the entry too
    return {"value": __import__("torch").arange(5)}

open(sys.argv[2], "w").close()  # this process is past its imports
while len(__import__("glob").glob(sys.argv[3] + "/ready-*")) < int(sys.argv[4]):
    time.sleep(0.01)
print(build_cache.cached("test", ("one key",), compute)["value"].tolist())
"""


@pytest.mark.slow
def test_processes_that_miss_at_once_compute_once(tmp_path):
    """Three workers missing the same entry at once: one computes, the others wait and read what it wrote (on an
    H200 two workers replayed the same cache warm-up at once, and the numerics worker's build took 16x its time
    alone)."""
    workers = 3
    script, log = tmp_path / "miss.py", tmp_path / "computed.log"
    script.write_text(MISSING_AT_ONCE)
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache"), "PYTHONPATH": str(Path(__file__).parents[3])}
    procs = [subprocess.Popen([sys.executable, str(script), str(log), str(tmp_path / f"ready-{i}"), str(tmp_path),
                               str(workers)], stdout=subprocess.PIPE, text=True, env=env) for i in range(workers)]
    outputs = [proc.communicate(timeout=120)[0].strip() for proc in procs]
    assert [proc.returncode for proc in procs] == [0] * workers
    assert outputs == ["[0, 1, 2, 3, 4]"] * workers
    assert log.read_text().splitlines() == ["computed"], "more than one process computed the entry"


def test_a_compute_may_read_another_entry(tmp_path, monkeypatch):
    """Nested: the outer compute holds the lock; the inner one must not wait on it (run in a thread, so that a
    deadlock fails the test instead of hanging it)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    got = []
    nested = threading.Thread(target=lambda: got.append(build_cache.cached(
        "outer", (1,), lambda: build_cache.cached("inner", (2,), lambda: torch.ones(2)) * 2)), daemon=True)
    nested.start()
    nested.join(timeout=30)
    assert not nested.is_alive(), "a nested compute waited on its own lock"
    assert torch.equal(got[0], torch.full((2,), 2.0))
