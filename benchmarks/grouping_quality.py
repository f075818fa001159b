"""P@k and PSP@k of the HASTE tail's label groupings (random, frequency, semantic) after a short
training of the reference trainer, each run in its own worker at a fixed seed.

    python -m benchmarks.grouping_quality --size small --steps 1000 --seeds 0 1 --set embedding_grad_mode=fused
"""

from __future__ import annotations

import argparse
import sys

from sg_opt.config import parse_sets
from targets.haste_rec.knobs import KNOB_SPACE
from targets.worker_client import run_worker
from targets.worker_protocol import WorkerRequest

GROUPINGS = ("random", "frequency", "semantic")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="small")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--set", action="append", default=[], dest="sets",
                        help="knob=value applied to every run (e.g. a faster embedding_grad_mode)")
    args = parser.parse_args(argv)
    common = parse_sets(args.sets, KNOB_SPACE)
    print(f"| grouping | seed | P@1 | P@3 | P@5 | PSP@1 | PSP@5 | final loss |\n|---|---|---|---|---|---|---|---|")
    for grouping in GROUPINGS:
        for seed in args.seeds:
            req = WorkerRequest(target="haste-rec", size=args.size, mode="quality", config={**common, "grouping": grouping},
                                steps=args.steps, seed=seed, device=args.device, threads=args.threads)
            result = run_worker(req, timeout_s=3600)
            if not result.ok:
                print(f"{grouping}: {result.failure.kind}: {result.failure.message}", file=sys.stderr)
                return 1
            m = result.quality.metrics
            print(f"| {grouping} | {seed} | {m['P@1']:.4f} | {m['P@3']:.4f} | {m['P@5']:.4f} | {m['PSP@1']:.4f} | "
                  f"{m['PSP@5']:.4f} | {result.quality.final_loss:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
