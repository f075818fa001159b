"""The HASTE output layer: a dense head plus a group-shared fixed fan-in tail.

HASTE (ICML 2026) splits the label space: the most frequent labels get an ordinary dense Linear
(the head); the rest are packed into K groups of G labels, and every group reads ONE set I_k of F
input dims shared by its labels, so the tail costs K*G*F weights instead of n_tail*H. Groups are
periodically rewired (lowest-magnitude fan-in dims pruned, random new ones grown).

The tail runs on one of four backends: "torch" differentiates through the reference gather+einsum
(the baseline), "slots" runs an autograd Function over the tail's kernel slots, so kernels that
sg-opt swaps in (``kernels``) are used in training; "triton" is "slots" with the Triton kernels
(``triton_tail``) in the slots; "triton-fused-loss" also computes the tail's BCE loss and all its
gradients in one fused pass (``tail_bce_loss``, ``FusedTailBCE``), so the tail's logits are never
written in training (evaluation still reads them through the Triton slots). Triton is imported only
when a Triton backend is built. Logits come in INTERNAL order: head labels, then the tail groups
flattened k-major with padding columns; the label maps translate.
"""

from __future__ import annotations

import importlib.util
import math
import os
from typing import Any, Callable, Mapping

import torch
from torch import nn

from targets.protocol import ConfigError
from targets.haste_rec.tail.tail_slots import TORCH_TAIL_IMPLS, random_fan_in, tail_forward

BACKENDS = ("torch", "slots", "triton", "triton-fused-loss")
TRITON_BACKENDS = ("triton", "triton-fused-loss")


# ----------------------------------------------------------------------------- slots backend

def _expect(tensor: torch.Tensor, shape: tuple[int, ...], what: str) -> None:
    if tuple(tensor.shape) != shape:
        raise ValueError(f"{what}: expected shape {shape}, got {tuple(tensor.shape)}")


def _check_tail_operands(h: torch.Tensor, idx: torch.Tensor, w: torch.Tensor,
                         bias: torch.Tensor | None) -> None:
    """Shapes, dtypes and devices of one tail call agree, or ValueError says which does not."""
    groups, size, fan_in = w.shape
    if h.dim() != 2:
        raise ValueError(f"tail input must be [B, Ht], got {tuple(h.shape)}")
    _expect(idx, (groups, fan_in), "tail fan-in index")
    if bias is not None:
        _expect(bias, (groups, size), "tail bias")
    if idx.dtype != torch.int64:
        raise ValueError(f"tail fan-in index must be int64, got {idx.dtype}")
    for name, t in (("weight", w), ("bias", bias)):
        if t is not None and (t.dtype != h.dtype or t.device != h.device):
            raise ValueError(f"tail {name} is {t.dtype} on {t.device}, input is {h.dtype} on {h.device}")


class SlotTail(torch.autograd.Function):
    """The tail's forward and backward, each through a kernel slot implementation."""

    @staticmethod
    def forward(ctx, h: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, idx: torch.Tensor,
                kernels: Mapping[str, Callable]) -> torch.Tensor:
        _check_tail_operands(h, idx, w, bias)
        h, w, idx = h.contiguous(), w.contiguous(), idx.contiguous()
        bias = None if bias is None else bias.contiguous()
        groups, size, _ = w.shape
        z = kernels["tail_forward"](h, idx, w, bias)
        _expect(z, (h.shape[0], groups * size), "tail_forward output")
        ctx.save_for_backward(h, w, idx)
        ctx.kernels = kernels
        ctx.has_bias = bias is not None
        return z

    @staticmethod
    def backward(ctx, dz: torch.Tensor):
        h, w, idx = ctx.saved_tensors
        dz = dz.contiguous()
        groups, size, _ = w.shape
        dh = dw = dbias = None
        if ctx.needs_input_grad[0]:
            dh = ctx.kernels["tail_backward_input"](dz, idx, w, h.shape[1])
            _expect(dh, tuple(h.shape), "tail_backward_input output")
        if ctx.needs_input_grad[1]:
            dw = ctx.kernels["tail_backward_weight"](dz, h, idx)
            _expect(dw, tuple(w.shape), "tail_backward_weight output")
        if ctx.has_bias and ctx.needs_input_grad[2]:
            dbias = dz.reshape(-1, groups, size).sum(0)
        return dh, dw, dbias, None, None


def _autocast_dtype(device: torch.device) -> torch.dtype | None:
    """The autocast dtype in force on this device type, or None."""
    if torch.is_autocast_enabled(device.type):
        return torch.get_autocast_dtype(device.type)
    return None


class FusedTailBCE(torch.autograd.Function):
    """The tail and its BCE loss in one Triton pass (``triton_fused_bce``): forward returns the loss and
    keeps the gradients the pass computed; backward hands them back, scaled by the incoming gradient
    (an in-place multiply: exact for the usual 1, one pass over dw; a second backward is refused)."""

    @staticmethod
    def forward(ctx, h: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, idx: torch.Tensor,
                col_weight: torch.Tensor | None, rows: torch.Tensor | None, cols: torch.Tensor | None, scale: float,
                kernel_config: Any, positives: torch.Tensor | None = None) -> torch.Tensor:
        from targets.haste_rec.tail.triton_fused_bce import tail_fused_bce_triton
        loss, dh, dw, dbias = tail_fused_bce_triton(h, idx, w, bias, col_weight, rows, cols, scale, positives,
                                                    config=kernel_config)
        ctx.grads = (dh, dw, dbias)
        return loss

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        if ctx.grads is None:
            raise RuntimeError("FusedTailBCE keeps one set of gradients: backward through it twice is not supported")
        grads, ctx.grads = ctx.grads, None
        dh, dw, dbias = (None if g is None or not need else g.mul_(grad)
                         for g, need in zip(grads, ctx.needs_input_grad[:3]))
        return dh, dw, dbias, None, None, None, None, None, None, None


def check_backend_device(backend: str, device: torch.device | str) -> None:
    """ConfigError unless the tail backend can run on the device (Triton needs CUDA or, on the CPU,
    its interpreter, enabled by TRITON_INTERPRET=1 before the kernels are first imported)."""
    if backend not in TRITON_BACKENDS:
        return
    device = torch.device(device)
    if importlib.util.find_spec("triton") is None:
        raise ConfigError(f"tail_backend {backend} needs Triton, which is not installed")
    if device.type == "cuda":
        return
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes"):
        from targets.haste_rec.tail.triton_tail import interpreter_active
        if interpreter_active():
            return
    raise ConfigError(f"tail_backend {backend} needs a CUDA device (or TRITON_INTERPRET=1 on the CPU)")


def _resolve_kernels(backend: str, kernels: Mapping[str, Callable] | None,
                     kernel_config: Mapping[str, Any] | None) -> dict[str, Callable]:
    if backend not in BACKENDS:
        raise ConfigError(f"HASTE backend must be one of {', '.join(BACKENDS)}, not {backend!r}")
    if kernels and backend not in ("slots", "triton"):
        raise ConfigError("kernel overrides of the HASTE tail need backend 'slots' or 'triton'")
    unknown = sorted(set(kernels or {}) - set(TORCH_TAIL_IMPLS))
    if unknown:
        raise ConfigError(f"unknown HASTE tail kernel slot(s) {', '.join(unknown)}; "
                          f"known: {', '.join(TORCH_TAIL_IMPLS)}")
    base: Mapping[str, Callable] = TORCH_TAIL_IMPLS
    if backend in TRITON_BACKENDS:
        from targets.haste_rec.tail.triton_tail import TailKernelConfig
        from targets.haste_rec.tail.triton_tail_impls import triton_tail_impls
        base = triton_tail_impls(TailKernelConfig(**(kernel_config or {})))
    return {**base, **(kernels or {})}


# ----------------------------------------------------------------------------- label maps

def _label_maps(head_labels: torch.Tensor, tail_groups: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(internal_label [n_internal], internal_position [L]); head+tail must be a permutation of 0..L-1."""
    if head_labels.numel() and int(head_labels.min()) < 0:
        raise ConfigError("head label ids must be non-negative; only tail groups hold padding (-1)")
    internal_label = torch.cat([head_labels.reshape(-1).cpu(), tail_groups.reshape(-1).cpu()]).to(torch.int64)
    labels = internal_label[internal_label >= 0]
    num_labels = labels.numel()
    if labels.unique().numel() != num_labels or (num_labels and int(labels.max()) != num_labels - 1):
        raise ConfigError("head and tail labels must together hold every label id 0..L-1 exactly once")
    position = torch.empty(num_labels, dtype=torch.int64)
    position[labels] = torch.nonzero(internal_label >= 0).flatten()
    return internal_label, position


# ----------------------------------------------------------------------------- the layer

class HasteOutput(nn.Module):
    """Dense head Linear(H, n_head) plus a group-shared fixed fan-in tail over the first tail_dims dims."""

    def __init__(self, hidden: int, tail_dims: int, head_labels: torch.Tensor, tail_groups: torch.Tensor,
                 fan_in: int, backend: str = "torch", kernels: Mapping[str, Callable] | None = None,
                 seed: int = 0, kernel_config: Mapping[str, Any] | None = None,
                 groups_owned: range | None = None) -> None:
        """kernel_config: the Triton backends' tile config (``triton_tail.TailKernelConfig`` fields:
        block_b, num_warps, num_stages; "auto" or absent = the shape rule).

        groups_owned: hold only these tail groups (a rank's share under label-group sharding), each
        exactly as the layer of all groups has it: the whole tail is drawn, then cut, so that the
        generator runs as in the full layer. None holds all groups. The head and the label maps stay whole.
        """
        super().__init__()
        if tail_groups.dim() != 2 or tail_groups.shape[0] < 1:
            raise ConfigError("HASTE tail groups must be a [K, G] tensor with at least one group")
        if not 0 < tail_dims <= hidden:
            raise ConfigError(f"HASTE tail dims must lie in [1, {hidden}], not {tail_dims}")
        if not 0 < fan_in <= tail_dims:
            raise ConfigError(f"HASTE fan-in must lie in [1, {tail_dims}] (the tail dims), not {fan_in}")
        self.backend = backend
        self.kernel_config = None
        if backend in TRITON_BACKENDS:
            from targets.haste_rec.tail.triton_tail import TailKernelConfig
            self.kernel_config = TailKernelConfig(**(kernel_config or {}))
        self.kernels = _resolve_kernels(backend, kernels, kernel_config)
        self.hidden, self.tail_dims, self.fan_in = hidden, tail_dims, fan_in
        groups, size = tail_groups.shape
        owned = range(groups) if groups_owned is None else groups_owned
        if owned.step != 1 or not 0 <= owned.start <= owned.stop <= groups:
            raise ConfigError(f"HASTE groups_owned must be a contiguous range within the {groups} groups, not {owned}")
        self.num_groups, self.groups_owned = groups, owned
        internal_label, position = _label_maps(head_labels, tail_groups)
        self.register_buffer("internal_label", internal_label, persistent=False)
        self.register_buffer("internal_position", position, persistent=False)
        self.register_buffer("valid_mask", internal_label >= 0, persistent=False)
        mine = slice(owned.start, owned.stop)
        self._tail_padded = bool((tail_groups[mine] < 0).any())

        generator = torch.Generator().manual_seed(seed)
        index = random_fan_in(groups, tail_dims, fan_in, generator).sort(dim=1).values
        self.register_buffer("tail_index", index[mine].clone())
        n_head = head_labels.numel()
        self.head = nn.Linear(hidden, n_head) if n_head else None
        if self.head is not None:
            with torch.no_grad():
                self.head.weight.normal_(0.0, hidden ** -0.5, generator=generator)
                self.head.bias.zero_()
        weight = torch.randn(groups, size, fan_in, generator=generator) * fan_in ** -0.5
        weight[tail_groups.cpu() < 0] = 0.0  # padded label rows stay out of rewiring magnitudes
        self.tail_weight = nn.Parameter(weight[mine].clone())
        self.tail_bias = nn.Parameter(torch.zeros(len(owned), size))

    @property
    def n_internal(self) -> int:
        return self.internal_label.numel()

    @property
    def n_head(self) -> int:
        return 0 if self.head is None else self.head.out_features

    @property
    def group_size(self) -> int:
        return self.tail_bias.shape[1]

    @property
    def owned_columns(self) -> slice:
        """The internal columns of the tail groups this layer holds (all tail columns unless groups_owned)."""
        size = self.group_size
        return slice(self.n_head + self.groups_owned.start * size, self.n_head + self.groups_owned.stop * size)

    def head_parameters(self) -> list[nn.Parameter]:
        return [] if self.head is None else list(self.head.parameters())

    def tail_parameters(self) -> list[nn.Parameter]:
        return [self.tail_weight, self.tail_bias]

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """Logits [B, n_internal] in internal order (head, then tail groups k-major, padding included);
        with groups_owned, the head's and the owned groups' columns only."""
        if h.dim() != 2 or h.shape[1] != self.hidden:
            raise ValueError(f"HASTE input must be [B, {self.hidden}], got {tuple(h.shape)}")
        tail = self.tail_logits(h)
        if self.head is None:
            return tail
        return torch.cat([self.head_logits(h), tail], dim=1)

    def head_logits(self, h: torch.Tensor) -> torch.Tensor:
        """The dense head's logits [B, n_head] (empty when there is no head)."""
        if self.head is None:
            return h.new_zeros(h.shape[0], 0)
        return self.head(h)

    def tail_logits(self, h: torch.Tensor) -> torch.Tensor:
        """The group-shared tail's logits [B, K*G] (K: the groups held), from the first tail_dims dims of h."""
        return self._tail(h[:, :self.tail_dims])

    def _tail(self, h: torch.Tensor) -> torch.Tensor:
        if self.backend == "torch" or not self.groups_owned:  # no groups held: no kernel over an empty grid
            return tail_forward(h, self.tail_index, self.tail_weight, self.tail_bias)
        dtype = _autocast_dtype(h.device)
        if dtype is None:
            return SlotTail.apply(h, self.tail_weight, self.tail_bias, self.tail_index, self.kernels)
        # As autocast runs the torch backend: the products in `dtype`, the bias added in its own dtype.
        with torch.autocast(h.device.type, enabled=False):
            z = SlotTail.apply(h.to(dtype), self.tail_weight.to(dtype), None, self.tail_index, self.kernels)
            return (z.reshape(h.shape[0], *self.tail_bias.shape) + self.tail_bias).reshape(z.shape)

    def tail_bce_loss(self, h: torch.Tensor, rows: torch.Tensor | None, cols: torch.Tensor | None, scale: float,
                      positives: torch.Tensor | None = None) -> torch.Tensor:
        """scale * the tail's BCE-with-logits loss summed over its valid columns (backend
        triton-fused-loss), fused with its gradients: the tail's logits are never written.

        h: [B, H] (the tail reads its first tail_dims dims); rows, cols int64 [P]: the positives as
        (batch row, tail column in internal tail order); pairs whose column lies outside the tail
        are ignored. ``positives`` may give them already as the kernel reads them (``tail_positive_bits``
        of rows and cols: fixed-shape, as a CUDA graph needs), and rows and cols are then unused.
        Under autocast the products run in its dtype and the bias in fp32, as in ``_tail``.
        """
        if self.backend != "triton-fused-loss":
            raise ConfigError(f"the fused tail loss needs tail_backend triton-fused-loss, not {self.backend}")
        h = h[:, :self.tail_dims]
        dtype = _autocast_dtype(h.device)
        col_weight = None
        if self._tail_padded:
            col_weight = self.valid_mask[self.owned_columns].reshape(self.tail_bias.shape).float()
        with torch.autocast(h.device.type, enabled=False):
            x = h if dtype is None else h.to(dtype)
            return FusedTailBCE.apply(x, self.tail_weight, self.tail_bias, self.tail_index, col_weight, rows, cols,
                                      scale, self.kernel_config, positives)

    # ------------------------------------------------------------------------- rewiring

    @torch.no_grad()
    def rewire(self, fraction: float, generator: torch.Generator) -> torch.Tensor:
        """Prune each group's round(fraction*F) weakest fan-in slots and regrow them on new dims.

        A slot's strength is sum_g |W[k, g, f]|. New dims are drawn at random (from ``generator``)
        among the dims not in the group's fan-in before pruning, so at most tail_dims - F slots
        per group are rewired; their weights start at zero.
        Returns the BoolTensor [K, F] of rewired slots (its sum is the number rewired); pass it to
        ``zero_rewired_state`` to clear the optimizer's moments at those slots.
        """
        if not 0.0 <= fraction <= 1.0:
            raise ConfigError(f"HASTE rewire fraction must lie in [0, 1], not {fraction}")
        groups, fan_in = self.tail_index.shape
        count = min(round(fraction * fan_in), self.tail_dims - fan_in)
        mask = torch.zeros(groups, fan_in, dtype=torch.bool, device=self.tail_index.device)
        if count <= 0:
            return mask
        strength = self.tail_weight.abs().sum(dim=1)
        pruned = strength.topk(count, dim=1, largest=False).indices
        mask.scatter_(1, pruned, True)
        self.tail_index.scatter_(1, pruned, self._draw_new_dims(count, generator))
        self.tail_weight.masked_fill_(mask[:, None, :], 0.0)
        return mask

    def _draw_new_dims(self, count: int, generator: torch.Generator) -> torch.Tensor:
        """[K, count] random dims per group, distinct and outside the group's current fan-in.

        The scores of ALL groups are drawn and the held groups' rows kept: the generator advances as
        in the full layer, so every owner of a label-group-sharded tail, each with the same generator,
        rewires its groups exactly as the full layer rewires them (pruning is per group already)."""
        scores = torch.rand(self.num_groups, self.tail_dims, generator=generator, device=generator.device)
        scores = scores[self.groups_owned.start:self.groups_owned.stop]
        scores = scores.to(self.tail_index.device).scatter_(1, self.tail_index, math.inf)
        return scores.topk(count, dim=1, largest=False).indices

    def as_dense_weight(self) -> torch.Tensor:
        """The tail as a dense weight [K*G, tail_dims] (internal tail order), zero outside each fan-in."""
        groups, size, fan_in = self.tail_weight.shape
        dense = self.tail_weight.new_zeros(groups, size, self.tail_dims)
        index = self.tail_index[:, None, :].expand(groups, size, fan_in)
        return dense.scatter(2, index, self.tail_weight).reshape(groups * size, self.tail_dims)


def zero_rewired_state(optimizer: torch.optim.Optimizer, mask: torch.Tensor,
                       weight: torch.Tensor | None = None) -> int:
    """Zero the optimizer state (momenta, second moments) of the rewired tail slots; returns tensors zeroed.

    ``mask`` is ``HasteOutput.rewire``'s [K, F] result. The state of ``weight`` is cleared when it
    is given; otherwise that of every parameter shaped [K, *, F] like a tail weight.
    """
    groups, fan_in = mask.shape
    zeroed = 0
    for param, state in optimizer.state.items():
        if weight is not None and param is not weight:
            continue
        if param.dim() != 3 or (param.shape[0], param.shape[2]) != (groups, fan_in):
            continue
        for value in state.values():
            if torch.is_tensor(value) and value.shape == param.shape:
                value.masked_fill_(mask.to(value.device)[:, None, :], 0)
                zeroed += 1
    return zeroed
