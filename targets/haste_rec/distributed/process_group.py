"""The process groups of the distributed trainer: the job's (``targets.ranks``) plus one for the embeddings.

The embedding exchanges get a process group of their own: DDP launches its bucketed all-reduces
asynchronously during the same backward that sends pooled gradients to the table owners, and
collectives of one group must be issued in the same order on every rank.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import torch.distributed as dist

from targets import ranks


@dataclass(frozen=True)
class RankContext(ranks.RankContext):
    """The job's rank context plus the process group of the embedding all-to-alls."""

    embedding_group: Any = None


def with_embedding_group(job: ranks.RankContext) -> RankContext:
    """This rank's context for a ShardedSession, once the job's default group is joined (collective)."""
    group = dist.new_group(backend=job.backend, timeout=job.timeout)
    return RankContext(**{f.name: getattr(job, f.name) for f in fields(job)}, embedding_group=group)


def join(timeout_s: float, device: str = "auto") -> RankContext:
    """Join torchrun's process group (with a collective timeout) and make the embedding group."""
    return with_embedding_group(ranks.join(timeout_s, device))
