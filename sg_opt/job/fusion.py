"""Embedding bag fusion: the bags of one ModuleList as row ranges of one fused table.

The model still calls each bag as it did; each call looks its ids up at the bag's row offset in the one fused
parameter. With sparse gradients every call adds a sparse gradient of the fused table (a concatenation, no
table-sized write), so the tables take one sparse gradient and one optimizer update instead of one per table. The
rows keep their values and each bag sums the same rows in the same order.
"""

from __future__ import annotations

from typing import Iterator

import torch
from torch import nn
from torch.nn import functional as F

from sg_opt.job.facts import fusable_bags


class FusedTable(nn.Module):
    """The rows of several bags, stacked."""

    def __init__(self, weights: list[torch.Tensor]):
        super().__init__()
        self.weight = nn.Parameter(torch.cat([w.detach() for w in weights]))


class FusedBag(nn.Module):
    """One bag of a fused table: its rows start at ``offset``; called as the nn.EmbeddingBag it replaces."""

    def __init__(self, table: FusedTable, offset: int, bag: nn.EmbeddingBag):
        super().__init__()
        self.table = [table]  # a plain list: the table is registered once, on the model
        self.offset, self.rows, self.mode = offset, bag.num_embeddings, bag.mode

    def forward(self, input: torch.Tensor, offsets: torch.Tensor | None = None,
                per_sample_weights: torch.Tensor | None = None) -> torch.Tensor:
        return F.embedding_bag(input + self.offset, self.table[0].weight, offsets, mode=self.mode, sparse=True,
                               per_sample_weights=per_sample_weights)

    def weight_view(self) -> torch.Tensor:
        return self.table[0].weight[self.offset:self.offset + self.rows]


def fuse_bags(model: nn.Module) -> list[nn.Parameter]:
    """Replace each fusable group of bags by a FusedTable; returns the fused parameters."""
    fused = []
    for group, (bags_list, indices) in enumerate(fusable_bags(model)):
        table = FusedTable([bags_list[i].weight for i in indices])
        offset = 0
        for i in indices:
            bag = bags_list[i]
            bags_list[i] = FusedBag(table, offset, bag)
            offset += bag.num_embeddings
        model.add_module(f"sg_opt_fused_table_{group}", table)  # not on the list: the model iterates that
        fused.append(table.weight)
    return fused


def canonical_parameters(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of every trainable tensor under the names of the unfused model: a fused bag's rows as its
    own ``weight``, so digests and norms compare across the knob."""
    for name, module in model.named_modules():
        if isinstance(module, FusedTable):
            continue
        if isinstance(module, FusedBag):
            yield f"{name}.weight", module.weight_view()
            continue
        for pname, param in module.named_parameters(recurse=False):
            yield f"{name}.{pname}" if name else pname, param
