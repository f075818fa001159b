"""The collectives of sharded embeddings: TorchRec's input and output dists, as all-to-alls.

Input dist: every rank sends its samples' bags (lengths, ids, per-sample weights) to the ranks that
hold their rows, all of one destination together, [tables, samples] lengths and the ids in that
order; each destination so receives the GLOBAL batch's bags, in global sample order (rank r's
samples follow rank r-1's). Two all-to-alls (three with weights): the lengths have a fixed size, and
they give the split sizes of the ids. Table-wise, a table's bags go whole to its owner; row-wise,
every bag is split by row block and each part goes, with the ids remapped to the block's local
rows, to the block's owner (every rank receives a bag, possibly empty, of every table and sample).

Output dist: table-wise, every owner sends the pooled vectors of its tables back to the ranks whose
samples they are (an all-to-all); row-wise, every rank holds partial sums of every table for the
global batch, and the sum over owners is scattered by samples (a reduce-scatter, as an all-to-all
and a sum). Both are differentiable: backward runs the all-to-all the other way, which sends
d(pooled) to the owners (row-wise: every rank's d(pooled) to every owner, an all-gather), who form
each row's gradient over the global batch and update it once.

Every exchange takes the per-rank sample counts of the batch at hand (training and evaluation
batches split differently).
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.distributed as dist
from torch.autograd import Function

from targets.haste_rec.data.batch import Batch
from targets.haste_rec.distributed.plan import ShardingPlan


def bag_lengths(offsets: torch.Tensor, nnz: int) -> torch.Tensor:
    return torch.diff(offsets, append=offsets.new_tensor([nnz]))


def all_to_all(send: torch.Tensor, send_counts: list[int], recv_counts: list[int], group: Any) -> torch.Tensor:
    """all_to_all_single of a 1-D tensor: send_counts[r] elements to rank r, recv_counts[r] from it."""
    recv = send.new_empty(sum(recv_counts))
    dist.all_to_all_single(recv, send.contiguous(), recv_counts, send_counts, group=group)
    return recv


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


class _AllToAll:
    """all_to_all on one group (differentiable or not), counting the bytes this rank sends."""

    def __init__(self, group: Any, differentiable: bool = False):
        self.group, self.differentiable, self.bytes_sent = group, differentiable, 0

    def __call__(self, send: torch.Tensor, send_counts: list[int], recv_counts: list[int]) -> torch.Tensor:
        self.bytes_sent += sum(send_counts) * send.element_size()
        if self.differentiable:
            return _DifferentiableAllToAll.apply(send, send_counts, recv_counts, self.group)
        return all_to_all(send, send_counts, recv_counts, self.group)


class _BagInputDist:
    """The input dist whatever the scheme: sends every destination rank its bags, [send_tables[r],
    this rank's samples] lengths and the ids in that order; returns the destination's view, the
    global batch's bags of its `recv_tables` tables or blocks (None when it holds none; it still takes
    part). A scheme says only how this rank's bags are laid out for sending (`_send_order`)."""

    def __init__(self, rank: int, group: Any, device: torch.device, weighted: bool, send_tables: list[int],
                 recv_tables: int):
        self.rank, self.device, self.weighted = rank, device, weighted
        self.send_tables, self.recv_tables = send_tables, recv_tables
        self.exchange = _AllToAll(group)

    def _local_bags(self, batch: Batch) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor] | None]:
        """Per table on the exchange's device: ids, bag lengths, weights (None unless the data is weighted)."""
        ids = [t.to(self.device) for t in batch.ids]
        lengths = [bag_lengths(off.to(self.device), t.numel()) for off, t in zip(batch.offsets, ids)]
        if not self.weighted:
            return ids, lengths, None
        # a table without weights sends ones: the single-process flatten does the same
        return ids, lengths, [torch.ones(t.numel(), device=self.device) if w is None else w.to(self.device)
                              for t, w in zip(ids, batch.weights)]

    def _send_order(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(lengths, ids, weights or None), destination-major, then table, then sample."""
        raise NotImplementedError

    def __call__(self, batch: Batch, samples: list[int]) -> Batch | None:
        mine, n = self.recv_tables, samples[self.rank]
        lengths, ids, weights = self._send_order(batch)
        send_bags, recv_bags = [k * n for k in self.send_tables], [mine * m for m in samples]
        got = self.exchange(lengths, send_bags, recv_bags)
        per_source = [chunk.view(mine, m) for chunk, m in zip(got.split(recv_bags), samples)]
        send_sums = torch.stack([chunk.sum() for chunk in lengths.split(send_bags)])
        nnz = torch.cat([send_sums, *(chunk.sum(dim=1) for chunk in per_source)]).tolist()  # one sync
        send_nnz, table_nnz = nnz[:len(samples)], nnz[len(samples):]  # table_nnz: source-major
        recv_nnz = [sum(table_nnz[r * mine:(r + 1) * mine]) for r in range(len(samples))]
        got_ids = self.exchange(ids, send_nnz, recv_nnz).split(table_nnz)
        got_weights = None if weights is None else self.exchange(weights, send_nnz, recv_nnz).split(table_nnz)
        if not mine:
            return None
        return self._owner_batch(per_source, got_ids, got_weights, sum(samples))

    def _owner_batch(self, per_source: list[torch.Tensor], ids: tuple[torch.Tensor, ...],
                     weights: tuple[torch.Tensor, ...] | None, total: int) -> Batch:
        """The received pieces (source-major, table-minor) as one batch of the held tables; only the
        sparse fields are filled, the embedding store reads nothing else."""
        mine, sources = self.recv_tables, range(len(per_source))
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


class TableWiseInputDist(_BagInputDist):
    """Table-wise: sends this rank's bags of every table to the table's owner, which receives the
    global batch's bags of the tables it owns."""

    def __init__(self, plan: ShardingPlan, rank: int, group: Any, device: torch.device, weighted: bool):
        super().__init__(rank, group, device, weighted, [len(plan.tables_of(r)) for r in range(plan.world_size)],
                         len(plan.tables_of(rank)))
        self.order = plan.owner_order()

    def _send_order(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        ids, lengths, weights = self._local_bags(batch)
        in_order = lambda per_table: torch.cat([per_table[t] for t in self.order])  # noqa: E731
        return in_order(lengths), in_order(ids), None if weights is None else in_order(weights)


class RowWiseInputDist(_BagInputDist):
    """Row-wise: splits every bag by row block (the owner of row i of table t is i // block_t) and
    sends each part, ids remapped to the block's rows, to the block's owner, which receives the
    global batch's bags of its block of every table."""

    def __init__(self, plan: ShardingPlan, rank: int, table_rows: Sequence[int], group: Any, device: torch.device,
                 weighted: bool):
        tables = len(table_rows)
        super().__init__(rank, group, device, weighted, [tables] * plan.world_size, tables)
        self.world_size = plan.world_size
        self.blocks = torch.tensor([plan.row_block(rows) for rows in table_rows], device=device)

    def _send_order(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        ids, lengths, weights = self._local_bags(batch)
        flat, tables, n = torch.cat(ids), len(ids), lengths[0].numel()
        table_bag = torch.repeat_interleave(torch.arange(tables * n, device=self.device), torch.cat(lengths),
                                            output_size=flat.numel())  # t * n + sample, per id
        block = self.blocks.index_select(0, table_bag // n)
        owner = flat // block
        key = owner * (tables * n) + table_bag
        order = torch.argsort(key, stable=True)  # stable: a bag's ids keep their order within each part
        lengths_sent = torch.bincount(key, minlength=self.world_size * tables * n)
        ids_sent = (flat - owner * block).index_select(0, order)
        return lengths_sent, ids_sent, None if weights is None else torch.cat(weights).index_select(0, order)


class TableWiseOutputDist:
    """Table-wise: sends each owner's pooled vectors [global batch, its tables * dim] to the ranks whose
    samples they are; returns this rank's [its samples, all tables * dim] in table order, as the
    single-process store lays out its output. Differentiable: backward is the reverse all-to-all."""

    def __init__(self, plan: ShardingPlan, rank: int, dim: int, group: Any, device: torch.device):
        self.rank, self.dim, self.device = rank, dim, device
        self.widths = [len(plan.tables_of(r)) for r in range(plan.world_size)]
        self.table_order = torch.argsort(torch.tensor(plan.owner_order())).to(device)  # owner order -> table order
        self.exchange = _AllToAll(group, differentiable=True)

    def __call__(self, pooled: torch.Tensor | None, samples: list[int]) -> torch.Tensor:
        n, dim = samples[self.rank], self.dim
        if pooled is None:  # no tables here: send nothing, but take part in the backward exchange too
            pooled = torch.zeros(0, device=self.device, requires_grad=torch.is_grad_enabled())
        recv_counts = [n * width * dim for width in self.widths]
        recv = self.exchange(pooled.reshape(-1), [m * self.widths[self.rank] * dim for m in samples], recv_counts)
        chunks = [chunk.view(n, width, dim) for chunk, width in zip(recv.split(recv_counts), self.widths)]
        return torch.cat(chunks, dim=1).index_select(1, self.table_order).reshape(n, -1)


class RowWiseOutputDist:
    """Row-wise: every rank's partial pooled vectors [global batch, all tables * dim] (sums over its row
    blocks) summed over the ranks; returns this rank's samples' rows, in the single-process layout.

    A reduce-scatter, run as an all-to-all (each rank's rows of every owner's partials) and a sum over
    owners in rank order, so that uneven sample splits work (reduce_scatter_tensor needs equal ones).
    Differentiable: backward sends this rank's d(pooled) to every owner, which so gets d(pooled) of
    the whole global batch (an all-gather)."""

    def __init__(self, rank: int, width: int, group: Any):
        self.rank, self.width = rank, width
        self.exchange = _AllToAll(group, differentiable=True)

    def __call__(self, pooled: torch.Tensor, samples: list[int]) -> torch.Tensor:
        n, owners = samples[self.rank], len(samples)
        recv = self.exchange(pooled.reshape(-1), [m * self.width for m in samples], [n * self.width] * owners)
        return recv.view(owners, n, self.width).sum(dim=0)


def padded_to(local: torch.Tensor, largest: int, dim: int) -> torch.Tensor:
    """`local` zero-padded along `dim` to `largest` (gloo exchanges equal shapes only)."""
    if local.shape[dim] == largest:
        return local.contiguous()
    shape = list(local.shape)
    shape[dim] = largest
    padded = local.new_zeros(shape)
    padded.narrow(dim, 0, local.shape[dim]).copy_(local)
    return padded


def all_gather_padded(local: torch.Tensor, counts: list[int], group: Any = None, dim: int = 0) -> torch.Tensor:
    """Every rank's `local` concatenated along `dim` in rank order; counts[r] is rank r's size along `dim`."""
    largest = max(counts)
    if largest == 0:  # the same on every rank: no collective anywhere
        return local
    padded = padded_to(local, largest, dim)
    parts = [torch.empty_like(padded) for _ in counts]
    dist.all_gather(parts, padded, group=group)
    return torch.cat([part.narrow(dim, 0, count) for part, count in zip(parts, counts)], dim)


def sum_over_ranks(value: float, device: torch.device, group: Any = None) -> float:
    """The sum over the ranks of one float per rank (e.g. squared norms of the parts each owns), in float64."""
    total = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(total, group=group)
    return float(total)
