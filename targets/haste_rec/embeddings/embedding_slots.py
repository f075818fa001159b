"""Kernel slots of the embedding store: the pooled forward and the fused backward + row-wise Adagrad.

These two operations are the embedding phase's whole device work (``row_ops``), so sg-opt can swap
in a faster implementation, check it against the torch reference on fresh random inputs and place
it on a roofline. The references are the store's own math (``row_ops.pool``; ``make_lookup``,
``row_gradients`` and ``rowwise_adagrad``), so a kernel that passes its slot computes what the
trainer computes. The Triton implementations are in ``triton_embedding``; this module imports no
triton, so the target loads on machines without it.

The update slot is functional: it returns the touched rows' new weights and state, [U, D + 1]
sorted by row, and leaves its inputs alone (a validator compares every input bitwise after the
call). The trainer runs the same kernel in place (``triton_embedding.embedding_fused_update_``).

Shape dicts use T (tables), B (bags per table), P (mean ids per bag), R (rows per table), D (dim),
Q (distinct rows per table in the batch), ``weighted`` (1: per-id weights) and ``ragged`` (1: bag
lengths drawn at random, empty bags included; 0: every bag holds P ids). So N = T*B*P lookups,
T*B bags and U = T*Q distinct rows, exactly, and the cost model needs nothing but the shape.
"""

from __future__ import annotations

from typing import Callable, Mapping

import torch

from targets.haste_rec.embeddings.row_ops import make_lookup, pool, row_gradients, rowwise_adagrad
from targets.protocol import FlopsBytes, KernelSlot

INDEX_BYTES = 8  # int64 ids and offsets
LR, EPS = 0.05, 1e-8


# ----------------------------------------------------------------------------- references

def pool_forward_reference(ids: torch.Tensor, offsets: torch.Tensor, weights: torch.Tensor | None,
                           rows: torch.Tensor) -> torch.Tensor:
    """pooled [bags, D]: the store's pooling (``row_ops.pool``), nn.EmbeddingBag's sum over each bag."""
    return pool(ids, rows, offsets, weights)


def fused_update_reference(ids: torch.Tensor, offsets: torch.Tensor, weights: torch.Tensor | None,
                           grad_pooled: torch.Tensor, rows: torch.Tensor, state: torch.Tensor, lr: float,
                           eps: float) -> torch.Tensor:
    """[U, D + 1]: the store's torch fused mode on the looked-up rows (segment-summed row gradients, then
    ``row_ops.rowwise_adagrad``): new weights in columns :D, new state in column D, rows sorted."""
    lookup = make_lookup(ids, offsets, weights, ids.device)
    grads = row_gradients(grad_pooled, lookup)
    new_w, new_s = rowwise_adagrad(rows.index_select(0, lookup.rows), state.index_select(0, lookup.rows), grads,
                                   lr, eps)
    return torch.cat([new_w, new_s.to(new_w.dtype)], dim=1)


# ----------------------------------------------------------------------------- inputs

def bag_inputs(shape: Mapping[str, int], device: torch.device | str,
               generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids int64 [N], offsets int64 [T*B]) in the store's layout: table t's bags draw from its Q distinct
    rows, each used at least once, in the shared row space (table t's rows start at t*R)."""
    T, B, P, R, Q = (int(shape[k]) for k in ("T", "B", "P", "R", "Q"))
    n = B * P
    if not (min(T, B, P, R, Q) >= 1 and Q <= min(R, n)):
        raise ValueError(f"need T, B, P, R, Q >= 1 and Q <= min(R, B*P), not {dict(shape)}")
    gdev = generator.device
    ids, offsets = [], []
    for t in range(T):
        distinct = torch.randperm(R, generator=generator, device=gdev)[:Q] + t * R
        picks = torch.cat([torch.arange(Q, device=gdev), torch.randint(Q, (n - Q,), generator=generator, device=gdev)])
        ids.append(distinct[picks[torch.randperm(n, generator=generator, device=gdev)]])
        if shape.get("ragged", 1):
            cuts = torch.randint(n + 1, (B - 1,), generator=generator, device=gdev).sort().values
        else:
            cuts = torch.arange(1, B, device=gdev) * P
        offsets.append(torch.cat([cuts.new_zeros(1), cuts]) + t * n)
    return torch.cat(ids).to(device), torch.cat(offsets).to(device)


def _values(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str, generator: torch.Generator,
            low: float | None = None) -> torch.Tensor:
    """Normal(0, 1) values, or uniform in [low, low + 1) when ``low`` is given; drawn on the generator's device."""
    gdev = generator.device
    drawn = (torch.randn(shape, generator=generator, device=gdev) if low is None
             else torch.rand(shape, generator=generator, device=gdev) + low)
    return drawn.to(device=device, dtype=dtype)


def _weights(shape: Mapping[str, int], n: int, dtype: torch.dtype, device: torch.device | str,
             generator: torch.Generator) -> torch.Tensor | None:
    return _values((n,), dtype, device, generator, low=0.5) if shape.get("weighted", 0) else None


def pool_forward_inputs(shape: Mapping[str, int], dtype: torch.dtype, device: torch.device | str,
                        generator: torch.Generator) -> tuple:
    ids, offsets = bag_inputs(shape, device, generator)
    rows = _values((shape["T"] * shape["R"], shape["D"]), dtype, device, generator)
    return ids, offsets, _weights(shape, ids.numel(), dtype, device, generator), rows


def fused_update_inputs(shape: Mapping[str, int], dtype: torch.dtype, device: torch.device | str,
                        generator: torch.Generator) -> tuple:
    ids, offsets = bag_inputs(shape, device, generator)
    weights = _weights(shape, ids.numel(), dtype, device, generator)
    grad_pooled = _values((offsets.numel(), shape["D"]), dtype, device, generator)
    rows = _values((shape["T"] * shape["R"], shape["D"]), dtype, device, generator)
    state = _values((shape["T"] * shape["R"], 1), dtype, device, generator, low=0.0)
    return ids, offsets, weights, grad_pooled, rows, state, LR, EPS


# ----------------------------------------------------------------------------- cost models
# e = bytes per element of dtype; ids and offsets are int64. Bytes are the fewest a kernel must move:
# each distinct row (and its state) read once, each output written once.

def _counts(shape: Mapping[str, int]) -> tuple[int, int, int, int, int]:
    """(N lookups, bags, U distinct rows, D, weighted)."""
    T, B, P, D, Q = (int(shape[k]) for k in ("T", "B", "P", "D", "Q"))
    return T * B * P, T * B, T * Q, D, int(shape.get("weighted", 0))


def pool_forward_cost(shape: Mapping[str, int], dtype: torch.dtype) -> FlopsBytes:
    N, bags, U, D, weighted = _counts(shape)
    e = dtype.itemsize
    # flops = N*D adds (+ N*D multiplies when weighted)
    # bytes = 8N (ids) + 8 bags (offsets) + eN (weights) + eUD (each distinct row once) + e bags D (pooled)
    nbytes = INDEX_BYTES * (N + bags) + weighted * e * N + e * U * D + e * bags * D
    return FlopsBytes(float((1 + weighted) * N * D), float(nbytes))


def fused_update_cost(shape: Mapping[str, int], dtype: torch.dtype) -> FlopsBytes:
    N, bags, U, D, weighted = _counts(shape)
    e = dtype.itemsize
    # flops = N*D adds (+ N*D multiplies when weighted) + 5UD (square, sum, lr * g, divide, subtract)
    # bytes = 8N + 8 bags + eN (weights) + e bags D (d pooled) + eU(D + 1) (rows, state read) + eU(D + 1) (written)
    nbytes = INDEX_BYTES * (N + bags) + weighted * e * N + e * bags * D + 2 * e * U * (D + 1)
    return FlopsBytes(float((1 + weighted) * N * D + 5 * U * D), float(nbytes))


def rows_read_bytes(shape: Mapping[str, int], dtype: torch.dtype) -> float:
    """e*N*D: every lookup's row, as nn.EmbeddingBag benchmarks count "rows read" (the anchors' TB/s)."""
    N, _, _, D, _ = _counts(shape)
    return float(dtype.itemsize * N * D)


# ----------------------------------------------------------------------------- slots

# A tiny ragged shape with repeated rows, one whose few rows are hot (more occurrences than the update
# kernel's chunk), a mid-size weighted one, and the benchmark's 26 tables x 1M rows x 128 dims, pooling
# 20, batch 8192 (Q: the expected distinct count of 163,840 uniform draws from 1M rows).
EMBEDDING_SHAPES: tuple[Mapping[str, int], ...] = (
    {"T": 3, "B": 7, "P": 5, "R": 50, "D": 13, "Q": 11, "weighted": 1, "ragged": 1},
    {"T": 2, "B": 33, "P": 9, "R": 1000, "D": 70, "Q": 5, "weighted": 0, "ragged": 1},
    {"T": 8, "B": 1000, "P": 10, "R": 100_000, "D": 64, "Q": 9000, "weighted": 1, "ragged": 1},
    {"T": 26, "B": 8192, "P": 20, "R": 1_000_000, "D": 128, "Q": 151_124, "weighted": 0, "ragged": 0},
)

EMBEDDING_SLOTS: tuple[KernelSlot, ...] = (
    KernelSlot(
        name="embedding_pool_forward",
        signature="embedding_pool_forward(ids: int64 [N], offsets: int64 [bags], weights: [N] | None, "
                  "rows: [R, D]) -> pooled: [bags, D]",
        reference=pool_forward_reference, make_inputs=pool_forward_inputs, cost=pool_forward_cost,
        shapes=EMBEDDING_SHAPES, in_training=False,
        why="sum-pooled lookups of every table in one row space: a gather of looked-up rows, bandwidth-bound",
    ),
    KernelSlot(
        name="embedding_fused_update",
        signature="embedding_fused_update(ids: int64 [N], offsets: int64 [bags], weights: [N] | None, "
                  "grad_pooled: [bags, D], rows: [R, D], state: [R, 1], lr: float, eps: float) -> updated: [U, D+1]",
        reference=fused_update_reference, make_inputs=fused_update_inputs, cost=fused_update_cost,
        shapes=EMBEDDING_SHAPES, in_training=False,
        why="the fused backward: each touched row's gradient segment-summed once, then row-wise Adagrad; "
            "no table-sized gradient",
    ),
)

TORCH_EMBEDDING_IMPLS: dict[str, Callable] = {slot.name: slot.reference for slot in EMBEDDING_SLOTS}
