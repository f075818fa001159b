"""The per-label fixed fan-in baseline kernels (forward, both backward products) against float64 torch."""

from __future__ import annotations

import pytest
import torch

from tests.haste_rec.tail.test_triton_tail import DEVICE, DTYPES, check_close, f64, make, poisoned_allocations, shape_id
from targets.haste_rec.tail.tail_slots import (perlabel_backward_input, perlabel_backward_weight, perlabel_forward,
                                               perlabel_forward_inputs)
from targets.haste_rec.tail.triton_perlabel import (perlabel_backward_input_triton, perlabel_backward_weight_triton,
                                                    perlabel_forward_triton)

SHAPES = ({"B": 5, "Ht": 17, "L": 29, "F": 7},
          {"B": 70, "Ht": 9, "L": 33, "F": 9},       # B past one block, F not a multiple of the F chunk
          {"B": 1, "Ht": 4, "L": 1, "F": 1})
GPU_SHAPES = ({"B": 256, "Ht": 768, "L": 9000, "F": 64}, {"B": 203, "Ht": 385, "L": 4097, "F": 37})
CASES = SHAPES + (GPU_SHAPES if DEVICE == "cuda" else ())


def _inputs(shape: dict, dtype: torch.dtype) -> tuple:
    h, idx, w = make(perlabel_forward_inputs, shape, dtype, seed=shape["L"])
    dz = torch.randn(shape["B"], shape["L"], generator=torch.Generator().manual_seed(1)).to(DEVICE, dtype)
    return h, idx, w, dz


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", CASES, ids=shape_id)
def test_perlabel_kernels_match_float64(shape: dict, dtype: torch.dtype) -> None:
    h, idx, w, dz = _inputs(shape, dtype)
    dims = shape["Ht"]
    with poisoned_allocations():
        z = perlabel_forward_triton(h, idx, w)
        dw = perlabel_backward_weight_triton(dz, h, idx)
        dh = perlabel_backward_input_triton(dz, idx, w, dims)
    check_close(z, perlabel_forward(*f64((h, idx, w))), dtype)
    check_close(dw, perlabel_backward_weight(*f64((dz, h, idx))), dtype)
    check_close(dh, perlabel_backward_input(*f64((dz, idx, w, dims))), dtype)
    assert torch.equal(dh, perlabel_backward_input_triton(dz, idx, w, dims)), "deterministic input gradient"


def test_perlabel_shape_contract() -> None:
    h, idx, w, dz = _inputs(SHAPES[0], torch.float32)
    with pytest.raises(ValueError):
        perlabel_forward_triton(h, idx, w[:, :-1])
    with pytest.raises(ValueError):
        perlabel_backward_weight_triton(dz[:, :-1], h, idx)
    with pytest.raises(ValueError):
        perlabel_backward_input_triton(dz, idx.int(), w, h.shape[1])
