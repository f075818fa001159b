"""Tables drawn on a GPU for the host reach it through a reused page-locked buffer, byte for byte."""

from __future__ import annotations

import pytest
import torch

from targets.digest import HostRing
from targets.haste_rec.embeddings.row_ops import TableLayout, copy_to_host


@pytest.mark.parametrize("chunk_bytes", [64, 1000, 1 << 20])
def test_a_chunked_copy_through_the_staging_buffer_is_the_plain_copy(chunk_bytes):
    ring = HostRing(slots=1, chunk_bytes=chunk_bytes, copy_host_chunks=True)  # staged on the CPU too
    for rows in (7, 300, 31):  # a larger table after a smaller one reuses the buffer
        source = torch.randn(rows, 12, generator=torch.Generator().manual_seed(rows))
        out = torch.full_like(source, float("nan"))
        copy_to_host(source, out, ring)
        assert torch.equal(out, source)
    assert len(ring.buffers) == 1 and ring.buffers[0].numel() == chunk_bytes


def test_a_one_value_row_and_other_dtypes_copy_too():
    source = torch.arange(50, dtype=torch.int64).view(50, 1)
    out = torch.zeros_like(source)
    copy_to_host(source, out, HostRing(slots=1, chunk_bytes=16, copy_host_chunks=True))
    assert torch.equal(out, source)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_tables_drawn_on_the_gpu_for_the_host_are_those_drawn_for_the_gpu():
    layout = TableLayout((1000, 70_000, 3))
    cuda = torch.device("cuda")
    on_host = layout.initial_rows(16, 0.01, seed=3, device=cuda, store=torch.device("cpu"))
    on_device = layout.initial_rows(16, 0.01, seed=3, device=cuda)
    assert on_host.device.type == "cpu" and torch.equal(on_host, on_device.cpu())
