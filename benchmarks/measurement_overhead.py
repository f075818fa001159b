"""Where an A/A measurement's wall time goes: its workers' start-up, its blocks, and closing them.

At `large-cached` on an H200 (2026-12-03) the agent's A/A runs of an incumbent with two loader workers took 56 s,
of which 13-15 s until the workers were ready and about 25 s of block medians times steps; 16 s were unaccounted
for, where runs without loader workers left 3-5 s. This runs one short A/A measurement of each configuration given
(``--config`` files, ``-`` for the defaults) with the side-by-side runner the agent uses and prints its split:

    python benchmarks/measurement_overhead.py --size large-cached --device cuda --config best.toml --config -
"""

from __future__ import annotations

import argparse

from sg_opt.config import load_config_file
from targets.worker_protocol import WorkerRequest
from validators.speedup import measure_ab


def split(config: dict, size: str, device: str, blocks: int, steps: int, block_s: float, timeout_s: float) -> str:
    """One A/A run of `config`: a line with its wall time and where it went."""
    spec = WorkerRequest(target="haste-rec", size=size, mode="bench", config=config, device=device)
    r = measure_ab(spec, spec, blocks, steps, timeout_s, "a1", "a2", block_seconds=block_s)
    if r.failure is not None:
        return f"failed ({r.failure.kind}): {r.failure.message}"
    ready = max(r.a.ready_s or 0.0, r.b.ready_s or 0.0)
    rest = r.wall_s - ready - r.blocks_s - r.close_s
    return (f"wall {r.wall_s:.1f} s: workers ready {ready:.1f}, blocks {r.blocks_s:.1f} (medians x steps "
            f"{r.medians_s:.1f}), closing {r.close_s:.1f}, the rest {rest:.1f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="tiny")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--config", action="append", default=[], help="a TOML of knob values; - for the defaults")
    parser.add_argument("--blocks", type=int, default=4, help="blocks a side")
    parser.add_argument("--steps", type=int, default=3, help="steps a block, at least")
    parser.add_argument("--block-seconds", type=float, default=0.3, help="the least a block lasts (the agent's)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds the measurement may take")
    args = parser.parse_args()
    for path in args.config or ["-"]:
        config = {} if path == "-" else load_config_file(path)
        line = split(config, args.size, args.device, args.blocks, args.steps, args.block_seconds, args.timeout)
        print(f"{path}: {line}", flush=True)


if __name__ == "__main__":
    main()
