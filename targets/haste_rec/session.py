"""One training session of the reference trainer: the step, split into named phases, plus the
deterministic probe, gradient norms, parameter digest and held-out quality the worker reads.

Optimizers follow HASTE (``optimizers.py``). The loss is BCE summed over all
labels and averaged over the batch. Under tail_backend triton-fused-loss the step computes the
same loss without the tail's logits: the head's BCE as usual, plus the tail's from the fused
kernel, which also yields the tail's gradients (so its "tail" phase holds part of the backward).
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, Callable, Mapping

import torch
import torch.nn.functional as F

from targets.haste_rec.data.batch import Batch
from targets.haste_rec.data.loader import DeviceBatches
from targets.haste_rec.dense_graph import DenseGraphs, check_dense_graph
from targets.haste_rec.embeddings.row_ops import TableLayout
from targets.haste_rec.metrics import propensity_scores, topk_metrics
from targets.haste_rec.model import HasteRecModel, embedding_config
from targets.haste_rec.optimizers import Optimizers, grad_norms
from targets.haste_rec.sizes import HasteRecSize
from targets.haste_rec.tail.haste import check_backend_device
from targets.haste_rec.work_model import step_work
from targets.digest import sequence_digest, sq_norm
from targets.protocol import BuildClock, PhaseTimer, PhaseWork

PHASES = ("data", "embed", "encoder", "head", "tail", "loss", "backward", "optimizer")
PROBE_SAMPLES, PROBE_COLUMNS = 16, 64


def _ones_at(targets: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """targets[rows, cols] = 1 in place (a contiguous 2-D tensor), with the 1 passed to the kernel as a scalar:
    ``targets[rows, cols] = 1.0`` may make the 1 a host tensor and copy it to the device, a copy that waits
    for the stream, i.e. for every kernel queued before it (the fused tail's, in the loss phase)."""
    return targets.view(-1).index_fill_(0, rows * targets.shape[1] + cols, 1.0).view_as(targets)


def loader_first(source, size: HasteRecSize, config: Mapping[str, Any], device: torch.device) -> DeviceBatches:
    """The batch stream per the data knobs, built before anything large exists in this process.

    Building it starts the loader's worker processes, forked from this one. Forked after the embedding
    tables exist, they would share the host tables' pages copy-on-write, and every row the host optimizer
    wrote afterwards would copy its page first: random row writes into a 1.9 GiB table ran 7-27x slower for
    the 8 steps after a fork (``benchmarks/fork_cow.py``), until every page is copied and the memory doubled.
    `source` is what the stream draws from: the data, or a rank's share of each batch in a sharded run.
    """
    layout = TableLayout(size.table_rows)
    return DeviceBatches(source, device, workers=config["data_workers"],
                         pin_memory=config["pin_memory"], prefetch=config["prefetch_to_device"],
                         sparse_on_device=embedding_config(config, size).ids_on_device,
                         prepare=layout.pack if config["pack_batches"] else None)


class HasteRecSession:
    """A built config of haste_rec, ready to train (see targets.protocol.Session)."""

    phase_names = PHASES

    def __init__(self, data, size: HasteRecSize, config: Mapping[str, Any], kernels: Mapping[str, Callable],
                 device: torch.device, seed: int, clock: BuildClock):
        """`clock` times the parts of the build (``build_parts``), continuing the one the caller began."""
        self.data, self.size, self.config, self.device = data, size, dict(config), device
        self.batch_size = size.batch_size
        check_backend_device(config["tail_backend"], device)  # a config error before any process starts
        if config["dense_cuda_graph"]:
            check_dense_graph(config, device)
        self.batches = loader_first(data, size, config, device)
        self._ahead: Batch | None = None  # the next step's batch, taken early for the embeddings' prefetch
        clock.mark("loader")
        self.model = HasteRecModel(data, size, config, kernels, device, seed, clock)
        self.timer = PhaseTimer(device)
        precision = config["precision"]
        self.compute_dtype = torch.bfloat16 if precision == "bf16" else torch.float32
        if precision == "bf16":
            self.model.encoder.to(torch.bfloat16)
            self.model.output.to(torch.bfloat16)
        self.autocast = precision == "bf16-autocast"
        # Process-wide, set by every session (a worker process builds one): torch's fp32 matmuls and convolutions.
        torch.set_float32_matmul_precision(config["matmul_precision"])
        self.encoder = torch.compile(self.model.encoder) if config["compile_encoder"] else self.model.encoder
        self.optimizers = Optimizers.build(self.model, size.hidden, config, seed)
        out = self.model.output
        self.record_grad_norms = False  # the worker's numerics mode turns this on (it costs a sync per step)
        self._grad_norms: dict[str, float] = {}
        self.valid = out.valid_mask.to(device)
        self.position = out.internal_position.to(device)
        self.fused_tail_loss = config["tail_backend"] == "triton-fused-loss"
        self.dense_graphs = DenseGraphs(self) if config["dense_cuda_graph"] else None
        clock.mark("optimizers and the rest")
        self.build_parts = clock.parts

    # -- the step ------------------------------------------------------------------------------
    def _cast_context(self):
        if self.autocast:
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def _positives(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """(batch row, internal column) of every positive label of the batch. The output size is the labels'
        count, known on the host, so repeat_interleave need not read it back from the device (a sync)."""
        counts = batch.label_offsets[1:] - batch.label_offsets[:-1]
        rows = torch.repeat_interleave(torch.arange(batch.batch_size, device=counts.device), counts,
                                       output_size=batch.labels.numel())
        return rows, self.position[batch.labels]

    def _targets(self, batch: Batch, columns: int) -> torch.Tensor:
        """Dense 0/1 targets in the output layer's internal column order."""
        rows, cols = self._positives(batch)
        return _ones_at(torch.zeros(batch.batch_size, columns, device=self.device), rows, cols)

    def _head_targets(self, rows: torch.Tensor, cols: torch.Tensor, batch_size: int) -> torch.Tensor:
        """Dense 0/1 targets of the head's columns only (tail positives land in a dropped extra column:
        no data-dependent shape, so no device sync)."""
        n_head = self.model.output.n_head
        targets = _ones_at(torch.zeros(batch_size, n_head + 1, device=self.device), rows, cols.clamp(max=n_head))
        return targets[:, :n_head]

    def _hidden(self, batch: Batch) -> torch.Tensor:
        """The encoder's output h [B, H] (call inside the cast context)."""
        phase = self.timer
        with phase("embed"):
            pooled = self.model.embeddings(batch)
        with phase("encoder"):
            return self.encoder(self._encoder_input(pooled, batch.dense))

    def _encoder_input(self, pooled: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:
        return torch.cat([pooled, dense], dim=1).to(self.compute_dtype)

    @staticmethod
    def _head_loss(head: torch.Tensor, targets: torch.Tensor, batch_size: int) -> torch.Tensor:
        """The head's BCE summed over its columns, over the batch size (the fused-loss step's head term)."""
        return F.binary_cross_entropy_with_logits(head.float(), targets, reduction="sum") / batch_size

    def forward(self, batch: Batch) -> torch.Tensor:
        """Logits [B, internal columns] for a batch, each part in its phase."""
        phase = self.timer
        with self._cast_context():
            h = self._hidden(batch)
            with phase("head"):
                head = self.model.output.head_logits(h)
            with phase("tail"):
                tail = self.model.output.tail_logits(h)
            return torch.cat([head, tail], dim=1)

    def loss(self, logits: torch.Tensor, batch: Batch, batch_size: int | None = None) -> torch.Tensor:
        """BCE summed over the valid columns, over `batch_size` (default: this batch's; a rank of a sharded
        run divides its samples' sum by the global batch size, so the ranks' losses add up)."""
        targets = self._targets(batch, logits.shape[1])
        total = F.binary_cross_entropy_with_logits(logits.float(), targets, weight=self.valid.float(), reduction="sum")
        return total / (batch_size or batch.batch_size)

    def fused_loss(self, batch: Batch) -> torch.Tensor:
        """``loss(forward(batch), batch)`` under tail_backend triton-fused-loss: the head's BCE from its
        logits, the tail's from the fused kernel (same sum over valid columns, divided by B)."""
        phase, out = self.timer, self.model.output
        with self._cast_context():
            h = self._hidden(batch)
            with phase("head"):
                head = out.head_logits(h)
            with phase("tail"):
                rows, cols = self._positives(batch)
                tail = out.tail_bce_loss(h, rows, cols - out.n_head, 1.0 / batch.batch_size)
        with phase("loss"):
            head_targets = self._head_targets(rows, cols, batch.batch_size)
            return self._head_loss(head, head_targets, batch.batch_size) + tail

    def step(self) -> torch.Tensor:
        phase = self.timer
        with phase("data"):
            batch = self._next_batch()
        if self.dense_graphs is not None:
            loss = self.dense_graphs.loss(batch)
        elif self.fused_tail_loss:
            loss = self.fused_loss(batch)
        else:
            logits = self.forward(batch)
            with phase("loss"):
                loss = self.loss(logits, batch)
        with phase("backward"):
            loss.backward()
        with phase("optimizer"):
            if self.record_grad_norms:
                self._grad_norms = grad_norms(self.model, self.model.embeddings)
            self.optimizers.step(self.model, self.model.embeddings)
        return loss.detach()

    def _next_batch(self) -> Batch:
        """The step's batch. When the embeddings prefetch (cache_prefetch), the batch after it is taken now too and
        handed to them, and the next step takes it."""
        embeddings = self.model.embeddings
        if not embeddings.prefetches:
            return next(self.batches)
        batch = self._ahead if self._ahead is not None else next(self.batches)
        self._ahead = next(self.batches)
        embeddings.prefetch_next(self._ahead)
        return batch

    @property
    def banked_steps(self) -> int:
        """Batches the loader can build ahead of the step, and one more once the embeddings prefetch: the next
        batch's lookup, prepared while the session is not stepping (see targets.worker.banked_steps). The ranked
        session shares this property (and its ``_ahead``)."""
        return self.batches.depth + int(self._ahead is not None)

    # -- what the worker reads -----------------------------------------------------------------
    def grad_norms(self) -> dict[str, float]:
        return dict(self._grad_norms)

    @torch.no_grad()
    def _eval_logits(self, batch: Batch) -> torch.Tensor:
        return self.forward(batch.to(self.device)).float()

    def probe(self) -> dict[str, list[float]]:
        """Logits of a fixed held-out slice at fixed columns; changes no state."""
        batch = self.data.heldout().slice(0, PROBE_SAMPLES)
        logits = self._eval_logits(batch)
        valid_cols = torch.nonzero(self.valid).flatten()
        pick = valid_cols[torch.linspace(0, valid_cols.numel() - 1, PROBE_COLUMNS).long()]
        return {"logits": logits[:, pick].flatten().tolist(),
                "row_max": logits.masked_fill(~self.valid, -math.inf).amax(dim=1).tolist()}

    def param_digest(self) -> dict[str, Any]:
        tables = self.model.embeddings.current_tables()
        groups = {"encoder": list(self.model.encoder.parameters()),
                  "head": list(self.model.output.head_parameters()),
                  "tail": list(self.model.output.tail_parameters()), "embeddings": tables}
        norms = {name: math.sqrt(sum(sq_norm(p) for p in ps)) for name, ps in groups.items()}
        every = [t for ps in groups.values() for t in ps] + [self.model.output.tail_index]
        return {"sha256": sequence_digest(every), "norms": norms}

    def quality(self) -> dict[str, float]:
        """P@k and PSP@k on the held-out split."""
        heldout = self.data.heldout()
        label_of = self.model.output.internal_label.to(self.device)
        tops = []
        for start in range(0, heldout.batch_size, 256):
            chunk = heldout.slice(start, min(start + 256, heldout.batch_size))
            logits = self._eval_logits(chunk).masked_fill(~self.valid, -math.inf)
            tops.append(label_of[logits.topk(5, dim=1).indices].cpu())
        counts = self.data.label_frequencies() * self.size.quality_steps * self.size.batch_size
        propensity = propensity_scores(counts, self.size.quality_steps * self.size.batch_size)
        return topk_metrics(torch.cat(tops), heldout.labels, heldout.label_offsets, propensity, ks=(1, 3, 5))

    def work_model(self, bus_bytes_per_step: float = 0.0) -> dict[str, PhaseWork]:
        """The least FLOPs and bytes of each phase of a step: the roofline floor's input."""
        return step_work(self, bus_bytes_per_step)

    @torch.no_grad()
    def perturb(self, relative: float, seed: int) -> None:
        """Every dense parameter times 1 +- relative (signs from seed, drawn on its device): a rounding-sized
        difference, to see how far training carries it. Tables are left alone (13 GB at size large)."""
        out = self.model.output
        for i, p in enumerate([*self.model.encoder.parameters(), *out.head_parameters(), *out.tail_parameters()]):
            gen = torch.Generator(device=p.device).manual_seed(seed * 1_000_003 + i)
            signs = torch.randint(0, 2, p.shape, generator=gen, device=p.device).to(p.dtype).mul_(2).sub_(1)
            p.mul_(signs.mul_(relative).add_(1))

    @property
    def steps_done(self) -> int:
        return self.optimizers.steps_done

    def counters(self) -> dict[str, float]:
        return {"steps": float(self.steps_done), **self.model.embeddings.counters()}
