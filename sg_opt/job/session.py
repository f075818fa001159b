"""One configuration of a user's job, ready to train: the adapter's own training loop with its knobs applied.

The loop is the plain one (batch, forward and loss, backward, optimizer step, the loss read on the host) with
each phase named for the profiler. Everything a knob changes happens here, so the user's code stays as written.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, Callable

import torch
from torch import nn

from sg_opt.job.facts import sparse_capable
from sg_opt.job.fusion import FusedTable, canonical_parameters, fuse_bags
from sg_opt.job.graphs import GraphedStep
from sg_opt.job.loading import Batches, ordered_batches, to_device
from sg_opt.job.optimizers import build_optimizers
from targets.protocol import ConfigError, PhaseTimer, sequence_digest

if TYPE_CHECKING:
    from sg_opt.job.spec import TorchJob
    from sg_opt.job.facts import JobFacts

PHASES = ("data", "forward", "backward", "optimizer", "metrics")
GRAPH_PHASES = ("data", "replay", "metrics")
PROBE_OUTPUTS = 64
AUTOCAST = {"bf16-autocast": torch.bfloat16, "fp16-autocast": torch.float16}


def first_tensor(outputs: Any) -> torch.Tensor:
    """The model's first output tensor (a tuple's, a dict's first value's), for the numerics probe."""
    if isinstance(outputs, torch.Tensor):
        return outputs
    values = outputs.values() if isinstance(outputs, dict) else outputs
    return next(first_tensor(v) for v in values)


def _norm(grads: list[torch.Tensor]) -> float:
    parts = [(g.coalesce().values() if g.is_sparse else g).float().norm() for g in grads]
    return float(torch.linalg.vector_norm(torch.stack(parts))) if parts else 0.0


class JobSession:
    """The ``targets.protocol.Session`` of a TorchJob under one resolved config."""

    def __init__(self, job: "TorchJob", facts: "JobFacts", config: dict[str, Any], size: str, device: torch.device,
                 seed: int):
        if device.type != "cuda" and config["cuda_graphs"]:
            raise ConfigError("cuda_graphs needs a CUDA device")
        torch.manual_seed(seed)
        torch.set_float32_matmul_precision("high" if config["tf32"] else "highest")  # cuDNN's TF32: torch's default
        self.job, self.config, self.device = job, config, device
        self.timer, self.record_grad_norms, self._norms = PhaseTimer(device), False, {}
        self.model = job.build_model(size).to(device)
        self.tables = self._tables(config)
        table_ids = {id(p) for p in self.tables}
        self.dense = [p for p in self.model.parameters() if id(p) not in table_ids]
        sparse = bool(config.get("sparse_embedding_grads"))
        everything = list(self.model.parameters())
        self.optimizers = build_optimizers(job.optimizer, facts, self.dense if sparse else everything,
                                           self.tables if sparse else [], config["optimizer_impl"],
                                           capturable=config["cuda_graphs"])
        mode = config["compile"]
        self.forward_model = self.model if mode == "none" else torch.compile(self.model, mode=mode)
        dtype = AUTOCAST.get(config["precision"])
        self.autocast: Callable[[], Any] = (contextlib.nullcontext if dtype is None else
                                            lambda: torch.autocast(device.type, dtype=dtype,
                                                                   cache_enabled=not config["cuda_graphs"]))
        self.batch_size = job.batch_size_at(size)
        self.batches = Batches(job.build_data(size, "train"), self.batch_size, job.collate, device, seed,
                               config["data_workers"], config["pin_memory"], config["prefetch_to_device"])
        self.banked_steps = self.batches.banked
        heldout = ordered_batches(job.build_data(size, "heldout"), self.batch_size, job.collate, job.heldout_batches)
        if not heldout:
            raise ConfigError(f"job {job.name}: its heldout data holds less than one batch of {self.batch_size}")
        self.heldout = [to_device(b, device) for b in heldout]
        self.every, self.pending, self.steps_done = config["metrics_every"], [], 0
        self.graph = GraphedStep(self) if config["cuda_graphs"] else None
        self.phase_names = GRAPH_PHASES if self.graph is not None else PHASES

    def _tables(self, config: dict[str, Any]) -> list[nn.Parameter]:
        """The embedding tables' parameters, with sparse gradients where asked (fused into one table per list of
        bags where asked too)."""
        if config.get("sparse_embedding_grads"):
            for module in self.model.modules():
                if sparse_capable(module):
                    module.sparse = True
            if config.get("embedding_fusion"):
                fuse_bags(self.model)
        return [m.weight for m in self.model.modules() if sparse_capable(m) or isinstance(m, FusedTable)]

    def loss_of(self, batch: Any) -> torch.Tensor:
        with self.autocast():
            return self.job.loss(self.job.forward(self.forward_model, batch), batch)

    def step(self) -> torch.Tensor:
        if self.graph is not None:
            with self.timer("data"):
                batch = next(self.batches)
            with self.timer("replay"):
                loss = self.graph.step(batch)
        else:
            with self.timer("data"):
                batch = next(self.batches)
            with self.timer("forward"):
                loss = self.loss_of(batch)
            with self.timer("backward"):
                for opt in self.optimizers:
                    opt.zero_grad(set_to_none=True)
                loss.backward()
            if self.record_grad_norms:
                self._record_norms()
            with self.timer("optimizer"):
                for opt in self.optimizers:
                    opt.step()
        with self.timer("metrics"):
            self._read_metrics(loss.detach())
        return loss.detach()

    def _record_norms(self) -> None:
        grads = lambda params: [p.grad for p in params if p.grad is not None]  # noqa: E731
        self._norms = {"dense": _norm(grads(self.dense)), "embeddings": _norm(grads(self.tables))}

    def _read_metrics(self, loss: torch.Tensor) -> None:
        """The loss on the host every ``metrics_every`` steps, all of them in one read, handed to the job's log."""
        self.pending.append(loss)
        self.steps_done += 1
        if self.steps_done % self.every:
            return
        values = torch.stack(self.pending).tolist()
        first, self.pending = self.steps_done - len(values), []
        if self.job.log is not None:
            for i, value in enumerate(values):
                self.job.log(first + i, value)

    def probe(self) -> dict[str, list[float]]:
        with torch.no_grad(), self.autocast():
            outputs = first_tensor(self.job.forward(self.forward_model, self.heldout[0]))
        return {"outputs": outputs.float().flatten()[:PROBE_OUTPUTS].tolist()}

    def grad_norms(self) -> dict[str, float]:
        if self.graph is not None and self.record_grad_norms:
            self._record_norms()
        return dict(self._norms)

    def param_digest(self) -> dict[str, Any]:
        named = list(canonical_parameters(self.model))
        return {"sha256": sequence_digest([t for _, t in named]),
                "norms": {name: float(t.detach().float().norm()) for name, t in named}}

    def quality(self) -> dict[str, float]:
        """The held-out loss over the held-out batches, and the job's own metrics where it has a quality function."""
        with torch.no_grad():
            losses = [float(self.loss_of(batch)) for batch in self.heldout]
            metrics = {"heldout_loss": sum(losses) / len(losses)}
            if self.job.quality is not None:
                with self.autocast():
                    metrics.update({k: float(v) for k, v in self.job.quality(self.forward_model, self.heldout).items()})
        return metrics

    def perturb(self, relative: float, seed: int) -> None:
        """Every dense parameter times 1 +- relative (signs from seed): how far training carries a rounding."""
        with torch.no_grad():
            for i, p in enumerate(self.dense):
                gen = torch.Generator(device=p.device).manual_seed(seed * 1_000_003 + i)
                signs = torch.randint(0, 2, p.shape, generator=gen, device=p.device).to(p.dtype).mul_(2).sub_(1)
                p.mul_(signs.mul_(relative).add_(1))

    def counters(self) -> dict[str, float]:
        return {"steps": float(self.steps_done)}
