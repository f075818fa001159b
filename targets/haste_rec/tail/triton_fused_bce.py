"""The HASTE tail fused with its BCE loss: logits, loss and the logits' gradient in one pass, and from
that gradient, still in registers, the weight, bias and input gradients. The B x K*G logits (and
their gradient) never reach memory: at B=256 and 670K labels that is 343 MB written and read
twice less than tail_forward + BCE + the two backward products.

Contract (``tail_fused_bce_triton``, same positional arguments as the torch reference
``tail_slots.tail_fused_bce``):

- h [B, Ht], idx int64 [K, F], w [K, G, F], bias [K, G] or None: the tail, as ``tail_forward``.
  h is bf16/fp16/fp32; w and bias may be h's dtype or fp32 (fp32 master weights under autocast:
  cast in registers, so no cast kernels; dw/dbias come back in w's/bias's dtype).
- col_weight fp32 [K, G] or None: a per-column loss weight (the trainer's padding columns are 0).
- rows, cols int64 [P]: the positives, (batch row, tail column k*G + g); a repeated pair counts once,
  a column outside [0, K*G) is ignored (the trainer passes the head's positives too), as is a row outside [0, B).
  ``positives_format`` picks how the kernel gets them (a prebuilt ``positives`` of that format is used as
  is; "auto", the default, is "bits" for G <= 64 and "list" above: ``resolve_positives_format``).
  "list": regrouped by group (``tail_positives``, a stable argsort: deterministic) so a program finds
  its group's few positives (B*labels/K ~ 0.06 per group at 670K labels) in a short loop instead of
  reading a B x K*G target mask (171 MB as bytes); but that loop's dynamic bounds sit inside the batch
  loop, and the regrouping is several launches per call. "bits" (G <= 64):
  a [K, B] bitmask, bit g of [k, b] set iff (b, k*G + g) is a positive (``tail_positive_bits``: one
  launch of atomic ORs into a zeroed tensor, no sort, no sync), so a chunk's targets are one [BLOCK_B]
  load and a shift, with no loop. Both give the same results. Compiled for sm_90, the bits kernel's batch
  loop is software-pipelined (cp.async of the words) and the list kernel's is not. On the H200 (bf16, B=256,
  F=64) bits took 1.45 ms against 1.89 at L=670K, G=32, and was faster at every measured G and L.
- scale: float, the loss's factor (1/B for the trainer's sum over labels, mean over the batch).

Returns (loss fp32 0-dim, dh [B, Ht], dw, dbias or None), with
loss = scale * sum_{b,c} col_weight[c] * (max(z,0) - z*y + log1p(exp(-|z|))) (torch's
BCEWithLogits) and the gradients of that loss. Rounding follows the unfused torch path: the
product is rounded to h's dtype, the bias added in the logits' dtype (promote(h, bias)), and the
logits' gradient rounded to that dtype when it is not fp32, then to h's dtype for the products.

Kernel (grid (K,), one group per program, BLOCK_B-row chunks as in ``triton_tail``):
z = H[:, I_k] W_k^T + b_k; y from the positives (list: a loop over the group's; bits: (bits[k, rows] >> g) & 1);
loss += w*BCE; dz = (sigmoid(z) - y)*w*scale; dbias += sum_b dz; dW_k += dz^T H[:, I_k]; dX_k = dz W_k goes to
the dim-ordered scratch, which ``triton_tail_backward.segment_sum`` reduces into dH. Deterministic: per-group
loss partials are summed by torch in fp64 (fixed order), every other output has one writer with a fixed order.

Traffic (``tail_fused_bce_traffic``): ``tail_slots.tail_fused_bce_cost`` (h, idx, w, bias, dw, dh,
positives) plus the scratch written and read once (2*e*B*K*F) and the CSR; the bitmask adds 4 or 8 *K*B
bytes (int32 for G <= 32, int64 for G <= 64) written once (the zero fill; the P atomics are scattered
read-modify-writes) and read once: 21 MB each way at B=256, K=20,940, G=32 (about 5 us each at 4.24 TB/s).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import torch
import triton
import triton.language as tl

from targets.haste_rec.tail.tail_slots import tail_fused_bce_cost
from targets.haste_rec.tail.triton_tail import (DEFAULT_CONFIG, TailKernelConfig, check_h_idx, check_operand,
                                                check_tiles, column_major, dot_acc, group_operands, load_tile)
from targets.haste_rec.tail.triton_tail_backward import SlotCSR, segment_sum, slot_csr, store_dx
from targets.protocol import FlopsBytes


@dataclass(frozen=True)
class TailPositives:
    """Positives grouped by tail group: group k's are rows[ptr[k]:ptr[k+1]] (batch rows) and
    cols[...] (label within the group, 0..G-1); int32."""

    rows: torch.Tensor
    cols: torch.Tensor
    group_ptr: torch.Tensor


POSITIVE_FORMATS = ("auto", "list", "bits")
MAX_BITS_SIZE = 64  # labels per group one bitmask word holds (int64)
_BITS_BLOCK = 1024  # pairs one program of the bitmask kernel sets


def _check_pairs(rows: torch.Tensor, cols: torch.Tensor) -> None:
    if rows.shape != cols.shape or rows.dim() != 1:
        raise ValueError(f"rows and cols must be [P], got {tuple(rows.shape)} and {tuple(cols.shape)}")


def tail_positives(rows: torch.Tensor, cols: torch.Tensor, groups: int, size: int) -> TailPositives:
    """TailPositives from (batch row, tail column) pairs; order within a group follows the input.
    Pairs whose column lies outside [0, K*G) (e.g. head labels) are ignored, without a device sync."""
    _check_pairs(rows, cols)
    inside = (cols >= 0) & (cols < groups * size)
    group = torch.where(inside, torch.div(cols, size, rounding_mode="floor"), groups)  # outside: past the end
    order = torch.argsort(group, stable=True)
    counts = torch.zeros(groups + 1, dtype=torch.int64, device=cols.device)
    counts.scatter_add_(0, group, torch.ones_like(group))  # bincount would read group.max() back from a GPU
    ptr = torch.zeros(groups + 1, dtype=torch.int64, device=cols.device)
    ptr[1:] = counts[:groups].cumsum(0)
    return TailPositives(rows[order].to(torch.int32), (cols - group * size)[order].to(torch.int32),
                         ptr.to(torch.int32))


def resolve_positives_format(positives_format: str, size: int) -> str:
    """The format the kernel reads for groups of ``size`` labels: "auto" is "bits" where a word holds a
    group (G <= 64, the faster format on the H200), else "list"."""
    if positives_format == "auto":
        return "bits" if size <= MAX_BITS_SIZE else "list"
    if positives_format not in POSITIVE_FORMATS:
        raise ValueError(f"positives_format must be one of {POSITIVE_FORMATS}, got {positives_format!r}")
    return positives_format


def positive_bits_dtype(size: int) -> torch.dtype:
    """The bitmask's word for groups of ``size`` labels: the narrowest integer with a bit per label."""
    if size > MAX_BITS_SIZE:
        raise ValueError(f"a positives bitmask holds at most {MAX_BITS_SIZE} labels per group, got G={size}: "
                         "use positives_format='list'")
    return torch.int32 if size <= 32 else torch.int64


def tail_positive_bits(rows: torch.Tensor, cols: torch.Tensor, groups: int, size: int, batch: int) -> torch.Tensor:
    """[groups, batch] words (``positive_bits_dtype(size)``), bit g of [k, b] set iff (b, k*size + g) is a pair.

    One launch of atomic ORs into a zeroed tensor, no sort and no device sync: OR is idempotent, so a
    repeated pair counts once and the result does not depend on the order the atomics land in. Pairs
    outside [0, batch) x [0, groups*size) (e.g. head labels) are ignored, as the list format ignores them."""
    _check_pairs(rows, cols)
    bits = torch.zeros((groups, batch), dtype=positive_bits_dtype(size), device=cols.device)
    if rows.numel() and bits.numel():
        _positive_bits_kernel[(triton.cdiv(rows.numel(), _BITS_BLOCK),)](
            rows.contiguous(), cols.contiguous(), bits, rows.numel(), batch, size, groups * size, BLOCK=_BITS_BLOCK)
    return bits


# ----------------------------------------------------------------------------- kernels

@triton.jit
def _positive_bits_kernel(rows_ptr, cols_ptr, bits_ptr, P, B, G, KG, BLOCK: tl.constexpr):
    """bits[k, b] |= 1 << g for each pair (b, k*G + g) inside [0, B) x [0, K*G); relaxed: only the union of
    the ORs matters, and the kernel boundary orders them before the fused kernel reads."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < P
    row = tl.load(rows_ptr + offs, mask=mask, other=0).to(tl.int64)
    col = tl.load(cols_ptr + offs, mask=mask, other=0).to(tl.int64)
    inside = mask & (row >= 0) & (row < B) & (col >= 0) & (col < KG)
    col = tl.where(inside, col, 0)
    k = col // G
    word = bits_ptr.dtype.element_ty
    bit = tl.full((BLOCK,), 1, word) << (col - k * G).to(word)
    tl.atomic_or(bits_ptr + k * B + row, bit, mask=inside, sem="relaxed")


@triton.jit
def _log1p(x):
    """log(1 + x) for x >= 0 to a few ulps (Goldberg's trick: tl.log alone loses it for small x)."""
    u = 1.0 + x
    return tl.where(u == 1.0, x, tl.log(u) * (x / tl.where(u == 1.0, 1.0, u - 1.0)))


@triton.jit
def _round_as(x, like):
    """x (fp32) rounded to like's dtype, kept in fp32."""
    return x.to(like.dtype).to(tl.float32)


@triton.jit
def _targets(prow_ptr, pcol_ptr, start, end, rows, offs_g, BLOCK_B: tl.constexpr, BLOCK_G: tl.constexpr):
    """The [BLOCK_B, BLOCK_G] 0/1 targets of a chunk, from the group's positives [start, end)."""
    y = tl.zeros((BLOCK_B, BLOCK_G), dtype=tl.float32)
    for p in range(start, end):
        b = tl.load(prow_ptr + p)
        g = tl.load(pcol_ptr + p)
        y = tl.where((rows[:, None] == b) & (offs_g[None, :] == g), 1.0, y)
    return y


@triton.jit
def _target_bits(bits_ptr, k, B, rows, mask_b, offs_g):
    """The [BLOCK_B, BLOCK_G] 0/1 targets of a chunk, from its rows' words of group k's bitmask: one load, no
    loop (offs_g < BLOCK_G <= the word's width, so every shift is defined)."""
    word = tl.load(bits_ptr + k * B + rows, mask=mask_b, other=0)
    return ((word[:, None] >> offs_g[None, :].to(word.dtype)) & 1).to(tl.float32)


@triton.jit
def _tail_fused_bce_kernel(h_ptr, idx_ptr, w_ptr, bias_ptr, cw_ptr, prow_ptr, pcol_ptr, gptr_ptr, bits_ptr, pos_ptr,
                           loss_ptr, dw_ptr, db_ptr, dx_ptr,
                           B, G, F, scale, stride_hb, stride_hh,
                           HAS_BIAS: tl.constexpr, HAS_CW: tl.constexpr, ROUND_PRODUCT: tl.constexpr,
                           ROUND_LOGITS: tl.constexpr, PRECISION: tl.constexpr, POSITIVES_AS_BITS: tl.constexpr,
                           BLOCK_B: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_F: tl.constexpr):
    k = tl.program_id(0).to(tl.int64)
    cols, w, offs_g, offs_f, mask_g, mask_f = group_operands(idx_ptr, w_ptr, k, G, F, BLOCK_G, BLOCK_F)
    w = w.to(h_ptr.dtype.element_ty)  # fp32 master weights: cast in registers
    wt = tl.trans(w)
    position = tl.load(pos_ptr + k * F + offs_f, mask=mask_f, other=0).to(tl.int64)
    col_w = tl.where(mask_g, 1.0, 0.0)
    if HAS_CW:
        col_w = tl.load(cw_ptr + k * G + offs_g, mask=mask_g, other=0.0).to(tl.float32)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + k * G + offs_g, mask=mask_g, other=0.0).to(tl.float32)
    if not POSITIVES_AS_BITS:
        start = tl.load(gptr_ptr + k)
        end = tl.load(gptr_ptr + k + 1)

    loss_acc = tl.zeros((BLOCK_G,), dtype=tl.float32)  # per column, summed over each chunk's rows
    db_acc = tl.zeros((BLOCK_G,), dtype=tl.float32)
    dw_acc = tl.zeros((BLOCK_G, BLOCK_F), dtype=tl.float32)
    for c0 in range(0, B, BLOCK_B):
        rows = c0 + tl.arange(0, BLOCK_B).to(tl.int64)
        mask_b = rows < B
        h = load_tile(h_ptr, rows, cols, stride_hb, stride_hh, mask_b, mask_f)
        z = dot_acc(h, wt, tl.zeros((BLOCK_B, BLOCK_G), dtype=tl.float32), PRECISION)
        if ROUND_PRODUCT:
            z = _round_as(z, h)
        if HAS_BIAS:
            z += bias[None, :]
            if ROUND_LOGITS:
                z = _round_as(z, h)
        if POSITIVES_AS_BITS:
            y = _target_bits(bits_ptr, k, B, rows, mask_b, offs_g)
        else:
            y = _targets(prow_ptr, pcol_ptr, start, end, rows, offs_g, BLOCK_B, BLOCK_G)
        weight = tl.where(mask_b[:, None], col_w[None, :], 0.0)
        loss_acc += tl.sum(weight * (tl.maximum(z, 0.0) - z * y + _log1p(tl.exp(-tl.abs(z)))), axis=0)
        dz = (tl.sigmoid(z) - y) * weight * scale
        if ROUND_LOGITS:
            dz = _round_as(dz, h)
        db_acc += tl.sum(dz, axis=0)
        dzc = dz.to(h.dtype)
        dw_acc = dot_acc(tl.trans(dzc), h, dw_acc, PRECISION)
        dx = dot_acc(dzc, w, tl.zeros((BLOCK_B, BLOCK_F), dtype=tl.float32), PRECISION)
        store_dx(dx_ptr, dx, rows, cols, position, mask_b, mask_f, B, 0, False)

    tl.store(loss_ptr + k, tl.sum(loss_acc, axis=0))
    tl.store(dw_ptr + k * G * F + offs_g[:, None] * F + offs_f[None, :], dw_acc.to(dw_ptr.dtype.element_ty),
             mask=mask_g[:, None] & mask_f[None, :])
    if HAS_BIAS:
        tl.store(db_ptr + k * G + offs_g, db_acc.to(db_ptr.dtype.element_ty), mask=mask_g)


# ----------------------------------------------------------------------------- launcher

def _kernel_positives(positives_format: str, positives: TailPositives | torch.Tensor | None, rows: torch.Tensor,
                      cols: torch.Tensor, groups: int, size: int, batch: int, device: torch.device
                      ) -> tuple[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]:
    """The format the kernel reads ("auto" resolved) and its (rows, cols, group_ptr, bits) operands: the
    format's own, built when not given, and placeholders the kernel never reads for the other format's."""
    positives_format = resolve_positives_format(positives_format, size)
    if positives_format == "list":
        if positives is None:
            positives = tail_positives(rows, cols, groups, size)
        elif not isinstance(positives, TailPositives):
            raise ValueError(f"positives_format='list' takes TailPositives, got {type(positives).__name__}")
        return positives_format, (positives.rows, positives.cols, positives.group_ptr, positives.group_ptr)
    dtype = positive_bits_dtype(size)
    if positives is None:
        positives = tail_positive_bits(rows, cols, groups, size, batch)
    elif not (torch.is_tensor(positives) and tuple(positives.shape) == (groups, batch)
              and positives.dtype == dtype and positives.device == device):
        raise ValueError(f"positives_format='bits' takes the [{groups}, {batch}] {dtype} bitmask of "
                         f"tail_positive_bits on {device}")
    bits = positives.contiguous()
    return positives_format, (bits, bits, bits, bits)


def tail_fused_bce_triton(h: torch.Tensor, idx: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None,
                          col_weight: torch.Tensor | None, rows: torch.Tensor, cols: torch.Tensor, scale: float,
                          positives: TailPositives | torch.Tensor | None = None, csr: SlotCSR | None = None,
                          config: TailKernelConfig = DEFAULT_CONFIG, *, positives_format: str = "auto"
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(loss, dh, dw, dbias): see the module docstring. ``positives`` (``tail_positives`` for "list",
    ``tail_positive_bits`` for "bits", from rows and cols) and ``csr`` (``slot_csr(idx, Ht)``) are built
    when not given. "auto" reads the positives as a bitmask where G <= 64 (the faster format on the H200),
    as a list above."""
    check_h_idx(h, idx)
    if w.dim() != 3:
        raise ValueError(f"w must be [K, G, F], got shape {tuple(w.shape)}")
    K, G, F = w.shape
    B, Ht = h.shape
    check_operand(idx, (K, F), idx, "idx (to match w's K and F)")
    for name, t, shape in (("w", w, (K, G, F)), ("bias", bias, (K, G))):
        if t is not None:
            check_operand(t, shape, h, name, any_float=True)
            if t.dtype not in (h.dtype, torch.float32):
                raise ValueError(f"{name} must be {h.dtype} or float32, got {t.dtype}")
    if col_weight is not None:
        check_operand(col_weight, (K, G), h, "col_weight", any_float=True)
    BLOCK_G, BLOCK_F = check_tiles(G, F)
    positives_format, (prows, pcols, gptr, bits) = _kernel_positives(positives_format, positives, rows, cols,
                                                                      K, G, B, h.device)
    csr = slot_csr(idx, Ht) if csr is None else csr

    loss_part = torch.empty(K, dtype=torch.float32, device=h.device)
    dw = torch.empty_like(w, memory_format=torch.contiguous_format)
    dbias = None if bias is None else torch.empty_like(bias, memory_format=torch.contiguous_format)
    dh = torch.empty((B, Ht), dtype=h.dtype, device=h.device)
    if B == 0:
        dw.zero_()
        return loss_part.new_zeros(()), dh, dw, None if dbias is None else dbias.zero_()
    scratch = torch.empty((K * F, B), dtype=h.dtype, device=h.device)
    hc = column_major(h)
    logits_dtype = h.dtype if bias is None else torch.promote_types(h.dtype, bias.dtype)
    block_b, num_warps, num_stages = config.resolve(B, G, F, fused_dtype=h.dtype)
    _tail_fused_bce_kernel[(K,)](
        hc, idx.contiguous(), w.contiguous(), w if bias is None else bias.contiguous(),
        w if col_weight is None else col_weight.float().contiguous(),
        prows, pcols, gptr, bits, csr.position,
        loss_part, dw, dw if dbias is None else dbias, scratch,
        B, G, F, float(scale), hc.stride(0), hc.stride(1),
        HAS_BIAS=bias is not None, HAS_CW=col_weight is not None, ROUND_PRODUCT=h.dtype != torch.float32,
        ROUND_LOGITS=logits_dtype != torch.float32, PRECISION=config.dot_precision(h.dtype),
        POSITIVES_AS_BITS=positives_format == "bits",
        BLOCK_B=block_b, BLOCK_G=BLOCK_G, BLOCK_F=BLOCK_F, num_warps=num_warps, num_stages=num_stages)
    segment_sum(scratch, csr, B, dh)
    loss = (loss_part.double().sum() * scale).float()
    return loss, dh, dw, dbias


def tail_fused_bce_traffic(shape: Mapping[str, int], dtype: torch.dtype, positives_format: str = "auto"
                           ) -> FlopsBytes:
    """What the kernels move: the minimum plus the dX scratch written and read once and the CSR reads;
    with "bits", the bitmask written once (zero fill) and read once."""
    minimum = tail_fused_bce_cost(shape, dtype)
    B, Ht, K, G, F = (shape[k] for k in ("B", "Ht", "K", "G", "F"))
    extra = 2 * dtype.itemsize * B * K * F + 4 * (2 * K * F + Ht + 1) + 4 * K
    if resolve_positives_format(positives_format, G) == "bits":
        extra += 2 * positive_bits_dtype(G).itemsize * K * B
    return FlopsBytes(minimum.flops, minimum.bytes + extra)
