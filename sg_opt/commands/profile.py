"""`sg-opt profile`: where a configuration's step time goes, phases to kernel slots."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from sg_opt.cli_common import (CONFIG_OPT, DATA_OPT, DEVICE_OPT, JSON_OPT, RANKS_OPT, SET_OPT, SIZE_OPT, TARGET_OPT,
                               THREADS_OPT, TIMEOUT_OPT, Working, check_result, console, inputs)

def profile(
    target: str = TARGET_OPT, size: str = SIZE_OPT, config: Optional[str] = CONFIG_OPT,
    set_: list[str] = SET_OPT, data: Optional[str] = DATA_OPT, device: str = DEVICE_OPT,
    fine: bool = typer.Option(False, "--fine", help="also time the kernel slots on the real shapes against "
                                                    "measured device ceilings"),
    trace: Optional[str] = typer.Option(None, "--trace", help="write the Chrome/Perfetto trace here"),
    steps: int = typer.Option(10, min=1, help="profiled steps (and as many unprofiled, before and after)"),
    warmup: int = typer.Option(5, min=0, help="untimed steps first"),
    threads: Optional[int] = THREADS_OPT, ranks: int = RANKS_OPT, timeout: float = TIMEOUT_OPT,
    as_json: bool = JSON_OPT,
) -> None:
    """Where the step time goes: phases, top ops, kernel slots on the roofline, ranked findings. With --ranks,
    every rank is profiled: the slowest rank's profile, each rank's phases and its share of collectives.

    Example: sg-opt profile --size large --device cuda --fine --trace trace.json
    Example: sg-opt profile --size tiny --ranks 2
    """
    from profilers.client import run_profile
    from profilers.records import ProfileRequest
    from sg_opt.profile_view import render

    overrides = inputs(target, size, config, set_, data, ranks)
    req = ProfileRequest(target=target, size=size, config=overrides, data=data, device=device, warmup=warmup,
                         threads=threads, ranks=ranks, profile_steps=steps, fine=fine,
                         trace=str(Path(trace).resolve()) if trace else None)
    on = f"{ranks} ranks on {device}" if ranks > 1 else device
    with Working(f"profiling {target} @ {size} on {on} ..."):
        result = run_profile(req, timeout_s=timeout)
    if as_json:
        print(result.model_dump_json(indent=1))
    check_result(result)
    if not as_json:
        render(result, console)
