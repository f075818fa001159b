"""The parameter digest that ends every numerics run: a sha256 tree over the raw bytes of tensors.

Each tensor's dtype and shape, then the sha256 of each 64 MB chunk of its bytes, feed one outer
sha256, in order; any changed bit changes it, as a flat sha256 would. Chunks are hashed in parallel
threads (hashlib releases the GIL), so 13 GB of embedding tables take seconds rather than the half
minute a flat hash of one host copy took.

A device tensor's chunks come to the host through a small ring of host buffers (pinned for CUDA),
each reused once the hash of the chunk it last held has finished. At size large on an H200 the
previous way, a fresh pageable host copy per chunk (13 GB of host memory allocated and touched),
took 8.5 s in ``benchmarks/build_cost.py`` (BENCHMARKS.md, 2026-11-30); the ring is not yet timed there. The bytes hashed are the same either
way, so digests stay comparable with those of earlier runs and saved baselines.
"""

from __future__ import annotations

import hashlib
import os
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Sequence

import torch

DIGEST_CHUNK_BYTES = 64 << 20
SQ_NORM_CHUNK = 16 << 20  # elements squared at a time by ``sq_norm``: 64 MB of float32


def sq_norm(t: torch.Tensor) -> float:
    """The sum of squares of ``t``'s elements, a chunk of SQ_NORM_CHUNK at a time (float32 within a chunk, float64
    across them). ``t.float().pow(2).sum()`` made a temporary as large as the tensor: 13.3 GB of host tables in
    every numerics run at `large-cached`, allocated and touched beside the timing workers started ahead; on the
    2-core VM, 0.8 GB summed in 0.22-0.27 s chunked, where the whole-tensor way took 0.23-0.92 s (0.92 when its
    temporary had to be touched afresh). The chunked sum is as accurate (of 2e8 normal draws: 200009466 where
    float64 says 200009465.2; torch's float32 vector_norm said 188409698 on the CPU)."""
    flat = t.detach().reshape(-1)
    parts = [flat[i:i + SQ_NORM_CHUNK].float().pow(2).sum().double() for i in range(0, flat.numel(), SQ_NORM_CHUNK)]
    return float(torch.stack(parts).sum()) if parts else 0.0


def _chunk_sha256(host_bytes: torch.Tensor) -> bytes:
    return hashlib.sha256(memoryview(host_bytes.numpy())).digest()


class HostRing:
    """``slots`` host buffers for device chunks, handed out in turn. A chunk already on the host is hashed
    where it lies unless ``copy_host_chunks`` (which tests use to run the ring without a GPU)."""

    def __init__(self, slots: int, chunk_bytes: int = DIGEST_CHUNK_BYTES, copy_host_chunks: bool = False):
        self.slots, self.chunk_bytes, self.copy_host_chunks = slots, chunk_bytes, copy_host_chunks
        self.buffers: list[torch.Tensor] = []

    def on_host(self, chunk: torch.Tensor, index: int) -> torch.Tensor:
        """``chunk`` (the index-th of the digest) on the host; its slot must no longer be in use."""
        if chunk.device.type == "cpu" and not self.copy_host_chunks:
            return chunk
        slot = index % self.slots
        if slot == len(self.buffers):
            self.buffers.append(torch.empty(self.chunk_bytes, dtype=torch.uint8,
                                            pin_memory=chunk.device.type == "cuda"))
        out = self.buffers[slot][:chunk.numel()]
        out.copy_(chunk)  # blocking: a device-to-host copy returns once the bytes are on the host
        return out


def ring_digest(tensors: Sequence[torch.Tensor], ring: HostRing, workers: int) -> str:
    """The digest of ``tensors``, their chunks staged through ``ring`` and hashed by ``workers`` threads."""
    digest = hashlib.sha256()
    pending: deque[Future[bytes]] = deque()  # chunk hashes in order; at most ring.slots, so a slot is free
    index = 0
    with ThreadPoolExecutor(max_workers=workers) as pool:
        for tensor in tensors:
            while pending:
                digest.update(pending.popleft().result())
            t = tensor.detach().contiguous()
            digest.update(str(t.dtype).encode())
            digest.update(str(tuple(t.shape)).encode())
            flat = t.reshape(-1).view(torch.uint8) if t.numel() else t.new_empty(0, dtype=torch.uint8)
            for start in range(0, flat.numel(), ring.chunk_bytes):
                if len(pending) == ring.slots:  # the oldest chunk's slot is the one this chunk takes
                    digest.update(pending.popleft().result())
                pending.append(pool.submit(_chunk_sha256, ring.on_host(flat[start:start + ring.chunk_bytes], index)))
                index += 1
        while pending:
            digest.update(pending.popleft().result())
    return digest.hexdigest()


def sequence_digest(tensors: Sequence[torch.Tensor]) -> str:
    """sha256 tree over the raw bytes of ``tensors`` (see the module's docstring), wherever they live."""
    workers = max(1, min(16, len(os.sched_getaffinity(0))))
    return ring_digest(tensors, HostRing(slots=workers + 2), workers)
