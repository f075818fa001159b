"""How long a config's session takes to build and to step, in this process, with the stacks of every thread
printed every --stacks seconds: what a worker that never gets ready is doing.

A worker builds its session out of sight of the agent, which only sees it time out; this builds the same session
(``targets.haste_rec.target.build``) where faulthandler can show where the time goes. ``--numerics`` runs the
worker's numerics request instead (``targets.worker.execute``: deterministic algorithms, the steps, probe and
parameter digest a candidate's validation runs), and prints its times.

    python benchmarks/session_build.py --size large-cached --device cuda \
        --set embedding_placement=cached --set embedding_grad_mode=fused [--steps 40] [--stacks 60] [--numerics]
"""

from __future__ import annotations

import argparse
import faulthandler
import sys
import time

import torch

from sg_opt.config import build_overrides
from targets.haste_rec.target import TARGET, build
from targets.worker import execute
from targets.worker_protocol import WorkerRequest


def _synced(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="large-cached")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--set", action="append", default=[], dest="sets", help="knob=value, as sg-opt's --set")
    parser.add_argument("--steps", type=int, default=40, help="steps timed one by one after the build")
    parser.add_argument("--stacks", type=float, default=60.0, help="seconds between stack dumps (0: none)")
    parser.add_argument("--numerics", action="store_true", help="run the worker's numerics request of --steps steps")
    args = parser.parse_args(argv)
    if args.stacks > 0:
        faulthandler.dump_traceback_later(args.stacks, repeat=True, file=sys.stderr)
    overrides = build_overrides(TARGET.knob_space, None, args.sets)
    if args.numerics:
        return _numerics(args, overrides)
    device = torch.device(args.device)
    config = TARGET.knob_space.resolve(overrides)
    begin = time.perf_counter()
    session = build(config, args.size, {}, device)
    built = _synced(device)
    print(f"built in {built - begin:.1f} s; counters: "
          + ", ".join(f"{k} {v:g}" for k, v in session.counters().items() if not k.startswith("cache_rows_t")))
    times = []
    for _ in range(args.steps):
        start = _synced(device)
        session.step()
        times.append(_synced(device) - start)
    ms = [f"{t * 1e3:.1f}" for t in times]
    print(f"{args.steps} steps, ms each: {' '.join(ms)}")
    print("counters after: " + ", ".join(f"{k} {v:g}" for k, v in session.counters().items()
                                        if not k.startswith("cache_rows_t")))
    faulthandler.cancel_dump_traceback_later()
    return 0


def _numerics(args: argparse.Namespace, overrides: dict) -> int:
    result = execute(WorkerRequest(target="haste-rec", size=args.size, mode="numerics", config=overrides,
                                   device=args.device, steps=args.steps))
    faulthandler.cancel_dump_traceback_later()
    if not result.ok:
        print(f"failed after {result.wall_s:.1f} s: {result.failure.message}\n{result.failure.detail}")
        return 1
    stages = ", ".join(f"{name} {seconds:.1f} s" for name, seconds in result.numerics.stage_s.items())
    print(f"numerics run of {args.steps} steps: {result.wall_s:.1f} s, of which the build {result.build_s:.1f} s, "
          f"{stages}; final loss {result.numerics.losses[-1]:.6g}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
