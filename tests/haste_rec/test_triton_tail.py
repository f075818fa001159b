"""Triton HASTE tail kernels against the float64 torch references, run on Triton's CPU interpreter."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():  # no GPU: Triton's CPU interpreter (set before triton is imported)
    os.environ.setdefault("TRITON_INTERPRET", "1")
INTERPRET = os.environ.get("TRITON_INTERPRET", "") not in ("", "0")

pytest.importorskip("triton")

from targets.haste_rec.tail_slots import (  # noqa: E402
    tail_backward_weight, tail_backward_weight_inputs, tail_forward, tail_forward_inputs)
from targets.haste_rec.triton_tail import TRITON_TAIL_IMPLS  # noqa: E402

# Without a GPU the variable stays set for the rest of the pytest process (triton reads it when a
# kernel is decorated and again at launch); with a GPU the kernels are compiled and run there.

DEVICE = "cuda" if torch.cuda.is_available() and not INTERPRET else "cpu"
SHAPES = ({"B": 19, "Ht": 40, "K": 5, "G": 7, "F": 13, "bias": 1},
          {"B": 19, "Ht": 40, "K": 5, "G": 7, "F": 13, "bias": 0},
          {"B": 70, "Ht": 33, "K": 3, "G": 17, "F": 33, "bias": 1},  # B > one block, G/F > 16
          {"B": 1, "Ht": 4, "K": 1, "G": 1, "F": 1, "bias": 0})
TOL = {torch.float32: 1e-5, torch.float16: 2e-3}
IDS = [f"B{s['B']}_K{s['K']}_G{s['G']}_F{s['F']}_bias{s['bias']}" for s in SHAPES]


def _inputs(make, shape: dict, dtype: torch.dtype) -> tuple:
    return make(shape, dtype, DEVICE, torch.Generator().manual_seed(0))


def _f64(inputs: tuple) -> tuple:
    return tuple(t.double() if torch.is_tensor(t) and t.is_floating_point() else t for t in inputs)


def _check(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    assert got.dtype == dtype and got.shape == want.shape
    got = got.double().cpu()
    want = want.cpu()
    assert not torch.isnan(got).any()
    err = (got - want).abs().max().item()
    scale = max(want.abs().max().item(), 1e-30)
    assert err / scale <= TOL[dtype], f"max rel error {err / scale:.3g} > {TOL[dtype]}"


@pytest.mark.parametrize("dtype", list(TOL), ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=IDS)
def test_tail_forward(shape: dict, dtype: torch.dtype) -> None:
    inputs = _inputs(tail_forward_inputs, shape, dtype)
    assert (inputs[3] is None) == (not shape["bias"])
    got = TRITON_TAIL_IMPLS["tail_forward"](*inputs)
    _check(got, tail_forward(*_f64(inputs)), dtype)


@pytest.mark.parametrize("dtype", list(TOL), ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=IDS)
def test_tail_backward_weight(shape: dict, dtype: torch.dtype) -> None:
    inputs = _inputs(tail_backward_weight_inputs, shape, dtype)
    got = TRITON_TAIL_IMPLS["tail_backward_weight"](*inputs)
    _check(got, tail_backward_weight(*_f64(inputs)), dtype)


def test_small_blocks_and_strided_h() -> None:
    """Several B blocks / loop iterations and a non-contiguous h."""
    shape = {"B": 37, "Ht": 40, "K": 4, "G": 5, "F": 9, "bias": 1}
    h, idx, w, bias = _inputs(tail_forward_inputs, shape, torch.float32)
    h_t = h.t().contiguous().t()  # same values, column-major strides
    z = TRITON_TAIL_IMPLS["tail_forward"](h_t, idx, w, bias, block_b=16)
    _check(z, tail_forward(*_f64((h, idx, w, bias))), torch.float32)
    dz, h, idx = _inputs(tail_backward_weight_inputs, shape, torch.float32)
    dw = TRITON_TAIL_IMPLS["tail_backward_weight"](dz, h.t().contiguous().t(), idx, block_b=16)
    _check(dw, tail_backward_weight(*_f64((dz, h, idx))), torch.float32)


def test_shape_contract() -> None:
    h, idx, w, bias = _inputs(tail_forward_inputs, SHAPES[0], torch.float32)
    with pytest.raises(ValueError):
        TRITON_TAIL_IMPLS["tail_forward"](h, idx[:, :-1], w, bias)
    with pytest.raises(ValueError):
        TRITON_TAIL_IMPLS["tail_forward"](h, idx.int(), w, bias)
    with pytest.raises(ValueError):
        TRITON_TAIL_IMPLS["tail_forward"](h, idx, w, bias[:, :-1])
    dz = torch.zeros(h.shape[0], idx.shape[0] * 7 + 1)
    with pytest.raises(ValueError):
        TRITON_TAIL_IMPLS["tail_backward_weight"](dz, h, idx)
