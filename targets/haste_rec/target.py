"""The bundled reference trainer as a Target: knobs, kernel slots, sizes and the builder."""

from __future__ import annotations

from typing import Any, Callable, Mapping

import torch

from targets.haste_rec.knobs import KNOB_SPACE
from targets.haste_rec.model import synthetic_data
from targets.haste_rec.session import PHASES, HasteRecSession
from targets.haste_rec.sizes import SIZES, get_size
from targets.haste_rec.tail_slots import TAIL_SLOTS
from targets.protocol import Target


def build(config: Mapping[str, Any], size: str, kernels: Mapping[str, Callable], device: torch.device | str,
          seed: int = 0) -> HasteRecSession:
    preset = get_size(size)
    return HasteRecSession(synthetic_data(preset, seed), preset, config, kernels, torch.device(device), seed)


TARGET = Target(
    name="haste-rec",
    description="Retrieval model: SparseGear-style sparse embeddings -> MLP encoder -> HASTE output layer, BCE",
    knob_space=KNOB_SPACE,
    sizes=tuple(SIZES),
    build=build,
    kernel_slots=TAIL_SLOTS,
    phases=PHASES,
    default_size="small",
)
