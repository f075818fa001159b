"""The HASTE tail's input gradient, deterministic: dH[b, d] = sum over slots (k, f) with
idx[k, f] == d of (dZ_k W_k)[b, f].

HASTE's CUDA kernel computes dX_k = dZ_k W_k per group and atomicAdds it into an fp32 dH; its own
comment calls that inefficient, and the result depends on the order the atomics land in. Here the
scatter becomes a gather, in two passes:

1. ``_tail_dx_kernel`` (group tile, grid (K,)): dX_k = dZ_k [BLOCK_B, G] @ W_k [G, F] with
   ``tl.dot``, written to a scratch [K*F, B] whose rows are in *dim order*: slot (k, f) goes to
   row ``position[k*F + f]`` of the transposed index (``SlotCSR``), as a contiguous run of B.
2. ``_segment_sum_kernel`` (grid (Ht, B / BLOCK_R)): dim d sums its contiguous segment of scratch
   rows ``row_ptr[d]:row_ptr[d+1]`` in a fixed order (fp32), and writes dH[:, d].

Every dH element is summed by one program in an order fixed by the CSR and the block sizes, so
the result is bitwise repeatable (no atomics). The CSR is built once per rewiring (a stable
argsort of idx, cached on the idx tensor's identity and version). The scratch holds dX in the
input dtype, as the torch path's einsum output does (its bf16 index_add then sums in bf16; here
the sum is fp32).

The same segmented sum serves the per-label baseline (``GATHER``: each slot reads its label's
dz row, weighted by w) and the fused loss. ``tail_backward_input_atomic`` is HASTE's scheme
(``tl.atomic_add`` into fp32), kept to measure what determinism costs; it is not bitwise repeatable.

Traffic (``tail_backward_input_traffic``): the minimum (dz, w, idx read once, dH written once;
``tail_slots.tail_backward_input_cost``) plus the scratch written and read once: 2*e*B*K*F bytes.
At B=256, K=20,940, F=64 in bf16 that is 1.37 GB on top of 0.43 GB, about 0.42 ms at 4.24 TB/s.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Mapping

import torch
import triton
import triton.language as tl

from targets.haste_rec.tail.tail_slots import tail_backward_input_cost
from targets.haste_rec.tail.triton_tail import (DEFAULT_CONFIG, TailKernelConfig, check_operand, check_tiles, dot_acc,
                                                group_operands, groups_of, load_tile, tile_dim)
from targets.protocol import FlopsBytes

SEGMENT_BLOCK_S = 32    # scratch rows one segmented-sum step reads
SEGMENT_BLOCK_R = 128   # batch rows one segmented-sum program owns
_CACHE_SIZE = 4


# ----------------------------------------------------------------------------- transposed index

@dataclass(frozen=True)
class SlotCSR:
    """The transposed fan-in index: for each input dim d, the slots s = r*F + f with idx[r, f] == d.

    ``perm[row_ptr[d]:row_ptr[d+1]]`` are dim d's slots in increasing slot order; ``position`` is
    perm's inverse (slot -> its place in dim order). All int32.
    """

    perm: torch.Tensor
    position: torch.Tensor
    row_ptr: torch.Tensor
    dims: int


def build_slot_csr(idx: torch.Tensor, dims: int) -> SlotCSR:
    """The SlotCSR of idx [R, F] over dims input dims (R = groups, or labels for the per-label layout)."""
    flat = idx.reshape(-1)
    if flat.numel() >= 2 ** 31:
        raise ValueError(f"{flat.numel()} slots exceed int32 CSR offsets")
    if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= dims):
        raise ValueError(f"fan-in indices must lie in [0, {dims})")
    perm = torch.argsort(flat, stable=True)
    position = torch.empty_like(perm)
    position[perm] = torch.arange(flat.numel(), device=flat.device)
    row_ptr = torch.zeros(dims + 1, dtype=torch.int64, device=flat.device)
    row_ptr[1:] = torch.bincount(flat, minlength=dims).cumsum(0)
    return SlotCSR(perm.to(torch.int32), position.to(torch.int32), row_ptr.to(torch.int32), dims)


_csr_cache: list[tuple[weakref.ref, int, int, SlotCSR]] = []


def slot_csr(idx: torch.Tensor, dims: int) -> SlotCSR:
    """build_slot_csr, cached on idx's identity and version: rebuilt only after idx changes in place
    (HASTE's rewiring) or for a new tensor. A freed tensor's entry can never match a new one."""
    for ref, version, cached_dims, csr in _csr_cache:
        if ref() is idx and version == idx._version and cached_dims == dims:
            return csr
    csr = build_slot_csr(idx, dims)
    _csr_cache.insert(0, (weakref.ref(idx), idx._version, dims, csr))
    del _csr_cache[_CACHE_SIZE:]
    return csr


# ----------------------------------------------------------------------------- pass 1: dX per group

@triton.jit
def store_dx(out_ptr, dx, rows, cols, position, mask_b, mask_f, B, stride_ob, ATOMIC: tl.constexpr):
    """Deliver a [BLOCK_B, BLOCK_F] tile of dX: atomically added into fp32 dH[rows, cols], or stored
    to the dim-ordered scratch at rows ``position`` (each a contiguous run of the batch)."""
    mask = mask_b[:, None] & mask_f[None, :]
    if ATOMIC:
        tl.atomic_add(out_ptr + rows[:, None] * stride_ob + cols[None, :], dx, mask=mask)
    else:
        tl.store(out_ptr + position[None, :] * B + rows[:, None], dx.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _tail_dx_kernel(dz_ptr, idx_ptr, w_ptr, pos_ptr, out_ptr,
                    B, G, F,
                    stride_db, stride_dc, stride_ob,
                    ATOMIC: tl.constexpr, PRECISION: tl.constexpr,
                    BLOCK_B: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_F: tl.constexpr):
    k = tl.program_id(0).to(tl.int64)
    cols, w, offs_g, offs_f, mask_g, mask_f = group_operands(idx_ptr, w_ptr, k, G, F, BLOCK_G, BLOCK_F)
    position = tl.load(pos_ptr + k * F + offs_f, mask=mask_f, other=0).to(tl.int64)
    for start in range(0, B, BLOCK_B):
        rows = start + tl.arange(0, BLOCK_B).to(tl.int64)
        mask_b = rows < B
        dz = load_tile(dz_ptr + k * G * stride_dc, rows, offs_g, stride_db, stride_dc, mask_b, mask_g)
        dx = dot_acc(dz, w, tl.zeros((BLOCK_B, BLOCK_F), dtype=tl.float32), PRECISION)
        store_dx(out_ptr, dx, rows, cols, position, mask_b, mask_f, B, stride_ob, ATOMIC)


# ----------------------------------------------------------------------------- pass 2: segmented sum

@triton.jit
def _segment_sum_kernel(src_ptr, perm_ptr, coef_ptr, row_ptr_ptr, out_ptr,
                        B, F, stride_ob, stride_od,
                        GATHER: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_R: tl.constexpr):
    """out[b, d] = sum over s in [row_ptr[d], row_ptr[d+1]) of src[s, b] (GATHER: of
    coef[perm[s]] * src[perm[s] // F, b]), summed in a fixed order; src rows are B long."""
    d = tl.program_id(0)
    rows = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R).to(tl.int64)
    mask_r = rows < B
    start = tl.load(row_ptr_ptr + d)
    end = tl.load(row_ptr_ptr + d + 1)
    acc = tl.zeros((BLOCK_S, BLOCK_R), dtype=tl.float32)
    for s0 in range(start, end, BLOCK_S):
        seg = s0 + tl.arange(0, BLOCK_S)
        mask_s = seg < end
        if GATHER:
            slot = tl.load(perm_ptr + seg, mask=mask_s, other=0)
            coef = tl.load(coef_ptr + slot, mask=mask_s, other=0.0).to(tl.float32)
            x = load_tile(src_ptr, (slot // F).to(tl.int64), rows, B, 1, mask_s, mask_r)
            acc += coef[:, None] * x.to(tl.float32)
        else:
            acc += load_tile(src_ptr, seg.to(tl.int64), rows, B, 1, mask_s, mask_r).to(tl.float32)
    tl.store(out_ptr + rows * stride_ob + d * stride_od, tl.sum(acc, axis=0).to(out_ptr.dtype.element_ty),
             mask=mask_r)


def segment_sum(src: torch.Tensor, csr: SlotCSR, batch: int, out: torch.Tensor,
                coef: torch.Tensor | None = None, fan_in: int = 1) -> torch.Tensor:
    """Fill out [B, dims] with each dim's segment of src rows summed (see ``_segment_sum_kernel``);
    with coef, src rows are labels: slot s reads row s // fan_in, weighted by coef[s]."""
    block_r = min(SEGMENT_BLOCK_R, tile_dim(batch))
    grid = (csr.dims, triton.cdiv(batch, block_r))
    _segment_sum_kernel[grid](
        src, csr.perm, src if coef is None else coef, csr.row_ptr, out, batch, fan_in,
        out.stride(0), out.stride(1),
        GATHER=coef is not None, BLOCK_S=SEGMENT_BLOCK_S, BLOCK_R=block_r)
    return out


# ----------------------------------------------------------------------------- launchers

def _checked(dz: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> tuple[int, int, int, int]:
    """(B, K, G, F) of one input-gradient call, or ValueError naming the operand that disagrees."""
    if w.dim() != 3:
        raise ValueError(f"w must be [K, G, F], got shape {tuple(w.shape)}")
    if idx.dim() != 2 or idx.dtype != torch.int64 or idx.device != dz.device:
        raise ValueError(f"idx must be int64 [K, F] on dz's device, got {idx.dtype} {tuple(idx.shape)}")
    G = groups_of(dz, dz, idx)
    K, F = idx.shape
    check_operand(w, (K, G, F), dz, "w")
    return dz.shape[0], K, G, F


def _launch_dx(dz, idx, w, position, out, atomic: bool, config: TailKernelConfig) -> None:
    B, K, G, F = _checked(dz, idx, w)
    BLOCK_G, BLOCK_F = check_tiles(G, F)
    block_b, num_warps, num_stages = config.resolve(B, G, F)
    _tail_dx_kernel[(K,)](
        dz, idx.contiguous(), w.contiguous(), position, out, B, G, F,
        dz.stride(0), dz.stride(1), out.stride(0),
        ATOMIC=atomic, PRECISION=config.dot_precision(dz.dtype),
        BLOCK_B=block_b, BLOCK_G=BLOCK_G, BLOCK_F=BLOCK_F, num_warps=num_warps, num_stages=num_stages)


def tail_backward_input_triton(dz: torch.Tensor, idx: torch.Tensor, w: torch.Tensor, Ht: int,
                               csr: SlotCSR | None = None, config: TailKernelConfig = DEFAULT_CONFIG) -> torch.Tensor:
    """dh [B, Ht], deterministic. Contract as ``tail_slots.tail_backward_input``; pass ``csr``
    (``slot_csr(idx, Ht)``) to skip the cache lookup."""
    B, K, G, F = _checked(dz, idx, w)
    dh = torch.empty((B, Ht), dtype=dz.dtype, device=dz.device)
    if B == 0 or Ht == 0:
        return dh
    csr = slot_csr(idx, Ht) if csr is None else csr
    if csr.dims != Ht or csr.position.numel() != K * F:
        raise ValueError(f"the CSR covers {csr.position.numel()} slots over {csr.dims} dims, not {K * F} over {Ht}")
    scratch = torch.empty((K * F, B), dtype=dz.dtype, device=dz.device)
    if G:
        _launch_dx(dz, idx, w, csr.position, scratch, atomic=False, config=config)
    else:
        scratch.zero_()
    return segment_sum(scratch, csr, B, dh)


def tail_backward_input_atomic(dz: torch.Tensor, idx: torch.Tensor, w: torch.Tensor, Ht: int,
                               config: TailKernelConfig = DEFAULT_CONFIG) -> torch.Tensor:
    """dh [B, Ht] by HASTE's scheme (fp32 atomicAdd, then a cast): same contract, NOT bitwise
    repeatable; for measuring what the deterministic version costs."""
    B, K, G, F = _checked(dz, idx, w)
    dh = torch.zeros((B, Ht), dtype=torch.float32, device=dz.device)
    if B and G and K:
        _launch_dx(dz, idx, w, idx, dh, atomic=True, config=config)  # position unused
    return dh.to(dz.dtype)


def tail_backward_input_traffic(shape: Mapping[str, int], dtype: torch.dtype) -> FlopsBytes:
    """What the deterministic kernels move: the slot's minimum plus the scratch written and read once
    (and the int32 CSR position/row_ptr/perm reads: 4*(2*K*F + Ht + 1))."""
    minimum = tail_backward_input_cost(shape, dtype)
    B, Ht, K, F = (shape[k] for k in ("B", "Ht", "K", "F"))
    extra = 2 * dtype.itemsize * B * K * F + 4 * (2 * K * F + Ht + 1)
    return FlopsBytes(minimum.flops, minimum.bytes + extra)
