"""Launch the distributed reference trainer under torchrun; rank 0 writes one JSON result.

    python -m torch.distributed.run --standalone --nproc_per_node 2 \\
        -m targets.haste_rec.distributed.train --size tiny --steps 20 --out result.json

The JSON holds the global loss per step, per rank its tables, samples, loss shares and step times
(and, with --phase-times, seconds per phase), with --numerics the NumericsData record the numerics
gate compares (loss and grad norms per step, probe, parameter norms), with --quality P@k and PSP@k. A config the trainer
cannot run is a ConfigError: one sentence on stderr and exit status 2 on every rank.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

import torch
import torch.distributed as dist

from targets.haste_rec.distributed.plan import ShardingPlan
from targets.haste_rec.distributed.process_group import join
from targets.haste_rec.distributed.session import ShardedSession
from targets.haste_rec.knobs import KNOB_SPACE
from targets.haste_rec.target import training_data
from targets.protocol import ConfigError
from targets.ranks import fail_on_purpose, fault_of, leave


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="targets.haste_rec.distributed.train", description=__doc__.split("\n")[0])
    p.add_argument("--size", default="tiny")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data", default=None, help="an extreme-classification file instead of synthetic data")
    p.add_argument("--set", action="append", default=[], metavar="KNOB=VALUE",
                   help="a knob of haste-rec (repeatable); the sharding plan is the knobs embedding_sharding and "
                        "tail_sharding")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    p.add_argument("--timeout-s", type=float, default=120.0,
                   help="collective timeout: a rank that stops answering fails the job after this long")
    p.add_argument("--numerics", action="store_true",
                   help="record grad norms per step, probe and parameter norms (one CPU thread per rank)")
    p.add_argument("--quality", action="store_true", help="P@k and PSP@k on the held-out split after training")
    p.add_argument("--phase-times", action="store_true", help="time every phase (synchronises the device at each)")
    p.add_argument("--out", default=None, help="where rank 0 writes the JSON result")
    p.add_argument("--fault", default=None, metavar="exit|hang:RANK:STEP",
                   help="testing: before step STEP, rank RANK exits with status 1 (exit) or stops answering "
                        "(hang), to check that the job fails instead of hanging")
    return p.parse_args(argv)


def resolve_config(sets: list[str]) -> dict[str, Any]:
    overrides = {}
    for item in sets:
        name, sep, text = item.partition("=")
        if not sep:
            raise ConfigError(f"--set takes KNOB=VALUE, not {item!r}")
        overrides[name.strip()] = KNOB_SPACE[name.strip()].parse(text)
    return KNOB_SPACE.resolve(overrides)


def _run(session: ShardedSession, steps: int, fault: tuple[str, int] | None) -> dict[str, list]:
    """Train `steps` steps: the global loss, this rank's share and its wall seconds per step."""
    record: dict[str, list] = {"losses": [], "local_losses": [], "step_s": [], "grad_norms": []}
    for step in range(steps):
        if fault is not None and step == fault[1]:
            fail_on_purpose(fault[0])
        start = time.perf_counter()
        loss = float(session.step())  # float() waits for the step
        record["step_s"].append(time.perf_counter() - start)
        record["losses"].append(loss)
        record["local_losses"].append(session.local_loss)
        record["grad_norms"].append(session.grad_norms())
    return record


def train(args: argparse.Namespace) -> dict[str, Any] | None:
    """Every rank trains; rank 0 returns the job's result, the others None."""
    config = resolve_config(args.set)
    data, size = training_data(args.size, args.seed, args.data)
    # checked before the process group exists, so that a config error never waits on a peer
    plan = ShardingPlan(int(os.environ.get("WORLD_SIZE", "1")), size.num_tables, config["embedding_sharding"],
                        config["tail_sharding"])
    fault = fault_of(args.fault, int(os.environ.get("RANK", "0")))
    ctx = join(args.timeout_s, args.device)
    if args.numerics and ctx.device.type == "cpu":
        torch.set_num_threads(1)  # as the worker's numerics mode: bitwise repeatable CPU reductions
    session = ShardedSession(data, size, config, {}, plan, ctx, args.seed)
    session.record_grad_norms = args.numerics
    session.timer.timing = args.phase_times
    record = _run(session, args.steps, fault)
    numerics = None
    if args.numerics:
        numerics = {"losses": record["losses"], "grad_norms": record["grad_norms"], "probe": session.probe(),
                    "digest": session.param_digest(), "counters": session.counters()}
    quality = session.quality() if args.quality else None
    mine = {"rank": ctx.rank, "device": str(ctx.device), "tables": plan.tables_of(ctx.rank),
            "samples": session.samples[ctx.rank], "local_losses": record["local_losses"], "step_s": record["step_s"],
            "phase_s": {k: v / max(args.steps, 1) for k, v in session.timer.take().items()},
            "counters": session.counters()}
    ranks: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(ranks, mine)
    if ctx.rank != 0:
        return None
    return {"size": size.name, "steps": args.steps, "seed": args.seed, "world_size": ctx.world_size,
            "backend": ctx.backend, "global_batch": size.batch_size, "plan": plan.to_dict(),
            "config": KNOB_SPACE.diff(config), "losses": record["losses"], "ranks": ranks, "numerics": numerics,
            "quality": quality}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        result = train(args)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    finally:
        leave()
    if result is not None:
        text = json.dumps(result, indent=1)
        if args.out:
            with open(args.out, "w") as f:
                f.write(text + "\n")
        else:
            print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
