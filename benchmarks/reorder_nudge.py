"""How far the baseline drifts from itself when nudged by one fp32 rounding once (before the first step) or
before every step, and what each reorder calibration says of a few reorder-class candidates.

The agent's calibration (``validators.numerics.calibrate_reorder``) nudges before every step, as a kernel that
sums in another order differs by a rounding at every step; this script shows what that changes on a workload.

Usage: python benchmarks/reorder_nudge.py --size small --steps 20 [--device cpu]
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from targets.worker import FP32_UNIT_ROUNDOFF, build_session, make_deterministic, open_device, run_numerics
from targets.worker_protocol import NumericsData, WorkerRequest
from validators.numerics import calibrate_reorder, compare

CANDIDATES = {"fused embedding updates": {"embedding_grad_mode": "fused"}, "slot tail": {"tail_backend": "slots"}}


def numerics(size: str, device: str, steps: int, config: dict[str, Any], nudge: str) -> NumericsData:
    """A numerics run in this process: deterministic ("none"), nudged once, or nudged before every step."""
    req = WorkerRequest(target="haste-rec", size=size, device=device, mode="numerics", steps=steps, threads=1,
                        config=config, reassociate=nudge == "every step")
    dev = open_device(req)
    make_deterministic(dev)
    _, _, _, session = build_session(req, dev)
    if nudge == "once":
        session.perturb(FP32_UNIT_ROUNDOFF, req.seed + 1)
    return run_numerics(session, req)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="small")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    base = numerics(args.size, args.device, args.steps, {}, "none")
    runs = {name: numerics(args.size, args.device, args.steps, cfg, "none") for name, cfg in CANDIDATES.items()}
    out = {}
    for nudge in ("once", "every step"):
        cal = calibrate_reorder(base, numerics(args.size, args.device, args.steps, {}, nudge))
        out[nudge] = {"largest step drift": max(cal.step_drift), "scale": cal.scale, "set by": cal.quantity,
                      **{name: compare(base, run, "reorder", reorder=cal).detail for name, run in runs.items()}}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
