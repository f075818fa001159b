"""One training batch of the reference trainer, in the layout every component reads.

Sparse features follow nn.EmbeddingBag's convention per table: a flat id tensor plus bag start
offsets (one per sample), optional per-sample weights (the extreme-classification reader uses
them for feature values). Positive labels are CSR: ``labels[label_offsets[b]:label_offsets[b+1]]``.

``PackedBatch`` is the same batch as the loader can pack it (knob pack_batches): the sparse features
already in the embedding store's shared row space (``row_ops.TableLayout.pack``) and every tensor a
view of at most four flat ones, so pinning, the worker-to-trainer hand-over and the host-to-device
copy take one call per flat tensor instead of one per table's tensor (55 at 26 tables).
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


@dataclass
class PackedBatch:
    """A batch with its sparse features flattened into the embedding store's shared row space (what
    ``TableLayout.flatten`` gives for a ``Batch``), held in at most four flat tensors."""

    sparse: torch.Tensor              # int64 [nnz + T*B]: shared-space ids, then the bags' starts, table-major
    weights: torch.Tensor | None      # float32 [nnz], or None when no table is weighted
    dense: torch.Tensor               # float32 [B, num_dense]
    label_part: torch.Tensor          # int64 [nnz_labels + B + 1]: labels, then label_offsets
    nnz: int                          # looked-up ids, all tables

    @property
    def batch_size(self) -> int:
        return int(self.dense.shape[0])

    @property
    def ids(self) -> torch.Tensor:
        return self.sparse[:self.nnz]

    @property
    def offsets(self) -> torch.Tensor:
        return self.sparse[self.nnz:]

    @property
    def labels(self) -> torch.Tensor:
        return self.label_part[:self.label_part.numel() - self.batch_size - 1]

    @property
    def label_offsets(self) -> torch.Tensor:
        return self.label_part[self.label_part.numel() - self.batch_size - 1:]

    def _map(self, sparse_fn, other_fn) -> "PackedBatch":
        weights = None if self.weights is None else sparse_fn(self.weights)
        return PackedBatch(sparse=sparse_fn(self.sparse), weights=weights, dense=other_fn(self.dense),
                           label_part=other_fn(self.label_part), nnz=self.nnz)

    def to(self, device: torch.device | str, non_blocking: bool = False, sparse: bool = True) -> "PackedBatch":
        """Move to a device; with ``sparse=False`` the sparse features stay where they are (host tables)."""
        move = lambda t: t.to(device, non_blocking=non_blocking)  # noqa: E731
        return self._map(move if sparse else (lambda t: t), move)

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.sparse, self.weights, self.dense, self.label_part) if t is not None]

    def pin_memory(self) -> "PackedBatch":
        pin = lambda t: t.pin_memory()  # noqa: E731
        return self._map(pin, pin)
