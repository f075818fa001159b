"""The whole training step as one CUDA graph: forward, backward and optimizer step captured once, then replayed.

An eager step launches every kernel from Python; a replay launches the captured ones at once, so a launch-bound
step stops waiting on the host. Legal only where the step is static: the same shapes every step, no host sync
inside it, no sparse gradients (their sizes vary), an optimizer with its step count on the device
(``capturable``). The first steps run eagerly on a side stream, as capture requires; the batch of the capture
step becomes the static input that later batches are copied into.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from sg_opt.job.session import JobSession

WARMUP_STEPS = 3  # eager steps before the capture (allocator and autotuning settle)


def copy_into(static: Any, batch: Any) -> None:
    """Copy every tensor of a batch into the same place of the static batch."""
    if isinstance(static, torch.Tensor):
        if static.shape != batch.shape:
            raise ValueError(f"a CUDA graph needs batches of one shape; got {tuple(batch.shape)} after "
                             f"{tuple(static.shape)}")
        static.copy_(batch, non_blocking=True)
    elif isinstance(static, (list, tuple)):
        for s, b in zip(static, batch):
            copy_into(s, b)
    elif isinstance(static, dict):
        for key in static:
            copy_into(static[key], batch[key])


class GraphedStep:
    def __init__(self, session: "JobSession"):
        self.session = session
        self.side = torch.cuda.Stream(session.device)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.static_batch: Any = None
        self.static_loss: torch.Tensor | None = None
        self.warmed = 0

    def _train(self, batch: Any) -> torch.Tensor:
        for opt in self.session.optimizers:
            opt.zero_grad(set_to_none=True)
        loss = self.session.loss_of(batch)
        loss.backward()
        for opt in self.session.optimizers:
            opt.step()
        return loss

    def _capture(self, batch: Any) -> None:
        self.static_batch = batch
        for opt in self.session.optimizers:
            opt.zero_grad(set_to_none=True)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.static_loss = self._train(self.static_batch)

    def step(self, batch: Any) -> torch.Tensor:
        """One training step on `batch`: eager on the side stream while warming up, else a replay."""
        current = torch.cuda.current_stream(self.session.device)
        if self.graph is None and self.warmed < WARMUP_STEPS:
            self.side.wait_stream(current)
            with torch.cuda.stream(self.side):
                loss = self._train(batch)
            current.wait_stream(self.side)
            self.warmed += 1
            return loss
        if self.graph is None:
            self._capture(batch)
        else:
            copy_into(self.static_batch, batch)
        self.graph.replay()
        return self.static_loss.clone()
