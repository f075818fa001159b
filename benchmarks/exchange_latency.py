"""How long the exchange with a timing worker takes: the parent's window around a command against the worker's own.

A side-by-side block's time is the parent's, from its run command to the answer (``validators.ab_runner``), so
whatever the exchange costs is added to both sides' every block. This prints, for drains (no steps) and for runs of
2 and 20 steps, the parent's window, the worker's perf_counter window and the sum of its per-step times (CUDA
events on a GPU).

    python benchmarks/exchange_latency.py --device cpu     # SG_OPT_FORK_SERVER=0: plain subprocesses
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from targets.worker_protocol import WorkerRequest
from validators.timing_worker import TimingWorker


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--target", default="haste-rec")
    parser.add_argument("--size", default="tiny")
    args = parser.parse_args()
    spec = WorkerRequest(target=args.target, size=args.size, mode="bench", warmup=1, device=args.device)
    commands = [{"cmd": "drain"}] * 3 + [{"cmd": "run", "steps": n, "drain": False} for n in (2, 2, 2, 20, 20)]
    with tempfile.TemporaryDirectory(prefix="sg-opt-exchange-") as folder:
        worker = TimingWorker(spec, "worker", Path(folder) / "request.json", None)
        try:
            worker.ready_line(time.monotonic() + 600)
            print(f"{'command':<8} {'steps':>5} {'parent ms':>10} {'worker ms':>10} {'steps ms':>9}")
            for command in commands:
                start = time.perf_counter()
                worker.send(command)
                answer = worker.receive(time.monotonic() + 120, command["cmd"])
                parent = time.perf_counter() - start
                print(f"{command['cmd']:<8} {command.get('steps', 0):>5} {parent * 1e3:>10.1f} "
                      f"{answer.get('timed_s', 0.0) * 1e3:>10.1f} {sum(answer.get('step_s', [])) * 1e3:>9.1f}")
            worker.send({"cmd": "quit"})
        finally:
            worker.close(graceful=True)


if __name__ == "__main__":
    main()
