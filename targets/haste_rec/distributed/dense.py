"""The data-parallel dense part: the encoder and the HASTE output layer, replicated on every rank and
wrapped in DistributedDataParallel; under tail_sharding label-groups the tail holds only this rank's
groups, which DDP leaves out (``sharded_tail.py``: their owner trains them over the global batch).

They are built from the single-process model's own pieces, in its order and from its seeds, so every
replica starts equal to the single-process model. Each rank's loss is its SHARE of the global loss
(its samples' BCE sum over the global batch size), so the global gradient is the SUM of the ranks'
gradients: DDP runs a summing all-reduce hook instead of its default average. That is exact for any
split of the batch, also an uneven one, and leaves the pooled gradients sent to the table owners
unscaled.
"""

from __future__ import annotations

import contextlib
import inspect
from itertools import chain
from typing import TYPE_CHECKING, Any, Callable, Mapping

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from targets.haste_rec.model import Encoder, ModelShape, label_layout, tail_kernel_config
from targets.haste_rec.sizes import HasteRecSize
from targets.haste_rec.tail.haste import HasteOutput, check_backend_device

if TYPE_CHECKING:
    from targets.haste_rec.distributed.sharded_tail import LabelGroupTail


def _no_phase(name: str):
    return contextlib.nullcontext()


class DenseTower(nn.Module):
    """[pooled | dense features] -> encoder -> logits [B, internal columns] (head, then tail groups).

    With a label-group-sharded tail (``gather_hidden`` given) it returns instead the pair (head logits
    [this rank's samples, n_head], this rank's groups' logits [global batch, its groups * G])."""

    def __init__(self, encoder: Encoder, output: HasteOutput, shape: ModelShape, compute_dtype: torch.dtype,
                 phase: Callable = _no_phase, gather_hidden: Callable | None = None):
        super().__init__()
        self.encoder, self.output, self.shape = encoder, output, shape
        self.compute_dtype, self.phase = compute_dtype, phase
        self.encode: Callable = encoder  # torch.compile may replace it (the module stays the parameter owner)
        self.gather_hidden = gather_hidden  # (h of this rank's samples, samples per rank) -> h of the global batch

    def forward(self, pooled: torch.Tensor, dense: torch.Tensor,
                samples: list[int] | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """`samples`: the batch's samples per rank, which the label-group tail's all-gather needs."""
        with self.phase("encoder"):
            h = self.encode(torch.cat([pooled, dense], dim=1).to(self.compute_dtype))
        with self.phase("head"):
            head = self.output.head_logits(h)
        if self.gather_hidden is None:
            with self.phase("tail"):
                tail = self.output.tail_logits(h)
            return torch.cat([head, tail], dim=1)
        with self.phase("tail_dist"):
            everyone = self.gather_hidden(h[:, :self.output.tail_dims], samples)
        with self.phase("tail"):
            return head, self.output.tail_logits(everyone)


def build_tower(data, size: HasteRecSize, config: Mapping[str, Any], kernels: Mapping[str, Callable],
                device: torch.device, seed: int, phase: Callable = _no_phase,
                tail: LabelGroupTail | None = None) -> DenseTower:
    """The encoder and output layer as HasteRecModel builds them (the equivalence test guards that the
    two stay in step), in the precision the config asks for; with `tail` (label-groups), the output
    layer holds only the tail groups this rank owns and the tower computes them over the global batch."""
    check_backend_device(config["tail_backend"], device)
    shape = ModelShape.resolve(config, size)
    torch.manual_seed(seed)
    encoder = Encoder(size.num_tables * size.embedding_dim + size.num_dense, size.encoder_hidden,
                      size.hidden).to(device)
    head, groups = label_layout(data, config["grouping"], shape, seed, size.batch_size)
    output = HasteOutput(size.hidden, size.hidden, head, groups, shape.fan_in, backend=config["tail_backend"],
                         kernels=kernels, seed=seed, kernel_config=tail_kernel_config(config),
                         groups_owned=None if tail is None else tail.owned(groups.shape[0])).to(device)
    compute_dtype = torch.bfloat16 if config["precision"] == "bf16" else torch.float32
    if config["precision"] == "bf16":
        encoder.to(torch.bfloat16)
        output.to(torch.bfloat16)
    tower = DenseTower(encoder, output, shape, compute_dtype, phase,
                       gather_hidden=None if tail is None else tail.gather_hidden)
    if config["compile_encoder"]:
        tower.encode = torch.compile(encoder)
    return tower


# No buffer broadcast at each forward: torch 2.13 names the switch forward_sync_buffers, deprecating
# broadcast_buffers, which older releases (the GPU image's 2.11) know alone.
NO_BUFFER_SYNC = ({"forward_sync_buffers": False}
                  if "forward_sync_buffers" in inspect.signature(DistributedDataParallel.__init__).parameters
                  else {"broadcast_buffers": False})


def sum_allreduce_hook(group, bucket):
    """DDP comm hook: the bucket's gradients summed over the ranks (DDP's default divides by the world size).

    Unannotated on purpose: DDP checks the annotations against the classes, and this module's
    postponed annotations would be strings."""
    work = dist.all_reduce(bucket.buffer(), group=group, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


def owned_tail_state(tower: DenseTower) -> list[str]:
    """Names of the tail's parameters and buffers (weight, bias, fan-in index) in the tower."""
    return [name for name, _ in chain(tower.named_parameters(), tower.named_buffers())
            if name.startswith("output.tail_")]


def data_parallel(tower: DenseTower, device: torch.device) -> DistributedDataParallel:
    """DDP over the tower with summed gradients. Buffers are not broadcast each step: the only one that
    changes, the tail's fan-in index, is rewired identically on every rank (same generator, same weights).
    A label-group-sharded tail is left out of DDP: its groups differ by rank and are trained by their owner."""
    if tower.gather_hidden is not None:
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(tower, owned_tail_state(tower))
    ddp = DistributedDataParallel(tower, device_ids=[device.index] if device.type == "cuda" else None,
                                  **NO_BUFFER_SYNC)
    ddp.register_comm_hook(None, sum_allreduce_hook)
    return ddp
