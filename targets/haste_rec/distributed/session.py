"""One rank's training session of the distributed reference trainer (the Session protocol, per rank).

A step, on every rank (W ranks, global batch B, rank r holding samples [lo_r, hi_r)):
  data        build global batch i, keep this rank's slice
  input_dist  all-to-all of bag lengths, then of ids: table owners get the global batch's bags
  embed       owners pool their tables over the global batch
  output_dist all-to-all of pooled vectors back to the samples' ranks
  dense       encoder and HASTE output on this rank's samples (DDP replica)
  loss        this rank's share: BCE summed over its samples and all labels, / B
  backward    DDP all-reduces (sums) the dense gradients in buckets; the pooled gradients go back to
              the owners by the reverse all-to-all, who form each row's gradient over the global batch
  optimizer   Adam (encoder) and SGD (output) on identical summed gradients on every rank; row-wise
              Adagrad by each owner on its rows; rewiring, identical on every rank
  loss_sync   all-reduce of the loss shares: the global loss, the single-process loss
That is embedding_sharding table-wise. Under row-wise (``sharded_embeddings.RowWiseEmbeddings``) every
rank owns a block of rows of every table: input_dist sends each id to its row's owner, embed pools
partial sums over the owned rows, output_dist sums them over the owners (a reduce-scatter as an
all-to-all). And it is tail_sharding replicated. Under label-groups (``sharded_tail.py``) each rank owns whole tail
groups, outside DDP, and the dense and loss phases change:
  dense       encoder and head on this rank's samples (DDP replica); tail_dist all-gathers h (and the
              batch's tail positives) to the global batch, tail computes the owned groups' logits of it
  loss        this rank's share: its samples' head BCE plus its groups' BCE over the global batch, / B
  backward    as above for the encoder and head; the owners' dh of the global batch is reduce-scattered
              (summed) to the samples' ranks; the owned groups' gradients are complete, no all-reduce
  optimizer   as above; SGD and rewiring of the owned groups, each owner its own, as the full layer
With embedding_cache_prefetch (placement cached) the data phase also takes the next batch, and its input_dist runs
then, a step early on every rank, so that each owner's store prepares that batch's lookup on its prefetch thread
while the step runs (TorchRec's pipelined input dist); the next step's embed takes the owned bags exchanged then.
The probe and the held-out quality are the single-process session's, run on logits that each rank
computes for its slice of the evaluation batch and all-gathers (under label-groups: the head's for its
slice, the tail's of its groups for the whole batch, all-gathered by columns). Every method here is
collective: every rank must call it, in the same order.
"""

from __future__ import annotations

import hashlib
import math
from typing import Any, Callable, Mapping

import torch
import torch.distributed as dist
import torch.nn.functional as F

from targets.haste_rec.data.batch import Batch
from targets.haste_rec.distributed.dense import build_tower, data_parallel
from targets.haste_rec.distributed.exchange import all_gather_padded
from targets.haste_rec.distributed.plan import RankSamples, ShardingPlan, check_ranked_config, sample_counts
from targets.haste_rec.distributed.process_group import RankContext
from targets.haste_rec.distributed.sharded_embeddings import (RowWiseEmbeddings, ShardedEmbeddings, TableWiseEmbeddings)
from targets.haste_rec.distributed.sharded_tail import LabelGroupTail
from targets.haste_rec.model import cache_plan_inputs, embedding_config
from targets.haste_rec.optimizers import Optimizers, grad_norms
from targets.haste_rec.session import HasteRecSession, loader_first
from targets.haste_rec.sizes import HasteRecSize
from targets.digest import sequence_digest, sq_norm
from targets.protocol import PhaseTimer

PHASES = ("data", "input_dist", "embed", "output_dist", "encoder", "head", "tail_dist", "tail", "loss", "backward",
          "optimizer", "loss_sync")


class ShardedSession:
    """A built config of haste_rec on one rank of a torch.distributed job."""

    phase_names = PHASES
    # Borrowed from the single-process session, so that the loss targets, the probe and the quality
    # metric are the same code: they read data, size, device, valid, position, model.output, _eval_logits.
    _positives = HasteRecSession._positives
    _targets = HasteRecSession._targets
    _head_targets = HasteRecSession._head_targets
    _cast_context = HasteRecSession._cast_context
    loss = HasteRecSession.loss
    probe = HasteRecSession.probe
    quality = HasteRecSession.quality
    banked_steps = HasteRecSession.banked_steps  # it reads batches
    # Dense parameters only, from the seed: the replicas stay identical. An owned tail slice draws its
    # signs for its own shape: as small a nudge as the single-process one, not the same one.
    perturb = HasteRecSession.perturb

    def __init__(self, data, size: HasteRecSize, config: Mapping[str, Any], kernels: Mapping[str, Callable],
                 plan: ShardingPlan, ctx: RankContext, seed: int):
        check_ranked_config(config)
        self.data, self.size, self.config, self.plan, self.ctx = data, size, dict(config), plan, ctx
        self.device = ctx.device
        self.batch_size = size.batch_size  # the global batch
        self.samples = sample_counts(size.batch_size, ctx.world_size)
        self.timer = PhaseTimer(self.device)
        start = sum(self.samples[:ctx.rank])
        # The loader first (see loader_first); unpacked (pack_batches is single-process): the exchange takes
        # per-table bags.
        self.batches = loader_first(RankSamples(data, start, start + self.samples[ctx.rank]), size, config,
                                    self.device)
        self._ahead: Batch | None = None  # the next step's batch, taken early for the embeddings' prefetch
        self.embeddings = self._build_embeddings(data, size, config, seed)
        self.tail = LabelGroupTail.join(plan, ctx) if plan.tail_sharding == "label-groups" else None
        self.model = build_tower(data, size, config, kernels, self.device, seed, self.timer, self.tail)
        self.ddp = data_parallel(self.model, self.device)
        self.autocast = config["precision"] == "bf16-autocast"
        torch.set_float32_matmul_precision(config["matmul_precision"])  # as the single-process session
        self.optimizers = Optimizers.build(self.model, size.hidden, config, seed)
        out = self.model.output
        self.record_grad_norms = False
        self._grad_norms: dict[str, float] = {}
        self.local_loss = math.nan  # this rank's share of the last step's loss
        self.valid = out.valid_mask.to(self.device)
        self.position = out.internal_position.to(self.device)

    def _build_embeddings(self, data, size: HasteRecSize, config: Mapping[str, Any], seed: int) -> ShardedEmbeddings:
        """The sharded tables (table-wise or row-wise, as the plan says), planned as HasteRecModel plans the
        single-process store: for the bags of the global batch, which is what an owner pools."""
        cfg = embedding_config(config, size)
        counts, max_unique = cache_plan_inputs(data, size, cfg)
        weighted = any(w is not None for w in data.heldout().weights)
        scheme = RowWiseEmbeddings if self.plan.embedding_sharding == "row-wise" else TableWiseEmbeddings
        return scheme(self.plan, self.ctx.rank, size.table_rows, size.embedding_dim, cfg, self.device, seed,
                      self.ctx.embedding_group, weighted, access_counts=counts, max_unique_per_batch=max_unique,
                      phase=self.timer)

    # -- the step ------------------------------------------------------------------------------

    def step(self) -> torch.Tensor:
        phase = self.timer
        with phase("data"):
            batch = self._ahead if self._ahead is not None else next(self.batches)
            self._ahead = next(self.batches) if self.embeddings.prefetches else None
        if self._ahead is not None:  # cache_prefetch: the next batch input-dist'ed now, its lookup prepared ahead
            self.embeddings.prefetch_next(self._ahead, self.samples)
        with self._cast_context():
            logits = self.ddp(self.embeddings(batch, self.samples), batch.dense, self.samples)
        if self.tail is None:
            with phase("loss"):
                loss = self.loss(logits, batch, self.batch_size)  # this rank's share of the global loss
        else:
            loss = self._label_groups_loss(*logits, batch)
        with phase("backward"):
            loss.backward()
        with phase("optimizer"):
            if self.record_grad_norms:
                self._grad_norms = grad_norms(self.model, self.embeddings, self._tail_total)
            self.optimizers.step(self.model, self.embeddings)
        with phase("loss_sync"):
            local = loss.detach()
            total = local.clone()
            dist.all_reduce(total)
        self.local_loss = float(local)
        return total

    def _label_groups_loss(self, head: torch.Tensor, tail: torch.Tensor, batch: Batch) -> torch.Tensor:
        """This rank's share of the global loss under label-groups: its samples' head BCE plus its groups'
        BCE over the global batch (valid columns only), both over the global batch size."""
        out = self.model.output
        rows, cols = self._positives(batch)
        with self.timer("tail_dist"):
            tail_targets = self.tail.owned_targets(out, rows, cols, self.samples)
        with self.timer("loss"):
            head_total = F.binary_cross_entropy_with_logits(
                head.float(), self._head_targets(rows, cols, batch.batch_size), reduction="sum")
            tail_total = F.binary_cross_entropy_with_logits(
                tail.float(), tail_targets, weight=self.valid[out.owned_columns].float(), reduction="sum")
            return (head_total + tail_total) / self.batch_size

    def _tail_total(self, local: float) -> float:
        """A squared norm of the tail's parameters or gradients, over all its groups."""
        return local if self.tail is None else self.tail.sum_over_ranks(local)

    # -- what the worker reads (collective) ----------------------------------------------------
    def grad_norms(self) -> dict[str, float]:
        return dict(self._grad_norms)

    @torch.no_grad()
    def _eval_logits(self, batch: Batch) -> torch.Tensor:
        """Logits of a whole evaluation batch, which every rank passes: each computes its slice, then all gather."""
        counts = sample_counts(batch.batch_size, self.ctx.world_size)
        start = sum(counts[:self.ctx.rank])
        mine = batch.slice(start, start + counts[self.ctx.rank]).to(self.device)
        with self._cast_context():
            logits = self.model(self.embeddings(mine, counts), mine.dense, counts)
        if self.tail is None:
            return all_gather_padded(logits.float(), counts)
        head, tail = logits
        all_tail = self.tail.all_columns(self.model.output, tail.float())
        return torch.cat([all_gather_padded(head.float(), counts), all_tail], dim=1)

    def param_digest(self) -> dict[str, Any]:
        """Parameter norms per group, and a sha256 over every rank's own parameters (its dense replica, its tables
        or row blocks, its tail groups and their wiring), in rank order: equal only between runs of one plan on as
        many ranks, so that a change promising the exact class (loader workers, the cache prefetch) can show it on
        ranks too. A sharded run matches the single-process one in the reorder class only, never by this."""
        out = self.model.output
        groups = {"encoder": list(self.model.encoder.parameters()), "head": list(out.head_parameters()),
                  "tail": list(out.tail_parameters())}
        sq_norms = {name: sum(sq_norm(p) for p in ps) for name, ps in groups.items()}
        sq_norms["tail"] = self._tail_total(sq_norms["tail"])
        norms = {name: math.sqrt(value) for name, value in sq_norms.items()}
        norms["embeddings"] = math.sqrt(self.embeddings.table_sq_norm())
        tables = [] if self.embeddings.store is None else self.embeddings.store.current_tables()
        mine = sequence_digest([p for ps in groups.values() for p in ps] + tables + [out.tail_index])
        every: list[Any] = [None] * self.ctx.world_size
        dist.all_gather_object(every, mine)
        return {"sha256": hashlib.sha256("".join(every).encode()).hexdigest(), "norms": norms}

    @property
    def steps_done(self) -> int:
        return self.optimizers.steps_done

    def counters(self) -> dict[str, float]:
        tail = {} if self.tail is None else self.tail.counters(self.model.output)
        return {"steps": float(self.steps_done), **self.embeddings.counters(), **tail}
