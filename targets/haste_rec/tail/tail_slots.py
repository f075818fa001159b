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
import torch.nn.functional as F_nn

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


def perlabel_backward_weight(dz: torch.Tensor, h: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """dw[l, f] = sum_b dz[b, l] * h[b, idx[l, f]]: perlabel_forward's weight gradient, [L, F]."""
    return torch.einsum("bl,blf->lf", dz, h[:, idx])


def perlabel_backward_input(dz: torch.Tensor, idx: torch.Tensor, w: torch.Tensor, Ht: int) -> torch.Tensor:
    """dh[b, d] = sum over (l, f) with idx[l, f] == d of dz[b, l] * w[l, f]: perlabel_forward's input gradient."""
    dx = torch.einsum("bl,lf->blf", dz, w)
    dh = dz.new_zeros(dz.shape[0], Ht)
    return dh.index_add_(1, idx.reshape(-1), dx.reshape(dz.shape[0], -1))


def tail_fused_bce(h: torch.Tensor, idx: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None,
                   col_weight: torch.Tensor | None, rows: torch.Tensor, cols: torch.Tensor,
                   scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The tail's BCE loss and its gradients, as the trainer computes them without fusion.

    z = tail_forward(h, idx, w, bias) [B, K*G]; targets y[b, c] = 1 where some p has
    (rows[p], cols[p]) == (b, c) (cols in the tail's column numbering k*G + g), else 0;
    loss = scale * sum_{b,c} col_weight[c] * BCEWithLogits(z[b, c], y[b, c]) (col_weight [K, G],
    None = all ones). Returns (loss 0-dim, dh [B, Ht], dw [K, G, F], dbias [K, G] or None).
    """
    leaves = [t.detach().requires_grad_(True) for t in (h, w)]
    leaves += [] if bias is None else [bias.detach().requires_grad_(True)]
    with torch.enable_grad():
        z = tail_forward(leaves[0], idx, leaves[1], leaves[2] if bias is not None else None)
        y = torch.zeros_like(z)
        y[rows, cols] = 1.0
        weight = None if col_weight is None else col_weight.reshape(-1).to(z.dtype)
        loss = F_nn.binary_cross_entropy_with_logits(z, y, weight=weight, reduction="sum") * scale
        grads = torch.autograd.grad(loss, leaves)
    return loss.detach(), grads[0], grads[1], grads[2] if bias is not None else None


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


def tail_fused_bce_inputs(shape: Mapping[str, int], dtype: torch.dtype, device: torch.device | str,
                          generator: torch.Generator) -> tuple:
    """(h, idx, w, bias, col_weight, rows, cols, scale): P positives at random (row, column) pairs
    (repeats allowed: a label listed twice is still one positive), a quarter of the columns weighted
    0 when ``weight`` (the trainer's padding columns), scale 1/B (the trainer's mean over the batch)."""
    h, idx, w, bias = tail_forward_inputs(shape, dtype, device, generator)
    B, K, G, P = shape["B"], shape["K"], shape["G"], shape["P"]
    col_weight = None
    if shape.get("weight", 1):
        col_weight = (torch.rand(K, G, generator=generator, device=generator.device) >= 0.25).float().to(device)
    rows = torch.randint(0, B, (P,), generator=generator, device=generator.device).to(device)
    cols = torch.randint(0, K * G, (P,), generator=generator, device=generator.device).to(device)
    return h, idx, w, bias, col_weight, rows, cols, 1.0 / B


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


def perlabel_backward_weight_cost(shape: Mapping[str, int], dtype: torch.dtype) -> FlopsBytes:
    B, Ht, L, F = (shape[k] for k in ("B", "Ht", "L", "F"))
    e = dtype.itemsize
    # flops = 2*B*L*F; bytes = e*B*L (dz) + e*B*Ht (h) + 8*L*F (idx) + e*L*F (dw)
    nbytes = e * B * L + e * B * Ht + INDEX_BYTES * L * F + e * L * F
    return FlopsBytes(float(2 * B * L * F), float(nbytes))


def perlabel_backward_input_cost(shape: Mapping[str, int], dtype: torch.dtype) -> FlopsBytes:
    B, Ht, L, F = (shape[k] for k in ("B", "Ht", "L", "F"))
    e = dtype.itemsize
    # flops = 2*B*L*F (one multiply-add per slot and row); bytes = e*B*L (dz) + 8*L*F (idx) + e*L*F (w) + e*B*Ht (dh)
    nbytes = e * B * L + INDEX_BYTES * L * F + e * L * F + e * B * Ht
    return FlopsBytes(float(2 * B * L * F), float(nbytes))


def tail_fused_bce_cost(shape: Mapping[str, int], dtype: torch.dtype) -> FlopsBytes:
    """The fused tail + loss never writes the B x K*G logits: its floor is the weights and their gradient."""
    B, Ht, K, G, F, P = (shape[k] for k in ("B", "Ht", "K", "G", "F", "P"))
    bias = 1 if shape.get("bias", 1) else 0
    weight = 1 if shape.get("weight", 1) else 0
    e = dtype.itemsize
    # flops = 3 * 2*B*K*G*F (logits, dw, dx) + B*K*F (dx summed onto dh) + bias*B*K*G (bias add);
    # the loss and sigmoid per logit are not counted (transcendentals, not multiply-adds)
    flops = 6 * B * K * G * F + B * K * F + bias * B * K * G
    # bytes = e*B*Ht (h) + 8*K*F (idx) + e*K*G*F (w) + bias*e*K*G (bias) + weight*4*K*G (fp32 column weights)
    #       + 16*P (int64 rows, cols) + e*K*G*F (dw) + e*B*Ht (dh) + bias*e*K*G (dbias) + 4 (fp32 loss)
    nbytes = (2 * e * B * Ht + INDEX_BYTES * K * F + 2 * e * K * G * F + 2 * bias * e * K * G
              + weight * 4 * K * G + 2 * INDEX_BYTES * P + 4)
    return FlopsBytes(float(flops), float(nbytes))


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

# The tail backends that call the slots' implementations, so a replaced kernel runs in training (haste.py).
SLOT_BACKENDS = (("tail_backend", ("slots", "triton")),)

TAIL_SLOTS: tuple[KernelSlot, ...] = (
    KernelSlot(
        name="tail_forward",
        signature="tail_forward(h: [B, Ht], idx: int64 [K, F], w: [K, G, F], bias: [K, G] | None) -> z: [B, K*G]",
        reference=tail_forward, make_inputs=tail_forward_inputs, cost=tail_forward_cost,
        shapes=TAIL_SHAPES, used_when=SLOT_BACKENDS,
        why="HASTE tail logits: a gather of each group's shared fan-in dims and a per-group GEMM",
    ),
    KernelSlot(
        name="tail_backward_weight",
        signature="tail_backward_weight(dz: [B, K*G], h: [B, Ht], idx: int64 [K, F]) -> dw: [K, G, F]",
        reference=tail_backward_weight, make_inputs=tail_backward_weight_inputs,
        cost=tail_backward_weight_cost, shapes=TAIL_SHAPES, used_when=SLOT_BACKENDS,
        why="HASTE tail weight gradient: per group dZ_k^T H[:, I_k]",
    ),
    KernelSlot(
        name="tail_backward_input",
        signature="tail_backward_input(dz: [B, K*G], idx: int64 [K, F], w: [K, G, F], Ht: int) -> dh: [B, Ht]",
        reference=tail_backward_input, make_inputs=tail_backward_input_inputs,
        cost=tail_backward_input_cost, shapes=TAIL_SHAPES, used_when=SLOT_BACKENDS,
        why="HASTE tail input gradient: per group dZ_k W_k, scatter-added onto the shared dims",
    ),
    KernelSlot(
        name="perlabel_forward",
        signature="perlabel_forward(h: [B, Ht], idx: int64 [L, F], w: [L, F]) -> z: [B, L]",
        reference=perlabel_forward, make_inputs=perlabel_forward_inputs,
        cost=perlabel_forward_cost, shapes=PERLABEL_SHAPES, in_training=False,
        why="per-label fixed fan-in logits (each label its own F dims); for kernel work, not the trainer",
    ),
)

TORCH_TAIL_IMPLS: dict[str, Callable] = {slot.name: slot.reference for slot in TAIL_SLOTS}
