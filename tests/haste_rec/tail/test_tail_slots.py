"""The HASTE tail's kernel slots: references against independent float64 math, inputs, cost models."""

from __future__ import annotations

import pytest
import torch

from targets.haste_rec.tail.tail_slots import TAIL_SLOTS, TORCH_TAIL_IMPLS
from targets.protocol import KernelSlot

SLOTS = {slot.name: slot for slot in TAIL_SLOTS}
RAGGED_TAIL = ({"B": 5, "Ht": 17, "K": 9, "G": 3, "F": 7, "bias": 1},
               {"B": 13, "Ht": 40, "K": 21, "G": 5, "F": 40, "bias": 0},
               {"B": 1, "Ht": 8, "K": 1, "G": 1, "F": 1, "bias": 1})
RAGGED_PERLABEL = ({"B": 5, "Ht": 17, "L": 29, "F": 7}, {"B": 11, "Ht": 9, "L": 3, "F": 9})
MAX_CPU_WORK = 2e7  # default shapes up to this many multiply-adds are checked here
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _shapes(slot: KernelSlot) -> list[dict]:
    own = RAGGED_PERLABEL if slot.name == "perlabel_forward" else RAGGED_TAIL
    small = [dict(s) for s in slot.shapes if slot.cost(s, torch.float32).flops / 2 <= MAX_CPU_WORK]
    return [dict(s) for s in own] + small


CASES = [(slot.name, shape) for slot in TAIL_SLOTS for shape in _shapes(slot)]


def _inputs(slot: KernelSlot, shape: dict, dtype: torch.dtype, seed: int = 0, device: str = "cpu") -> tuple:
    return slot.make_inputs(shape, dtype, device, torch.Generator().manual_seed(seed))


def _cpu(inputs: tuple) -> tuple:
    return tuple(t.cpu() if torch.is_tensor(t) else t for t in inputs)


# ----------------------------------------------------------------------------- independent math

def _dense_tail(idx: torch.Tensor, w: torch.Tensor, dims: int) -> torch.Tensor:
    """[K*G, dims] float64 weight with w[k, g, f] at column idx[k, f], by accumulate-put."""
    K, G, F = w.shape
    k = torch.arange(K)[:, None, None].expand(K, G, F)
    g = torch.arange(G)[None, :, None].expand(K, G, F)
    cols = idx[:, None, :].expand(K, G, F)
    dense = torch.zeros(K, G, dims, dtype=torch.float64)
    return dense.index_put_((k, g, cols), w.double(), accumulate=True).reshape(K * G, dims)


def _expected(name: str, inputs: tuple) -> torch.Tensor:
    if name == "tail_forward":
        h, idx, w, bias = inputs
        z = h.double() @ _dense_tail(idx, w, h.shape[1]).T
        return z if bias is None else z + bias.double().reshape(-1)
    if name == "tail_backward_weight":
        dz, h, idx = inputs
        K, F = idx.shape
        dense_grad = (dz.double().T @ h.double()).reshape(K, -1, h.shape[1])
        return dense_grad.gather(2, idx[:, None, :].expand(K, dense_grad.shape[1], F))
    if name == "tail_backward_input":
        dz, idx, w, dims = inputs
        return dz.double() @ _dense_tail(idx, w, dims)
    h, idx, w = inputs
    L, F = idx.shape
    dense = torch.zeros(L, h.shape[1], dtype=torch.float64)
    dense[torch.arange(L)[:, None].expand(L, F), idx] = w.double()
    return h.double() @ dense.T


# ----------------------------------------------------------------------------- tests

@pytest.mark.parametrize("name,shape", CASES)
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-10), (torch.float32, 2e-5)])
@pytest.mark.parametrize("device", DEVICES)
def test_reference_matches_independent_float64(name: str, shape: dict, dtype: torch.dtype, tol: float,
                                               device: str) -> None:
    slot = SLOTS[name]
    inputs = _inputs(slot, shape, dtype, device=device)
    assert all(t.device.type == device for t in inputs if torch.is_tensor(t))
    out = slot.reference(*inputs)
    expected = _expected(name, _cpu(inputs))
    assert out.dtype == dtype and out.shape == expected.shape and out.device.type == device
    torch.testing.assert_close(out.double().cpu(), expected, rtol=tol, atol=tol * 10)


@pytest.mark.parametrize("name,shape", CASES)
def test_inputs_have_distinct_in_range_indices(name: str, shape: dict) -> None:
    slot = SLOTS[name]
    inputs = _inputs(slot, shape, torch.float32)
    idx = next(t for t in inputs if torch.is_tensor(t) and t.dtype == torch.int64)
    rows = shape["L"] if name == "perlabel_forward" else shape["K"]
    assert idx.shape == (rows, shape["F"])
    assert int(idx.min()) >= 0 and int(idx.max()) < shape["Ht"]
    assert (idx.sort(dim=1).values.diff(dim=1) > 0).all(), "fan-in dims must be distinct within a row"
    if name == "tail_forward":
        assert (inputs[3] is None) == (shape["bias"] == 0)


@pytest.mark.parametrize("name", SLOTS)
def test_inputs_are_fresh_and_seeded(name: str) -> None:
    slot = SLOTS[name]
    shape = dict((RAGGED_PERLABEL if name == "perlabel_forward" else RAGGED_TAIL)[0])
    first, again, other = (_inputs(slot, shape, torch.float32, seed) for seed in (1, 1, 2))
    tensors = [(a, b, c) for a, b, c in zip(first, again, other) if torch.is_tensor(a) and a.is_floating_point()]
    assert all(torch.equal(a, b) for a, b, _ in tensors)
    assert all(not torch.equal(a, c) for a, _, c in tensors)


@pytest.mark.parametrize("name,shape", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_cost_bytes_are_inputs_read_once_plus_output(name: str, shape: dict, dtype: torch.dtype) -> None:
    slot = SLOTS[name]
    inputs = _inputs(slot, shape, dtype)
    output = slot.reference(*inputs)
    moved = sum(t.numel() * t.element_size() for t in (*inputs, output) if torch.is_tensor(t))
    assert slot.cost(shape, dtype).bytes == moved


@pytest.mark.parametrize("name,shape", CASES)
def test_cost_flops(name: str, shape: dict) -> None:
    cost = SLOTS[name].cost(shape, torch.float32)
    if name == "perlabel_forward":
        assert cost.flops == 2 * shape["B"] * shape["L"] * shape["F"]
        return
    B, K, G, F = shape["B"], shape["K"], shape["G"], shape["F"]
    extra = {"tail_forward": B * K * G * shape["bias"], "tail_backward_weight": 0,
             "tail_backward_input": B * K * F}[name]
    assert cost.flops == 2 * B * K * G * F + extra > 0


def test_registry() -> None:
    assert set(TORCH_TAIL_IMPLS) == {"tail_forward", "tail_backward_weight", "tail_backward_input",
                                     "perlabel_forward"}
    for slot in TAIL_SLOTS:
        assert TORCH_TAIL_IMPLS[slot.name] is slot.reference
        assert slot.signature.startswith(slot.name + "(")
        assert len(slot.shapes) >= 2 and slot.why


def test_default_shapes_include_ragged_ones() -> None:
    for slot in TAIL_SLOTS:
        sizes = [v for s in slot.shapes for k, v in s.items() if k != "bias"]
        assert any(v % 8 for v in sizes), f"{slot.name} has no ragged default shape"
