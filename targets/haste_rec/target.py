"""The bundled reference trainer as a Target: knobs, kernel slots, sizes and the builder."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping

import torch

from targets.haste_rec.embedding_slots import EMBEDDING_SLOTS
from targets.haste_rec.knobs import KNOB_SPACE
from targets.haste_rec.model import synthetic_data
from targets.haste_rec.session import PHASES, HasteRecSession
from targets.haste_rec.sizes import SIZES, HasteRecSize, get_size
from targets.haste_rec.tail_slots import TAIL_SLOTS
from targets.haste_rec.xc_format import XCDataset, XCFormatError, read_xc
from targets.protocol import ConfigError, Target


def xc_data(path: str, preset: HasteRecSize, seed: int) -> tuple[XCDataset, HasteRecSize]:
    """An extreme-classification file as the trainer's data; the size preset gives the model's widths,
    the file gives labels, feature rows and bag sizes."""
    try:
        data = read_xc(path)
    except XCFormatError as exc:
        raise ConfigError(str(exc)) from None
    dataset = XCDataset(data, preset.batch_size, seed=seed)
    widest_bag = int(data.feature_offsets.diff().max()) if data.num_samples else 1
    shaped = dataclasses.replace(preset, num_labels=data.num_labels, table_rows=(data.num_features,),
                                 table_zipf=(1.0,), pooling=(max(1, widest_bag),), num_dense=dataset.num_dense,
                                 heldout_size=dataset.heldout().batch_size)
    return dataset, shaped


def build(config: Mapping[str, Any], size: str, kernels: Mapping[str, Callable], device: torch.device | str,
          seed: int = 0, data: str | None = None) -> HasteRecSession:
    preset = get_size(size)
    if data is None:
        source = synthetic_data(preset, seed)
    else:
        source, preset = xc_data(data, preset, seed)
    return HasteRecSession(source, preset, config, kernels, torch.device(device), seed)


TARGET = Target(
    name="haste-rec",
    description="Retrieval model: SparseGear-style sparse embeddings -> MLP encoder -> HASTE output layer, BCE",
    knob_space=KNOB_SPACE,
    sizes=tuple(SIZES),
    build=build,
    kernel_slots=TAIL_SLOTS + EMBEDDING_SLOTS,
    phases=PHASES,
    default_size="small",
    data_formats=("xc",),
)
