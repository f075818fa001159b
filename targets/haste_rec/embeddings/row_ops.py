"""The row math every embedding mode shares: row-wise Adagrad, per-row gradient formation, pooling,
and the one row space all tables live in (table t's rows follow table t-1's, as in FBGEMM's
table-batched embeddings), so a step pools and updates with one operation each.

Row-wise Adagrad (FBGEMM/DLRM): state[r] += mean(g_r ** 2); w_r -= lr * g_r / (sqrt(state[r]) + eps).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from targets.haste_rec.data.batch import Batch, PackedBatch
from targets.digest import HostRing
from targets.haste_rec.embeddings.embedding_config import CPU
from targets.worker_client import cpu_count

# -- the math every mode shares -------------------------------------------------------------------
def rowwise_adagrad_(weights: torch.Tensor, state: torch.Tensor, grads: torch.Tensor, lr: float, eps: float) -> None:
    """One row-wise Adagrad step in place on (weights [n, dim], state [n, 1]) with ``grads`` [n, dim]:
    state += mean(g^2), then w -= lr * g / (sqrt(state) + eps), each operation rounded as written (so in
    place or not, the same bits), with one temporary the size of ``grads`` instead of four: on the 2-core
    VM, 80K rows of 128 out of a 6.5M-row host table took 56-60 ms against 75-77 ms written out of place
    (the fastest three of six rounds each, ``python benchmarks/host_adagrad.py``)."""
    state += grads.pow(2).mean(dim=1, keepdim=True)
    weights.sub_(grads.mul(lr).div_(state.sqrt().add_(eps)))


def rowwise_adagrad(weights: torch.Tensor, state: torch.Tensor, grads: torch.Tensor, lr: float,
                    eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """New (weights [n, dim], state [n, 1]) after one row-wise Adagrad step with `grads` [n, dim]."""
    weights, state = weights.clone(), state.clone()
    rowwise_adagrad_(weights, state, grads, lr, eps)
    return weights, state


def apply_rowwise_adagrad_(weight: torch.Tensor, w_index: torch.Tensor | None, state: torch.Tensor,
                           s_index: torch.Tensor | None, grads: torch.Tensor, lr: float, eps: float) -> None:
    """Row-wise Adagrad in place on weight[w_index] and state[s_index] (both None: every row)."""
    if w_index is None or s_index is None:
        rowwise_adagrad_(weight, state, grads, lr, eps)
        return
    rows, rows_state = weight.index_select(0, w_index), state.index_select(0, s_index)
    rowwise_adagrad_(rows, rows_state, grads, lr, eps)
    weight.index_copy_(0, w_index, rows)
    state.index_copy_(0, s_index, rows_state)


def segment_sum(values: torch.Tensor, segment: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """out[s] = sum of values[i] with segment[i] == s, added once each in the order of i; ``counts[s]`` is how
    many i have segment s (``unique_ids`` gives it: a bincount here would read its size back from a GPU).

    A stable sort groups each segment's contributions, then one sequential reduction per segment
    sums them: deterministic on every device (no atomics). Every segment must be non-empty.
    ``unsafe=True`` skips segment_reduce's own check of the lengths (their minimum and their sum read back with
    ``.item()``: two device syncs a call). Counts from ``unique_ids`` are positive and sum to len(segment) by
    construction. The backward phase of the tuned `large` step, where the fused update calls this, waited
    1.5 ms a step on the device on an H200 (2026-11-30): a host that waits there cannot queue the rest of
    the step while the tail's kernels run.
    """
    order = torch.argsort(segment, stable=True)
    return torch.segment_reduce(values.index_select(0, order), "sum", lengths=counts.to(values.device), axis=0,
                                unsafe=True)


def unique_ids(ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sorted distinct ids, position -> index into them, occurrences of each): the one read-back from a GPU
    that a data-dependent row count needs."""
    return torch.unique(ids, sorted=True, return_inverse=True, return_counts=True)


def coalesce_rows(rows: torch.Tensor, grads: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(distinct rows, summed gradient of each) from per-occurrence rows and gradients."""
    unique, inverse, counts = unique_ids(rows)
    return unique, segment_sum(grads, inverse.to(grads.device), counts)


@dataclass
class Lookup:
    """One batch's lookup as backward needs it; all but `rows` sit where pooling and row gradients happen."""

    rows: torch.Tensor            # distinct rows of the batch, sorted
    inverse: torch.Tensor         # position -> index into rows
    counts: torch.Tensor          # occurrences of each row
    offsets: torch.Tensor         # bag starts
    bag_of: torch.Tensor          # position -> bag
    weights: torch.Tensor | None  # per-sample weights, or None
    slots: torch.Tensor | None = None  # a device cache's slots of `rows`, as the lookup prepared them
    slots_epoch: int = -1              # that cache's epoch then (TableCaches.epoch)


def make_lookup(ids: torch.Tensor, offsets: torch.Tensor, weights: torch.Tensor | None, device: torch.device) -> Lookup:
    rows, inverse, counts = unique_ids(ids)
    inverse, counts, offsets = inverse.to(device), counts.to(device), offsets.to(device)
    lengths = torch.diff(offsets, append=offsets.new_tensor([inverse.numel()]))
    bag_of = torch.repeat_interleave(torch.arange(offsets.numel(), device=device), lengths,
                                     output_size=inverse.numel())
    return Lookup(rows, inverse, counts, offsets, bag_of, None if weights is None else weights.to(device))


def row_gradients(grad_pooled: torch.Tensor, lookup: Lookup) -> torch.Tensor:
    """[len(rows), dim]: each row's gradient, its contributions segment-summed once."""
    contrib = grad_pooled.index_select(0, lookup.bag_of)
    if lookup.weights is not None:
        contrib = contrib * lookup.weights.unsqueeze(1)
    return segment_sum(contrib, lookup.inverse, lookup.counts)


def pool(ids: torch.Tensor, rows: torch.Tensor, offsets: torch.Tensor, weights: torch.Tensor | None,
         sparse: bool = False) -> torch.Tensor:
    return F.embedding_bag(ids, rows, offsets, mode="sum", per_sample_weights=weights, sparse=sparse)


# -- one row space for all tables ------------------------------------------------------------------
STAGING_BYTES = 64 << 20  # page-locked bytes a table drawn on a GPU crosses to the host at a time


def copy_to_host(rows: torch.Tensor, out: torch.Tensor, ring: HostRing) -> None:
    """out[:] = rows (out a contiguous host tensor of rows' shape and dtype), through `ring`'s page-locked buffer.

    A device-to-host copy into pageable memory goes through the driver's own staging and one thread, which also
    takes the first touch of every destination page: the 13.3 GB of host tables at `large-cached` took 11-15 s of
    an H200 worker's build (2026-12-04, ``targets.protocol.BuildClock``). Here the DMA lands in page-locked memory
    at bus speed, and torch's copy into the destination runs on every intra-op thread, first touches included:
    13.3 GB in 2.49 s on an H200 where the pageable copy took 10.66 s (``benchmarks/host_tables.py``, 2026-12-04).
    The bytes are the same either way."""
    source = rows.contiguous().reshape(-1).view(torch.uint8)
    target = out.view(-1).view(torch.uint8)  # a view: a reshape of a strided tensor would copy it
    for index, start in enumerate(range(0, source.numel(), ring.chunk_bytes)):
        chunk = source[start:start + ring.chunk_bytes]
        target[start:start + chunk.numel()].copy_(ring.on_host(chunk, index))


@dataclass(frozen=True)
class TableLayout:
    """Table t holds rows [starts[t], starts[t] + table_rows[t]) of the shared row space."""

    table_rows: tuple[int, ...]

    @property
    def starts(self) -> list[int]:
        return [sum(self.table_rows[:t]) for t in range(len(self.table_rows))]

    def initial_rows(self, dim: int, std: float, seed: int, device: torch.device = CPU,
                     store: torch.device | None = None) -> torch.Tensor:
        """N(0, std) rows, table t drawn from (seed, t) on `device` and returned on `store` (default
        `device`). A run draws on its own device type whatever the placement, so every placement
        starts identical; host placements copy table by table, never holding all rows on the device.

        On a GPU this takes milliseconds where the host takes seconds (13 GB at size large). On the
        CPU, tables are drawn in parallel threads, each from its own generator, so the result does
        not depend on the thread count. Drawn on a GPU for the host, each table reaches it through
        ``copy_to_host``.
        """
        store = device if store is None else store
        out = torch.empty(sum(self.table_rows), dim, device=store)
        staging = HostRing(slots=1, chunk_bytes=STAGING_BYTES) if store != device else None

        def draw(t: int, table: torch.Tensor) -> None:
            gen = torch.Generator(device=device).manual_seed((seed * 1_000_003 + t) % 2**63)
            rows = table if staging is None else torch.empty(table.shape, device=device)
            torch.randn(table.shape, generator=gen, out=rows, device=device)
            rows.mul_(std)
            if staging is not None:
                copy_to_host(rows, table, staging)

        tables = self.split(out)
        threads = 1 if device.type != "cpu" else max(1, min(len(tables), cpu_count()))
        with ThreadPoolExecutor(max_workers=threads) as pool:
            list(pool.map(draw, range(len(tables)), tables))
        return out

    def split(self, rows: torch.Tensor) -> list[torch.Tensor]:
        return list(torch.split(rows, self.table_rows))

    def flatten(self, batch: Batch | PackedBatch,
                device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(shared-space ids, offsets of all T*B bags table-major, weights or None) on `device`; a packed
        batch holds them already."""
        if isinstance(batch, PackedBatch):
            return (batch.ids.to(device), batch.offsets.to(device),
                    None if batch.weights is None else batch.weights.to(device))
        nnz = [ids.numel() for ids in batch.ids]
        ids = torch.cat([ids.to(device) + start for ids, start in zip(batch.ids, self.starts)])
        offsets = torch.cat([off.to(device) + sum(nnz[:t]) for t, off in enumerate(batch.offsets)])
        if all(w is None for w in batch.weights):
            return ids, offsets, None
        weights = torch.cat([torch.ones(i.numel(), device=device) if w is None else w.to(device)
                             for i, w in zip(batch.ids, batch.weights)])  # x * 1.0 is exact
        return ids, offsets, weights

    def pack(self, batch: Batch) -> PackedBatch:
        """``batch`` as the loader packs it (knob pack_batches): ``flatten`` on the host, the labels beside it."""
        ids, offsets, weights = self.flatten(batch, CPU)
        return PackedBatch.pack(ids, offsets, weights, batch.dense, batch.labels, batch.label_offsets)
