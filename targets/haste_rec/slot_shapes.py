"""The fine profile's view of the trainer's kernel slots (``Target.slot_shapes``, ``slot_dtype``, ``slot_phases``):
the shapes its tail slots run at in a built session, the dtype, and the phase whose work each does."""

from __future__ import annotations

from typing import Any

import torch

# The tail slots and the phase whose work each does (tail_backend torch runs the same
# products through autograd, in the same phases).
SLOT_PHASES = {"tail_forward": "tail", "tail_backward_weight": "backward", "tail_backward_input": "backward"}


def slot_shapes(session: Any) -> dict[str, dict[str, int]]:
    """The tail slots' shapes in a built session, read from its output layer (``session.model.output``):
    tail_index [K, F], tail_weight [K, G, F], the batch size B and the tail's input width Ht. Under bf16 autocast
    with the slots backend the bias is added outside the slot (``bias`` 0); otherwise tail_forward adds it."""
    out = session.model.output
    groups, size, fan_in = out.tail_weight.shape
    if tuple(out.tail_index.shape) != (groups, fan_in):
        raise ValueError(f"tail_index is {tuple(out.tail_index.shape)}, tail_weight {tuple(out.tail_weight.shape)}")
    shape = {"B": int(session.batch_size), "Ht": int(out.tail_dims), "K": int(groups), "G": int(size),
             "F": int(fan_in)}
    bias_outside = bool(getattr(session, "autocast", False)) and out.backend in ("slots", "triton", "triton-fused-loss")
    return {"tail_forward": {**shape, "bias": 0 if bias_outside else 1},
            "tail_backward_weight": dict(shape), "tail_backward_input": dict(shape)}


def slot_dtype(session: Any) -> torch.dtype:
    """The dtype the tail's products run in: bf16 under autocast, else the session's compute dtype."""
    return torch.bfloat16 if getattr(session, "autocast", False) else session.compute_dtype

