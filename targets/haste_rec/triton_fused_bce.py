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
  a column outside [0, K*G) (the trainer passes the head's positives too) or a row outside [0, B)
  is ignored.
- scale: float, the loss's factor (1/B for the trainer's sum over labels, mean over the batch).

Returns (loss fp32 0-dim, dh [B, Ht], dw, dbias or None), with
loss = scale * sum_{b,c} col_weight[c] * (max(z,0) - z*y + log1p(exp(-|z|))) (torch's
BCEWithLogits) and the gradients of that loss. Rounding follows the unfused torch path: the
product is rounded to h's dtype, the bias added in the logits' dtype (promote(h, bias)), and the
logits' gradient rounded to that dtype when it is not fp32, then to h's dtype for the products.

Targets (``tail_targets``): a bitmask int32 [K, B, ceil(G/32)], bit g of word (k, b, g // 32) set
when (b, k*G + g) is a positive: one memset and one small Triton kernel (``tl.atomic_or``: OR is
idempotent and commutative, so the bits never depend on the order, and a repeated pair is just set
twice). 1 bit per logit (21 MB at 670K labels, B=256: 1/16 of the bf16 logits), read as one
[BLOCK_K, BLOCK_B, BLOCK_G] load per chunk. It replaces a per-group positives list walked by a
loop inside the batch loop: Triton never software-pipelines a loop that contains another loop, so
that version ran its batch loop with no prefetch (and its launcher cost an argsort, a bincount
with a device sync and ~20 small launches).

Kernel (grid (K / BLOCK_K,), BLOCK_K groups per program (``TailKernelConfig.block_k``, auto 1
here: three products per chunk), BLOCK_B-row chunks as in ``triton_tail``):
z = H[:, I_k] W_k^T + b_k; y from the bitmask; loss += w*BCE; dz = (sigmoid(z) - y)*w*scale;
dbias += sum_b dz; dW_k += dz^T H[:, I_k]; dX_k = dz W_k goes to the dim-ordered scratch, which
``triton_tail_backward.segment_sum`` reduces into dH. One exp, one log and two fast divisions per
logit (sigmoid and log1p share exp(-|z|)). Deterministic: the loss partials (fp32, one per
program) are summed once by torch in fp64 (fixed order); every other output has one writer with a
fixed order.

Launches per call: the bitmask memset and marking kernel (2), the column-major copy of h (1, when
h is row-major), the fused kernel (1), the segmented sum (1), the loss sum, scale and cast (3): 8.
No host sync. Bytes (``tail_fused_bce_traffic``), at B=256, Ht=768, K=20,940, G=32, F=64 in bf16:
the minimum ``tail_slots.tail_fused_bce_cost`` (h, idx, w, bias, dw, dbias, dh, positives: 0.19 GB)
plus the dX scratch written and read once (2*e*B*K*F = 1.37 GB), the bitmask written and read
(2*4*K*B*ceil(G/32) = 43 MB), the int32 CSR position/row_ptr (5.4 MB) and the copy of h (0.8 MB):
1.61 GB, 0.38 ms at 4.23 TB/s. The scratch dominates: it is the price of a deterministic dH
without atomics (see ``triton_tail_backward``).
"""

from __future__ import annotations

from typing import Mapping

import torch
import triton
import triton.language as tl

from targets.haste_rec.tail_slots import tail_fused_bce_cost
from targets.haste_rec.triton_tail import (DEFAULT_CONFIG, TailKernelConfig, _bmm, _gather_h, _group_index,
                                           _group_weights, _groups, check_h_idx, check_operand, check_tiles,
                                           column_major)
from targets.haste_rec.triton_tail_backward import SlotCSR, _store_dx, segment_sum, slot_csr
from targets.protocol import FlopsBytes

MARK_BLOCK = 1024  # positives per program of the bitmask kernel


# ----------------------------------------------------------------------------- targets

@triton.jit
def _mark_targets_kernel(rows_ptr, cols_ptr, bits_ptr, P, B, G, KG, NW, BLOCK: tl.constexpr):
    p = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = p < P
    r = tl.load(rows_ptr + p, mask=mask, other=0).to(tl.int64)
    c = tl.load(cols_ptr + p, mask=mask, other=0).to(tl.int64)
    mask = mask & (c >= 0) & (c < KG) & (r >= 0) & (r < B)
    c = tl.where(mask, c, 0)
    r = tl.where(mask, r, 0)
    g = c % G
    bit = tl.full((BLOCK,), 1, tl.int32) << (g % 32).to(tl.int32)
    tl.atomic_or(bits_ptr + ((c // G) * B + r) * NW + g // 32, bit, mask=mask)


def tail_targets(rows: torch.Tensor, cols: torch.Tensor, batch: int, groups: int, size: int) -> torch.Tensor:
    """The positives as a bitmask int32 [K, B, ceil(G/32)]: bit g % 32 of word [k, b, g // 32] is set
    when some p has (rows[p], cols[p]) == (b, k*G + g). Pairs outside [0, B) x [0, K*G) are ignored."""
    if rows.shape != cols.shape or rows.dim() != 1:
        raise ValueError(f"rows and cols must be [P], got {tuple(rows.shape)} and {tuple(cols.shape)}")
    bits = torch.zeros((groups, batch, triton.cdiv(size, 32)), dtype=torch.int32, device=cols.device)
    if rows.numel() and bits.numel():
        _mark_targets_kernel[(triton.cdiv(rows.numel(), MARK_BLOCK),)](
            rows.contiguous(), cols.contiguous(), bits, rows.numel(), batch, size, groups * size, bits.shape[2],
            BLOCK=MARK_BLOCK)
    return bits


# ----------------------------------------------------------------------------- kernel

@triton.jit
def _round_as(x, like):
    """x (fp32) rounded to like's dtype, kept in fp32."""
    return x.to(like.dtype).to(tl.float32)


@triton.jit
def _tail_fused_bce_kernel(h_ptr, idx_ptr, w_ptr, bias_ptr, cw_ptr, bits_ptr, pos_ptr,
                           loss_ptr, dw_ptr, db_ptr, dx_ptr,
                           B, K, G, F, NW, scale, stride_hb, stride_hh,
                           HAS_BIAS: tl.constexpr, HAS_CW: tl.constexpr, ROUND_PRODUCT: tl.constexpr,
                           ROUND_LOGITS: tl.constexpr, IEEE: tl.constexpr, BLOCK_K: tl.constexpr,
                           BLOCK_B: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_F: tl.constexpr):
    groups, offs_g, offs_f, mask_k, mask_g, mask_f = _groups(K, G, F, BLOCK_K, BLOCK_G, BLOCK_F)
    mask_kf = mask_k[:, None] & mask_f[None, :]
    mask_kg = mask_k[:, None] & mask_g[None, :]
    cols = _group_index(idx_ptr, groups, offs_f, mask_k, mask_f, F)
    position = _group_index(pos_ptr, groups, offs_f, mask_k, mask_f, F).to(tl.int64)
    w = _group_weights(w_ptr, groups, offs_g, offs_f, mask_k, mask_g, mask_f, G, F)
    w = w.to(h_ptr.dtype.element_ty)  # fp32 master weights: cast in registers
    wt = tl.permute(w, (0, 2, 1))
    col_w = tl.where(mask_kg, 1.0, 0.0)
    if HAS_CW:
        col_w = tl.load(cw_ptr + groups[:, None] * G + offs_g[None, :], mask=mask_kg, other=0.0).to(tl.float32)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + groups[:, None] * G + offs_g[None, :], mask=mask_kg, other=0.0).to(tl.float32)
    word = (groups[:, None, None] * B) * NW + (offs_g // 32)[None, None, :]  # + row * NW
    shift = (offs_g % 32)[None, None, :]

    loss_acc = tl.zeros((BLOCK_K, BLOCK_G), dtype=tl.float32)  # per column, summed over each chunk's rows
    db_acc = tl.zeros((BLOCK_K, BLOCK_G), dtype=tl.float32)
    dw_acc = tl.zeros((BLOCK_K, BLOCK_G, BLOCK_F), dtype=tl.float32)
    for c0 in range(0, B, BLOCK_B):
        rows = c0 + tl.arange(0, BLOCK_B).to(tl.int64)
        mask_b = rows < B
        h = _gather_h(h_ptr, rows, cols, stride_hb, stride_hh, mask_b, mask_kf)
        z = _bmm(h, wt, tl.zeros((BLOCK_K, BLOCK_B, BLOCK_G), dtype=tl.float32), IEEE, BLOCK_K)
        if ROUND_PRODUCT:
            z = _round_as(z, h)
        if HAS_BIAS:
            z += bias[:, None, :]
            if ROUND_LOGITS:
                z = _round_as(z, h)
        bits = tl.load(bits_ptr + word + rows[None, :, None] * NW,
                       mask=mask_kg[:, None, :] & mask_b[None, :, None], other=0)
        y = ((bits >> shift) & 1).to(tl.float32)
        weight = tl.where(mask_b[None, :, None], col_w[:, None, :], 0.0)
        e = tl.exp(-tl.abs(z))   # shared by log1p(exp(-|z|)) and the sigmoid
        u = 1.0 + e
        inv = tl.fdiv(1.0, u)
        # log1p(e) to a few ulps (Goldberg's trick: tl.log(u) alone loses it for small e)
        log1p_e = tl.where(u == 1.0, e, tl.log(u) * tl.fdiv(e, tl.where(u == 1.0, 1.0, u - 1.0)))
        loss_acc += tl.sum(weight * (tl.maximum(z, 0.0) - z * y + log1p_e), axis=1)
        dz = (tl.where(z >= 0, inv, e * inv) - y) * weight * scale
        if ROUND_LOGITS:
            dz = _round_as(dz, h)
        db_acc += tl.sum(dz, axis=1)
        dzc = dz.to(h.dtype)
        dw_acc = _bmm(tl.permute(dzc, (0, 2, 1)), h, dw_acc, IEEE, BLOCK_K)
        dx = _bmm(dzc, w, tl.zeros((BLOCK_K, BLOCK_B, BLOCK_F), dtype=tl.float32), IEEE, BLOCK_K)
        _store_dx(dx_ptr, dx, rows, cols, position, mask_b, mask_kf, B, 0, False)

    tl.store(loss_ptr + tl.program_id(0), tl.sum(tl.sum(loss_acc, axis=1), axis=0))
    tl.store(dw_ptr + groups[:, None, None] * G * F + offs_g[None, :, None] * F + offs_f[None, None, :],
             dw_acc.to(dw_ptr.dtype.element_ty), mask=mask_kg[:, :, None] & mask_f[None, None, :])
    if HAS_BIAS:
        tl.store(db_ptr + groups[:, None] * G + offs_g[None, :], db_acc.to(db_ptr.dtype.element_ty), mask=mask_kg)


# ----------------------------------------------------------------------------- launcher

def tail_fused_bce_triton(h: torch.Tensor, idx: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None,
                          col_weight: torch.Tensor | None, rows: torch.Tensor, cols: torch.Tensor, scale: float,
                          targets: torch.Tensor | None = None, csr: SlotCSR | None = None,
                          config: TailKernelConfig = DEFAULT_CONFIG
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(loss, dh, dw, dbias): see the module docstring. ``targets`` (``tail_targets`` of rows and cols)
    and ``csr`` (``slot_csr(idx, Ht)``) are built when not given."""
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
    words = triton.cdiv(G, 32)
    if targets is None:
        targets = tail_targets(rows, cols, B, K, G)
    elif tuple(targets.shape) != (K, B, words) or targets.dtype != torch.int32 or not targets.is_contiguous():
        raise ValueError(f"targets must be a contiguous int32 [{K}, {B}, {words}] (tail_targets)")
    csr = slot_csr(idx, Ht) if csr is None else csr

    block_k = config.groups_per_program(G, F, fused=True)
    n_programs = triton.cdiv(K, block_k)
    loss_part = torch.empty(n_programs, dtype=torch.float32, device=h.device)
    dw = torch.empty_like(w, memory_format=torch.contiguous_format)
    dbias = None if bias is None else torch.empty_like(bias, memory_format=torch.contiguous_format)
    dh = torch.empty((B, Ht), dtype=h.dtype, device=h.device)
    if B == 0:
        dw.zero_()
        return loss_part.new_zeros(()), dh, dw, None if dbias is None else dbias.zero_()
    scratch = torch.empty((K * F, B), dtype=h.dtype, device=h.device)
    hc = column_major(h)
    logits_dtype = h.dtype if bias is None else torch.promote_types(h.dtype, bias.dtype)
    block_b, num_warps, num_stages = config.resolve(B, G, F, block_k)
    _tail_fused_bce_kernel[(n_programs,)](
        hc, idx.contiguous(), w.contiguous(), w if bias is None else bias.contiguous(),
        w if col_weight is None else col_weight.float().contiguous(), targets, csr.position,
        loss_part, dw, dw if dbias is None else dbias, scratch,
        B, K, G, F, words, float(scale), hc.stride(0), hc.stride(1),
        HAS_BIAS=bias is not None, HAS_CW=col_weight is not None, ROUND_PRODUCT=h.dtype != torch.float32,
        ROUND_LOGITS=logits_dtype != torch.float32, IEEE=h.dtype == torch.float32, BLOCK_K=block_k,
        BLOCK_B=block_b, BLOCK_G=BLOCK_G, BLOCK_F=BLOCK_F, num_warps=num_warps, num_stages=num_stages)
    segment_sum(scratch, csr, B, dh, block_r=config.segment_block_r(B))
    loss = (loss_part.sum(dtype=torch.float64) * scale).float()
    return loss, dh, dw, dbias


def tail_fused_bce_traffic(shape: Mapping[str, int], dtype: torch.dtype) -> FlopsBytes:
    """What the kernels move: the minimum plus the dX scratch written and read once, the int32 CSR
    (position, row_ptr), the targets bitmask written and read once, the loss partials (at most one
    per group) and the column-major copy of h."""
    minimum = tail_fused_bce_cost(shape, dtype)
    B, Ht, K, G, F = (shape[k] for k in ("B", "Ht", "K", "G", "F"))
    e = dtype.itemsize
    extra = (2 * e * B * K * F + 4 * (K * F + Ht + 1) + 2 * 4 * K * B * triton.cdiv(G, 32) + 2 * 4 * K
             + 2 * e * B * Ht)
    return FlopsBytes(minimum.flops, minimum.bytes + extra)
