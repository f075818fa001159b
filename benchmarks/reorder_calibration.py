"""How far a workload carries a rounding-sized difference: the reorder calibration the agent runs at
baseline time, on its own.

Runs the config's numerics twice in fresh workers, once deterministic and once reassociated from
dense parameters nudged by one fp32 rounding, and prints ``validators.numerics.calibrate_reorder``:

    python benchmarks/reorder_calibration.py --size small --steps 20 [--device cuda] [--set knob=value]
"""

from __future__ import annotations

import argparse

from targets.registry import resolve_target
from targets.worker_client import run_worker
from targets.worker_protocol import WorkerRequest
from validators.numerics import calibrate_reorder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="haste-rec")
    parser.add_argument("--size", default="small")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--set", action="append", default=[], help="knob=value")
    args = parser.parse_args()
    space = resolve_target(args.target).knob_space
    config = {k: space[k].parse(v) for k, v in (s.split("=", 1) for s in args.set)}
    runs = []
    for nudged in (False, True):
        req = WorkerRequest(target=args.target, size=args.size, mode="numerics", steps=args.steps, config=config,
                            device=args.device, threads=args.threads, reassociate=nudged)
        result = run_worker(req, timeout_s=1800)
        if not result.ok:
            raise SystemExit(f"the {'nudged' if nudged else 'deterministic'} run failed: {result.failure.message}")
        runs.append(result.numerics)
    calibration = calibrate_reorder(*runs)
    print(f"{args.target} @ {args.size} on {args.device}, {args.steps} steps: {calibration.detail}")


if __name__ == "__main__":
    main()
