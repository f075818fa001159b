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
  a column outside [0, K*G) is ignored (the trainer passes the head's positives too).
  They are regrouped by group (``tail_positives``, a stable argsort: deterministic) so a program
  finds its group's few positives (B*labels/K ~ 0.06 per group at 670K labels) in a short loop
  instead of reading a B x K*G target mask (171 MB as bytes).
- scale: float, the loss's factor (1/B for the trainer's sum over labels, mean over the batch).

Returns (loss fp32 0-dim, dh [B, Ht], dw, dbias or None), with
loss = scale * sum_{b,c} col_weight[c] * (max(z,0) - z*y + log1p(exp(-|z|))) (torch's
BCEWithLogits) and the gradients of that loss. Rounding follows the unfused torch path: the
product is rounded to h's dtype, the bias added in the logits' dtype (promote(h, bias)), and the
logits' gradient rounded to that dtype when it is not fp32, then to h's dtype for the products.

Kernel (grid (K,), one group per program, BLOCK_B-row chunks as in ``triton_tail``):
z = H[:, I_k] W_k^T + b_k; y from the positives; loss += w*BCE; dz = (sigmoid(z) - y)*w*scale;
dbias += sum_b dz; dW_k += dz^T H[:, I_k]; dX_k = dz W_k goes to the dim-ordered scratch, which
``triton_tail_backward.segment_sum`` reduces into dH. Deterministic: per-group loss partials are
summed by torch in fp64 (fixed order), every other output has one writer with a fixed order.

Traffic (``tail_fused_bce_traffic``): ``tail_slots.tail_fused_bce_cost`` (h, idx, w, bias, dw, dh,
positives) plus the scratch written and read once (2*e*B*K*F) and the CSR.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import torch
import triton
import triton.language as tl

from targets.haste_rec.tail_slots import tail_fused_bce_cost
from targets.haste_rec.triton_tail import (DEFAULT_CONFIG, TailKernelConfig, _group_operands, _load_tile, _mm,
                                           check_h_idx, check_operand, check_tiles, column_major)
from targets.haste_rec.triton_tail_backward import SlotCSR, _store_dx, segment_sum, slot_csr
from targets.protocol import FlopsBytes


@dataclass(frozen=True)
class TailPositives:
    """Positives grouped by tail group: group k's are rows[ptr[k]:ptr[k+1]] (batch rows) and
    cols[...] (label within the group, 0..G-1); int32."""

    rows: torch.Tensor
    cols: torch.Tensor
    group_ptr: torch.Tensor


def tail_positives(rows: torch.Tensor, cols: torch.Tensor, groups: int, size: int) -> TailPositives:
    """TailPositives from (batch row, tail column) pairs; order within a group follows the input.
    Pairs whose column lies outside [0, K*G) (e.g. head labels) are ignored, without a device sync."""
    if rows.shape != cols.shape or rows.dim() != 1:
        raise ValueError(f"rows and cols must be [P], got {tuple(rows.shape)} and {tuple(cols.shape)}")
    inside = (cols >= 0) & (cols < groups * size)
    group = torch.where(inside, torch.div(cols, size, rounding_mode="floor"), groups)  # outside: past the end
    order = torch.argsort(group, stable=True)
    ptr = torch.zeros(groups + 1, dtype=torch.int64, device=cols.device)
    ptr[1:] = torch.bincount(group, minlength=groups + 1)[:groups].cumsum(0)
    return TailPositives(rows[order].to(torch.int32), (cols - group * size)[order].to(torch.int32),
                         ptr.to(torch.int32))


# ----------------------------------------------------------------------------- kernel

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
def _tail_fused_bce_kernel(h_ptr, idx_ptr, w_ptr, bias_ptr, cw_ptr, prow_ptr, pcol_ptr, gptr_ptr, pos_ptr,
                           loss_ptr, dw_ptr, db_ptr, dx_ptr,
                           B, G, F, scale, stride_hb, stride_hh,
                           HAS_BIAS: tl.constexpr, HAS_CW: tl.constexpr, ROUND_PRODUCT: tl.constexpr,
                           ROUND_LOGITS: tl.constexpr, IEEE: tl.constexpr,
                           BLOCK_B: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_F: tl.constexpr):
    k = tl.program_id(0).to(tl.int64)
    cols, w, offs_g, offs_f, mask_g, mask_f = _group_operands(idx_ptr, w_ptr, k, G, F, BLOCK_G, BLOCK_F)
    w = w.to(h_ptr.dtype.element_ty)  # fp32 master weights: cast in registers
    wt = tl.trans(w)
    position = tl.load(pos_ptr + k * F + offs_f, mask=mask_f, other=0).to(tl.int64)
    col_w = tl.where(mask_g, 1.0, 0.0)
    if HAS_CW:
        col_w = tl.load(cw_ptr + k * G + offs_g, mask=mask_g, other=0.0).to(tl.float32)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + k * G + offs_g, mask=mask_g, other=0.0).to(tl.float32)
    start = tl.load(gptr_ptr + k)
    end = tl.load(gptr_ptr + k + 1)

    loss_acc = tl.zeros((BLOCK_G,), dtype=tl.float32)  # per column, summed over each chunk's rows
    db_acc = tl.zeros((BLOCK_G,), dtype=tl.float32)
    dw_acc = tl.zeros((BLOCK_G, BLOCK_F), dtype=tl.float32)
    for c0 in range(0, B, BLOCK_B):
        rows = c0 + tl.arange(0, BLOCK_B).to(tl.int64)
        mask_b = rows < B
        h = _load_tile(h_ptr, rows, cols, stride_hb, stride_hh, mask_b, mask_f)
        z = _mm(h, wt, tl.zeros((BLOCK_B, BLOCK_G), dtype=tl.float32), IEEE)
        if ROUND_PRODUCT:
            z = _round_as(z, h)
        if HAS_BIAS:
            z += bias[None, :]
            if ROUND_LOGITS:
                z = _round_as(z, h)
        y = _targets(prow_ptr, pcol_ptr, start, end, rows, offs_g, BLOCK_B, BLOCK_G)
        weight = tl.where(mask_b[:, None], col_w[None, :], 0.0)
        loss_acc += tl.sum(weight * (tl.maximum(z, 0.0) - z * y + _log1p(tl.exp(-tl.abs(z)))), axis=0)
        dz = (tl.sigmoid(z) - y) * weight * scale
        if ROUND_LOGITS:
            dz = _round_as(dz, h)
        db_acc += tl.sum(dz, axis=0)
        dzc = dz.to(h.dtype)
        dw_acc = _mm(tl.trans(dzc), h, dw_acc, IEEE)
        dx = _mm(dzc, w, tl.zeros((BLOCK_B, BLOCK_F), dtype=tl.float32), IEEE)
        _store_dx(dx_ptr, dx, rows, cols, position, mask_b, mask_f, B, 0, False)

    tl.store(loss_ptr + k, tl.sum(loss_acc, axis=0))
    tl.store(dw_ptr + k * G * F + offs_g[:, None] * F + offs_f[None, :], dw_acc.to(dw_ptr.dtype.element_ty),
             mask=mask_g[:, None] & mask_f[None, :])
    if HAS_BIAS:
        tl.store(db_ptr + k * G + offs_g, db_acc.to(db_ptr.dtype.element_ty), mask=mask_g)


# ----------------------------------------------------------------------------- launcher

def tail_fused_bce_triton(h: torch.Tensor, idx: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None,
                          col_weight: torch.Tensor | None, rows: torch.Tensor, cols: torch.Tensor, scale: float,
                          positives: TailPositives | None = None, csr: SlotCSR | None = None,
                          config: TailKernelConfig = DEFAULT_CONFIG
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(loss, dh, dw, dbias): see the module docstring. ``positives`` (from rows and cols) and ``csr``
    (``slot_csr(idx, Ht)``) are built when not given."""
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
    positives = tail_positives(rows, cols, K, G) if positives is None else positives
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
    block_b, num_warps, num_stages = config.resolve(B, G, F)
    _tail_fused_bce_kernel[(K,)](
        hc, idx.contiguous(), w.contiguous(), w if bias is None else bias.contiguous(),
        w if col_weight is None else col_weight.float().contiguous(),
        positives.rows, positives.cols, positives.group_ptr, csr.position,
        loss_part, dw, dw if dbias is None else dbias, scratch,
        B, G, F, float(scale), hc.stride(0), hc.stride(1),
        HAS_BIAS=bias is not None, HAS_CW=col_weight is not None, ROUND_PRODUCT=h.dtype != torch.float32,
        ROUND_LOGITS=logits_dtype != torch.float32, IEEE=h.dtype == torch.float32,
        BLOCK_B=block_b, BLOCK_G=BLOCK_G, BLOCK_F=BLOCK_F, num_warps=num_warps, num_stages=num_stages)
    segment_sum(scratch, csr, B, dh)
    loss = (loss_part.double().sum() * scale).float()
    return loss, dh, dw, dbias


def tail_fused_bce_traffic(shape: Mapping[str, int], dtype: torch.dtype) -> FlopsBytes:
    """What the kernels move: the minimum plus the dX scratch written and read once and the CSR reads."""
    minimum = tail_fused_bce_cost(shape, dtype)
    B, Ht, K, F = (shape[k] for k in ("B", "Ht", "K", "F"))
    extra = 2 * dtype.itemsize * B * K * F + 4 * (2 * K * F + Ht + 1) + 4 * K
    return FlopsBytes(minimum.flops, minimum.bytes + extra)
