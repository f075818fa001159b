"""A candidate kernel file judged whole: the static check of ``validators.source`` first (a rejected file never
runs), then ``validators.kernel.check_kernel`` on the same text in a confined subprocess
(``validators.kernel_worker``).

A module of its own because it is the one caller of both halves: the worker runs the in-process check, and this
starts the worker, so neither of those imports the other's caller.
"""

from __future__ import annotations

from pathlib import Path

from validators import kernel_worker
from validators.kernel import KernelVerdict
from validators.source import check_source


def validate_kernel_file(target_name: str, slot_name: str, path: str, device: str, dtype: str,
                         timeout_s: float, *, seed: int | None = None, allow_tf32: bool = False,
                         max_flops: float | None = None) -> KernelVerdict:
    """Static check of the file, then (only if it passes) ``check_kernel`` on the same text in a subprocess.

    ``timeout_s`` covers the whole child, including its torch import (about 2 s). ``seed`` defaults to
    a fresh random one, so the candidate cannot know its inputs or ragged shapes in advance.
    """
    try:
        source = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        return KernelVerdict(ok=False, slot=slot_name, check="load", device=device, dtype=dtype,
                             reason=f"cannot read kernel file {path} ({exc}).")
    static = check_source(source, slot_name)
    if not static.ok:
        return KernelVerdict(ok=False, slot=slot_name, check="source", device=device, dtype=dtype,
                             reason=static.message, source=static)
    # looked up on the module at each call, so a test can put a guard in the launcher's place
    verdict = kernel_worker.run_kernel_check(target_name, slot_name, source, device, dtype, timeout_s, seed=seed,
                                             allow_tf32=allow_tf32, max_flops=max_flops)
    verdict.source = static
    return verdict
