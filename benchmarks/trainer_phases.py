"""Step time per phase of the reference trainer, through the real worker, as a Markdown table.

    python -m benchmarks.trainer_phases --size small --device cpu
    python -m benchmarks.trainer_phases --size large --device cuda --set precision=bf16
"""

from __future__ import annotations

import argparse
import json
import sys

from sg_opt.bench import bench, step_summary
from sg_opt.config import build_overrides
from targets.registry import resolve_target


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="haste-rec")
    parser.add_argument("--size", default="small")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--set", action="append", default=[], dest="sets")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--phase-steps", type=int, default=10)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--json-out", default=None, help="also write the worker result here")
    args = parser.parse_args(argv)
    overrides = build_overrides(resolve_target(args.target).knob_space, None, args.sets)
    result = bench(args.target, args.size, overrides, args.device, args.steps, args.warmup, args.phase_steps,
                   timeout_s=3600, threads=args.threads)
    if args.json_out:
        with open(args.json_out, "w") as f:
            f.write(result.model_dump_json(indent=1))
    if not result.ok:
        print(f"failed: {result.failure.kind}: {result.failure.message}\n{result.failure.detail}", file=sys.stderr)
        return 1
    data, env = result.bench, result.environment
    s = step_summary(data.step_s)
    print(f"\n{args.target} @ {args.size}, {env.device} ({env.device_name}), torch {env.torch}, "
          f"{env.threads} threads, config {json.dumps(overrides) if overrides else 'baseline'}")
    print(f"step median {s['median_ms']:.2f} ms (p10 {s['p10_ms']:.2f}, p90 {s['p90_ms']:.2f}) over "
          f"{len(data.step_s)} steps; {data.samples_per_step / (s['median_ms'] / 1e3):,.0f} samples/s\n")
    total = sum(data.phase_s.values())
    print("| phase | ms / step | share |\n|---|---|---|")
    for name, sec in data.phase_s.items():
        print(f"| {name} | {1e3 * sec:.2f} | {100 * sec / total:.0f}% |")
    print(f"| **sum (synchronised pass)** | **{1e3 * total:.2f}** | |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
