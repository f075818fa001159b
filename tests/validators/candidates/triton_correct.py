"""Correct: a Triton kernel, one program per (group, block of rows), accumulating in fp32 or fp64.

Runs on CUDA, or on the CPU under TRITON_INTERPRET=1. A realistic candidate for the static check:
triton.jit, tl.load/tl.store, constexpr block sizes and a grid lambda must all be allowed.
"""
import torch
import triton
import triton.language as tl


@triton.jit
def _tail_forward_kernel(h_ptr, idx_ptr, w_ptr, bias_ptr, z_ptr, batch, size, fan_in,
                         stride_hb, stride_hd, stride_ik, stride_if, stride_wk, stride_wg, stride_wf,
                         stride_zb, HAS_BIAS: tl.constexpr, ACC: tl.constexpr,
                         BLOCK_B: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_F: tl.constexpr):
    k = tl.program_id(0)
    rows = tl.program_id(1) * BLOCK_B + tl.arange(0, BLOCK_B)
    cols = tl.arange(0, BLOCK_G)
    fans = tl.arange(0, BLOCK_F)
    row_ok = rows < batch
    col_ok = cols < size
    fan_ok = fans < fan_in
    dims = tl.load(idx_ptr + k * stride_ik + fans * stride_if, mask=fan_ok, other=0)
    hg = tl.load(h_ptr + rows[:, None] * stride_hb + dims[None, :] * stride_hd,
                 mask=row_ok[:, None] & fan_ok[None, :], other=0.0).to(ACC)
    wk = tl.load(w_ptr + k * stride_wk + cols[:, None] * stride_wg + fans[None, :] * stride_wf,
                 mask=col_ok[:, None] & fan_ok[None, :], other=0.0).to(ACC)
    acc = tl.sum(hg[:, None, :] * wk[None, :, :], axis=2)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + k * size + cols, mask=col_ok, other=0.0).to(ACC)[None, :]
    out = z_ptr + rows[:, None] * stride_zb + (k * size + cols)[None, :]
    tl.store(out, acc.to(z_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def tail_forward(h, idx, w, bias):
    batch = h.shape[0]
    groups, size, fan_in = w.shape
    z = torch.empty(batch, groups * size, dtype=h.dtype, device=h.device)
    bias_arg = bias.contiguous() if bias is not None else z
    block_g, block_f = triton.next_power_of_2(size), triton.next_power_of_2(fan_in)
    block_b = max(1, min(64, 4096 // (block_g * block_f)))  # about 4096 products in flight per program
    grid = (groups, triton.cdiv(batch, block_b))
    _tail_forward_kernel[grid](
        h, idx, w, bias_arg, z, batch, size, fan_in,
        h.stride(0), h.stride(1), idx.stride(0), idx.stride(1), w.stride(0), w.stride(1), w.stride(2), z.stride(0),
        HAS_BIAS=bias is not None, ACC=tl.float64 if h.dtype == torch.float64 else tl.float32,
        BLOCK_B=block_b, BLOCK_G=block_g, BLOCK_F=block_f)
    return z
