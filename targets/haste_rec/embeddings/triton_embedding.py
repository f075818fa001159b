"""Triton kernels for the embedding store's two hot operations: pooled lookups over every table in one
launch, and the fused backward + row-wise Adagrad over the rows a batch touched.

Why: pooling and the row update are pure data movement (a few flops per byte), so what matters is
reading each looked-up row once with wide loads and never materialising anything table-sized.
``nn.EmbeddingBag`` with a dense gradient writes, zeroes and re-reads a table-sized gradient and a
table-sized Adagrad state every step; the torch fused path of the store (``row_ops``) is
row-sparse but runs a dozen small ops (unique, repeat_interleave, index_select, segment_reduce,
index_copy). Here the forward is one kernel, the update one sort in torch plus one or two kernels.

Layout (the store's, see ``row_ops.TableLayout`` and ``row_ops.pool``): all tables share one row
space, so a batch is flat int64 ``ids`` [N] (shared-space rows), int64 ``offsets`` [bags] (bag
starts, table-major: bag t*B + b; the last bag ends at N; empty bags allowed), optional per-id
``weights`` [N], and ``rows`` [R, D] with unit stride along D. Pooling is a sum (the store has no
other mode); the result is [bags, D] in the rows' dtype, accumulated in fp32.

Kernels (tutorial style: kernel and launcher side by side; the torch references, input generators and
FLOP/byte models are in ``embedding_slots``, which must stay importable without triton):

- ``_gather_sum_kernel``: out[s] = sum over positions p in [starts[s], ends[s]) of
  src[index[p]] * w[p]; grid (segments, ceil(D / BLOCK_D)). Each program loads BLOCK_N indices
  at a time and a [BLOCK_N, BLOCK_D] tile of whole-row slices (contiguous along D, so loads are
  vectorised), accumulating in fp32 registers; the tile is reduced once at the end. All index
  arithmetic is int64. The pooled forward is this kernel with segments = bags, index = ids,
  src = rows; the update uses it again for long gradient segments (below).
- ``_rowwise_adagrad_kernel``: one program per BLOCK_R distinct rows (whole rows, all D), which
  sums each row's gradient and applies row-wise Adagrad in place. The launcher sorts ids once
  (stable torch.sort) and cuts the sorted positions into one segment per distinct row. A short
  segment (at most ``chunk`` occurrences) is summed by the row's program, one occurrence at a time
  in position order: grad_pooled[bag of p] * w[p]. A long one (a hot row) is first cut into chunks
  of ``chunk`` positions that ``_gather_sum_kernel`` sums in parallel into fp32 partial rows, and
  the row's program adds its partials in chunk order; so a Zipf-hot row with thousands of
  occurrences does not serialise one program. Then state += sum(g^2) / D and
  w -= lr * g / (sqrt(state) + eps), with correctly rounded division and square root, exactly
  ``row_ops.rowwise_adagrad``. No table-sized gradient, no atomics.

Meta-parameters (``EmbeddingKernelConfig``; the knobs embedding_tile_elements, embedding_num_warps and
embedding_num_stages): ``tile_elements`` (the fp32 elements of one program's [BLOCK_N or BLOCK_R, BLOCK_D]
tile), ``num_warps`` and ``num_stages``, each an int or "auto". "auto" resolves by a fixed rule of the
shape (``resolve_gather_sum``, ``resolve_update``), never by timing, so a config gives the same bits on
every run. The default is the sweep's best on the H200 (``benchmarks/embedding_kernels.py --tune``, 26 x
1M x 128, docs/results/2026-11-30-h200-kernels): a 1024-element tile and warps by the launch's tile (2 up
to 1024 elements, 4 up to 4096, else 8), Triton's default stages. It took the pooled forward from 0.844
to 0.551 ms and the fused update from 3.79 to 3.34 ms against the 4096-element tile with 4 warps
(gather-sum) and 4 or 8 (update) that the kernels launched before they were knobs. The tile sets BLOCK_N,
the positions a gather-sum program adds per step, hence the pooled sum's and the hot-row partials'
association (numerics "reorder"; BLOCK_R, the update's rows per program, does not change a row's sum);
num_warps sets how ``tl.sum`` splits its reductions over lanes and warps ("reorder"); num_stages only
changes how far the position and occurrence loops prefetch ("exact").

Determinism: no atomics anywhere. Every sum runs in an order fixed by the data and the launch
parameters (stable sort, then position order, chunk order, tile order), so repeated runs are
bitwise identical. Against torch the summation order differs (tiles and chunks vs torch's own
reductions): the ``reorder`` numerics class.

Cost model (``embedding_slots.pool_forward_cost`` and ``fused_update_cost``): the fewest bytes a kernel must move.
With N lookups, bags = T*B, U distinct rows, element size e: the forward reads ids (8N), offsets
(8 bags), weights (eN) and each distinct row once (eUD), and writes the pooled bags (e bags D).
The update reads ids, offsets, weights, the pooled gradient once (e bags D), each touched row and
its state once (eU(D+1)) and writes them once (eU(D+1)). What these kernels actually move: the
forward re-reads a row for each of its occurrences (eND, from L2 when it repeats soon), the update
reads the pooled gradient once per occurrence (eND), the sorted permutation and bags (~40N bytes in
the torch sort and the launcher) and, for hot rows, fp32 partials (8D per chunk). FLOPs: one add
(and a multiply when weighted) per looked-up element, plus about 5 per updated element.

Limits: D up to ``MAX_ROW`` (the update holds a whole row per program). bf16 works on GPU; Triton's
CPU interpreter computes bf16 wrongly, so the CPU tests cover fp32 and fp16 only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, NamedTuple

import torch
import triton
import triton.language as tl

MAX_ROW = 8192          # widest row the update kernel holds in one program
AUTO = "auto"
TILE_ELEMENTS = 1024    # auto: fp32 elements of one program's [BLOCK_N or BLOCK_R, BLOCK_D] tile
TILE_RANGE = (16, 16384)  # the tile_elements a config may set (powers of two)
MAX_BLOCK_R = 16        # most rows one update program holds (its occurrence loop runs to their longest segment)
WARPS = (1, 2, 4, 8, 16, 32)
STAGES = range(1, 9)
_SUPPORTED = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


# ----------------------------------------------------------------------------- meta-parameters

class Launch(NamedTuple):
    """One kernel launch's meta-parameters, as an ``EmbeddingKernelConfig`` resolves them for a shape."""

    block_rows: int          # BLOCK_N (gather-sum: positions per step) or BLOCK_R (update: rows per program)
    block_d: int             # BLOCK_D: elements of a row per program
    num_warps: int
    num_stages: int | None   # None: Triton's default

    def options(self) -> dict[str, int]:
        """The launch keywords: num_warps, and num_stages unless it is Triton's default."""
        return {"num_warps": self.num_warps} | ({} if self.num_stages is None else {"num_stages": self.num_stages})


@dataclass(frozen=True)
class EmbeddingKernelConfig:
    """Meta-parameters of the embedding kernels (knobs embedding_tile_elements, embedding_num_warps,
    embedding_num_stages): each an int or "auto", resolved per kernel by a fixed rule of the shape,
    never by timing. Numerics: see the module docstring (tile and warps "reorder", stages "exact").

    tile_elements: fp32 elements of one program's tile, a power of two in ``TILE_RANGE`` (auto:
    ``TILE_ELEMENTS``). The gather-sum takes BLOCK_D = the row's next power of two capped by the tile,
    and BLOCK_N = the expected segment length's next power of two capped by the tile's remaining rows;
    the update holds whole rows (BLOCK_D = next power of two of D) and BLOCK_R = tile / BLOCK_D rows,
    1 to ``MAX_BLOCK_R``.
    num_warps: one of ``WARPS`` (auto: by the launch's tile, ``_warps``, for both kernels). num_stages:
    1 to 8 (auto: Triton's default).
    """

    tile_elements: int | str = AUTO
    num_warps: int | str = AUTO
    num_stages: int | str = AUTO

    def __post_init__(self) -> None:
        lo, hi = TILE_RANGE
        for name, ok, what in (
                ("tile_elements", lambda v: lo <= v <= hi and v & (v - 1) == 0, f"a power of two from {lo} to {hi}"),
                ("num_warps", lambda v: v in WARPS, "one of " + ", ".join(map(str, WARPS))),
                ("num_stages", lambda v: v in STAGES, f"an integer from {STAGES.start} to {STAGES.stop - 1}")):
            value = getattr(self, name)
            if value != AUTO and (isinstance(value, bool) or not isinstance(value, int) or not ok(value)):
                raise ValueError(f"EmbeddingKernelConfig.{name} must be {AUTO!r} or {what}, got {value!r}")

    @property
    def tile(self) -> int:
        return TILE_ELEMENTS if self.tile_elements == AUTO else self.tile_elements

    def _warps(self, elements: int) -> int:
        """num_warps for a launch whose program holds ``elements`` fp32 values: the set value, or by size
        (2 up to 1024, 4 up to 4096, else 8; the H200 sweep's best at 1024 and at 4096 elements)."""
        if self.num_warps != AUTO:
            return self.num_warps
        return 2 if elements <= 1024 else 4 if elements <= 4096 else 8

    def _stages(self) -> int | None:
        return None if self.num_stages == AUTO else self.num_stages

    def resolve_gather_sum(self, D: int, segment_len: int) -> Launch:
        """``_gather_sum_kernel``'s launch for rows of D elements and segments of about ``segment_len`` positions:
        a whole row when it fits the tile, at most ``tile`` elements in all."""
        block_d = min(triton.next_power_of_2(max(D, 1)), self.tile)
        block_n = max(1, min(triton.next_power_of_2(max(segment_len, 1)), self.tile // block_d))
        return Launch(block_n, block_d, self._warps(block_n * block_d), self._stages())

    def resolve_update(self, D: int, block_r: int | None = None) -> Launch:
        """``_rowwise_adagrad_kernel``'s launch for rows of D elements (``block_r``: rows per program, if given)."""
        block_d = triton.next_power_of_2(max(D, 1))
        block_r = block_r or max(1, min(MAX_BLOCK_R, self.tile // block_d))
        return Launch(block_r, block_d, self._warps(block_r * block_d), self._stages())


DEFAULT_EMBEDDING_CONFIG = EmbeddingKernelConfig()


# ----------------------------------------------------------------------------- shape contract

def check_bags(ids: torch.Tensor, offsets: torch.Tensor, weights: torch.Tensor | None, rows: torch.Tensor) -> None:
    """ValueError/TypeError unless (ids, offsets, weights, rows) follow the layout in the module docstring."""
    if ids.dim() != 1 or ids.dtype != torch.int64:
        raise ValueError(f"ids must be int64 [N], got {ids.dtype} {tuple(ids.shape)}")
    if offsets.dim() != 1 or offsets.dtype != torch.int64:
        raise ValueError(f"offsets must be int64 [bags], got {offsets.dtype} {tuple(offsets.shape)}")
    if rows.dim() != 2 or rows.shape[1] < 1 or rows.dtype not in _SUPPORTED:
        raise TypeError(f"rows must be [R, D >= 1] of {_SUPPORTED}, got {rows.dtype} {tuple(rows.shape)}")
    if rows.shape[1] > 1 and rows.stride(1) != 1:
        raise ValueError("rows must be contiguous along D (stride 1)")
    if weights is not None and (weights.shape != ids.shape or not weights.is_floating_point()):
        raise ValueError(f"weights must be a float [N] = [{ids.numel()}], got {weights.dtype} {tuple(weights.shape)}")
    if any(t.device != rows.device for t in (ids, offsets) + (() if weights is None else (weights,))):
        raise ValueError("ids, offsets, weights and rows must be on one device")


def _unit_stride(t: torch.Tensor) -> torch.Tensor:
    return t if t.dim() < 2 or t.shape[1] <= 1 or t.stride(1) == 1 else t.contiguous()


# ----------------------------------------------------------------------------- gather + segment sum

@triton.jit
def _gather(index_ptr, src_ptr, weight_ptr, pos, mask, offs_d, mask_d, stride_src, HAS_WEIGHTS: tl.constexpr):
    """fp32 [len(pos), BLOCK_D]: src[index[pos]] (times weight[pos]); zero where masked."""
    row = tl.load(index_ptr + pos, mask=mask, other=0).to(tl.int64)
    vals = tl.load(src_ptr + row[:, None] * stride_src + offs_d[None, :],
                   mask=mask[:, None] & mask_d[None, :], other=0.0).to(tl.float32)
    if HAS_WEIGHTS:
        vals = vals * tl.load(weight_ptr + pos, mask=mask, other=0.0).to(tl.float32)[:, None]
    return vals


@triton.jit
def _gather_sum_kernel(index_ptr, src_ptr, weight_ptr, starts_ptr, ends_ptr, out_ptr,
                       n_ends, last_end, D, stride_src, stride_out,
                       HAS_WEIGHTS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """out[s, d-block] = sum over p in [starts[s], end) of src[index[p]] * weight[p];
    end = ends[s], or last_end for s >= n_ends."""
    seg = tl.program_id(0).to(tl.int64)
    offs_d = tl.program_id(1).to(tl.int64) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask_d = offs_d < D
    start = tl.load(starts_ptr + seg)
    end = tl.load(ends_ptr + seg, mask=seg < n_ends, other=last_end)
    acc = tl.zeros((BLOCK_N, BLOCK_D), dtype=tl.float32)
    for first in range(start, end, BLOCK_N):
        pos = first + tl.arange(0, BLOCK_N)
        acc += _gather(index_ptr, src_ptr, weight_ptr, pos, pos < end, offs_d, mask_d, stride_src, HAS_WEIGHTS)
    tl.store(out_ptr + seg * stride_out + offs_d, tl.sum(acc, axis=0).to(out_ptr.dtype.element_ty), mask=mask_d)


def _gather_sum(index: torch.Tensor, src: torch.Tensor, weights: torch.Tensor | None, starts: torch.Tensor,
                ends: torch.Tensor, last_end: int, out: torch.Tensor, segment_len: int,
                config: EmbeddingKernelConfig = DEFAULT_EMBEDDING_CONFIG) -> torch.Tensor:
    """Launch ``_gather_sum_kernel`` over out's rows (segments), BLOCK_N sized for segments of about
    ``segment_len`` positions (``config.resolve_gather_sum``); ends has one fewer entry than starts when
    last_end closes the last segment."""
    segments, D = out.shape
    if segments == 0:
        return out
    launch = config.resolve_gather_sum(D, segment_len)
    grid = (segments, triton.cdiv(D, launch.block_d))
    _gather_sum_kernel[grid](
        index, src, index if weights is None else weights, starts, ends, out,
        ends.numel(), last_end, D, src.stride(0), out.stride(0),
        HAS_WEIGHTS=weights is not None, BLOCK_N=launch.block_rows, BLOCK_D=launch.block_d, **launch.options())
    return out


# ----------------------------------------------------------------------------- pooled forward

def embedding_pool_forward(ids: torch.Tensor, offsets: torch.Tensor, weights: torch.Tensor | None,
                           rows: torch.Tensor, out: torch.Tensor | None = None,
                           block_n: int | None = None,
                           config: EmbeddingKernelConfig = DEFAULT_EMBEDDING_CONFIG) -> torch.Tensor:
    """pooled [bags, D]: pooled[i] = sum over ids[offsets[i]:offsets[i+1]] of rows[id] (* weight), all tables at once.

    Contract and cost model: ``embedding_slots.pool_forward_reference`` (``row_ops.pool``) and ``pool_forward_cost``.
    ``out`` (optional) is a [bags, D] buffer of the rows' dtype, unit stride along D; ``block_n`` (optional)
    the ids loaded per step (rounded up to a power of two; default: the mean bag's length), capped by the
    tile of ``config`` (the launch's meta-parameters, ``EmbeddingKernelConfig``).
    """
    check_bags(ids, offsets, weights, rows)
    shape = (offsets.numel(), rows.shape[1])
    if out is None:
        out = torch.empty(shape, dtype=rows.dtype, device=rows.device)
    elif tuple(out.shape) != shape or out.dtype != rows.dtype or (shape[1] > 1 and out.stride(1) != 1):
        raise ValueError(f"out must be {rows.dtype} {shape} with unit stride along D")
    if ids.numel() == 0:
        return out.zero_()
    segment_len = block_n or -(-ids.numel() // max(offsets.numel(), 1))  # the mean bag
    return _gather_sum(ids, rows, weights, offsets, offsets[1:], ids.numel(), out, segment_len, config)


# ----------------------------------------------------------------------------- fused backward + Adagrad

@triton.jit
def _rowwise_adagrad_kernel(bag_ptr, sorted_w_ptr, grad_ptr, seg_start_ptr, seg_count_ptr, chunk_start_ptr,
                            partial_ptr, row_ptr, state_index_ptr, w_ptr, s_ptr, w_out_ptr, s_out_ptr, sq_ptr,
                            U, D, chunk, stride_grad, stride_w, stride_s, stride_w_out, stride_s_out, lr, eps,
                            HAS_WEIGHTS: tl.constexpr, HAS_STATE_INDEX: tl.constexpr, IN_PLACE: tl.constexpr,
                            BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    """Rows u of one tile: g_u = sum of their occurrences' pooled gradients, then row-wise Adagrad."""
    u = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    mask_u = u < U
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < D
    mask = mask_u[:, None] & mask_d[None, :]
    # the rows and their states first: their loads are in flight while the gradients are summed
    row = tl.load(row_ptr + u, mask=mask_u, other=0).to(tl.int64)
    srow = row
    if HAS_STATE_INDEX:
        srow = tl.load(state_index_ptr + row, mask=mask_u, other=0).to(tl.int64)
    state = tl.load(s_ptr + srow * stride_s, mask=mask_u, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + row[:, None] * stride_w + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
    start = tl.load(seg_start_ptr + u, mask=mask_u, other=0)
    count = tl.load(seg_count_ptr + u, mask=mask_u, other=0)
    long = count > chunk
    # short segments: one occurrence per step, in position order
    n_short = tl.where(long, 0, count)
    acc = tl.zeros((BLOCK_R, BLOCK_D), dtype=tl.float32)
    for j in range(0, tl.max(n_short, axis=0)):
        acc += _gather(bag_ptr, grad_ptr, sorted_w_ptr, start + j, j < n_short, offs_d, mask_d, stride_grad,
                       HAS_WEIGHTS)
    # long segments: their chunks' fp32 partial sums, in chunk order
    n_chunks = tl.where(long, (count + chunk - 1) // chunk, 0)
    first = tl.load(chunk_start_ptr + u, mask=mask_u & long, other=0)
    for j in range(0, tl.max(n_chunks, axis=0)):
        acc += tl.load(partial_ptr + (first + j)[:, None] * D + offs_d[None, :],
                       mask=(j < n_chunks)[:, None] & mask_d[None, :], other=0.0)
    # row-wise Adagrad, as row_ops.rowwise_adagrad: state += mean(g^2); w -= lr * g / (sqrt(state) + eps)
    sq = tl.sum(acc * acc, axis=1)
    state = state + tl.div_rn(sq, tl.zeros_like(sq) + D)
    w = w - tl.div_rn(lr * acc, (tl.sqrt_rn(state) + eps)[:, None])
    w_dst, s_dst = u, u
    if IN_PLACE:
        w_dst, s_dst = row, srow
    tl.store(w_out_ptr + w_dst[:, None] * stride_w_out + offs_d[None, :], w.to(w_out_ptr.dtype.element_ty), mask=mask)
    tl.store(s_out_ptr + s_dst * stride_s_out, state.to(s_out_ptr.dtype.element_ty), mask=mask_u)
    tl.store(sq_ptr + u, sq, mask=mask_u)


@dataclass
class Segments:
    """A batch's positions grouped by row: what the update kernel reads (all on the batch's device)."""

    rows: torch.Tensor         # [U] distinct rows, sorted (int32 when every id fits)
    start: torch.Tensor        # [U] first sorted position of each row
    count: torch.Tensor        # [U] occurrences of each row
    bag: torch.Tensor          # [N] bag of each sorted position (int32 when the bags fit)
    weight: torch.Tensor | None  # [N] per-id weight of each sorted position
    chunk_start: torch.Tensor  # [U] first partial of a long row
    partial: torch.Tensor      # [chunks, D] fp32 partial sums of long rows' chunks


def segment_rows(ids: torch.Tensor, offsets: torch.Tensor, weights: torch.Tensor | None, grad_pooled: torch.Tensor,
                 num_rows: int, chunk: int = 32, config: EmbeddingKernelConfig = DEFAULT_EMBEDDING_CONFIG) -> Segments:
    """Sort the ids (stable: a row's occurrences stay in position order), cut one segment per distinct row,
    and sum the chunks of rows with more than ``chunk`` occurrences into fp32 partials (``_gather_sum`` as
    ``config`` says). Two host syncs (the number of distinct rows and of chunks)."""
    if chunk < 1:
        raise ValueError(f"chunk must be positive, not {chunk}")
    narrow = num_rows <= 2 ** 31  # ids < num_rows: 32-bit keys, half the radix-sort passes
    sorted_ids, perm = torch.sort(ids.to(torch.int32) if narrow else ids, stable=True)
    rows, count = torch.unique_consecutive(sorted_ids, return_counts=True)
    end = torch.cumsum(count, 0)
    start = end - count
    # the bag of each sorted position; empty bags share their successor's start, right=True skips them
    bag = torch.searchsorted(offsets, perm, right=True, out_int32=offsets.numel() < 2 ** 31) - 1
    weight = None if weights is None else weights.index_select(0, perm)
    n_chunks = torch.where(count > chunk, (count + chunk - 1) // chunk, 0)
    chunk_start = torch.cumsum(n_chunks, 0) - n_chunks
    total = int(n_chunks.sum()) if rows.numel() else 0
    partial = torch.empty((total, grad_pooled.shape[1]), dtype=torch.float32, device=ids.device)
    if total:
        seg = torch.repeat_interleave(torch.arange(rows.numel(), device=ids.device), n_chunks, output_size=total)
        lo = start[seg] + (torch.arange(total, device=ids.device) - chunk_start[seg]) * chunk
        hi = torch.minimum(lo + chunk, end[seg])
        _gather_sum(bag, grad_pooled, weight, lo, hi, 0, partial, chunk, config)
    return Segments(rows, start, count, bag, weight, chunk_start, partial)


def _adagrad(seg: Segments, grad_pooled: torch.Tensor, weight: torch.Tensor, state: torch.Tensor,
             w_out: torch.Tensor, s_out: torch.Tensor, lr: float, eps: float, chunk: int,
             state_index: torch.Tensor | None, in_place: bool, block_r: int | None,
             config: EmbeddingKernelConfig = DEFAULT_EMBEDDING_CONFIG) -> torch.Tensor:
    """Launch ``_rowwise_adagrad_kernel`` as ``config.resolve_update`` says; returns each distinct row's
    squared gradient norm (fp32 [U])."""
    U, D = seg.rows.numel(), weight.shape[1]
    sq = torch.empty(U, dtype=torch.float32, device=weight.device)
    if U == 0:
        return sq
    if D > MAX_ROW:
        raise ValueError(f"rows of {D} elements exceed the update kernel's {MAX_ROW}")
    launch = config.resolve_update(D, block_r)
    dummy = seg.rows
    _rowwise_adagrad_kernel[(triton.cdiv(U, launch.block_rows),)](
        seg.bag, dummy if seg.weight is None else seg.weight, grad_pooled, seg.start, seg.count, seg.chunk_start,
        seg.partial, seg.rows, dummy if state_index is None else state_index, weight, state, w_out, s_out, sq,
        U, D, chunk, grad_pooled.stride(0), weight.stride(0), state.stride(0), w_out.stride(0), s_out.stride(0),
        float(lr), float(eps),
        HAS_WEIGHTS=seg.weight is not None, HAS_STATE_INDEX=state_index is not None, IN_PLACE=in_place,
        BLOCK_R=launch.block_rows, BLOCK_D=launch.block_d, **launch.options())
    return sq


def _check_update(ids, offsets, weights, grad_pooled, rows, state) -> torch.Tensor:
    check_bags(ids, offsets, weights, rows)
    if tuple(grad_pooled.shape) != (offsets.numel(), rows.shape[1]) or grad_pooled.device != rows.device:
        raise ValueError(f"grad_pooled must be [bags, D] = {(offsets.numel(), rows.shape[1])} on {rows.device}, "
                         f"got {tuple(grad_pooled.shape)} on {grad_pooled.device}")
    if state.dim() not in (1, 2) or state.numel() != state.shape[0] or not state.is_floating_point() \
            or state.device != rows.device:
        raise ValueError(f"state must be a float [R] or [R, 1] on {rows.device}, got {state.dtype} "
                         f"{tuple(state.shape)}")
    return _unit_stride(grad_pooled)


def embedding_fused_update_(ids: torch.Tensor, offsets: torch.Tensor, weights: torch.Tensor | None,
                            grad_pooled: torch.Tensor, rows: torch.Tensor, state: torch.Tensor, lr: float,
                            eps: float, state_index: torch.Tensor | None = None, chunk: int = 32,
                            block_r: int | None = None,
                            config: EmbeddingKernelConfig = DEFAULT_EMBEDDING_CONFIG) -> torch.Tensor:
    """In place: each row r the batch looked up gets g_r = sum of d(pooled) of its bags (times its weights) and
    state[s] += mean(g_r^2); rows[r] -= lr * g_r / (sqrt(state[s]) + eps), with s = state_index[r] (or r).

    The trainer's path (grad mode fused). Returns the squared norm of each distinct row's gradient
    (fp32 [U], rows in sorted order), whose sum is the embedding gradient's squared norm. ``config``: both
    kernels' meta-parameters (``EmbeddingKernelConfig``).
    """
    grad_pooled = _check_update(ids, offsets, weights, grad_pooled, rows, state)
    seg = segment_rows(ids, offsets, weights, grad_pooled, rows.shape[0], chunk, config)
    return _adagrad(seg, grad_pooled, rows, state, rows, state, lr, eps, chunk, state_index, True, block_r, config)


def embedding_fused_update(ids: torch.Tensor, offsets: torch.Tensor, weights: torch.Tensor | None,
                           grad_pooled: torch.Tensor, rows: torch.Tensor, state: torch.Tensor, lr: float,
                           eps: float, out: torch.Tensor | None = None, chunk: int = 32,
                           block_r: int | None = None,
                           config: EmbeddingKernelConfig = DEFAULT_EMBEDDING_CONFIG) -> torch.Tensor:
    """[U, D + 1]: the new weights (columns :D) and Adagrad state (column D) of the U distinct looked-up rows,
    sorted by row; ``rows`` and ``state`` are left as they are (the kernel-slot form of the update).

    Contract and cost model: ``embedding_slots.fused_update_reference`` and ``fused_update_cost``.
    """
    grad_pooled = _check_update(ids, offsets, weights, grad_pooled, rows, state)
    seg = segment_rows(ids, offsets, weights, grad_pooled, rows.shape[0], chunk, config)
    shape = (seg.rows.numel(), rows.shape[1] + 1)
    if out is None:
        out = torch.empty(shape, dtype=rows.dtype, device=rows.device)
    elif tuple(out.shape) != shape or out.dtype != rows.dtype or out.stride(1) != 1:
        raise ValueError(f"out must be {rows.dtype} {shape} with unit stride along columns")
    _adagrad(seg, grad_pooled, rows, state, out, out[:, rows.shape[1]:], lr, eps, chunk, None, False, block_r,
             config)
    return out


TRITON_EMBEDDING_IMPLS: dict[str, Callable] = {
    "embedding_pool_forward": embedding_pool_forward,
    "embedding_fused_update": embedding_fused_update,
}
