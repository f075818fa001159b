"""Joining the job's process group from torchrun's environment.

Every collective runs under the group's timeout, so a rank that dies or stops answering becomes an
error on the others (and torchrun, seeing a failed worker, stops the job) instead of a hang. NCCL on
CUDA, gloo on the CPU. The embedding exchanges get a process group of their own: DDP launches its
bucketed all-reduces asynchronously during the same backward that sends pooled gradients to the table
owners, and collectives of one group must be issued in the same order on every rank.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from targets.protocol import ConfigError

TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class RankContext:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str
    embedding_group: Any  # the process group of the embedding all-to-alls


def pick_device(local_rank: int, device: str = "auto") -> torch.device:
    """cuda:local_rank when CUDA is there (or asked for), else the CPU."""
    if device == "cpu" or (device == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ConfigError("device cuda was asked for, but CUDA is not available on this machine")
    return torch.device("cuda", local_rank)


def join(timeout_s: float, device: str = "auto") -> RankContext:
    """Initialise the default process group (and the embedding group) of this torchrun worker."""
    missing = [name for name in TORCHRUN_ENV if name not in os.environ]
    if missing:
        raise ConfigError(f"the distributed trainer runs under torchrun (python -m torch.distributed.run), which "
                          f"sets {', '.join(missing)}")
    rank, world, local = (int(os.environ[name]) for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))
    where = pick_device(local, device)
    backend = "nccl" if where.type == "cuda" else "gloo"
    if where.type == "cuda":
        torch.cuda.set_device(where)
    timeout = timedelta(seconds=timeout_s)
    dist.init_process_group(backend, timeout=timeout)
    return RankContext(rank, world, local, where, backend, dist.new_group(backend=backend, timeout=timeout))


def leave() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
