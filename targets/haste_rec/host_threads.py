"""The trainer's intra-op CPU threads, as a knob: the worker's count (``auto``), half of it or a quarter.

torch's CPU ops split their work over an OpenMP team and wait at each parallel region's end for its slowest
thread. When the team has a thread on every CPU, any other busy thread (a loader worker, the CUDA driver's, a
pinning or write-back thread, the profiler's) takes a CPU from one of them, and every region then waits for that
thread's next time slice: on the 32-core host of two H200s (2026-11-29) haste-rec @ large with 32 threads stepped
in 216 ms median (336 ms p90, bimodal), with 16 or 8 in 117 ms; on the 16-core H200 host, where a GPU worker takes
all 16 (``targets.worker.CUDA_HOST_THREADS``), a large-cached profile's data ops ran 10-40x slower than in the
profile before (2026-12-03). Fewer threads leave CPUs to the rest, and parallelise each host op less.

The setting only ever lowers the count it finds, so a numerics run's single CPU thread stays single.
"""

from __future__ import annotations

import torch

HOST_THREADS = ("auto", "half", "quarter")
_DIVISOR = {"auto": 1, "half": 2, "quarter": 4}


def threads_for(setting: str, current: int) -> int:
    """The intra-op thread count ``setting`` asks for, given the count the worker set."""
    if setting not in _DIVISOR:
        raise ValueError(f"unknown host_threads {setting!r}; one of {', '.join(HOST_THREADS)}")
    return max(1, current // _DIVISOR[setting])


def apply_host_threads(setting: str) -> None:
    """Lower this process's intra-op threads as ``setting`` asks (before the session builds its loader, which
    leaves its workers a core each from there)."""
    torch.set_num_threads(threads_for(setting, torch.get_num_threads()))
