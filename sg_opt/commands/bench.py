"""`sg-opt bench`: time one configuration's steps in a worker, or two side by side with ``--vs``."""

from __future__ import annotations

from typing import Optional

import typer

from sg_opt.cli_common import (CONFIG_OPT, DATA_OPT, DEVICE_OPT, JSON_OPT, RANKS_OPT, SET_OPT, SIZE_OPT, TARGET_OPT,
                               THREADS_OPT, TIMEOUT_OPT, Working, check_result, console, fail, fail_workload,
                               inputs)
from targets.protocol import ConfigError

def bench(
    target: str = TARGET_OPT, size: str = SIZE_OPT, config: Optional[str] = CONFIG_OPT,
    set_: list[str] = SET_OPT, data: Optional[str] = DATA_OPT, device: str = DEVICE_OPT,
    steps: int = typer.Option(20, min=1, help="timed steps"),
    warmup: int = typer.Option(5, min=0, help="untimed steps first"),
    phase_steps: int = typer.Option(5, min=0, help="steps of the synchronised per-phase pass"),
    threads: Optional[int] = THREADS_OPT, ranks: int = RANKS_OPT, timeout: float = TIMEOUT_OPT,
    as_json: bool = JSON_OPT,
    vs: Optional[str] = typer.Option(None, "--vs", help="a second config (TOML) to measure side by side against "
                                                        "this one: interval and verdict"),
    blocks: int = typer.Option(20, min=2, help="--vs: interleaved blocks per side (even; as many as optimize's "
                                               "final measurement)"),
    block_steps: int = typer.Option(5, min=1, help="--vs: steps per block (at least)"),
    block_seconds: float = typer.Option(0.3, "--block-seconds", min=0.0, help="--vs: the least a block lasts, "
                                        "as in the agent's measurements (0: --block-steps alone)"),
    floor: Optional[float] = typer.Option(None, min=0.0, help="--vs: noise floor (default: A/A calibration)"),
    save: Optional[str] = typer.Option(None, "--save", help="also take the numerics fingerprint and save both, with "
                                                            "the environment, to this JSON file for "
                                                            "`sg-opt gate --baseline`"),
) -> None:
    """Time training steps of one target config in a worker process (or two, side by side, with --vs).

    Example: sg-opt bench --size small --set embedding_grad_mode=fused --vs examples/haste_rec_hand_tuned.toml
    """
    from sg_opt.bench import bench as run_bench, render
    from sg_opt.saved_baseline import SaveFailed, check_writable

    overrides = inputs(target, size, config, set_, data, ranks)
    if save is not None:
        if vs is not None:
            fail("--save keeps the figures of one config; drop --vs")
        try:
            check_writable(save)
        except ConfigError as exc:
            fail(str(exc))
    if vs is not None:
        _bench_vs(target, size, overrides, inputs(target, size, vs, [], data), data, device, warmup, threads,
                  ranks, timeout, blocks, block_steps, block_seconds, floor, as_json)
        return
    on = f"{ranks} ranks on {device}" if ranks > 1 else device
    with Working(f"benchmarking {target} @ {size} on {on} ..."):
        try:
            result = run_bench(target, size, overrides, device, steps, warmup, phase_steps, timeout, threads, data,
                               save, ranks)
        except SaveFailed as exc:
            fail(str(exc), code=1)
    if as_json:
        print(result.model_dump_json(indent=1))
    check_result(result)
    if not as_json:
        render(result, console)
        if save is not None:
            console.print(f"saved the step times, numerics fingerprint and environment to {save}")


def _bench_vs(target: str, size: str, incumbent: dict, candidate: dict, data: str | None, device: str, warmup: int,
              threads: int | None, ranks: int, timeout: float, blocks: int, block_steps: int, block_seconds: float,
              floor: float | None, as_json: bool) -> None:
    from sg_opt.compare import compare, render
    from targets.worker_protocol import WorkerRequest
    from validators.speedup import CalibrationFailed

    if blocks % 2:
        fail("--blocks must be even, so that each side runs first equally often")
    spec = dict(target=target, size=size, mode="bench", data=data, device=device, warmup=warmup, threads=threads,
                ranks=ranks)
    with Working("calibrating the noise floor (A/A), then measuring side by side ...") as working:
        try:
            result, noise = compare(WorkerRequest(config=incumbent, **spec), WorkerRequest(config=candidate, **spec),
                                    blocks, block_steps, timeout, floor, block_seconds,
                                    progress=working.note)
        except CalibrationFailed as exc:  # the incumbent itself failed during calibration
            if exc.failure is None:
                fail(str(exc), code=1)
            fail_workload("the noise floor could not be set", exc.failure)
        except RuntimeError as exc:  # e.g. a side that ran another spec than asked
            fail(str(exc), code=1)
    if as_json:
        print(result.model_dump_json(indent=1))
    if result.failure is not None:
        fail_workload("the comparison failed", result.failure)
    if not as_json:
        render(result, noise, console)
