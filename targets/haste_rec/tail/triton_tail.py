"""Triton kernels for the HASTE tail (Triton-tutorial style: kernel, launcher, shape contract and
cost side by side), and what every tail kernel module shares: the tile config, the jit helpers
and the shape checks. The registry of slot implementations is ``triton_tail_impls``, above every
tail kernel module, so that none of them imports another that imports it back.

Layout: K groups of G labels; group k reads the F input dims ``idx[k]`` of h [B, Ht] and owns the
weights ``w[k]`` [G, F]. Every "group-tile" kernel (these two, the input gradient's first pass in
``triton_tail_backward``, the fused loss in ``triton_fused_bce``) gives one program a whole group:
its F indices and its [G, F] weight tile are loaded once, then the program walks the batch in
BLOCK_B-row chunks, gathering the chunk's [BLOCK_B, F] slice of h into registers for ``tl.dot``
(G and F padded to powers of two >= 16 with masks: ``tl.dot`` needs tile dims >= 16). A [B, K, F]
gathered tensor never exists in memory.

Why h is read column-major: a row-major h [B, Ht] scatters a group's F picks over every 32-byte
sector of each row (~36 of 48 sectors per row at Ht=768, F=64: 9x the bytes used). The launchers
hand the kernels a column-major copy (0.4 MB at B=256, H=768), so each picked dim is one
contiguous run of BLOCK_B rows; the kernels only see strides, so any layout stays correct.

- forward: grid (K,); z[b, kG:(k+1)G] = H[b, I_k] @ W_k^T + bias_k, chunk by chunk. With
  ``TailKernelConfig.groups_per_program=2``, grid (cdiv(K, 2),): groups 2p and 2p+1 take two 2-D ``tl.dot``
  (a batched 3-D dot compiled to Hopper's older MMA and ran slower) and one [BLOCK_B, 2G] store. Why: z
  is most of the forward's bytes, and one G=32 bf16 group writes 64-byte row segments (0.180 ms, 58% of
  the copy rate at the main shape) where G=64's 128-byte ones reached 0.149 ms. Any G and an odd K are
  masked; only a power-of-two G >= 16 makes the 2G columns one contiguous segment.
- backward weight: grid (K,); dw[k] = sum over B chunks of dZ_k^T [G, BLOCK_B] @ H[:, I_k] [BLOCK_B, F].

Accumulation is fp32; outputs take the input dtype. fp32 inputs use ``input_precision="ieee"`` by
default, so results match fp32 references (no TF32); ``TailKernelConfig.fp32_precision`` lets them use
the tensor cores: "tf32" (the knob matmul_precision="high", TF32's 10-bit mantissa) or "tf32x3" (the knob
tail_fp32_dot, three TF32 products, a few fp32 ulps each). Both
kernels are deterministic: every output element is written by one program, summed in a fixed order.

FLOP/byte model: the minimum traffic and work are ``tail_slots.tail_forward_cost`` and
``tail_slots.tail_backward_weight_cost``. What these kernels move on top: the gather of h is
L2-served (h is read K*F/Ht times from L2, in whole sectors thanks to the column-major copy), plus
the 2*e*B*Ht bytes of that copy; idx, w, z, dz and dw move exactly once.

Limits: G and F must each fit one tile (padded to <= 256: register pressure), which covers the
shipped shapes (G <= 64, F <= 128). 2 groups per program hold two groups' tiles: compiled for sm_90 at
G=32, F=64, BLOCK_B=64, 4 warps, 221 registers a thread against 128. bf16 works on GPU; Triton's CPU
interpreter computes bf16 wrongly, so the CPU tests cover fp32 and fp16 only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

MAX_TILE = 256  # largest padded G or F one program holds
AUTO = "auto"
FP32_PRECISIONS = ("ieee", "tf32", "tf32x3")  # tl.dot's input precisions for fp32 operands
_SUPPORTED = (torch.float32, torch.float16, torch.bfloat16)


def tile_dim(n: int) -> int:
    """Next power of two, at least 16 (tl.dot's smallest tile dim)."""
    return max(16, triton.next_power_of_2(n))


# ----------------------------------------------------------------------------- tile config

@dataclass(frozen=True)
class TailKernelConfig:
    """Meta-parameters of the group-tile kernels (knobs tail_block_b, tail_num_warps, tail_num_stages).

    "auto" resolves by a fixed rule of the shape (``resolve``), never by timing, so a config gives
    the same bits on every run. BLOCK_B sets the batch chunking of the weight-gradient and loss sums
    (their float association) and num_warps can change the MMA instruction, so both are "reorder"
    knobs; num_stages only changes how far loads run ahead, not the arithmetic.

    groups_per_program (forward only, no knob): 2 has each program store two adjacent groups as one
    [BLOCK_B, 2G] tile, for wider row segments of z (see the module docstring). Exact: the same
    products in the same order, so "auto" may pick it by shape: 2 for G <= 16, 1 above. On the H200
    (bf16, B=256, F=64) 2 groups took 0.252 ms against 0.281 at G=16 (1.002 against 1.169 at 2.8M
    labels) but 0.205 against 0.183 at G=32 and 0.162 against 0.146 at G=64.

    fp32_precision: ``tl.dot``'s input precision for fp32 operands (``FP32_PRECISIONS``): "ieee" keeps exact
    fp32 products on the CUDA cores (the default); "tf32" and "tf32x3" use the tensor cores ("tf32": the knob
    matmul_precision=high, a precision change; "tf32x3": the knob tail_fp32_dot, held to the reorder band).

    ``resolve(..., fused_dtype=dtype)`` is the fused loss kernel's rule: it holds the forward tile, the
    loss, dz, a dW accumulator and the dX tile at once. When its ``tl.dot`` runs on the tensor cores in
    one pass (bf16/fp16 inputs, or fp32 at "tf32") and groups have at least 32 labels, it ran fastest with
    half the forward's auto BLOCK_B (H200, L=670,080, bf16: 1.10 ms at BLOCK_B=32 against 1.45 at 64 for
    G=32, 1.19 either way for G=64; fp32 at tf32, G=32: 1.92 against 2.45). At G=16 half is slower (1.97
    against 1.59; 8.08 against 6.51 at L=2.8M). Exact fp32 ("ieee", 7.45 ms at 64 against 8.23 at 32) and
    "tf32x3" (2.95 against 3.21) keep the forward's rule (``benchmarks.fused_bce_sweep``, BENCHMARKS.md,
    2026-11-29 and 2026-11-30).
    """

    block_b: int | str = AUTO
    num_warps: int | str = AUTO
    num_stages: int | str = AUTO
    groups_per_program: int | str = AUTO
    fp32_precision: str = "ieee"

    def __post_init__(self) -> None:
        """The fields no shape rule reads are checked once, here, not at every launch."""
        if self.groups_per_program not in (1, 2, AUTO):
            raise ValueError(f"groups_per_program must be 1, 2 or {AUTO!r}, got {self.groups_per_program!r}")
        if self.fp32_precision not in FP32_PRECISIONS:
            raise ValueError(f"fp32_precision must be one of {FP32_PRECISIONS}, got {self.fp32_precision!r}")

    def resolve(self, batch: int, size: int, fan_in: int, *,
                fused_dtype: torch.dtype | None = None) -> tuple[int, int, int]:
        """(BLOCK_B, num_warps, num_stages) for B, G, F; ``fused_dtype``: the inputs' dtype when the launch is
        the fused loss kernel's."""
        tile = tile_dim(size) * tile_dim(fan_in)
        auto_block_b = 64 if tile <= 64 * 64 else 32
        if fused_dtype is not None and self.dot_precision(fused_dtype) == "tf32" and tile_dim(size) >= 32:
            auto_block_b //= 2  # one tensor-core pass over groups of 32 labels or more
        block_b = auto_block_b if self.block_b == AUTO else int(self.block_b)
        num_warps = (4 if tile <= 64 * 64 else 8) if self.num_warps == AUTO else int(self.num_warps)
        num_stages = 3 if self.num_stages == AUTO else int(self.num_stages)
        return tile_dim(min(block_b, max(batch, 1))), num_warps, num_stages

    def dot_precision(self, dtype: torch.dtype) -> str:
        """The kernels' ``tl.dot`` input precision for inputs of ``dtype``: fp32_precision for fp32 (the
        knob matmul_precision: "highest" keeps "ieee"), Triton's default for 16-bit inputs, which ignore it."""
        return self.fp32_precision if dtype == torch.float32 else "tf32"

    def resolve_groups_per_program(self, size: int) -> int:
        """GROUPS_PER_PROGRAM of the forward kernel for groups of ``size`` labels: 1 or 2."""
        return (2 if size <= 16 else 1) if self.groups_per_program == AUTO else self.groups_per_program


DEFAULT_CONFIG = TailKernelConfig()


def interpreter_active() -> bool:
    """Whether these kernels run on Triton's CPU interpreter (decided when ``triton.jit`` ran, i.e.
    whether TRITON_INTERPRET=1 was set before this module was first imported)."""
    from triton.runtime.interpreter import InterpretedFunction
    return isinstance(_tail_forward_kernel, InterpretedFunction)


# ----------------------------------------------------------------------------- jit helpers

@triton.jit
def dot_acc(a, b, acc, PRECISION: tl.constexpr):
    """acc + a @ b, fp32 accumulation; PRECISION (``TailKernelConfig.dot_precision``) is how fp32 inputs
    multiply: "ieee" (exact fp32 products), "tf32" or "tf32x3" (tensor cores); 16-bit inputs ignore it."""
    return tl.dot(a, b, acc, input_precision=PRECISION)


@triton.jit
def load_tile(ptr, offs_r, offs_c, stride_r, stride_c, mask_r, mask_c):
    """The [R, C] tile ptr[offs_r * stride_r + offs_c * stride_c], zero outside the masks."""
    return tl.load(ptr + offs_r[:, None] * stride_r + offs_c[None, :] * stride_c,
                   mask=mask_r[:, None] & mask_c[None, :], other=0.0)


@triton.jit
def group_operands(idx_ptr, w_ptr, k, G, F, BLOCK_G: tl.constexpr, BLOCK_F: tl.constexpr):
    """Group k's fan-in dims [BLOCK_F] and weight tile W_k [BLOCK_G, BLOCK_F], with their offsets and masks."""
    offs_g = tl.arange(0, BLOCK_G)
    offs_f = tl.arange(0, BLOCK_F)
    mask_g = offs_g < G
    mask_f = offs_f < F
    cols = tl.load(idx_ptr + k * F + offs_f, mask=mask_f, other=0)
    w = load_tile(w_ptr + k * G * F, offs_g, offs_f, F, 1, mask_g, mask_f)
    return cols, w, offs_g, offs_f, mask_g, mask_f


# ----------------------------------------------------------------------------- shared checks

def check_h_idx(h: torch.Tensor, idx: torch.Tensor) -> None:
    if h.dim() != 2:
        raise ValueError(f"h must be [B, Ht], got shape {tuple(h.shape)}")
    if h.dtype not in _SUPPORTED:
        raise TypeError(f"h dtype {h.dtype} not supported; use one of {_SUPPORTED}")
    if idx.dim() != 2 or idx.dtype != torch.int64:
        raise ValueError(f"idx must be int64 [K, F], got {idx.dtype} {tuple(idx.shape)}")
    if idx.device != h.device:
        raise ValueError("idx and h must be on the same device")


def check_operand(t: torch.Tensor, shape: tuple[int, ...], like: torch.Tensor, what: str,
                  any_float: bool = False) -> None:
    """t has ``shape`` and lies on like's device with like's dtype (any supported float if any_float)."""
    if tuple(t.shape) != shape:
        raise ValueError(f"{what} must be {list(shape)}, got {tuple(t.shape)}")
    if t.device != like.device or (t.dtype not in _SUPPORTED if any_float else t.dtype != like.dtype):
        raise ValueError(f"{what} is {t.dtype} on {t.device}; expected {like.dtype} on {like.device}")


def check_tiles(size: int, fan_in: int) -> tuple[int, int]:
    """(BLOCK_G, BLOCK_F), or ValueError when a group's tile does not fit one program."""
    block_g, block_f = tile_dim(size), tile_dim(fan_in)
    if block_g > MAX_TILE or block_f > MAX_TILE:
        raise ValueError(f"G={size} and F={fan_in} must each pad to at most {MAX_TILE}")
    return block_g, block_f


def groups_of(dz: torch.Tensor, h_like: torch.Tensor, idx: torch.Tensor) -> int:
    """G from dz [B, K*G], checking dz against h's batch, dtype and device."""
    if dz.dim() != 2 or dz.shape[0] != h_like.shape[0]:
        raise ValueError(f"dz must be [B, K*G] with B = {h_like.shape[0]}, got {tuple(dz.shape)}")
    if dz.dtype != h_like.dtype or dz.device != h_like.device:
        raise ValueError("dz must share h's dtype and device")
    groups = idx.shape[0]
    if groups == 0 or dz.shape[1] % groups:
        raise ValueError(f"dz's {dz.shape[1]} columns are not a multiple of K = {groups}")
    return dz.shape[1] // groups


def column_major(x: torch.Tensor) -> torch.Tensor:
    """x [R, C] with unit stride between rows (the same values): a gather of columns then reads
    contiguous runs of rows."""
    if x.shape[0] <= 1 or x.stride(0) == 1:
        return x
    return x.t().contiguous().t()


# ----------------------------------------------------------------------------- forward

@triton.jit
def _forward_group(idx_ptr, w_ptr, bias_ptr, k, G, F,
                   HAS_BIAS: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_F: tl.constexpr):
    """What the forward keeps of group k across the batch: its fan-in dims, W_k^T and bias_k (fp32)."""
    cols, w, offs_g, offs_f, mask_g, mask_f = group_operands(idx_ptr, w_ptr, k, G, F, BLOCK_G, BLOCK_F)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + k * G + offs_g, mask=mask_g, other=0.0).to(tl.float32)
    else:
        bias = tl.zeros((BLOCK_G,), dtype=tl.float32)  # not added
    return cols, tl.trans(w), bias, mask_f


@triton.jit
def _forward_chunk(h_ptr, rows, mask_b, cols, mask_f, wt, bias, stride_hb, stride_hh,
                   HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_G: tl.constexpr):
    """One group's fp32 [BLOCK_B, BLOCK_G] tile of z for one batch chunk: H[rows, I_k] @ W_k^T + bias_k."""
    h = load_tile(h_ptr, rows, cols, stride_hb, stride_hh, mask_b, mask_f)  # gathered [BLOCK_B, BLOCK_F]
    acc = dot_acc(h, wt, tl.zeros((BLOCK_B, BLOCK_G), dtype=tl.float32), PRECISION)
    if HAS_BIAS:
        acc += bias[None, :]
    return acc


@triton.jit
def _tail_forward_kernel(h_ptr, idx_ptr, w_ptr, bias_ptr, z_ptr,
                         B, K, G, F,
                         stride_hb, stride_hh, stride_zb,
                         HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr, GROUPS_PER_PROGRAM: tl.constexpr,
                         BLOCK_B: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_F: tl.constexpr):
    """Groups GROUPS_PER_PROGRAM * p + j (j < GROUPS_PER_PROGRAM, 1 or 2), stored as one tile per chunk."""
    first = tl.program_id(0).to(tl.int64) * GROUPS_PER_PROGRAM
    cols, wt, bias, mask_f = _forward_group(idx_ptr, w_ptr, bias_ptr, first, G, F, HAS_BIAS, BLOCK_G, BLOCK_F)
    if GROUPS_PER_PROGRAM == 2:
        # odd K: the last program recomputes group K-1 as its second group (in bounds); the store masks it off
        second = tl.minimum(first + 1, K - 1)
        cols1, wt1, bias1, _ = _forward_group(idx_ptr, w_ptr, bias_ptr, second, G, F, HAS_BIAS, BLOCK_G, BLOCK_F)
    # tile column c holds label c % BLOCK_G of group first + c // BLOCK_G: with G == BLOCK_G the columns
    # are one contiguous run of GROUPS_PER_PROGRAM * G labels, else the padding lanes are masked off
    offs_c = tl.arange(0, GROUPS_PER_PROGRAM * BLOCK_G)
    group, label = first + offs_c // BLOCK_G, offs_c % BLOCK_G
    mask_c = (label < G) & (group < K)
    for start in range(0, B, BLOCK_B):
        rows = start + tl.arange(0, BLOCK_B).to(tl.int64)
        mask_b = rows < B
        acc = _forward_chunk(h_ptr, rows, mask_b, cols, mask_f, wt, bias, stride_hb, stride_hh,
                             HAS_BIAS, PRECISION, BLOCK_B, BLOCK_G)
        if GROUPS_PER_PROGRAM == 2:
            acc1 = _forward_chunk(h_ptr, rows, mask_b, cols1, mask_f, wt1, bias1, stride_hb, stride_hh,
                                  HAS_BIAS, PRECISION, BLOCK_B, BLOCK_G)
            # [BLOCK_B, BLOCK_G, 2] -> [BLOCK_B, 2, BLOCK_G] -> [BLOCK_B, 2 * BLOCK_G]: group-major columns
            acc = tl.reshape(tl.permute(tl.join(acc, acc1), (0, 2, 1)), (BLOCK_B, 2 * BLOCK_G))
        tl.store(z_ptr + rows[:, None] * stride_zb + (group * G + label)[None, :],
                 acc.to(z_ptr.dtype.element_ty), mask=mask_b[:, None] & mask_c[None, :])


def tail_forward_triton(h: torch.Tensor, idx: torch.Tensor, w: torch.Tensor,
                        bias: torch.Tensor | None = None, config: TailKernelConfig = DEFAULT_CONFIG) -> torch.Tensor:
    """z [B, K*G] with z[b, k*G + g] = sum_f h[b, idx[k, f]] * w[k, g, f] + bias[k, g].

    Contract as ``tail_slots.tail_forward``; cost model ``tail_slots.tail_forward_cost``.
    """
    check_h_idx(h, idx)
    if w.dim() != 3:
        raise ValueError(f"w must be [K, G, F], got shape {tuple(w.shape)}")
    K, G, F = w.shape
    check_operand(idx, (K, F), idx, "idx (to match w's K and F)")
    check_operand(w, (K, G, F), h, "w")
    if bias is not None:
        check_operand(bias, (K, G), h, "bias")
    BLOCK_G, BLOCK_F = check_tiles(G, F)
    B = h.shape[0]
    z = torch.empty((B, K * G), dtype=h.dtype, device=h.device)
    if B == 0 or K * G == 0:
        return z
    h = column_major(h)
    block_b, num_warps, num_stages = config.resolve(B, G, F)
    groups = config.resolve_groups_per_program(G)
    _tail_forward_kernel[(triton.cdiv(K, groups),)](
        h, idx.contiguous(), w.contiguous(), w if bias is None else bias.contiguous(), z, B, K, G, F,
        h.stride(0), h.stride(1), z.stride(0),
        HAS_BIAS=bias is not None, PRECISION=config.dot_precision(h.dtype), GROUPS_PER_PROGRAM=groups,
        BLOCK_B=block_b, BLOCK_G=BLOCK_G, BLOCK_F=BLOCK_F, num_warps=num_warps, num_stages=num_stages)
    return z


# ----------------------------------------------------------------------------- backward weight

@triton.jit
def _tail_backward_weight_kernel(dz_ptr, h_ptr, idx_ptr, dw_ptr,
                                 B, G, F,
                                 stride_db, stride_dc, stride_hb, stride_hh,
                                 PRECISION: tl.constexpr,
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
        dzt = load_tile(dz_ptr + k * G * stride_dc, offs_g, rows, stride_dc, stride_db, mask_g, mask_b)
        h = load_tile(h_ptr, rows, cols, stride_hb, stride_hh, mask_b, mask_f)
        acc = dot_acc(dzt, h, acc, PRECISION)
    tl.store(dw_ptr + k * G * F + offs_g[:, None] * F + offs_f[None, :],
             acc.to(dw_ptr.dtype.element_ty), mask=mask_g[:, None] & mask_f[None, :])


def tail_backward_weight_triton(dz: torch.Tensor, h: torch.Tensor, idx: torch.Tensor,
                                config: TailKernelConfig = DEFAULT_CONFIG) -> torch.Tensor:
    """dw [K, G, F] with dw[k] = dZ_k^T H[:, I_k] (dZ_k = dz[:, k*G:(k+1)*G]).

    Contract as ``tail_slots.tail_backward_weight``; cost model ``tail_slots.tail_backward_weight_cost``.
    """
    check_h_idx(h, idx)
    G = groups_of(dz, h, idx)
    K, F = idx.shape
    BLOCK_G, BLOCK_F = check_tiles(G, F)
    B = h.shape[0]
    dw = torch.empty((K, G, F), dtype=h.dtype, device=h.device)
    if G * F == 0:
        return dw
    h = column_major(h)
    block_b, num_warps, num_stages = config.resolve(B, G, F)
    _tail_backward_weight_kernel[(K,)](
        dz, h, idx.contiguous(), dw, B, G, F,
        dz.stride(0), dz.stride(1), h.stride(0), h.stride(1),
        PRECISION=config.dot_precision(h.dtype),
        BLOCK_B=block_b, BLOCK_G=BLOCK_G, BLOCK_F=BLOCK_F, num_warps=num_warps, num_stages=num_stages)
    return dw
