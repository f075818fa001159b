"""One training batch of the reference trainer, in the layout every component reads.

Sparse features follow nn.EmbeddingBag's convention per table: a flat id tensor plus bag start
offsets (one per sample), optional per-sample weights (the extreme-classification reader uses
them for feature values). Positive labels are CSR: ``labels[label_offsets[b]:label_offsets[b+1]]``.

``PackedBatch`` is the same batch as the loader can pack it (knob pack_batches): the sparse features
already in the embedding store's shared row space (``row_ops.TableLayout.pack``) and every tensor a
view of one byte buffer, so pinning, the worker-to-trainer hand-over and the host-to-device copy take
one call each instead of one per table's tensor (55 at 26 tables).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Batch:
    ids: list[torch.Tensor]                 # per table: int64 [nnz_t]
    offsets: list[torch.Tensor]             # per table: int64 [B], bag starts
    weights: list[torch.Tensor | None]      # per table: float32 [nnz_t] or None
    dense: torch.Tensor                     # float32 [B, num_dense]
    labels: torch.Tensor                    # int64 [nnz_labels], positive label ids
    label_offsets: torch.Tensor             # int64 [B + 1]

    @property
    def batch_size(self) -> int:
        return int(self.dense.shape[0])

    def _map(self, fn) -> "Batch":
        return Batch(
            ids=[fn(t) for t in self.ids],
            offsets=[fn(t) for t in self.offsets],
            weights=[None if w is None else fn(w) for w in self.weights],
            dense=fn(self.dense),
            labels=fn(self.labels),
            label_offsets=fn(self.label_offsets),
        )

    def to(self, device: torch.device | str, non_blocking: bool = False, sparse: bool = True) -> "Batch":
        """Move to a device; with ``sparse=False`` the sparse ids stay where they are (host tables)."""
        move = lambda t: t.to(device, non_blocking=non_blocking)  # noqa: E731
        keep = move if sparse else (lambda t: t)
        return Batch(ids=[keep(t) for t in self.ids], offsets=[keep(t) for t in self.offsets],
                     weights=[None if w is None else keep(w) for w in self.weights], dense=move(self.dense),
                     labels=move(self.labels), label_offsets=move(self.label_offsets))

    def tensors(self) -> list[torch.Tensor]:
        return [*self.ids, *self.offsets, *(w for w in self.weights if w is not None), self.dense, self.labels,
                self.label_offsets]

    def pin_memory(self) -> "Batch":
        return self._map(lambda t: t.pin_memory())

    def positives(self, b: int) -> torch.Tensor:
        """The positive label ids of sample b."""
        return self.labels[self.label_offsets[b]:self.label_offsets[b + 1]]

    def slice(self, start: int, stop: int) -> "Batch":
        """Samples [start, stop) as a new batch (offsets rebased)."""
        ids, offsets, weights = [], [], []
        for t, off, w in zip(self.ids, self.offsets, self.weights):
            ends = torch.cat([off[1:], off.new_tensor([t.numel()])])
            lo, hi = int(off[start]), int(ends[stop - 1])
            ids.append(t[lo:hi])
            offsets.append(off[start:stop] - lo)
            weights.append(None if w is None else w[lo:hi])
        llo, lhi = int(self.label_offsets[start]), int(self.label_offsets[stop])
        return Batch(ids, offsets, weights, self.dense[start:stop], self.labels[llo:lhi],
                     self.label_offsets[start:stop + 1] - llo)


def _aligned(nbytes: int) -> int:
    """Byte offsets of the sections of a packed buffer are multiples of 8, so each can be viewed as int64."""
    return (nbytes + 7) // 8 * 8


@dataclass(frozen=True)
class PackedLayout:
    """Where each section of a ``PackedBatch``'s bytes lies: the dense features and the labels first (they
    always go to the training device), then, from ``split`` on, the sparse features (which stay on the host
    with host tables)."""

    batch_size: int
    num_dense: int
    label_numel: int        # nnz_labels + B + 1: labels, then label_offsets
    nnz: int                # looked-up ids, all tables
    sparse_numel: int       # nnz + T*B: shared-space ids, then the bags' starts, table-major
    weighted: bool

    @property
    def labels_at(self) -> int:
        return _aligned(4 * self.batch_size * self.num_dense)

    @property
    def split(self) -> int:
        return _aligned(self.labels_at + 8 * self.label_numel)

    @property
    def weights_at(self) -> int:  # from split
        return 8 * self.sparse_numel

    @property
    def nbytes(self) -> int:
        return self.split + self.weights_at + (4 * self.nnz if self.weighted else 0)


@dataclass
class PackedBatch:
    """A batch with its sparse features flattened into the embedding store's shared row space (what
    ``TableLayout.flatten`` gives for a ``Batch``), every tensor a view of one byte buffer: a loader worker
    hands the trainer one buffer (a shared slot, ``shared_ring``), and one copy takes it to the device (at
    `large` on a 2-core VM, taking a batch from 2 workers' full queues: medians 2.97 and 3.79 ms with three
    storages, 2.28 and 2.24 with one; ``python benchmarks/loader_handover.py``).

    ``buffer`` holds the sections of ``layout``; after ``to(device, sparse=False)`` it holds only those before
    ``layout.split``, and ``apart`` the sparse features' bytes, left where they were."""

    buffer: torch.Tensor              # uint8
    layout: PackedLayout
    apart: torch.Tensor | None = None

    @classmethod
    def pack(cls, ids: torch.Tensor, offsets: torch.Tensor, weights: torch.Tensor | None, dense: torch.Tensor,
             labels: torch.Tensor, label_offsets: torch.Tensor) -> "PackedBatch":
        """One buffer holding these host tensors (int64 ids and offsets, float32 weights and dense features)."""
        layout = PackedLayout(batch_size=int(dense.shape[0]), num_dense=int(dense.shape[1]),
                              label_numel=labels.numel() + label_offsets.numel(), nnz=ids.numel(),
                              sparse_numel=ids.numel() + offsets.numel(), weighted=weights is not None)
        packed = cls(torch.empty(layout.nbytes, dtype=torch.uint8), layout)
        packed.dense.copy_(dense)
        torch.cat([labels, label_offsets], out=packed.label_part)
        torch.cat([ids, offsets], out=packed.sparse)
        if weights is not None:
            packed.weights.copy_(weights)
        return packed

    def _section(self, start: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
        split = self.layout.split
        if start >= split and self.apart is not None:
            buffer, start = self.apart, start - split
        else:
            buffer = self.buffer
        return buffer[start:start + numel * dtype.itemsize].view(dtype)

    @property
    def dense(self) -> torch.Tensor:             # float32 [B, num_dense]
        layout = self.layout
        return self._section(0, layout.batch_size * layout.num_dense, torch.float32).view(layout.batch_size,
                                                                                          layout.num_dense)

    @property
    def label_part(self) -> torch.Tensor:        # int64 [nnz_labels + B + 1]: labels, then label_offsets
        return self._section(self.layout.labels_at, self.layout.label_numel, torch.int64)

    @property
    def sparse(self) -> torch.Tensor:            # int64 [nnz + T*B]: shared-space ids, then the bags' starts
        return self._section(self.layout.split, self.layout.sparse_numel, torch.int64)

    @property
    def weights(self) -> torch.Tensor | None:    # float32 [nnz], or None when no table is weighted
        layout = self.layout
        return self._section(layout.split + layout.weights_at, layout.nnz, torch.float32) if layout.weighted else None

    @property
    def nnz(self) -> int:
        return self.layout.nnz

    @property
    def batch_size(self) -> int:
        return self.layout.batch_size

    @property
    def ids(self) -> torch.Tensor:
        return self.sparse[:self.nnz]

    @property
    def offsets(self) -> torch.Tensor:
        return self.sparse[self.nnz:]

    @property
    def labels(self) -> torch.Tensor:
        return self.label_part[:self.layout.label_numel - self.batch_size - 1]

    @property
    def label_offsets(self) -> torch.Tensor:
        return self.label_part[self.layout.label_numel - self.batch_size - 1:]

    def to(self, device: torch.device | str, non_blocking: bool = False, sparse: bool = True) -> "PackedBatch":
        """Move to a device in one copy; with ``sparse=False`` the sparse features stay where they are (host
        tables) and only the bytes before them move."""
        if self.apart is not None:
            return PackedBatch(self.buffer.to(device, non_blocking=non_blocking), self.layout,
                               self.apart.to(device, non_blocking=non_blocking) if sparse else self.apart)
        if sparse:
            return PackedBatch(self.buffer.to(device, non_blocking=non_blocking), self.layout)
        split = self.layout.split
        return PackedBatch(self.buffer[:split].to(device, non_blocking=non_blocking), self.layout,
                           self.buffer[split:])

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.buffer, self.apart) if t is not None]

    def pin_memory(self) -> "PackedBatch":
        return PackedBatch(self.buffer.pin_memory(), self.layout,
                           None if self.apart is None else self.apart.pin_memory())
