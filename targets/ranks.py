"""One rank of a torchrun job: joining its process group, its device, and the test-only fault hook.

Target-agnostic: the rank worker (``targets.rank_worker``) joins here and hands the RankContext to
the target's ``build_ranked``; a target that needs more process groups (haste-rec's embedding
exchanges) makes them from the context. Every collective runs under the group's timeout, so a rank
that dies or stops answering becomes an error on the others instead of a hang. NCCL on CUDA, gloo
on the CPU.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from targets.protocol import ConfigError

TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
FAULT_ENV = "SG_OPT_RANK_FAULT"  # testing only: exit|hang:RANK:STEP (see fault_of)


@dataclass(frozen=True)
class RankContext:
    """Where this rank runs, once the job's default process group is joined."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str
    timeout: timedelta  # of every collective; give any further process group the same


def pick_device(local_rank: int, device: str = "auto") -> torch.device:
    """cuda:local_rank when CUDA is there (or asked for: "cuda" or "cuda:N", whose index the rank
    replaces), else the CPU."""
    if device == "cpu" or (device == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if device != "auto" and not device.startswith("cuda"):
        raise ConfigError(f"unknown device {device!r}; use cpu or cuda")
    if not torch.cuda.is_available():
        raise ConfigError("device cuda was asked for, but CUDA is not available on this machine")
    if local_rank >= torch.cuda.device_count():
        raise ConfigError(f"rank {local_rank} needs CUDA device {local_rank}, but torch sees only "
                          f"{torch.cuda.device_count()} on this machine: ask for fewer ranks")
    return torch.device("cuda", local_rank)


def join(timeout_s: float, device: str = "auto") -> RankContext:
    """Initialise the default process group of this torchrun worker."""
    missing = [name for name in TORCHRUN_ENV if name not in os.environ]
    if missing:
        raise ConfigError(f"a ranked run starts under torchrun (python -m torch.distributed.run), which "
                          f"sets {', '.join(missing)}")
    rank, world, local = (int(os.environ[name]) for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))
    where = pick_device(local, device)
    backend = "nccl" if where.type == "cuda" else "gloo"
    if where.type == "cuda":
        torch.cuda.set_device(where)
    timeout = timedelta(seconds=timeout_s)
    dist.init_process_group(backend, timeout=timeout)
    return RankContext(rank, world, local, where, backend, timeout)


def leave() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def fault_of(spec: str | None, rank: int) -> tuple[str, int] | None:
    """(exit or hang, the step before which) this rank fails on purpose, or None; for tests that check a
    dead or silent rank fails the job instead of hanging it."""
    if not spec:
        return None
    kind, _, rest = spec.partition(":")
    who, _, step = rest.partition(":")
    if kind not in ("exit", "hang") or not who.isdigit() or not step.isdigit():
        raise ConfigError(f"a rank fault is exit:RANK:STEP or hang:RANK:STEP, not {spec!r}")
    return (kind, int(step)) if int(who) == rank else None


def inject_fault(session, rank: int) -> None:
    """Make this rank's session fail on purpose before its STEP-th step (warm-up included) when the
    environment asks (``FAULT_ENV``, set by tests only); otherwise leave it alone."""
    fault = fault_of(os.environ.get(FAULT_ENV), rank)
    if fault is None:
        return
    kind, at = fault
    step, done = session.step, [0]

    def faulty_step():
        if done[0] == at:
            fail_on_purpose(kind)
        done[0] += 1
        return step()

    session.step = faulty_step


def fail_on_purpose(kind: str) -> None:
    """exit: die with status 1 and no clean-up, as a crash; hang: stay alive but silent, so that only the
    other ranks' collective timeout (or the caller's time limit) ends the job."""
    if kind == "exit":
        os._exit(1)
    while True:
        time.sleep(60)
