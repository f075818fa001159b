"""Step times of a compiled-encoder session from its first step: does a transient follow the compile?

In the `large-cached` TPE oracle on an H200 (2026-12-04) every timing side with the compiled encoder, host tables
and no loader workers ran its first one to three blocks at 725-800 ms a step, then 50-100 ms. The likely cause is
inductor's pool of compile processes (one per CPU), which starts at the first Triton kernel and imports torch in
every process beside the steps; workers now compile with one thread (``targets.worker_client.WORKER_ENV``). This
builds one session in this process, as a worker does, and prints each step's time, the processes below this
one and the recompilations dynamo counted, with the inductor threads the environment gives (run it once with
TORCHINDUCTOR_COMPILE_THREADS=1 and once without to compare):

    python benchmarks/compile_transient.py --size large-cached --device cuda --steps 60 \
        --set embedding_placement=host --set embedding_grad_mode=sparse --set pin_memory=true
"""

from __future__ import annotations

import argparse
import json
import os
import time

from targets.worker import build_session, open_device, sync_device
from targets.worker_client import descendants
from targets.worker_protocol import WorkerRequest


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="tiny")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--set", action="append", default=[], metavar="KNOB=VALUE",
                        help="a knob value as TOML would write it (true, 2, \"host\" or host)")
    args = parser.parse_args()
    config = {"compile_encoder": True}
    for item in args.set:
        knob, _, value = item.partition("=")
        try:
            config[knob] = json.loads(value)
        except json.JSONDecodeError:
            config[knob] = value
    req = WorkerRequest(target="haste-rec", size=args.size, mode="bench", config=config, device=args.device)
    device = open_device(req)
    _, _, _, session = build_session(req, device, None)
    from torch._dynamo.utils import counters
    from torch._inductor import config as inductor
    print(f"inductor compile threads {inductor.decide_compile_threads()}", flush=True)
    began = time.perf_counter()
    for step in range(args.steps):
        start = time.perf_counter()
        session.step()
        sync_device(device)
        now = time.perf_counter()
        print(f"step {step:3d} at {now - began:6.1f} s: {1e3 * (now - start):8.1f} ms, "
              f"{len(descendants(os.getpid()))} processes below, {sum(counters['recompiles'].values())} recompiles",
              flush=True)


if __name__ == "__main__":
    main()
