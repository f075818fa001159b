"""The bundled reference trainer as a Target: knobs, kernel slots, sizes and the builder."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping

import torch

from targets.haste_rec.data.xc_format import XCDataset, XCFormatError, read_xc
from targets.haste_rec.embeddings.embedding_slots import EMBEDDING_SLOTS
from targets.haste_rec.headroom import haste_headroom
from targets.haste_rec.host_threads import apply_host_threads
from targets.haste_rec.knobs import KNOB_SPACE
from targets.haste_rec.model import check_config, synthetic_data
from targets.haste_rec.rules import RULES
from targets.haste_rec.session import PHASES, HasteRecSession
from targets.haste_rec.sizes import SIZES, HasteRecSize, get_size
from targets.haste_rec.slot_shapes import SLOT_PHASES, slot_dtype, slot_shapes
from targets.haste_rec.tail.tail_slots import TAIL_SLOTS
from targets.protocol import BuildClock, ConfigError, QualityMetric, Target


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


def training_data(size: str, seed: int, data: str | None = None):
    """(data source, size) of a run: synthetic data of the size preset, or a file shaped by it."""
    preset = get_size(size)
    return (synthetic_data(preset, seed), preset) if data is None else xc_data(data, preset, seed)


def build(config: Mapping[str, Any], size: str, kernels: Mapping[str, Callable], device: torch.device | str,
          seed: int = 0, data: str | None = None) -> HasteRecSession:
    clock = BuildClock(torch.device(device))
    source, preset = training_data(size, seed, data)
    apply_host_threads(config["host_threads"])
    clock.mark("data")
    return HasteRecSession(source, preset, config, kernels, torch.device(device), seed, clock)


def build_ranked(config: Mapping[str, Any], size: str, kernels: Mapping[str, Callable], device: torch.device,
                 seed: int, job, data: str | None = None):
    """This rank's ShardedSession (the sharding plan from the config's embedding_sharding and tail_sharding)
    in a joined job (a ``targets.ranks.RankContext``); imported here so that single-process runs never load it."""
    from targets.haste_rec.distributed.plan import ShardingPlan
    from targets.haste_rec.distributed.process_group import with_embedding_group
    from targets.haste_rec.distributed.session import ShardedSession

    source, preset = training_data(size, seed, data)
    plan = ShardingPlan(job.world_size, preset.num_tables, config["embedding_sharding"], config["tail_sharding"])
    apply_host_threads(config["host_threads"])
    return ShardedSession(source, preset, config, kernels, plan, with_embedding_group(job), seed)


TARGET = Target(
    name="haste-rec",
    description="Retrieval model: SparseGear-style sparse embeddings -> MLP encoder -> HASTE output layer, BCE",
    knob_space=KNOB_SPACE,
    sizes=tuple(SIZES),
    build=build,
    build_ranked=build_ranked,
    check_config=check_config,
    kernel_slots=TAIL_SLOTS + EMBEDDING_SLOTS,
    phases=PHASES,
    default_size="small",
    data_formats=("xc",),
    rules=RULES,
    headroom=haste_headroom,
    target_findings=(("tail", "fp32-products"),),
    quality_metrics=(QualityMetric("P@1", "higher", 0.01),),
    quality_steps=lambda size: get_size(size).quality_steps,
    slot_shapes=slot_shapes,
    slot_dtype=slot_dtype,
    slot_phases=SLOT_PHASES,
)
