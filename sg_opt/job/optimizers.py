"""The job's optimizers under a config: the user's optimizer rebuilt with another implementation, and the tables'
own sparse-capable optimizer when their gradients are sparse.

torch optimizers keep every constructor argument in ``defaults`` and in each param group, so the user's factory
runs once as written and the adapter rebuilds the same optimizer (same class, hyper-parameters and groups) with
only ``foreach``/``fused`` (and ``capturable`` for a CUDA graph) changed.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Sequence

import torch
from torch import nn

from sg_opt.job.facts import JobFacts

IMPL_FLAGS: dict[str, dict[str, Any]] = {
    "default": {}, "for-loop": {"foreach": False, "fused": None}, "foreach": {"foreach": True, "fused": None},
    "fused": {"foreach": None, "fused": True}}


def rebuilt(optimizer: torch.optim.Optimizer, impl: str, capturable: bool = False) -> torch.optim.Optimizer:
    """The same optimizer over the same groups, with the implementation `impl` (``IMPL_FLAGS``)."""
    cls = type(optimizer)
    takes = inspect.signature(cls.__init__).parameters
    flags = {k: v for k, v in {**IMPL_FLAGS[impl], **({"capturable": True} if capturable else {})}.items()
             if k in takes}
    if not flags:
        return optimizer
    groups = [{**group, **flags} for group in optimizer.param_groups]
    defaults = {k: v for k, v in {**optimizer.defaults, **flags}.items() if k in takes}
    return cls(groups, **defaults)


def table_optimizer(facts: JobFacts, tables: Sequence[nn.Parameter]) -> torch.optim.Optimizer:
    """The sparse-capable optimizer for tables with sparse gradients, with the user's hyper-parameters where it
    takes them (``facts.sparse``); its loop implementation, the one with a sparse path."""
    cls = facts.sparse.optimizer
    takes = inspect.signature(cls.__init__).parameters
    kwargs = {k: v for k, v in facts.optimizer_defaults.items() if k in takes and k not in ("foreach", "fused")}
    if "foreach" in takes:
        kwargs["foreach"] = False
    return cls(list(tables), **kwargs)


def build_optimizers(factory: Callable[..., torch.optim.Optimizer], facts: JobFacts, dense: Sequence[nn.Parameter],
                     tables: Sequence[nn.Parameter], impl: str, capturable: bool) -> list[torch.optim.Optimizer]:
    """One optimizer over everything as the user built it (dense tables), or the user's over the dense parameters
    plus the tables' sparse-capable one (``tables`` non-empty: their gradients are sparse)."""
    user = rebuilt(factory(list(dense)), impl, capturable)
    return [user, table_optimizer(facts, tables)] if tables else [user]
