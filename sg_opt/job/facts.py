"""What the adapter learns about a user's job before any knob exists: which optimizer it trains with (and whether
sparse gradients have an optimizer of the same math), and which embedding tables its model holds.

The knob space follows from these facts: a model without embedding tables gets no embedding knobs, an optimizer
without a fused implementation no ``fused`` value, and sparse gradients are declared ``model`` where the only
sparse-capable optimizer is another one (SparseAdam is not Adam).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

EMBEDDING_TYPES = (nn.Embedding, nn.EmbeddingBag)


@dataclass(frozen=True)
class SparseMatch:
    """The optimizer that updates tables from sparse gradients, and whether its math is the user's."""

    optimizer: type[torch.optim.Optimizer]
    same_math: bool
    why: str


@dataclass(frozen=True)
class JobFacts:
    optimizer: type[torch.optim.Optimizer]
    optimizer_defaults: dict[str, Any]
    impls: tuple[str, ...]  # values of optimizer_impl this optimizer takes
    sparse: SparseMatch | None  # None: no embedding tables, or no sparse-capable optimizer for them
    tables: int  # embedding modules that can produce sparse gradients
    fusable: int  # EmbeddingBags of one ModuleList that one fused table can hold


def optimizer_impls(cls: type[torch.optim.Optimizer]) -> tuple[str, ...]:
    """default and for-loop always; foreach and fused where the optimizer's constructor takes them."""
    params = inspect.signature(cls.__init__).parameters
    return ("default", "for-loop") + tuple(name for name in ("foreach", "fused") if name in params)


def sparse_match(cls: type[torch.optim.Optimizer], defaults: dict[str, Any]) -> SparseMatch | None:
    """The optimizer for tables with sparse gradients: the same class where its sparse update is the dense one's
    math (plain SGD; Adagrad, whose zero-gradient rows do not move), else SparseAdam for Adam-like optimizers (its
    moments of untouched rows do not decay: another model), else none."""
    decay = defaults.get("weight_decay", 0) != 0
    if cls is torch.optim.SGD and not decay and defaults.get("momentum", 0) == 0:
        return SparseMatch(cls, True, "plain SGD updates only the rows with a gradient either way")
    if cls is torch.optim.Adagrad and not decay:
        return SparseMatch(cls, True, "Adagrad leaves rows without a gradient where they are either way")
    if cls in (torch.optim.Adam, torch.optim.AdamW) and not defaults.get("amsgrad", False):
        return SparseMatch(torch.optim.SparseAdam, False, "SparseAdam moves only the looked-up rows and their moments, "
                                                          "where Adam decays every row's moments every step")
    return None


def sparse_capable(module: nn.Module) -> bool:
    """An embedding module that can produce sparse gradients (EmbeddingBag's max mode and max_norm cannot)."""
    return (isinstance(module, EMBEDDING_TYPES) and module.max_norm is None
            and getattr(module, "mode", "sum") != "max")


def fusable_bags(model: nn.Module) -> list[tuple[nn.ModuleList, list[int]]]:
    """ModuleLists holding two or more sum/mean EmbeddingBags of one width, no padding, no per-sample weights'
    tricks: (the list, the indices of those bags). One fused table can hold each such group."""
    found = []
    for module in model.modules():
        if not isinstance(module, nn.ModuleList):
            continue
        bags = [i for i, m in enumerate(module) if isinstance(m, nn.EmbeddingBag) and sparse_capable(m)
                and m.padding_idx is None and not m.include_last_offset and not m.scale_grad_by_freq]
        widths = {(module[i].embedding_dim, module[i].mode) for i in bags}
        if len(bags) >= 2 and len(widths) == 1:
            found.append((module, bags))
    return found


def learn(model_factory: Callable[[], nn.Module], optimizer_factory: Callable[..., torch.optim.Optimizer]) -> JobFacts:
    """The facts, from the model built on the meta device (no memory, no init cost) and the optimizer built over
    one throwaway parameter."""
    probe = optimizer_factory([nn.Parameter(torch.zeros(1))])
    cls, defaults = type(probe), dict(probe.defaults)
    with torch.device("meta"):
        model = model_factory()
    tables = [m for m in model.modules() if sparse_capable(m)]
    return JobFacts(optimizer=cls, optimizer_defaults=defaults, impls=optimizer_impls(cls),
                    sparse=sparse_match(cls, defaults) if tables else None, tables=len(tables),
                    fusable=sum(len(bags) for _, bags in fusable_bags(model)))
