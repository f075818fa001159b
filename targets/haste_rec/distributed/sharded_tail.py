"""The HASTE tail sharded by label groups (tail_sharding label-groups): each rank trains whole groups
over the global batch.

Rank r owns the contiguous tail groups ``plan.group_range(r, K)``, built exactly as the full layer has
them (``HasteOutput(groups_owned=...)``). The encoder and the head stay data parallel under DDP; the
owned groups are left out of DDP and need no gradient all-reduce, since their owner computes their
gradient over the whole global batch. A step (W ranks, global batch B, rank r holding n_r samples):

  tail_dist  all-gather of the hidden states h [n_r, Ht] into the global batch's [B, Ht] (global
             order: rank r's samples follow rank r-1's), and of the batch's tail positives
  tail       each owner: its groups' logits [B, k_r * G]
  loss       each rank: its samples' head BCE plus its groups' BCE over the global batch, both / B. The
             owners' labels are disjoint and each sample's head counts on its own rank only, so the
             ranks' losses add up to the single-process loss with no term counted twice
  backward   the all-gather's backward is a reduce-scatter (sum): the owners' dh of the global batch,
             summed, each rank receiving its samples' rows, which join its head's dh
  optimizer  SGD with momentum works per element, so on the owned groups it is the full layer's; the
             rewiring draws the scores of ALL groups from the generator every rank holds alike and
             keeps the owned rows (``HasteOutput._draw_new_dims``), so it is the full layer's too
  evaluation the owners' columns are all-gathered into the logits of all labels

The exchanges have a process group of their own, as the embeddings' do: DDP's bucketed all-reduces
run asynchronously during the same backward that reduce-scatters dh.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.autograd import Function

from targets.haste_rec.distributed.exchange import all_gather_padded, padded_to, sum_over_ranks
from targets.haste_rec.distributed.plan import ShardingPlan
from targets.haste_rec.tail.haste import HasteOutput


def reduce_scatter_rows(full: torch.Tensor, counts: list[int], rank: int, group: Any) -> torch.Tensor:
    """The sum over the ranks of `full` [sum(counts), ...], of which this rank gets its counts[rank] rows."""
    largest = max(counts)
    blocks = [padded_to(chunk, largest, 0) for chunk in full.split(counts)]
    mine = full.new_empty(largest, *full.shape[1:])
    dist.reduce_scatter(mine, blocks, group=group)
    return mine[:counts[rank]]


class _GatherRows(Function):
    """all-gather of every rank's rows whose backward is the reduce-scatter (sum) of their gradients:
    each rank gets the sum over the ranks of the gradient of its own rows."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, counts: list[int], rank: int, group: Any) -> torch.Tensor:
        ctx.counts, ctx.rank, ctx.group = counts, rank, group
        return all_gather_padded(local, counts, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return reduce_scatter_rows(grad, ctx.counts, ctx.rank, ctx.group), None, None, None


class LabelGroupTail:
    """This rank's side of the label-group-sharded tail: which groups it owns, and the exchanges.

    Every method but ``owned`` and ``counters`` is collective on the tail's process group."""

    def __init__(self, plan: ShardingPlan, rank: int, group: Any, device: torch.device):
        self.plan, self.rank, self.group, self.device = plan, rank, group, device
        self.bytes_gathered = 0  # what this rank put into all-gathers (hidden states, positives, eval logits)
        self.bytes_reduced = 0   # what it put into the reduce-scatters of dh

    @classmethod
    def join(cls, plan: ShardingPlan, ctx) -> "LabelGroupTail":
        """The tail of this rank of a joined job (a ``process_group.RankContext``), with its own process
        group (collective: every rank calls it, in the same order as its other new groups)."""
        group = dist.new_group(backend=ctx.backend, timeout=ctx.timeout)
        return cls(plan, ctx.rank, group, ctx.device)

    def owned(self, num_groups: int) -> range:
        return self.plan.group_range(self.rank, num_groups)

    def gather_hidden(self, h: torch.Tensor, samples: list[int]) -> torch.Tensor:
        """h of the global batch [sum(samples), Ht] from every rank's [samples[r], Ht]; differentiable."""
        row_bytes = h.shape[1] * h.element_size()
        self.bytes_gathered += max(samples) * row_bytes
        if torch.is_grad_enabled() and h.requires_grad:
            self.bytes_reduced += len(samples) * max(samples) * row_bytes
        return _GatherRows.apply(h, samples, self.rank, self.group)

    def owned_targets(self, output: HasteOutput, rows: torch.Tensor, cols: torch.Tensor,
                      samples: list[int]) -> torch.Tensor:
        """0/1 targets [global batch, owned columns] of this rank's groups: every rank sends its samples'
        tail positives as (global row, internal column), every owner keeps those in its columns.

        rows, cols: this rank's positives (row in its slice, internal column), as ``_positives`` gives them."""
        tail = cols >= output.n_head
        pairs = torch.stack([rows[tail] + sum(samples[:self.rank]), cols[tail]], dim=1)
        count_of_rank = [torch.zeros(1, dtype=torch.int64, device=self.device) for _ in samples]
        dist.all_gather(count_of_rank, torch.tensor([pairs.shape[0]], device=self.device), group=self.group)
        counts = torch.cat(count_of_rank).tolist()
        self.bytes_gathered += max(counts) * pairs.shape[1] * pairs.element_size()
        every = all_gather_padded(pairs, counts, self.group)
        columns = output.owned_columns
        width = columns.stop - columns.start
        local = every[:, 1] - columns.start
        local = torch.where((local >= 0) & (local < width), local, width)  # others' columns: a dropped extra one
        targets = torch.zeros(sum(samples), width + 1, device=self.device)
        targets[every[:, 0], local] = 1.0
        return targets[:, :width]

    def all_columns(self, output: HasteOutput, tail: torch.Tensor) -> torch.Tensor:
        """The logits of every tail group [B, K * G] from each owner's [B, its groups * G] (evaluation)."""
        counts = [len(self.plan.group_range(r, output.num_groups)) * output.group_size
                  for r in range(self.plan.world_size)]
        self.bytes_gathered += tail.shape[0] * max(counts) * tail.element_size()
        return all_gather_padded(tail, counts, self.group, dim=1)

    def sum_over_ranks(self, value: float) -> float:
        """A sum of per-owner parts (squared norms) over this tail's group."""
        return sum_over_ranks(value, self.device, self.group)

    def counters(self, output: HasteOutput) -> dict[str, float]:
        return {"tail_groups_owned": float(len(output.groups_owned)),
                "tail_bytes_gathered": float(self.bytes_gathered), "tail_bytes_reduced": float(self.bytes_reduced)}
