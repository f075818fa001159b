"""A user's own recommendation model made an sg-opt target: three knobs, one kernel slot.

    sg-opt targets --json                      # (built-in targets only; this one is named by path)
    sg-opt bench --target examples.custom_target:target --size tiny
    sg-opt optimize --target examples.custom_target:target --size tiny --max-iters 4

All a target needs is ``targets.protocol``: a knob space (each knob with its domain, reason,
category and numerics class), kernel slots (reference, input generator, cost model), and a
``build(config, size, kernels, device, seed)`` that returns a session with step/probe/digest.
"""

from __future__ import annotations

import torch

from examples.custom_target.model import SIZES, CtrSession, interaction
from targets.protocol import FlopsBytes, KernelSlot, Knob, KnobSpace, QualityMetric, Target

KNOBS = KnobSpace((
    Knob("batch_build", "choice", "loop", category="data", numerics="exact", choices=("loop", "vectorized"),
         why="loop gathers one example at a time (easy to read); vectorized gathers the batch in one indexing op"),
    Knob("sparse_embedding_grads", "bool", False, category="embedding", numerics="reorder",
         why="dense gradients touch every table row every step; sparse ones only the rows the batch used"),
    Knob("learning_rate", "float", 0.05, category="model", numerics="model", low=1e-4, high=1.0,
         why="SGD step size: changes what is learned, so it is judged by quality (logloss), not numerics"),
))


def _interaction_inputs(shape, dtype, device, generator):
    return (torch.randn(shape["B"], shape["N"], shape["D"], generator=generator, dtype=dtype).to(device),)


def _interaction_cost(shape, dtype) -> FlopsBytes:
    b, n, d = shape["B"], shape["N"], shape["D"]
    size = torch.empty(0, dtype=dtype).element_size()
    return FlopsBytes(2.0 * b * n * n * d, float(size * (b * n * d + b * n * (n - 1) // 2)))


INTERACTION = KernelSlot(name="interaction", signature="vectors", reference=interaction,
                         make_inputs=_interaction_inputs, cost=_interaction_cost,
                         shapes=({"B": 256, "N": 5, "D": 16}, {"B": 1024, "N": 6, "D": 32}),
                         why="pairwise dot products of the dense and embedded vectors (DLRM's interaction)")


def _build(config, size, kernels, device, seed=0, data=None):
    return CtrSession(config, size, kernels or {}, torch.device(device), seed)


target = Target(name="custom-ctr", description="a user's own DLRM-style click model (example)", knob_space=KNOBS,
                sizes=tuple(SIZES), build=_build, kernel_slots=(INTERACTION,), phases=CtrSession.phase_names,
                default_size="tiny", quality_metrics=(QualityMetric("logloss", "lower", 0.01),), quality_steps=100)
