"""Triton HASTE tail kernels (the three slots, the transposed index, the atomic variant, the forward at
2 groups per program) against the float64 torch references, on fresh random inputs with outputs
poisoned (NaN) at allocation.

Without a GPU they run on Triton's CPU interpreter in fp32 and fp16 (the interpreter computes bf16
wrongly); with one, on the GPU in fp32 and bf16. The other test_triton_tail_* modules import the
helpers here (DEVICE, DTYPES, check_close, poisoned_allocations...).
"""

from __future__ import annotations

import contextlib
import os

import pytest
import torch

if not torch.cuda.is_available():  # no GPU: Triton's CPU interpreter (set before triton is imported)
    os.environ.setdefault("TRITON_INTERPRET", "1")
INTERPRET = os.environ.get("TRITON_INTERPRET", "") not in ("", "0")

pytest.importorskip("triton")

from targets.haste_rec.tail.tail_slots import (  # noqa: E402
    tail_backward_input, tail_backward_input_inputs, tail_backward_weight, tail_backward_weight_inputs,
    tail_forward, tail_forward_inputs)
from targets.haste_rec.tail.triton_tail import TailKernelConfig, interpreter_active  # noqa: E402
from targets.haste_rec.tail.triton_tail_impls import triton_tail_impls  # noqa: E402
from targets.haste_rec.tail.triton_tail_backward import (  # noqa: E402
    build_slot_csr, slot_csr, tail_backward_input_atomic, tail_backward_input_triton)

# Without a GPU the variable stays set for the rest of the pytest process (triton reads it when a
# kernel is decorated); with a GPU the kernels are compiled and run there.
DEVICE = "cuda" if torch.cuda.is_available() and not INTERPRET else "cpu"
DTYPES = (torch.float32, torch.bfloat16) if DEVICE == "cuda" else (torch.float32, torch.float16)
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}  # max error / max |reference|
GPU_ONLY = pytest.mark.skipif(DEVICE != "cuda", reason="needs a CUDA device")

SHAPES = ({"B": 19, "Ht": 40, "K": 5, "G": 7, "F": 13, "bias": 1},
          {"B": 19, "Ht": 40, "K": 5, "G": 7, "F": 13, "bias": 0},
          {"B": 70, "Ht": 33, "K": 3, "G": 17, "F": 33, "bias": 1},  # B > one block, G/F > 16
          {"B": 1, "Ht": 4, "K": 1, "G": 1, "F": 1, "bias": 0})
GPU_SHAPES = ({"B": 256, "Ht": 768, "K": 300, "G": 32, "F": 64, "bias": 1},   # the large preset's tile
              {"B": 203, "Ht": 385, "K": 211, "G": 24, "F": 37, "bias": 0},   # ragged everywhere
              {"B": 512, "Ht": 128, "K": 40, "G": 64, "F": 128, "bias": 1})
CASES = SHAPES + (GPU_SHAPES if DEVICE == "cuda" else ())


def shape_id(shape: dict) -> str:
    return "_".join(f"{k}{v}" for k, v in shape.items())


def make(make_inputs, shape: dict, dtype: torch.dtype, seed: int = 0) -> tuple:
    """Fresh inputs of a slot's generator on DEVICE."""
    return make_inputs(shape, dtype, DEVICE, torch.Generator().manual_seed(seed))


def f64(inputs: tuple) -> tuple:
    return tuple(t.double() if torch.is_tensor(t) and t.is_floating_point() else t for t in inputs)


def check_close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, tol: float | None = None) -> None:
    """got has dtype and want's shape, no NaN, and max |got - want| <= tol * max |want|."""
    assert got.dtype == dtype and got.shape == want.shape, (got.dtype, got.shape, want.shape)
    got, want = got.double().cpu(), want.double().cpu()
    assert not torch.isnan(got).any(), "NaN in the output: an element was left unwritten"
    err = (got - want).abs().max().item() if want.numel() else 0.0
    scale = max(want.abs().max().item() if want.numel() else 0.0, 1e-30)
    limit = TOL[dtype] if tol is None else tol
    assert err / scale <= limit, f"max rel error {err / scale:.3g} > {limit}"


@contextlib.contextmanager
def poisoned_allocations():
    """torch.empty and torch.empty_like fill float tensors with NaN and integer ones with their minimum,
    so an output element a kernel forgets to write fails the comparison."""
    real_empty, real_like = torch.empty, torch.empty_like

    def poison(t: torch.Tensor) -> torch.Tensor:
        if t.is_floating_point():
            t.fill_(float("nan"))
        elif t.dtype != torch.bool:
            t.fill_(torch.iinfo(t.dtype).min)
        return t

    torch.empty = lambda *a, **k: poison(real_empty(*a, **k))
    torch.empty_like = lambda *a, **k: poison(real_like(*a, **k))
    try:
        yield
    finally:
        torch.empty, torch.empty_like = real_empty, real_like


def test_interpreter_matches_the_device() -> None:
    assert interpreter_active() == (DEVICE == "cpu")


# ----------------------------------------------------------------------------- the three slots

SLOT_CASES = {"tail_forward": (tail_forward_inputs, tail_forward),
              "tail_backward_weight": (tail_backward_weight_inputs, tail_backward_weight),
              "tail_backward_input": (tail_backward_input_inputs, tail_backward_input)}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", CASES, ids=shape_id)
@pytest.mark.parametrize("slot", SLOT_CASES)
def test_slot_matches_float64_reference(slot: str, shape: dict, dtype: torch.dtype) -> None:
    make_inputs, reference = SLOT_CASES[slot]
    inputs = make(make_inputs, shape, dtype, seed=len(slot))
    with poisoned_allocations():
        got = triton_tail_impls()[slot](*inputs)
    check_close(got, reference(*f64(inputs)), dtype)


# TF32 rounds each fp32 input to a 10-bit mantissa (2^-11 relative), F-term sums in fp32; 3xTF32 drops only
# the product of the two inputs' TF32 remainders (about 2^-22 relative), ten times tighter is loose for it.
TOLERANCES = {"tf32": 5e-3, "tf32x3": 5e-4}


@pytest.mark.parametrize("precision", TOLERANCES)
@pytest.mark.parametrize("slot", SLOT_CASES)
def test_tensor_core_fp32_products_stay_within_their_error_of_the_reference(slot: str, precision: str) -> None:
    """fp32_precision "tf32" (the knob matmul_precision=high) and "tf32x3" (tail_fp32_dot): within their error
    of float64, and on a GPU not the IEEE bits, so the setting reaches tl.dot (the CPU interpreter multiplies
    in fp32 either way)."""
    make_inputs, reference = SLOT_CASES[slot]
    shape = CASES[-1] if DEVICE == "cuda" else SHAPES[2]
    inputs = make(make_inputs, shape, torch.float32, seed=3)
    with poisoned_allocations():
        got = triton_tail_impls(TailKernelConfig(fp32_precision=precision))[slot](*inputs)
    check_close(got, reference(*f64(inputs)), torch.float32, TOLERANCES[precision])
    if DEVICE == "cuda":
        assert not torch.equal(got, triton_tail_impls()[slot](*inputs))


@pytest.mark.parametrize("block_b", [16, 32])
def test_small_blocks_and_strided_inputs(block_b: int) -> None:
    """Several batch chunks per program, a column-major h and a non-contiguous dz."""
    shape = {"B": 37, "Ht": 40, "K": 4, "G": 5, "F": 9, "bias": 1}
    impls = triton_tail_impls(TailKernelConfig(block_b=block_b))
    h, idx, w, bias = make(tail_forward_inputs, shape, torch.float32)
    check_close(impls["tail_forward"](h.t().contiguous().t(), idx, w, bias),
                tail_forward(*f64((h, idx, w, bias))), torch.float32)
    dz, h, idx = make(tail_backward_weight_inputs, shape, torch.float32)
    dz_t = dz.t().contiguous().t()
    check_close(impls["tail_backward_weight"](dz_t, h, idx), tail_backward_weight(*f64((dz, h, idx))), torch.float32)
    dz, idx, w, dims = make(tail_backward_input_inputs, shape, torch.float32)
    check_close(impls["tail_backward_input"](dz.t().contiguous().t(), idx, w, dims),
                tail_backward_input(*f64((dz, idx, w, dims))), torch.float32)


# ----------------------------------------------------------------------------- two groups per program

PAIR_SHAPES = ({"B": 37, "Ht": 40, "K": 4, "G": 16, "F": 9, "bias": 1},    # even K, three batch chunks
               {"B": 19, "Ht": 40, "K": 5, "G": 16, "F": 13, "bias": 0},   # odd K: the last program has one group
               {"B": 19, "Ht": 40, "K": 4, "G": 32, "F": 13, "bias": 0},
               {"B": 37, "Ht": 33, "K": 3, "G": 32, "F": 20, "bias": 1},
               {"B": 19, "Ht": 40, "K": 5, "G": 7, "F": 13, "bias": 1},    # G < BLOCK_G: padding lanes masked
               {"B": 1, "Ht": 4, "K": 1, "G": 1, "F": 1, "bias": 0})
PAIR_CASES = PAIR_SHAPES + (GPU_SHAPES[:2] if DEVICE == "cuda" else ())


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", PAIR_CASES, ids=shape_id)
def test_two_groups_per_program_match_one_bit_for_bit(shape: dict, dtype: torch.dtype) -> None:
    """groups_per_program only regroups the stores: the same products in the same order, so the same bits."""
    inputs = make(tail_forward_inputs, shape, dtype, seed=11)
    one = triton_tail_impls(TailKernelConfig(block_b=16))["tail_forward"](*inputs)
    with poisoned_allocations():
        two = triton_tail_impls(TailKernelConfig(block_b=16, groups_per_program=2))["tail_forward"](*inputs)
    assert torch.equal(one, two), "2 groups per program must give the 1-group path's bits"
    check_close(two, tail_forward(*f64(inputs)), dtype)


# ----------------------------------------------------------------------------- input gradient

@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", CASES, ids=shape_id)
def test_input_gradient_is_bitwise_repeatable_and_matches_atomic(shape: dict, dtype: torch.dtype) -> None:
    dz, idx, w, dims = make(tail_backward_input_inputs, shape, dtype, seed=3)
    first = tail_backward_input_triton(dz, idx, w, dims)
    again = tail_backward_input_triton(dz, idx, w, dims, csr=build_slot_csr(idx, dims))
    assert torch.equal(first, again), "the deterministic input gradient must repeat bit for bit"
    with poisoned_allocations():
        atomic = tail_backward_input_atomic(dz, idx, w, dims)
    check_close(atomic, tail_backward_input(*f64((dz, idx, w, dims))), dtype)


def test_dims_no_group_reads_get_zero() -> None:
    shape = {"B": 9, "Ht": 50, "K": 2, "G": 3, "F": 4}
    dz, idx, w, dims = make(tail_backward_input_inputs, shape, torch.float32)
    with poisoned_allocations():
        dh = tail_backward_input_triton(dz, idx, w, dims)
    unread = torch.ones(dims, dtype=torch.bool)
    unread[idx.flatten().cpu()] = False
    assert unread.sum() >= 40 and (dh.cpu()[:, unread] == 0).all()


def test_slot_csr_layout() -> None:
    idx = torch.tensor([[3, 0, 5], [0, 3, 1]])
    csr = build_slot_csr(idx, 6)
    assert csr.perm.dtype == csr.position.dtype == csr.row_ptr.dtype == torch.int32
    assert csr.row_ptr.tolist() == [0, 2, 3, 3, 5, 5, 6]          # dims 0..5 hold 2, 1, 0, 2, 0, 1 slots
    assert csr.perm.tolist() == [1, 3, 5, 0, 4, 2]                  # dim order, ties in slot order
    assert torch.equal(csr.perm[csr.position.long()], torch.arange(6, dtype=torch.int32))
    with pytest.raises(ValueError, match="fan-in"):
        build_slot_csr(idx, 5)


def test_slot_csr_cache_follows_identity_and_version() -> None:
    idx = torch.tensor([[3, 0, 5], [0, 3, 1]])
    first = slot_csr(idx, 6)
    assert slot_csr(idx, 6) is first
    assert slot_csr(idx.clone(), 6) is not first, "another tensor never shares a cached CSR"
    idx[0, 0] = 2  # in-place change (as rewiring does): the version moves
    rebuilt = slot_csr(idx, 6)
    assert rebuilt is not first and rebuilt.row_ptr.tolist() == [0, 2, 3, 4, 5, 5, 6]


# ----------------------------------------------------------------------------- config and contract

def test_config_resolution_is_a_fixed_rule() -> None:
    assert TailKernelConfig().resolve(256, 32, 64) == (64, 4, 3)
    assert TailKernelConfig().resolve(256, 64, 128) == (32, 8, 3)
    assert TailKernelConfig().resolve(5, 7, 13) == (16, 4, 3)      # a batch of 5 needs one 16-row tile
    assert TailKernelConfig(block_b=128, num_warps=2, num_stages=1).resolve(100, 8, 8) == (128, 2, 1)
    bf16, fp32 = torch.bfloat16, torch.float32
    assert TailKernelConfig().resolve(256, 32, 64, fused_dtype=bf16) == (32, 4, 3)  # fused loss, bf16: half the rows
    assert TailKernelConfig().resolve(256, 64, 128, fused_dtype=bf16) == (16, 8, 3)
    assert TailKernelConfig().resolve(256, 16, 64, fused_dtype=bf16) == (64, 4, 3)  # G=16: half is slower
    assert TailKernelConfig(block_b=64).resolve(256, 32, 64, fused_dtype=bf16) == (64, 4, 3)  # a set value stands
    assert [TailKernelConfig(fp32_precision=p).resolve(256, 32, 64, fused_dtype=fp32)[0]
            for p in ("ieee", "tf32", "tf32x3")] == [64, 32, 64]          # one tensor-core pass halves it
    assert [TailKernelConfig(groups_per_program=g).resolve_groups_per_program(32) for g in (1, 2, "auto")] == [1, 2, 1]
    assert [TailKernelConfig().resolve_groups_per_program(g) for g in (8, 16, 17, 64)] == [2, 2, 1, 1]
    with pytest.raises(ValueError, match="groups_per_program"):
        TailKernelConfig(groups_per_program=3).resolve_groups_per_program(32)
    assert [TailKernelConfig(fp32_precision=p).dot_precision(torch.float32) for p in ("ieee", "tf32")] == ["ieee", "tf32"]
    assert TailKernelConfig().dot_precision(torch.float32) == "ieee"       # exact fp32 products unless asked
    assert TailKernelConfig(fp32_precision="ieee").dot_precision(torch.bfloat16) == "tf32"  # Triton's default
    with pytest.raises(ValueError, match="fp32_precision"):
        TailKernelConfig(fp32_precision="fp16").dot_precision(torch.float32)


@pytest.mark.parametrize("stages", [1, 2, 4] if DEVICE == "cuda" else [1])  # the interpreter drops num_stages
def test_num_stages_does_not_change_bits(stages: int) -> None:
    """tail_num_stages is declared numerics "exact": prefetch depth must not move a bit."""
    shape = CASES[-1] if DEVICE == "cuda" else SHAPES[2]
    dtype = DTYPES[-1]
    base, other = triton_tail_impls(TailKernelConfig(num_stages=3)), triton_tail_impls(TailKernelConfig(num_stages=stages))
    for slot, (make_inputs, _) in SLOT_CASES.items():
        inputs = make(make_inputs, shape, dtype, seed=7)
        assert torch.equal(base[slot](*inputs), other[slot](*inputs)), slot


def test_shape_contract() -> None:
    impls = triton_tail_impls()
    h, idx, w, bias = make(tail_forward_inputs, SHAPES[0], torch.float32)
    for bad in ((h, idx[:, :-1], w, bias), (h, idx.int(), w, bias), (h, idx, w, bias[:, :-1]),
                (h, idx, w.half(), bias), (h[0], idx, w, bias)):
        with pytest.raises(ValueError):
            impls["tail_forward"](*bad)
    with pytest.raises(TypeError):
        impls["tail_forward"](h.double(), idx, w.double(), bias.double())
    dz = torch.zeros(h.shape[0], idx.shape[0] * 7 + 1, device=DEVICE)
    with pytest.raises(ValueError):
        impls["tail_backward_weight"](dz, h, idx)
    with pytest.raises(ValueError):
        impls["tail_backward_input"](dz, idx, w, h.shape[1])
    with pytest.raises(ValueError):
        impls["tail_backward_input"](dz[:, :-1], idx, w, h.shape[1], csr=build_slot_csr(idx, h.shape[1] + 1))
