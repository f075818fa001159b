"""Where a worker's set-up time goes: one build of haste-rec at a size, stage by stage.

Every candidate the agent evaluates costs several fresh worker processes (numerics run, two A/B
pairs), so set-up time, not step time, bounds how many candidates fit in a run at size large.
This times the stages a worker goes through, with the device synchronised after each, then builds once
more in the same process: the difference is what the first build spent importing lazily (on the 2-core
CPU VM at tiny, 1.5 s of a 1.5 s build: torch.optim's first optimizer imports torch._dynamo):

    python benchmarks/build_cost.py --size large --device cuda [--set embedding_grad_mode=fused]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time

T0 = time.perf_counter()
import torch  # noqa: E402

from targets.haste_rec.target import TARGET  # noqa: E402
from targets.worker import sync_device  # noqa: E402

IMPORTED = time.perf_counter()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="small")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--set", action="append", default=[], help="knob=value")
    parser.add_argument("--profile-build", type=int, default=0, metavar="N",
                        help="print the N functions the first build spent the most time in (cProfile, cumulative)")
    args = parser.parse_args()
    device = torch.device(args.device)
    patch = {k: TARGET.knob_space[k].parse(v) for k, v in (s.split("=", 1) for s in args.set)}
    config = TARGET.knob_space.resolve(patch)
    print(f"imports {IMPORTED - T0:.2f} s")
    marks = [("start", time.perf_counter())]

    def mark(name: str) -> None:
        sync_device(device)
        marks.append((name, time.perf_counter()))
        print(f"{name:<22} {marks[-1][1] - marks[-2][1]:7.2f} s")

    torch.zeros(1, device=device)
    mark("device context")
    profiler = cProfile.Profile() if args.profile_build else None
    if profiler is not None:
        profiler.enable()
    session = TARGET.build(config, args.size, {}, device, 0)
    mark("build")
    if profiler is not None:
        profiler.disable()
        pstats.Stats(profiler, stream=sys.stdout).sort_stats("cumulative").print_stats(args.profile_build)
    session.step()
    mark("first step")
    for _ in range(5):
        session.step()
    mark("5 more steps")
    session.probe()
    mark("probe")
    session.param_digest()
    mark("param digest")
    del session
    TARGET.build(config, args.size, {}, device, 0)  # what the first build spent on lazy imports, it skips
    mark("build again")
    print(f"total {marks[-1][1] - T0:.2f} s (imports included)")


if __name__ == "__main__":
    main()
