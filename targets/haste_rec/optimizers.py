"""The trainer's optimizers and its update phase, shared by the single-process and the sharded session.

Optimizers follow HASTE: Adam for the encoder, SGD with momentum for the output layer, row-wise
Adagrad for the embedding tables (owned by the embedding store, whichever kind of store it is). A
logit's SGD step grows with its fan-in: the dense head reads all H dims, a tail group F, so the
head's rate is scaled by F / H to give every logit the same step size. Every ``rewire_every`` steps
HASTE rewires the tail's weakest fan-in slots and their momentum is cleared. Both act on the tail
the layer holds, so on a label-group-sharded tail each owner updates and rewires its own groups
exactly as the whole layer would (see ``HasteOutput._draw_new_dims``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch

from targets.haste_rec.tail.haste import zero_rewired_state

ENCODER_LR, OUTPUT_LR, OUTPUT_MOMENTUM = 3e-3, 0.5, 0.9
REWIRE_FRACTION = 0.1


def optimizer_flags(impl: str) -> dict[str, bool]:
    return {"default": {}, "for-loop": {"foreach": False}, "foreach": {"foreach": True},
            "fused": {"fused": True}}[impl]


@dataclass
class Optimizers:
    """The encoder's Adam and the output layer's SGD, plus the rewiring schedule; tables update themselves."""

    encoder: torch.optim.Optimizer
    output: torch.optim.Optimizer
    rewire_every: int
    rewire_gen: torch.Generator
    steps_done: int = 0

    @classmethod
    def build(cls, model, hidden: int, config: Mapping[str, Any], seed: int) -> "Optimizers":
        flags = optimizer_flags(config["optimizer_impl"])
        out = model.output
        head_lr = OUTPUT_LR * model.shape.fan_in / hidden
        return cls(encoder=torch.optim.Adam(model.encoder.parameters(), lr=ENCODER_LR, **flags),
                   output=torch.optim.SGD([{"params": out.tail_parameters()},
                                           {"params": out.head_parameters(), "lr": head_lr}],
                                          lr=OUTPUT_LR, momentum=OUTPUT_MOMENTUM, **flags),
                   rewire_every=config["rewire_every"], rewire_gen=torch.Generator().manual_seed(seed + 101))

    def step(self, model, embeddings) -> None:
        """One update of every parameter, the gradients reset, then HASTE's rewiring when it is due."""
        self.encoder.step()
        self.output.step()
        embeddings.optimizer_step()
        self.encoder.zero_grad(set_to_none=True)
        self.output.zero_grad(set_to_none=True)
        embeddings.zero_grad()
        self.steps_done += 1
        if self.rewire_every and self.steps_done % self.rewire_every == 0:
            zero_rewired_state(self.output, model.output.rewire(REWIRE_FRACTION, self.rewire_gen))


def grad_norms(model, embeddings, tail_total: Callable[[float], float] | None = None) -> dict[str, float]:
    """Gradient norms per parameter group (encoder, head, tail, embeddings) of the last backward.

    tail_total sums the tail's squared norm over the ranks that hold parts of it (a label-group-sharded
    tail); None for a tail held whole."""
    def sq_norm(params) -> float:
        grads = [p.grad.float().pow(2).sum() for p in params if p.grad is not None]
        return float(torch.stack(grads).sum()) if grads else 0.0
    out = model.output
    tail_sq = sq_norm(out.tail_parameters())
    return {"encoder": math.sqrt(sq_norm(model.encoder.parameters())),
            "head": math.sqrt(sq_norm(out.head_parameters())),
            "tail": math.sqrt(tail_sq if tail_total is None else tail_total(tail_sq)),
            "embeddings": math.sqrt(embeddings.grad_sq_norm())}
