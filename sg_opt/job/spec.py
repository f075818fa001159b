"""``TorchJob``: a plain PyTorch training job handed to sg-opt as factories, made a Target whose generic knobs
(precision, TF32, optimizer implementation, compile, CUDA graphs, loader workers, pinning and prefetch, deferred
host reads, sparse and fused embedding gradients) sg-opt applies itself, because the adapter owns the loop.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import torch
from torch import nn

from sg_opt.job.facts import JobFacts, learn
from sg_opt.job.headroom import job_headroom
from sg_opt.job.knobs import knob_space
from sg_opt.job.session import PHASES, JobSession
from targets.protocol import ConfigError, QualityMetric, Target

HELDOUT_LOSS = QualityMetric("heldout_loss", "lower", 0.01)


def default_forward(model: nn.Module, batch: Any) -> Any:
    """model(*inputs) for a (inputs..., target) batch, model(batch) for anything else."""
    return model(*batch[:-1]) if isinstance(batch, (tuple, list)) else model(batch)


@dataclass
class TorchJob:
    """A training job as factories. With ``sizes``, ``model``, ``data`` and a callable ``batch_size`` take the
    size's value first; ``data(split)`` returns a map-style Dataset for split "train" or "heldout"; ``loss(outputs,
    batch)`` the scalar loss of ``forward(model, batch)``'s outputs. ``log(step, loss)`` gets each step's loss as
    the job's own loop would print it; ``quality(model, heldout_batches)`` extra held-out metrics, declared in
    ``quality_metrics`` with their direction and band (held-out loss is always measured)."""

    model: Callable[..., nn.Module]
    optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer]
    data: Callable[..., torch.utils.data.Dataset]
    loss: Callable[[Any, Any], torch.Tensor]
    batch_size: int | Callable[[Any], int] = 256
    forward: Callable[[nn.Module, Any], Any] = default_forward
    name: str = "torch-job"
    description: str = "a plain PyTorch training job through sg-opt's job adapter"
    sizes: Mapping[str, Any] | None = None
    default_size: str | None = None
    collate: Callable[[list[Any]], Any] | None = None
    log: Callable[[int, float], None] | None = None
    quality: Callable[[nn.Module, list[Any]], Mapping[str, float]] | None = None
    quality_metrics: tuple[QualityMetric, ...] = (HELDOUT_LOSS,)
    quality_steps: int = 200
    heldout_batches: int = 8
    _target: Target | None = field(default=None, init=False, repr=False)

    def _size_value(self, size: str) -> Any:
        if self.sizes is None:
            return None
        if size not in self.sizes:
            raise ConfigError(f"job {self.name} has no size {size!r}; sizes: {', '.join(self.sizes)}")
        return self.sizes[size]

    def _at(self, fn: Callable, size: str, *args: Any) -> Any:
        return fn(self._size_value(size), *args) if self.sizes is not None else fn(*args)

    def build_model(self, size: str) -> nn.Module:
        return self._at(self.model, size)

    def build_data(self, size: str, split: str) -> torch.utils.data.Dataset:
        return self._at(self.data, size, split)

    def batch_size_at(self, size: str) -> int:
        return int(self._at(self.batch_size, size) if callable(self.batch_size) else self.batch_size)

    def facts(self, size: str) -> JobFacts:
        return learn(lambda: self.build_model(size), self.optimizer)

    def target(self) -> Target:
        """The Target sg-opt tunes (built once; its knob space from the default size's model and optimizer)."""
        if self._target is not None:
            return self._target
        sizes = tuple(self.sizes) if self.sizes is not None else ("default",)
        default = self.default_size or sizes[0]
        facts = self.facts(default)

        def build(config, size, kernels, device, seed=0, data=None) -> JobSession:
            if data is not None:
                raise ConfigError(f"job {self.name} reads its data through its data factory; drop --data")
            return JobSession(self, facts, dict(config), size, torch.device(device), seed)

        self._target = Target(name=self.name, description=self.description, knob_space=knob_space(facts),
                              sizes=sizes, build=build, phases=PHASES, default_size=default,
                              headroom=job_headroom, quality_metrics=tuple(self.quality_metrics),
                              quality_steps=self.quality_steps)
        return self._target

    def __call__(self) -> Target:
        """``--target module:job`` names the job itself: the registry calls it for its Target."""
        return self.target()
