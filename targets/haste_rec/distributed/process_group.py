"""The process groups of the distributed trainer: the job's (``targets.ranks``) plus one for the embeddings.

The embedding exchanges get a process group of their own: DDP launches its bucketed all-reduces
asynchronously during the same backward that sends pooled gradients to the table owners, and
collectives of one group must be issued in the same order on every rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from targets import ranks
from targets.ranks import leave  # noqa: F401 - the trainer's entry point leaves through here


@dataclass(frozen=True)
class RankContext:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str
    embedding_group: Any  # the process group of the embedding all-to-alls


def with_embedding_group(job: ranks.RankContext) -> RankContext:
    """This rank's context for a ShardedSession, once the job's default group is joined (collective)."""
    group = dist.new_group(backend=job.backend, timeout=job.timeout)
    return RankContext(job.rank, job.world_size, job.local_rank, job.device, job.backend, group)


def join(timeout_s: float, device: str = "auto") -> RankContext:
    """Join torchrun's process group (with a collective timeout) and make the embedding group."""
    return with_embedding_group(ranks.join(timeout_s, device))
