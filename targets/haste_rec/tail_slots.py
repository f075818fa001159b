"""Kernel slots of the HASTE output layer's sparse tail, with their torch references.

The tail is where a HASTE model spends its output-layer time: K groups of G labels, each group
reading F shared input dims. Its forward and both backward products are replaceable kernels
(``KernelSlot``), so sg-opt can swap in a faster implementation and check it against the torch
reference on fresh random inputs, and place it on a roofline with the FLOP/byte model. The
per-label fixed fan-in product (each label its own F dims) is a slot for later kernel work; the
trainer does not use it.

Shape dicts use the keys B (batch), Ht (tail input dims), K (groups), G (labels per group),
F (fan-in), L (labels, per-label slot only) and ``bias`` (1 or 0, tail_forward only).
"""

from __future__ import annotations

from typing import Callable, Mapping

import torch

from targets.protocol import FlopsBytes, KernelSlot

INDEX_BYTES = 8  # int64 indices


# ----------------------------------------------------------------------------- references

def tail_forward(h: torch.Tensor, idx: torch.Tensor, w: torch.Tensor,
                 bias: torch.Tensor | None) -> torch.Tensor:
    """z[b, k*G + g] = sum_f h[b, idx[k, f]] * w[k, g, f] + bias[k, g]."""
    batch = h.shape[0]
    groups, size, _ = w.shape
    z = torch.einsum("bkf,kgf->bkg", h[:, idx], w)
    if bias is not None:
        z = z + bias
    return z.reshape(batch, groups * size)


def tail_backward_weight(dz: torch.Tensor, h: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """dw[k] = dZ_k^T H[:, I_k]: the gradient of tail_forward with respect to w, [K, G, F]."""
    batch = dz.shape[0]
    groups = idx.shape[0]
    return torch.einsum("bkg,bkf->kgf", dz.reshape(batch, groups, -1), h[:, idx])


def tail_backward_input(dz: torch.Tensor, idx: torch.Tensor, w: torch.Tensor, Ht: int) -> torch.Tensor:
    """dh = sum over groups of dZ_k W_k scattered onto I_k (dims read by several groups summed)."""
    batch = dz.shape[0]
    groups, size, fan_in = w.shape
    dx = torch.einsum("bkg,kgf->bkf", dz.reshape(batch, groups, size), w)
    dh = dz.new_zeros(batch, Ht)
    return dh.index_add_(1, idx.reshape(-1), dx.reshape(batch, groups * fan_in))


def perlabel_forward(h: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Per-label fixed fan-in (Spartex-style): z[b, l] = sum_f h[b, idx[l, f]] * w[l, f]."""
    return torch.einsum("blf,lf->bl", h[:, idx], w)


# ----------------------------------------------------------------------------- inputs

def random_fan_in(rows: int, dims: int, fan_in: int, generator: torch.Generator) -> torch.Tensor:
    """int64 [rows, fan_in]: each row F distinct dims of [0, dims), drawn on the generator's device."""
    if fan_in > dims:
        raise ValueError(f"fan-in {fan_in} exceeds the {dims} available dims")
    scores = torch.rand(rows, dims, generator=generator, device=generator.device)
    return scores.argsort(dim=1)[:, :fan_in]


def _normal(shape: tuple[int, ...], std: float, dtype: torch.dtype, device: torch.device | str,
            generator: torch.Generator) -> torch.Tensor:
    """Normal(0, std) values drawn on the generator's device, delivered on ``device``."""
    values = torch.randn(shape, generator=generator, device=generator.device, dtype=dtype)
    return (values * std).to(device)


def _tail_operands(shape: Mapping[str, int], dtype: torch.dtype, device: torch.device | str,
                   generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(idx [K, F], w [K, G, F]) with w scaled so a logit has unit variance."""
    K, G, F, Ht = shape["K"], shape["G"], shape["F"], shape["Ht"]
    idx = random_fan_in(K, Ht, F, generator).to(device)
    w = _normal((K, G, F), F ** -0.5, dtype, device, generator)
    return idx, w


def tail_forward_inputs(shape: Mapping[str, int], dtype: torch.dtype, device: torch.device | str,
                        generator: torch.Generator) -> tuple:
    h = _normal((shape["B"], shape["Ht"]), 1.0, dtype, device, generator)
    idx, w = _tail_operands(shape, dtype, device, generator)
    bias = _normal((shape["K"], shape["G"]), 1.0, dtype, device, generator) if shape.get("bias", 1) else None
    return h, idx, w, bias


def tail_backward_weight_inputs(shape: Mapping[str, int], dtype: torch.dtype, device: torch.device | str,
                                generator: torch.Generator) -> tuple:
    dz = _normal((shape["B"], shape["K"] * shape["G"]), 1.0, dtype, device, generator)
    h = _normal((shape["B"], shape["Ht"]), 1.0, dtype, device, generator)
    idx = random_fan_in(shape["K"], shape["Ht"], shape["F"], generator).to(device)
    return dz, h, idx


def tail_backward_input_inputs(shape: Mapping[str, int], dtype: torch.dtype, device: torch.device | str,
                               generator: torch.Generator) -> tuple:
    dz = _normal((shape["B"], shape["K"] * shape["G"]), 1.0, dtype, device, generator)
    idx, w = _tail_operands(shape, dtype, device, generator)
    return dz, idx, w, shape["Ht"]


def perlabel_forward_inputs(shape: Mapping[str, int], dtype: torch.dtype, device: torch.device | str,
                            generator: torch.Generator) -> tuple:
    L, F = shape["L"], shape["F"]
    h = _normal((shape["B"], shape["Ht"]), 1.0, dtype, device, generator)
    idx = random_fan_in(L, shape["Ht"], F, generator).to(device)
    w = _normal((L, F), F ** -0.5, dtype, device, generator)
    return h, idx, w


# ----------------------------------------------------------------------------- cost models
# e = bytes per element of dtype; indices are int64 (8 bytes). Bytes are the fewest a kernel must
# move: each input read once, each output written once.

def tail_forward_cost(shape: Mapping[str, int], dtype: torch.dtype) -> FlopsBytes:
    B, Ht, K, G, F = (shape[k] for k in ("B", "Ht", "K", "G", "F"))
    bias = 1 if shape.get("bias", 1) else 0
    e = dtype.itemsize
    # flops = 2*B*K*G*F (one multiply-add per fan-in term) + bias*B*K*G (bias add)
    flops = 2 * B * K * G * F + bias * B * K * G
    # bytes = e*B*Ht (h) + 8*K*F (idx) + e*K*G*F (w) + bias*e*K*G (bias) + e*B*K*G (z)
    nbytes = e * B * Ht + INDEX_BYTES * K * F + e * K * G * F + bias * e * K * G + e * B * K * G
    return FlopsBytes(float(flops), float(nbytes))


def tail_backward_weight_cost(shape: Mapping[str, int], dtype: torch.dtype) -> FlopsBytes:
    B, Ht, K, G, F = (shape[k] for k in ("B", "Ht", "K", "G", "F"))
    e = dtype.itemsize
    # flops = 2*B*K*G*F (dw[k,g,f] sums B products)
    # bytes = e*B*K*G (dz) + e*B*Ht (h) + 8*K*F (idx) + e*K*G*F (dw)
    nbytes = e * B * K * G + e * B * Ht + INDEX_BYTES * K * F + e * K * G * F
    return FlopsBytes(float(2 * B * K * G * F), float(nbytes))


def tail_backward_input_cost(shape: Mapping[str, int], dtype: torch.dtype) -> FlopsBytes:
    B, Ht, K, G, F = (shape[k] for k in ("B", "Ht", "K", "G", "F"))
    e = dtype.itemsize
    # flops = 2*B*K*G*F (dx[b,k,f] sums G products) + B*K*F (scatter-add onto dh)
    flops = 2 * B * K * G * F + B * K * F
    # bytes = e*B*K*G (dz) + 8*K*F (idx) + e*K*G*F (w) + e*B*Ht (dh)
    nbytes = e * B * K * G + INDEX_BYTES * K * F + e * K * G * F + e * B * Ht
    return FlopsBytes(float(flops), float(nbytes))


def perlabel_forward_cost(shape: Mapping[str, int], dtype: torch.dtype) -> FlopsBytes:
    B, Ht, L, F = (shape[k] for k in ("B", "Ht", "L", "F"))
    e = dtype.itemsize
    # flops = 2*B*L*F
    # bytes = e*B*Ht (h) + 8*L*F (idx) + e*L*F (w) + e*B*L (z)
    nbytes = e * B * Ht + INDEX_BYTES * L * F + e * L * F + e * B * L
    return FlopsBytes(float(2 * B * L * F), float(nbytes))


# ----------------------------------------------------------------------------- slots

# Shapes: a tiny ragged one, a mid-size ragged one and the paper's scale (670,080 tail labels in
# groups of 32).
TAIL_SHAPES: tuple[Mapping[str, int], ...] = (
    {"B": 64, "Ht": 96, "K": 50, "G": 7, "F": 13, "bias": 1},
    {"B": 1000, "Ht": 300, "K": 1111, "G": 24, "F": 37, "bias": 0},
    {"B": 512, "Ht": 512, "K": 20940, "G": 32, "F": 64, "bias": 1},
)
PERLABEL_SHAPES: tuple[Mapping[str, int], ...] = (
    {"B": 64, "Ht": 96, "L": 333, "F": 13},
    {"B": 1000, "Ht": 300, "L": 26666, "F": 37},
    {"B": 256, "Ht": 512, "L": 65536, "F": 64},
)

TAIL_SLOTS: tuple[KernelSlot, ...] = (
    KernelSlot(
        name="tail_forward",
        signature="tail_forward(h: [B, Ht], idx: int64 [K, F], w: [K, G, F], bias: [K, G] | None) -> z: [B, K*G]",
        reference=tail_forward, make_inputs=tail_forward_inputs, cost=tail_forward_cost,
        shapes=TAIL_SHAPES,
        why="HASTE tail logits: a gather of each group's shared fan-in dims and a per-group GEMM",
    ),
    KernelSlot(
        name="tail_backward_weight",
        signature="tail_backward_weight(dz: [B, K*G], h: [B, Ht], idx: int64 [K, F]) -> dw: [K, G, F]",
        reference=tail_backward_weight, make_inputs=tail_backward_weight_inputs,
        cost=tail_backward_weight_cost, shapes=TAIL_SHAPES,
        why="HASTE tail weight gradient: per group dZ_k^T H[:, I_k]",
    ),
    KernelSlot(
        name="tail_backward_input",
        signature="tail_backward_input(dz: [B, K*G], idx: int64 [K, F], w: [K, G, F], Ht: int) -> dh: [B, Ht]",
        reference=tail_backward_input, make_inputs=tail_backward_input_inputs,
        cost=tail_backward_input_cost, shapes=TAIL_SHAPES,
        why="HASTE tail input gradient: per group dZ_k W_k, scatter-added onto the shared dims",
    ),
    KernelSlot(
        name="perlabel_forward",
        signature="perlabel_forward(h: [B, Ht], idx: int64 [L, F], w: [L, F]) -> z: [B, L]",
        reference=perlabel_forward, make_inputs=perlabel_forward_inputs,
        cost=perlabel_forward_cost, shapes=PERLABEL_SHAPES,
        why="per-label fixed fan-in logits (each label its own F dims); for kernel work, not the trainer",
    ),
)

TORCH_TAIL_IMPLS: dict[str, Callable] = {slot.name: slot.reference for slot in TAIL_SLOTS}
