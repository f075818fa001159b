"""Per-label fixed fan-in (Spartex-style: each label l its own F input dims idx[l]) in Triton: the
baseline HASTE's group-shared layout is measured against (forward up to 4.4x, backward up to 25x
in the paper). Written to be a fair baseline, not a straw man: the same column-major h and
deterministic segmented sum as the group-shared kernels, only without what sharing buys.

Without a shared fan-in there is no tile for ``tl.dot``: every label is a length-F dot product
over its own gather, so the work runs on CUDA cores and every (row, label, f) term gathers its own
element of h (B*L*F gathered loads, L1/L2-served). That, not HBM, is what bounds these kernels.

- forward (grid (L / BLOCK_L, B / BLOCK_B), label blocks fastest so the programs in flight share
  one batch block of h in cache): z[b, l] = sum_f w[l, f] * h[b, idx[l, f]], in F chunks of
  BLOCK_FC: a [BLOCK_L, BLOCK_FC, BLOCK_B] gathered tile reduced over its middle axis.
- backward weight (grid (L / BLOCK_L,)): dw[l, f] = sum_b dz[b, l] * h[b, idx[l, f]], per F chunk a
  [BLOCK_L, BLOCK_FC, BLOCK_B] tile reduced over the batch; the program's dz columns stay in L1.
- backward input: dh[b, d] = sum over (l, f) with idx[l, f] == d of dz[b, l] * w[l, f]: the
  transposed index over L*F slots (``triton_tail_backward.slot_csr``) and the segmented sum in
  GATHER mode over dz^T (each slot reads its label's dz row; the launcher transposes dz, 2*e*B*L
  bytes). No scratch: a slot's product is one multiply, done where it is summed. Deterministic.

Costs: ``tail_slots.perlabel_forward_cost``, ``perlabel_backward_weight_cost``,
``perlabel_backward_input_cost`` (minimum traffic; the gathers come on top, from cache).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from targets.haste_rec.tail.triton_tail import check_h_idx, check_operand, column_major
from targets.haste_rec.tail.triton_tail_backward import SlotCSR, segment_sum, slot_csr

BLOCK_L = 32    # labels per program
BLOCK_B = 64    # batch rows per program (forward) or per step (weight gradient)
BLOCK_FC = 4    # fan-in terms per gathered tile


@triton.jit
def _gather3(h_ptr, cols, rows, stride_hb, stride_hh, mask_lf, mask_b):
    """h[rows, cols] as a [BLOCK_L, BLOCK_FC, BLOCK_B] fp32 tile (cols [BLOCK_L, BLOCK_FC])."""
    ptrs = h_ptr + cols[:, :, None] * stride_hh + rows[None, None, :] * stride_hb
    return tl.load(ptrs, mask=mask_lf[:, :, None] & mask_b[None, None, :], other=0.0).to(tl.float32)


@triton.jit
def _perlabel_forward_kernel(h_ptr, idx_ptr, w_ptr, z_ptr, B, L, F,
                             stride_hb, stride_hh, stride_zb,
                             BLOCK_L: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_FC: tl.constexpr):
    labels = tl.program_id(0) * BLOCK_L + tl.arange(0, BLOCK_L).to(tl.int64)
    rows = tl.program_id(1) * BLOCK_B + tl.arange(0, BLOCK_B).to(tl.int64)
    mask_l = labels < L
    mask_b = rows < B
    acc = tl.zeros((BLOCK_L, BLOCK_B), dtype=tl.float32)
    for f0 in range(0, F, BLOCK_FC):
        offs_f = f0 + tl.arange(0, BLOCK_FC)
        mask_lf = mask_l[:, None] & (offs_f < F)[None, :]
        cols = tl.load(idx_ptr + labels[:, None] * F + offs_f[None, :], mask=mask_lf, other=0)
        w = tl.load(w_ptr + labels[:, None] * F + offs_f[None, :], mask=mask_lf, other=0.0).to(tl.float32)
        acc += tl.sum(w[:, :, None] * _gather3(h_ptr, cols, rows, stride_hb, stride_hh, mask_lf, mask_b), axis=1)
    tl.store(z_ptr + rows[None, :] * stride_zb + labels[:, None], acc.to(z_ptr.dtype.element_ty),
             mask=mask_l[:, None] & mask_b[None, :])


@triton.jit
def _perlabel_backward_weight_kernel(dz_ptr, h_ptr, idx_ptr, dw_ptr, B, L, F,
                                     stride_db, stride_dl, stride_hb, stride_hh,
                                     BLOCK_L: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_FC: tl.constexpr):
    labels = tl.program_id(0) * BLOCK_L + tl.arange(0, BLOCK_L).to(tl.int64)
    mask_l = labels < L
    for f0 in range(0, F, BLOCK_FC):
        offs_f = f0 + tl.arange(0, BLOCK_FC)
        mask_lf = mask_l[:, None] & (offs_f < F)[None, :]
        cols = tl.load(idx_ptr + labels[:, None] * F + offs_f[None, :], mask=mask_lf, other=0)
        acc = tl.zeros((BLOCK_L, BLOCK_FC), dtype=tl.float32)
        for b0 in range(0, B, BLOCK_B):
            rows = b0 + tl.arange(0, BLOCK_B).to(tl.int64)
            mask_b = rows < B
            dzt = tl.load(dz_ptr + rows[None, :] * stride_db + labels[:, None] * stride_dl,
                          mask=mask_l[:, None] & mask_b[None, :], other=0.0).to(tl.float32)  # [BLOCK_L, BLOCK_B]
            acc += tl.sum(dzt[:, None, :] * _gather3(h_ptr, cols, rows, stride_hb, stride_hh, mask_lf, mask_b),
                          axis=2)
        tl.store(dw_ptr + labels[:, None] * F + offs_f[None, :], acc.to(dw_ptr.dtype.element_ty), mask=mask_lf)


def _check(h_like: torch.Tensor, idx: torch.Tensor, w: torch.Tensor | None) -> tuple[int, int]:
    """(L, F), checking idx [L, F] and w [L, F] against h's dtype and device."""
    L, F = idx.shape
    if w is not None:
        check_operand(w, (L, F), h_like, "w")
    return L, F


def perlabel_forward_triton(h: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """z [B, L]; contract as ``tail_slots.perlabel_forward``."""
    check_h_idx(h, idx)
    L, F = _check(h, idx, w)
    B = h.shape[0]
    z = torch.empty((B, L), dtype=h.dtype, device=h.device)
    if B * L == 0:
        return z
    h = column_major(h)
    grid = (triton.cdiv(L, BLOCK_L), triton.cdiv(B, BLOCK_B))
    _perlabel_forward_kernel[grid](h, idx.contiguous(), w.contiguous(), z, B, L, F,
                                   h.stride(0), h.stride(1), z.stride(0),
                                   BLOCK_L=BLOCK_L, BLOCK_B=BLOCK_B, BLOCK_FC=BLOCK_FC)
    return z


def perlabel_backward_weight_triton(dz: torch.Tensor, h: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """dw [L, F]; contract as ``tail_slots.perlabel_backward_weight``."""
    check_h_idx(h, idx)
    L, F = _check(h, idx, None)
    check_operand(dz, (h.shape[0], L), h, "dz")
    dw = torch.empty((L, F), dtype=h.dtype, device=h.device)
    if L * F == 0:
        return dw
    h = column_major(h)
    _perlabel_backward_weight_kernel[(triton.cdiv(L, BLOCK_L),)](
        dz, h, idx.contiguous(), dw, h.shape[0], L, F, dz.stride(0), dz.stride(1), h.stride(0), h.stride(1),
        BLOCK_L=BLOCK_L, BLOCK_B=BLOCK_B, BLOCK_FC=BLOCK_FC)
    return dw


def perlabel_backward_input_triton(dz: torch.Tensor, idx: torch.Tensor, w: torch.Tensor, Ht: int,
                                   csr: SlotCSR | None = None) -> torch.Tensor:
    """dh [B, Ht], deterministic; contract as ``tail_slots.perlabel_backward_input``."""
    check_h_idx(dz, idx)
    L, F = _check(dz, idx, w)
    B = dz.shape[0]
    check_operand(dz, (B, L), dz, "dz")
    dh = torch.empty((B, Ht), dtype=dz.dtype, device=dz.device)
    if B * Ht == 0:
        return dh
    csr = slot_csr(idx, Ht) if csr is None else csr
    if csr.dims != Ht or csr.perm.numel() != L * F:
        raise ValueError(f"the CSR covers {csr.perm.numel()} slots over {csr.dims} dims, not {L * F} over {Ht}")
    return segment_sum(dz.t().contiguous(), csr, B, dh, coef=w.contiguous().reshape(-1), fan_in=F)
