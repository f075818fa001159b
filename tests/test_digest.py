"""The parameter digest: its definition, its ring of host buffers, and its values across versions."""

from __future__ import annotations

import hashlib
import time

import pytest
import torch

from targets import digest
from targets.digest import HostRing, ring_digest, sequence_digest


def tensors() -> list[torch.Tensor]:
    """Deterministic tensors of every shape the digest meets: 2-d, integer, empty, 0-dim bf16, bool."""
    return [torch.arange(7000, dtype=torch.float32).reshape(1000, 7) / 3, torch.arange(10), torch.zeros(0),
            torch.tensor(1.5).bfloat16(), torch.ones(3, dtype=torch.bool)]


def by_definition(ts: list[torch.Tensor], chunk_bytes: int) -> str:
    """The digest as its docstring defines it, written out plainly."""
    outer = hashlib.sha256()
    for t in ts:
        outer.update(str(t.dtype).encode())
        outer.update(str(tuple(t.shape)).encode())
        raw = t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
        for start in range(0, len(raw), chunk_bytes):
            outer.update(hashlib.sha256(raw[start:start + chunk_bytes]).digest())
    return outer.hexdigest()


def test_the_digest_is_the_sha256_tree_of_its_definition():
    assert sequence_digest(tensors()) == by_definition(tensors(), digest.DIGEST_CHUNK_BYTES)


def test_digests_keep_the_values_of_earlier_versions():
    """Saved baselines hold digests made by earlier versions (one fresh host copy per chunk): the same bytes
    must still give the same value, with the real chunk size and with many chunks."""
    assert sequence_digest(tensors()) == "d7140a548b8447bde58ee8d8e941d6bbed04e29f5648683403fa51ebd9498c24"
    assert (ring_digest(tensors(), HostRing(3, chunk_bytes=100, copy_host_chunks=True), workers=2)
            == "d5b9d8e503ca8fb17e0fdb56ee698514fe2caa17b105da3d523d7a6fe47538d8")


def test_a_slot_is_reused_only_after_its_chunk_is_hashed(monkeypatch):
    """Slow hashes and a ring of 3 slots over 280 chunks: a slot overwritten before its hash ran would
    change the digest."""
    real = digest._chunk_sha256

    def slow(host_bytes: torch.Tensor) -> bytes:
        time.sleep(0.002)
        return real(host_bytes)

    monkeypatch.setattr(digest, "_chunk_sha256", slow)
    ring = HostRing(3, chunk_bytes=100, copy_host_chunks=True)
    assert ring_digest(tensors(), ring, workers=3) == by_definition(tensors(), 100)
    assert len(ring.buffers) == 3


def test_any_flipped_bit_changes_the_digest():
    before = sequence_digest(tensors())
    for position in (0, 3499, 6999):
        changed = tensors()
        flat = changed[0].reshape(-1).view(torch.int32)
        flat[position] ^= 1  # the lowest mantissa bit of one float
        assert sequence_digest(changed) != before
    assert sequence_digest([t.reshape(-1) for t in tensors()]) != before  # same bytes, other shapes


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_device_tensor_digests_as_its_host_copy():
    big = torch.randn(40 << 20, device="cuda")  # 160 MB: three chunks through pinned slots
    small = torch.arange(5, device="cuda")
    assert sequence_digest([big, small]) == sequence_digest([big.cpu(), small.cpu()])


def test_sq_norm_sums_squares_chunk_by_chunk_as_accurately_as_float64(monkeypatch):
    import targets.digest as digest
    monkeypatch.setattr(digest, "SQ_NORM_CHUNK", 1000)  # many chunks, and a short last one
    t = torch.randn(257, 33, generator=torch.Generator().manual_seed(0))
    assert digest.sq_norm(t) == pytest.approx(float(t.double().pow(2).sum()), rel=1e-6)
    assert digest.sq_norm(t.half()) == pytest.approx(float(t.half().double().pow(2).sum()), rel=1e-6)
    assert digest.sq_norm(torch.empty(0)) == 0.0
