"""Triton kernels for the HASTE tail's kernel slots (``tail_slots.tail_forward`` and
``tail_slots.tail_backward_weight``), written Triton-tutorial style: one kernel and one launcher each.

Layout: K groups of G labels; group k reads the F input dims ``idx[k]`` of h [B, Ht] and owns the
weights ``w[k]`` [G, F]. Both kernels give one program a whole group's [G, F] weight tile (G and F
padded to powers of two >= 16 with masks, since ``tl.dot`` needs tile dims >= 16), so each group's
F indices are loaded once per program and the gather of h happens in registers.

- forward: grid (ceil(B / BLOCK_B), K); z[b, kG:(k+1)G] = H[b, I_k] @ W_k^T + bias_k.
- backward weight: grid (K,); dw[k] = sum over B chunks of dZ_k^T [G, BLOCK_B] @ H[:, I_k] [BLOCK_B, F].

Accumulation is fp32; outputs take the input dtype. fp32 inputs use ``input_precision="ieee"`` so
results match fp32 references (no TF32).

FLOP/byte model: the minimum traffic and work are ``tail_slots.tail_forward_cost`` and
``tail_slots.tail_backward_weight_cost`` (2*B*K*G*F flops each; h read once, idx read once, w/dw
and z/dz once). What these kernels actually move: the forward reads idx once per (B block, group),
so idx and w traffic is multiplied by ceil(B / BLOCK_B), and the gather of h is cache-served (each
row of h is read K*F/Ht times from L2 on average); the backward reads each group's columns of h and
dz once (h gathered K*F/Ht times in total from L2), idx and dw exactly once.

Limits: G and F must each fit one tile (padded to <= 256 here: register pressure), which covers
the shipped shapes (G <= 32, F <= 64). bf16 works on GPU; Triton's CPU interpreter computes bf16
wrongly, so the tests cover fp32 and fp16 only.
"""

from __future__ import annotations

from typing import Callable

import torch
import triton
import triton.language as tl

MAX_TILE = 256  # largest padded G or F one program holds
_SUPPORTED = (torch.float32, torch.float16, torch.bfloat16)


def _pad(n: int) -> int:
    """Next power of two, at least 16 (tl.dot's smallest tile dim)."""
    return max(16, triton.next_power_of_2(n))


# ----------------------------------------------------------------------------- forward

@triton.jit
def _tail_forward_kernel(h_ptr, idx_ptr, w_ptr, bias_ptr, z_ptr,
                         B, G, F,
                         stride_hb, stride_hh, stride_zb,
                         HAS_BIAS: tl.constexpr, IEEE: tl.constexpr,
                         BLOCK_B: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_F: tl.constexpr):
    pid_b = tl.program_id(0)
    k = tl.program_id(1).to(tl.int64)

    rows = pid_b.to(tl.int64) * BLOCK_B + tl.arange(0, BLOCK_B)
    offs_g = tl.arange(0, BLOCK_G)
    offs_f = tl.arange(0, BLOCK_F)
    mask_b = rows < B
    mask_g = offs_g < G
    mask_f = offs_f < F

    # the group's F indices, loaded once
    cols = tl.load(idx_ptr + k * F + offs_f, mask=mask_f, other=0)
    # gathered h tile [BLOCK_B, BLOCK_F]
    h = tl.load(h_ptr + rows[:, None] * stride_hb + cols[None, :] * stride_hh,
                mask=mask_b[:, None] & mask_f[None, :], other=0.0)
    # W_k tile [BLOCK_G, BLOCK_F]
    w = tl.load(w_ptr + k * G * F + offs_g[:, None] * F + offs_f[None, :],
                mask=mask_g[:, None] & mask_f[None, :], other=0.0)
    if IEEE:
        acc = tl.dot(h, tl.trans(w), input_precision="ieee")
    else:
        acc = tl.dot(h, tl.trans(w))
    if HAS_BIAS:
        b = tl.load(bias_ptr + k * G + offs_g, mask=mask_g, other=0.0).to(tl.float32)
        acc += b[None, :]
    z_ptrs = z_ptr + rows[:, None] * stride_zb + k * G + offs_g[None, :]
    tl.store(z_ptrs, acc.to(z_ptr.dtype.element_ty), mask=mask_b[:, None] & mask_g[None, :])


def _check_common(h: torch.Tensor, idx: torch.Tensor) -> None:
    if h.dim() != 2:
        raise ValueError(f"h must be [B, Ht], got shape {tuple(h.shape)}")
    if h.dtype not in _SUPPORTED:
        raise TypeError(f"h dtype {h.dtype} not supported; use one of {_SUPPORTED}")
    if idx.dim() != 2 or idx.dtype != torch.int64:
        raise ValueError(f"idx must be int64 [K, F], got {idx.dtype} {tuple(idx.shape)}")
    if idx.device != h.device:
        raise ValueError("idx and h must be on the same device")


def tail_forward_triton(h: torch.Tensor, idx: torch.Tensor, w: torch.Tensor,
                        bias: torch.Tensor | None = None, block_b: int = 64) -> torch.Tensor:
    """z [B, K*G] with z[b, k*G + g] = sum_f h[b, idx[k, f]] * w[k, g, f] + bias[k, g].

    Contract as ``tail_slots.tail_forward``; cost model ``tail_slots.tail_forward_cost``.
    """
    _check_common(h, idx)
    if w.dim() != 3:
        raise ValueError(f"w must be [K, G, F], got shape {tuple(w.shape)}")
    K, G, F = w.shape
    if tuple(idx.shape) != (K, F):
        raise ValueError(f"idx shape {tuple(idx.shape)} does not match w's (K, F) = {(K, F)}")
    if w.dtype != h.dtype or w.device != h.device:
        raise ValueError("w must share h's dtype and device")
    if bias is not None:
        if tuple(bias.shape) != (K, G):
            raise ValueError(f"bias must be [K, G] = {(K, G)}, got {tuple(bias.shape)}")
        if bias.dtype != h.dtype or bias.device != h.device:
            raise ValueError("bias must share h's dtype and device")
    BLOCK_G, BLOCK_F = _pad(G), _pad(F)
    if BLOCK_G > MAX_TILE or BLOCK_F > MAX_TILE:
        raise ValueError(f"G={G} and F={F} must each pad to at most {MAX_TILE}")
    B = h.shape[0]
    z = torch.empty((B, K * G), dtype=h.dtype, device=h.device)
    if B == 0 or K * G == 0:
        return z
    idx = idx.contiguous()
    w = w.contiguous()
    bias_arg = bias.contiguous() if bias is not None else w  # dummy pointer, never read
    BLOCK_B = _pad(min(block_b, B))
    grid = (triton.cdiv(B, BLOCK_B), K)
    _tail_forward_kernel[grid](
        h, idx, w, bias_arg, z, B, G, F,
        h.stride(0), h.stride(1), z.stride(0),
        HAS_BIAS=bias is not None, IEEE=h.dtype == torch.float32,
        BLOCK_B=BLOCK_B, BLOCK_G=BLOCK_G, BLOCK_F=BLOCK_F)
    return z


# ----------------------------------------------------------------------------- backward weight

@triton.jit
def _tail_backward_weight_kernel(dz_ptr, h_ptr, idx_ptr, dw_ptr,
                                 B, G, F,
                                 stride_db, stride_dc, stride_hb, stride_hh,
                                 IEEE: tl.constexpr,
                                 BLOCK_B: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_F: tl.constexpr):
    k = tl.program_id(0).to(tl.int64)
    offs_g = tl.arange(0, BLOCK_G)
    offs_f = tl.arange(0, BLOCK_F)
    mask_g = offs_g < G
    mask_f = offs_f < F

    cols = tl.load(idx_ptr + k * F + offs_f, mask=mask_f, other=0)
    acc = tl.zeros((BLOCK_G, BLOCK_F), dtype=tl.float32)
    for start in range(0, B, BLOCK_B):
        rows = start + tl.arange(0, BLOCK_B).to(tl.int64)
        mask_b = rows < B
        # dZ_k^T tile [BLOCK_G, BLOCK_B]
        dzt = tl.load(dz_ptr + rows[None, :] * stride_db + (k * G + offs_g[:, None]) * stride_dc,
                      mask=mask_g[:, None] & mask_b[None, :], other=0.0)
        # gathered H[:, I_k] tile [BLOCK_B, BLOCK_F]
        h = tl.load(h_ptr + rows[:, None] * stride_hb + cols[None, :] * stride_hh,
                    mask=mask_b[:, None] & mask_f[None, :], other=0.0)
        if IEEE:
            acc = tl.dot(dzt, h, acc, input_precision="ieee")
        else:
            acc = tl.dot(dzt, h, acc)
    dw_ptrs = dw_ptr + k * G * F + offs_g[:, None] * F + offs_f[None, :]
    tl.store(dw_ptrs, acc.to(dw_ptr.dtype.element_ty), mask=mask_g[:, None] & mask_f[None, :])


def tail_backward_weight_triton(dz: torch.Tensor, h: torch.Tensor, idx: torch.Tensor,
                                block_b: int = 64) -> torch.Tensor:
    """dw [K, G, F] with dw[k] = dZ_k^T H[:, I_k] (dZ_k = dz[:, k*G:(k+1)*G]).

    Contract as ``tail_slots.tail_backward_weight``; cost model ``tail_slots.tail_backward_weight_cost``.
    """
    _check_common(h, idx)
    if dz.dim() != 2 or dz.shape[0] != h.shape[0]:
        raise ValueError(f"dz must be [B, K*G] with B = {h.shape[0]}, got {tuple(dz.shape)}")
    if dz.dtype != h.dtype or dz.device != h.device:
        raise ValueError("dz must share h's dtype and device")
    K, F = idx.shape
    if K == 0 or dz.shape[1] % K:
        raise ValueError(f"dz's {dz.shape[1]} columns are not a multiple of K = {K}")
    G = dz.shape[1] // K
    BLOCK_G, BLOCK_F = _pad(G), _pad(F)
    if BLOCK_G > MAX_TILE or BLOCK_F > MAX_TILE:
        raise ValueError(f"G={G} and F={F} must each pad to at most {MAX_TILE}")
    B = h.shape[0]
    dw = torch.empty((K, G, F), dtype=h.dtype, device=h.device)
    if G * F == 0:
        return dw
    idx = idx.contiguous()
    BLOCK_B = _pad(min(block_b, max(B, 1)))
    _tail_backward_weight_kernel[(K,)](
        dz, h, idx, dw, B, G, F,
        dz.stride(0), dz.stride(1), h.stride(0), h.stride(1),
        IEEE=h.dtype == torch.float32,
        BLOCK_B=BLOCK_B, BLOCK_G=BLOCK_G, BLOCK_F=BLOCK_F)
    return dw


TRITON_TAIL_IMPLS: dict[str, Callable] = {
    "tail_forward": tail_forward_triton,
    "tail_backward_weight": tail_backward_weight_triton,
}
