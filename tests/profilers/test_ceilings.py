"""Device ceilings: measured with the quick plan here, cached per device, re-measured when the cache is bad."""

import json

import pytest
import torch

from profilers import ceilings as ceilings_module
from profilers.ceilings import cache_path, device_key, get_ceilings


@pytest.fixture
def measurements(tmp_path, monkeypatch):
    """Counts real measurements, with the cache in a fresh directory."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    calls = []
    measure = ceilings_module.measure_ceilings

    def counted(device, quick=False):
        calls.append(quick)
        return measure(device, quick)

    monkeypatch.setattr(ceilings_module, "measure_ceilings", counted)
    return calls


def test_quick_measurement_is_plausible_and_cached(measurements, tmp_path):
    first = get_ceilings("cpu", quick=True)
    assert measurements == [True]
    assert 1e8 < first.matmul_flops_per_s["float32"] < 1e14 and 1e8 < first.copy_bytes_per_s < 1e13
    assert first.quick and first.device_key == device_key(torch.device("cpu"))
    path = cache_path(torch.device("cpu"), quick=True)
    assert path.parent == tmp_path / "sg-opt" and path.name.endswith("-quick.json")
    assert torch.__version__.lower().split("+")[0] in path.name
    assert get_ceilings("cpu", quick=True) == first
    assert measurements == [True]  # read from the file


def test_corrupt_or_foreign_cache_is_measured_again(measurements):
    first = get_ceilings("cpu", quick=True)
    path = cache_path(torch.device("cpu"), quick=True)
    path.write_text("{not json")
    second = get_ceilings("cpu", quick=True)
    assert len(measurements) == 2 and second.measured_at >= first.measured_at
    stored = json.loads(path.read_text())
    path.write_text(json.dumps({**stored, "version": stored["version"] + 1}))
    get_ceilings("cpu", quick=True)
    assert len(measurements) == 3
    get_ceilings("cpu", quick=True, refresh=True)
    assert len(measurements) == 4


def test_quick_never_stands_in_for_a_full_measurement(measurements):
    get_ceilings("cpu", quick=True)
    assert cache_path(torch.device("cpu")) != cache_path(torch.device("cpu"), quick=True)
    assert not cache_path(torch.device("cpu")).exists()
