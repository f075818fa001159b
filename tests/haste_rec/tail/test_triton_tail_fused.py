"""The fused tail + BCE kernel against the float64 torch reference (loss and every gradient), its
positives regrouping and bitmask (the two formats give the same results), its rounding modes, and its
autograd Function inside HasteOutput."""

from __future__ import annotations

import math

import pytest
import torch

from tests.haste_rec.tail.test_triton_tail import (DEVICE, DTYPES, TOL, check_close, f64, make, poisoned_allocations,
                                                   shape_id)
from targets.haste_rec.tail.haste import HasteOutput
from targets.haste_rec.tail.tail_slots import tail_fused_bce, tail_fused_bce_inputs
from targets.haste_rec.tail.triton_fused_bce import (tail_fused_bce_traffic, tail_fused_bce_triton, tail_positive_bits,
                                                     tail_positives)
from targets.haste_rec.tail.triton_tail import TailKernelConfig

SHAPES = ({"B": 19, "Ht": 40, "K": 5, "G": 7, "F": 13, "bias": 1, "weight": 1, "P": 40},
          {"B": 70, "Ht": 33, "K": 3, "G": 17, "F": 33, "bias": 0, "weight": 0, "P": 300},  # dense positives
          {"B": 33, "Ht": 20, "K": 9, "G": 4, "F": 6, "bias": 1, "weight": 0, "P": 0},      # no positive at all
          {"B": 1, "Ht": 4, "K": 1, "G": 1, "F": 1, "bias": 1, "weight": 1, "P": 1})
GPU_SHAPES = ({"B": 256, "Ht": 768, "K": 300, "G": 32, "F": 64, "bias": 1, "weight": 1, "P": 1500},
              {"B": 203, "Ht": 385, "K": 211, "G": 24, "F": 37, "bias": 0, "weight": 1, "P": 999})
CASES = SHAPES + (GPU_SHAPES if DEVICE == "cuda" else ())
LOSS_TOL = {torch.float32: 1e-6, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def _check_all(got: tuple, want: tuple, dtype: torch.dtype, grad_dtypes: tuple | None = None) -> None:
    loss, want_loss = got[0], want[0]
    assert loss.dtype == torch.float32 and loss.dim() == 0
    assert abs(loss.item() - want_loss.item()) <= LOSS_TOL[dtype] * max(abs(want_loss.item()), 1e-30)
    for name, g, w, gd in zip(("dh", "dw", "dbias"), got[1:], want[1:], grad_dtypes or (dtype,) * 3):
        assert (g is None) == (w is None), name
        if g is not None:
            check_close(g, w, gd, tol=TOL[dtype])  # the tolerance of the compute dtype


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", CASES, ids=shape_id)
def test_fused_matches_float64_reference(shape: dict, dtype: torch.dtype) -> None:
    inputs = make(tail_fused_bce_inputs, shape, dtype, seed=11)
    with poisoned_allocations():
        got = tail_fused_bce_triton(*inputs)
    _check_all(got, tail_fused_bce(*f64(inputs)), dtype)
    assert all(torch.equal(a, b) for a, b in zip(got, tail_fused_bce_triton(*inputs)) if a is not None), \
        "the fused loss and gradients must repeat bit for bit"


def test_tf32x3_products_stay_within_their_error_of_the_reference() -> None:
    """fp32_precision="tf32x3" (the knob tail_fp32_dot), the fused kernel at its auto BLOCK_B for it: loss and
    gradients within 3xTF32's error of float64; on a GPU not the IEEE bits (the interpreter ignores it)."""
    shape = GPU_SHAPES[0] if DEVICE == "cuda" else SHAPES[0]
    inputs = make(tail_fused_bce_inputs, shape, torch.float32, seed=5)
    with poisoned_allocations():
        got = tail_fused_bce_triton(*inputs, config=TailKernelConfig(fp32_precision="tf32x3"))
    want = tail_fused_bce(*f64(inputs))
    assert abs(got[0].item() - want[0].item()) <= 1e-5 * abs(want[0].item())
    for g, w in zip(got[1:], want[1:]):
        check_close(g, w, torch.float32, tol=5e-4)
    if DEVICE == "cuda":
        assert not torch.equal(got[1], tail_fused_bce_triton(*inputs)[1])


def test_small_blocks_repeated_and_outside_positives() -> None:
    """Several batch chunks; a positive listed twice counts once; columns outside the tail are ignored."""
    shape = {"B": 37, "Ht": 30, "K": 6, "G": 5, "F": 7, "bias": 1, "weight": 1, "P": 25}
    h, idx, w, bias, cw, rows, cols, scale = make(tail_fused_bce_inputs, shape, torch.float32, seed=2)
    rows2 = torch.cat([rows, rows[:5], torch.tensor([0, 3], device=DEVICE)])
    cols2 = torch.cat([cols, cols[:5], torch.tensor([-4, 6 * 5], device=DEVICE)])
    got = tail_fused_bce_triton(h, idx, w, bias, cw, rows2, cols2, scale, config=TailKernelConfig(block_b=16))
    _check_all(got, tail_fused_bce(*f64((h, idx, w, bias, cw, rows, cols, scale))), torch.float32)


def test_master_weights_in_fp32() -> None:
    """Autocast's layout: h in half precision, w and bias fp32 (cast in registers); gradients come back
    in each operand's dtype, the products rounded as torch rounds them."""
    low = DTYPES[-1]
    shape = {"B": 45, "Ht": 40, "K": 6, "G": 9, "F": 11, "bias": 1, "weight": 1, "P": 60}
    h, idx, w, bias, cw, rows, cols, scale = make(tail_fused_bce_inputs, shape, torch.float32, seed=4)
    got = tail_fused_bce_triton(h.to(low), idx, w, bias, cw, rows, cols, scale)
    want = tail_fused_bce(*f64((h.to(low), idx, w.to(low), bias, cw, rows, cols, scale)))
    _check_all(got, want, low, grad_dtypes=(low, torch.float32, torch.float32))
    with pytest.raises(ValueError, match="bias"):
        tail_fused_bce_triton(h.to(low), idx, w, bias.double(), cw, rows, cols, scale)


def test_tail_positives_groups_in_input_order() -> None:
    rows = torch.tensor([0, 1, 2, 3, 4, 5])
    cols = torch.tensor([7, 2, 6, -1, 3, 12])  # G = 3, K = 4: groups 2, 0, 2, (head), 1, (past the tail)
    pos = tail_positives(rows, cols, 4, 3)
    assert pos.group_ptr.tolist() == [0, 1, 2, 4, 4]
    assert pos.rows.tolist()[:4] == [1, 4, 0, 2] and pos.cols.tolist()[:4] == [2, 0, 1, 0]
    assert pos.rows.dtype == pos.cols.dtype == pos.group_ptr.dtype == torch.int32


# ----------------------------------------------------------------------------- positives as a bitmask

def _bits_reference(rows: list, cols: list, groups: int, size: int, batch: int, width: int) -> torch.Tensor:
    """The bitmask by Python ints: OR each pair inside the tail in, then wrap to a signed word."""
    words = [[0] * batch for _ in range(groups)]
    for b, c in zip(rows, cols):
        if 0 <= b < batch and 0 <= c < groups * size:
            words[c // size][b] |= 1 << (c % size)
    return torch.tensor([[v - (1 << width) if v >> (width - 1) else v for v in row] for row in words])


@pytest.mark.parametrize("size", (1, 7, 32, 33, 64))  # int32 up to 32 (bit 31: the sign), int64 above
def test_tail_positive_bits_match_a_python_reference(size: int) -> None:
    """Repeated pairs count once; head (negative) and past-the-tail columns, and rows outside the batch,
    are ignored; more pairs than one program sets."""
    groups, batch, n = 6, 11, 1500
    g = torch.Generator().manual_seed(size)
    rows = torch.randint(0, batch, (n,), generator=g)
    cols = torch.randint(-size, (groups + 1) * size, (n,), generator=g)
    # repeats; the last word's highest bit, twice; two rows outside the batch
    rows = torch.cat([rows, rows[:40], torch.tensor([batch - 1, batch - 1, -1, batch])])
    cols = torch.cat([cols, cols[:40], torch.tensor([groups * size - 1, groups * size - 1, 3, size - 1])])
    got = tail_positive_bits(rows.to(DEVICE), cols.to(DEVICE), groups, size, batch)
    width = 32 if size <= 32 else 64
    assert got.dtype == (torch.int32 if width == 32 else torch.int64) and got.shape == (groups, batch)
    assert torch.equal(got.cpu().long(), _bits_reference(rows.tolist(), cols.tolist(), groups, size, batch, width))


def test_tail_positive_bits_limits() -> None:
    empty = torch.zeros(0, dtype=torch.int64, device=DEVICE)
    assert torch.equal(tail_positive_bits(empty, empty, 3, 5, 4).cpu(), torch.zeros(3, 4, dtype=torch.int32))
    with pytest.raises(ValueError, match="at most 64 labels per group"):
        tail_positive_bits(empty, empty, 3, 65, 4)
    with pytest.raises(ValueError, match=r"\[P\]"):
        tail_positive_bits(empty, empty[:0].reshape(0, 1), 3, 5, 4)


BITS_CASES = (SHAPES[0], SHAPES[1],  # G=7 (int32), G=17 with dense positives
              {"B": 21, "Ht": 30, "K": 3, "G": 40, "F": 9, "bias": 1, "weight": 1, "P": 90})  # int64 words


@pytest.mark.parametrize("shape", BITS_CASES + (GPU_SHAPES if DEVICE == "cuda" else ()), ids=shape_id)
def test_bits_format_gives_the_list_format_results(shape: dict) -> None:
    """Same loss, dh, dw, dbias bit for bit, built inside or handed in prebuilt; several batch chunks,
    repeated and outside positives included."""
    dtype = DTYPES[-1] if shape["G"] == 17 else DTYPES[0]  # one half-precision case, fp32 otherwise
    h, idx, w, bias, cw, rows, cols, scale = make(tail_fused_bce_inputs, shape, dtype, seed=6)
    K, G, B = shape["K"], shape["G"], shape["B"]
    rows2 = torch.cat([rows, rows[:7], torch.tensor([0, B - 1], device=DEVICE)])
    cols2 = torch.cat([cols, cols[:7], torch.tensor([-1, K * G], device=DEVICE)])
    config = TailKernelConfig(block_b=16)
    args = (h, idx, w, bias, cw, rows2, cols2, scale)
    with poisoned_allocations():
        got = tail_fused_bce_triton(*args, config=config, positives_format="bits")
    _check_all(got, tail_fused_bce(*f64((h, idx, w, bias, cw, rows, cols, scale))), dtype)
    prebuilt = tail_positive_bits(rows2, cols2, K, G, B)
    for other in (tail_fused_bce_triton(*args, config=config, positives_format="list"),
                  tail_fused_bce_triton(*args, prebuilt, config=config, positives_format="bits")):
        assert all((a is None and b is None) or torch.equal(a, b) for a, b in zip(got, other))


def test_positives_format_checks() -> None:
    shape = {"B": 4, "Ht": 8, "K": 2, "G": 65, "F": 3, "bias": 0, "weight": 0, "P": 3}
    inputs = make(tail_fused_bce_inputs, shape, torch.float32)
    with pytest.raises(ValueError, match="at most 64"):
        tail_fused_bce_triton(*inputs, positives_format="bits")
    with pytest.raises(ValueError, match="positives_format must be one of"):
        tail_fused_bce_triton(*inputs, positives_format="dense")
    small = dict(shape, G=5)
    h, idx, w, bias, cw, rows, cols, scale = make(tail_fused_bce_inputs, small, torch.float32)
    bits = tail_positive_bits(rows, cols, 2, 5, 4)
    with pytest.raises(ValueError, match="takes TailPositives"):
        tail_fused_bce_triton(h, idx, w, bias, cw, rows, cols, scale, bits, positives_format="list")
    with pytest.raises(ValueError, match="bitmask of tail_positive_bits"):
        tail_fused_bce_triton(h, idx, w, bias, cw, rows, cols, scale, bits.long(), positives_format="bits")
    traffic = {fmt: tail_fused_bce_traffic(small, torch.float32, fmt).bytes for fmt in ("list", "bits", "auto")}
    assert traffic["bits"] - traffic["list"] == 2 * 4 * 2 * 4  # int32 words, K x B, written and read once
    assert traffic["auto"] == traffic["bits"]                   # G <= 64 reads bits by default
    assert (tail_fused_bce_traffic(shape, torch.float32).bytes  # G = 65: "auto" reads the list
            == tail_fused_bce_traffic(shape, torch.float32, "list").bytes)
    # "auto" (the default) takes a prebuilt bitmask for G <= 64, and runs the list format above
    got = tail_fused_bce_triton(h, idx, w, bias, cw, rows, cols, scale, bits)
    want = tail_fused_bce_triton(h, idx, w, bias, cw, rows, cols, scale, positives_format="list")
    assert all(torch.equal(a, b) for a, b in zip(got[:3], want[:3]))
    tail_fused_bce_triton(*inputs)


# ----------------------------------------------------------------------------- through HasteOutput

def _layer(backend: str, seed: int = 0) -> HasteOutput:
    """3 head labels and 41 tail labels in groups of 6 (one padded column), non-zero tail bias."""
    labels = torch.randperm(44, generator=torch.Generator().manual_seed(seed))
    groups = torch.full((42,), -1)
    groups[:41] = labels[3:]
    layer = HasteOutput(24, 19, labels[:3], groups.reshape(7, 6), 5, backend=backend, seed=seed)
    with torch.no_grad():
        layer.tail_bias.normal_(generator=torch.Generator().manual_seed(seed + 1))
    return layer.to(DEVICE)


def test_fused_layer_loss_and_gradients_equal_the_unfused_tail() -> None:
    fused, plain = _layer("triton-fused-loss"), _layer("torch")
    g = torch.Generator().manual_seed(5)
    h = torch.randn(10, 24, generator=g).to(DEVICE)
    rows = torch.randint(0, 10, (30,), generator=g).to(DEVICE)
    cols = torch.randint(-3, 42, (30,), generator=g).to(DEVICE)  # negative: head labels, ignored

    h1 = h.clone().requires_grad_(True)
    loss = fused.tail_bce_loss(h1, rows, cols, 0.1)
    (3.0 * loss).backward()

    h2 = h.clone().requires_grad_(True)
    z = plain.tail_logits(h2)
    y = torch.zeros_like(z)
    keep = cols >= 0
    y[rows[keep], cols[keep]] = 1.0
    weight = plain.valid_mask[3:].float()
    assert weight.min() == 0, "the case must have a padded column"
    want = torch.nn.functional.binary_cross_entropy_with_logits(z, y, weight=weight, reduction="sum") * 0.1
    (3.0 * want).backward()

    assert math.isclose(loss.item(), want.item(), rel_tol=1e-6)
    for a, b in ((h1.grad, h2.grad), (fused.tail_weight.grad, plain.tail_weight.grad),
                 (fused.tail_bias.grad, plain.tail_bias.grad)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    padded = ~fused.valid_mask[3:].reshape(7, 6)
    assert (fused.tail_weight.grad[padded] == 0).all() and (fused.tail_bias.grad[padded] == 0).all()


def test_fused_layer_refuses_a_second_backward_and_other_backends() -> None:
    fused = _layer("triton-fused-loss")
    h = torch.randn(4, 24, device=DEVICE, requires_grad=True)
    loss = fused.tail_bce_loss(h, torch.tensor([0], device=DEVICE), torch.tensor([2], device=DEVICE), 1.0)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="twice"):
        loss.backward()
    with pytest.raises(Exception, match="triton-fused-loss"):
        _layer("triton").tail_bce_loss(h, torch.tensor([0]), torch.tensor([2]), 1.0)
