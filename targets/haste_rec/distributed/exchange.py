"""The collectives of table-wise sharded embeddings: TorchRec's input and output dists, as all-to-alls.

Input dist: every rank sends, per table, its samples' bag lengths and ids (and per-sample weights)
to the table's owner, which so receives the GLOBAL batch's bags of its tables, in global sample
order (rank r's samples follow rank r-1's). Two all-to-alls (three with weights): the lengths have a
fixed size, and they give the split sizes of the ids.

Output dist: every owner sends the pooled vectors of its tables back to the ranks whose samples they
are. It is differentiable: its backward is the same all-to-all the other way, which sends d(pooled)
to the owners, who form each row's gradient over the global batch and update it once.

Every exchange takes the per-rank sample counts of the batch at hand (training and evaluation
batches split differently).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.autograd import Function

from targets.haste_rec.batch import Batch
from targets.haste_rec.distributed.plan import ShardingPlan


def bag_lengths(offsets: torch.Tensor, nnz: int) -> torch.Tensor:
    return torch.diff(offsets, append=offsets.new_tensor([nnz]))


def all_to_all(send: torch.Tensor, send_counts: list[int], recv_counts: list[int], group: Any) -> torch.Tensor:
    """all_to_all_single of a 1-D tensor: send_counts[r] elements to rank r, recv_counts[r] from it."""
    recv = send.new_empty(sum(recv_counts))
    dist.all_to_all_single(recv, send.contiguous(), recv_counts, send_counts, group=group)
    return recv


class _AllToAll:
    """all_to_all on one group, counting the bytes this rank sends."""

    def __init__(self, group: Any):
        self.group, self.bytes_sent = group, 0

    def __call__(self, send: torch.Tensor, send_counts: list[int], recv_counts: list[int]) -> torch.Tensor:
        self.bytes_sent += sum(send_counts) * send.element_size()
        return all_to_all(send, send_counts, recv_counts, self.group)


class _DifferentiableAllToAll(Function):
    """all_to_all whose backward is the reverse all_to_all (torch.distributed.nn's version is
    deprecated in favour of a private module)."""

    @staticmethod
    def forward(ctx, send: torch.Tensor, send_counts: list[int], recv_counts: list[int], group: Any) -> torch.Tensor:
        ctx.counts, ctx.group = (send_counts, recv_counts), group
        return all_to_all(send, send_counts, recv_counts, group)

    @staticmethod
    def backward(ctx, grad_recv: torch.Tensor):
        send_counts, recv_counts = ctx.counts
        return all_to_all(grad_recv, recv_counts, send_counts, ctx.group), None, None, None


class SparseInputDist:
    """Sends this rank's bags of every table to the table's owner; returns the owner's view: the global
    batch's bags of the tables this rank owns (None when it owns none; it still takes part)."""

    def __init__(self, plan: ShardingPlan, rank: int, group: Any, device: torch.device, weighted: bool):
        self.rank, self.device, self.weighted = rank, device, weighted
        self.owned = plan.tables_of(rank)
        self.by_owner = [plan.tables_of(r) for r in range(plan.world_size)]
        self.order = plan.owner_order()
        self.exchange = _AllToAll(group)

    def __call__(self, batch: Batch, samples: list[int]) -> Batch | None:
        mine, n = len(self.owned), samples[self.rank]
        ids = [t.to(self.device) for t in batch.ids]
        lengths = [bag_lengths(off.to(self.device), t.numel()) for off, t in zip(batch.offsets, ids)]
        got = self.exchange(torch.cat([lengths[t] for t in self.order]),
                            [len(tables) * n for tables in self.by_owner], [mine * m for m in samples])
        per_source = [chunk.view(mine, m) for chunk, m in zip(got.split([mine * m for m in samples]), samples)]
        table_nnz = torch.cat([chunk.sum(dim=1) for chunk in per_source]).tolist()  # source-major, one sync
        send_nnz = [sum(ids[t].numel() for t in tables) for tables in self.by_owner]
        recv_nnz = [sum(table_nnz[r * mine:(r + 1) * mine]) for r in range(len(samples))]
        got_ids = self.exchange(torch.cat([ids[t] for t in self.order]), send_nnz, recv_nnz).split(table_nnz)
        got_weights = None
        if self.weighted:  # a table without weights sends ones: the single-process flatten does the same
            weights = [torch.ones(t.numel(), device=self.device) if w is None else w.to(self.device)
                       for t, w in zip(ids, batch.weights)]
            got_weights = self.exchange(torch.cat([weights[t] for t in self.order]), send_nnz,
                                        recv_nnz).split(table_nnz)
        if not mine:
            return None
        return self._owner_batch(per_source, got_ids, got_weights, sum(samples))

    def _owner_batch(self, per_source: list[torch.Tensor], ids: tuple[torch.Tensor, ...],
                     weights: tuple[torch.Tensor, ...] | None, total: int) -> Batch:
        """The received pieces (source-major, table-minor) as one batch of the owned tables; only the
        sparse fields are filled, the embedding store reads nothing else."""
        mine, sources = len(self.owned), range(len(per_source))
        pick = lambda parts, j: torch.cat([parts[r * mine + j] for r in sources])  # noqa: E731
        out_ids, out_offsets, out_weights = [], [], []
        for j in range(mine):
            lengths = torch.cat([chunk[j] for chunk in per_source])
            out_ids.append(pick(ids, j))
            out_offsets.append(torch.cumsum(lengths, 0) - lengths)
            out_weights.append(None if weights is None else pick(weights, j))
        empty = torch.zeros(0, dtype=torch.int64, device=self.device)
        return Batch(out_ids, out_offsets, out_weights, dense=torch.zeros(total, 0, device=self.device),
                     labels=empty, label_offsets=torch.zeros(total + 1, dtype=torch.int64, device=self.device))


class PooledOutputDist:
    """Sends each owner's pooled vectors [global batch, its tables * dim] to the ranks whose samples they
    are; returns this rank's [its samples, all tables * dim] in table order, as the single-process store
    lays out its output. Differentiable: backward is the reverse all-to-all."""

    def __init__(self, plan: ShardingPlan, rank: int, dim: int, group: Any, device: torch.device):
        self.rank, self.dim, self.group, self.device = rank, dim, group, device
        self.widths = [len(plan.tables_of(r)) for r in range(plan.world_size)]
        self.table_order = torch.argsort(torch.tensor(plan.owner_order())).to(device)  # owner order -> table order
        self.bytes_sent = 0

    def __call__(self, pooled: torch.Tensor | None, samples: list[int]) -> torch.Tensor:
        n, dim = samples[self.rank], self.dim
        if pooled is None:  # no tables here: send nothing, but take part in the backward exchange too
            pooled = torch.zeros(0, device=self.device, requires_grad=torch.is_grad_enabled())
        send = pooled.reshape(-1)
        send_counts = [m * self.widths[self.rank] * dim for m in samples]
        recv_counts = [n * width * dim for width in self.widths]
        recv = _DifferentiableAllToAll.apply(send, send_counts, recv_counts, self.group)
        self.bytes_sent += sum(send_counts) * send.element_size()
        chunks = [chunk.view(n, width, dim) for chunk, width in zip(recv.split(recv_counts), self.widths)]
        return torch.cat(chunks, dim=1).index_select(1, self.table_order).reshape(n, -1)


def gather_rows(local: torch.Tensor, counts: list[int], group: Any = None) -> torch.Tensor:
    """Every rank's rows of a tensor, concatenated in rank order (counts may differ: padded to the largest)."""
    padded = local.new_zeros(max(counts), *local.shape[1:])
    padded[:local.shape[0]] = local
    parts = [torch.empty_like(padded) for _ in counts]
    dist.all_gather(parts, padded, group=group)
    return torch.cat([part[:count] for part, count in zip(parts, counts)])
