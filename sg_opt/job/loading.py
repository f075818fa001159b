"""The job's batches under a config: a DataLoader over the user's dataset in a seeded order that no loader knob
changes, pinned or not, copied to the device in the step or ahead of it on a side stream.

The order comes from a sampler of the adapter's own (an endless run of seeded permutations), so loader workers,
epochs and pinning never change which samples make a batch; the loader gets a generator of its own, so it takes
nothing from the global RNG that the model's dropout draws from.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator

import torch
from torch.utils.data import DataLoader, Dataset, Sampler

PREFETCH_FACTOR = 2  # batches each loader worker keeps ready (DataLoader's default)


class EndlessSampler(Sampler[int]):
    """Seeded permutations of the dataset's indices, one after another, forever."""

    def __init__(self, size: int, seed: int):
        self.size, self.seed = size, seed

    def __iter__(self) -> Iterator[int]:
        gen = torch.Generator().manual_seed(self.seed)
        while True:
            yield from torch.randperm(self.size, generator=gen).tolist()


def to_device(batch: Any, device: torch.device, non_blocking: bool = False) -> Any:
    """Every tensor of a (nested tuple, list or dict) batch on the device."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=non_blocking)
    if isinstance(batch, (list, tuple)):
        moved = [to_device(x, device, non_blocking) for x in batch]
        return type(batch)(*moved) if hasattr(batch, "_fields") else type(batch)(moved)
    if isinstance(batch, dict):
        return {k: to_device(v, device, non_blocking) for k, v in batch.items()}
    return batch


def ordered_batches(dataset: Dataset, batch_size: int, collate: Callable | None, count: int) -> list[Any]:
    """The first `count` batches of a dataset in index order (held-out and probe batches)."""
    loader = DataLoader(dataset, batch_size=batch_size, shuffle=False, drop_last=True, collate_fn=collate)
    batches = []
    for batch in loader:
        batches.append(batch)
        if len(batches) == count:
            break
    return batches


class Batches:
    """Training batches on the device, one per ``next()``; ``banked`` says how many are built ahead."""

    def __init__(self, dataset: Dataset, batch_size: int, collate: Callable | None, device: torch.device, seed: int,
                 workers: int, pin: bool, prefetch: bool):
        on_cuda = device.type == "cuda"
        self.device, self.pin = device, pin and on_cuda
        self.prefetch = prefetch and on_cuda
        loader = DataLoader(dataset, batch_size=batch_size, sampler=EndlessSampler(len(dataset), seed),
                            drop_last=True, collate_fn=collate, num_workers=workers, pin_memory=self.pin,
                            generator=torch.Generator().manual_seed(seed + 1),
                            prefetch_factor=PREFETCH_FACTOR if workers else None, persistent_workers=workers > 0)
        self.loader = iter(loader)
        self.banked = workers * PREFETCH_FACTOR + int(self.prefetch)
        self.stream = torch.cuda.Stream(device) if self.prefetch else None
        self.ready: Any = None
        if self.prefetch:
            self._copy_next()

    def _copy_next(self) -> None:
        with torch.cuda.stream(self.stream):
            self.ready = to_device(next(self.loader), self.device, non_blocking=self.pin)

    def __next__(self) -> Any:
        if not self.prefetch:
            return to_device(next(self.loader), self.device, non_blocking=self.pin)
        torch.cuda.current_stream(self.device).wait_stream(self.stream)
        batch = self.ready
        _record_stream(batch, torch.cuda.current_stream(self.device))
        self._copy_next()
        return batch


def _record_stream(batch: Any, stream: Any) -> None:
    """Tell the allocator that the step's stream uses tensors the side stream allocated."""
    if isinstance(batch, torch.Tensor):
        batch.record_stream(stream)
    elif isinstance(batch, (list, tuple)):
        for x in batch:
            _record_stream(x, stream)
    elif isinstance(batch, dict):
        for x in batch.values():
            _record_stream(x, stream)
