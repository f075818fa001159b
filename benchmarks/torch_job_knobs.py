"""The job adapter's generic knobs on the DLRM-style example, one at a time and combined: each config's step time
(median of timed steps after a warm-up, ``targets.worker.time_steps``: CUDA events on a GPU) and its numerics
against the baseline's under the class its knobs declare (``validators.numerics.compare``).

    python benchmarks/torch_job_knobs.py --device cuda --size small [--threads 2] [--steps 60] [--findings]

``--findings`` first prints the findings of the baseline's coarse profile: the causes the agent would read.

The timings are of one process after another, not side by side: a table of where each knob stands, not a
verdict (``sg-opt bench --vs`` gives one).
"""

from __future__ import annotations

import argparse
import statistics

import torch

from examples.dlrm.job import target
from profilers.coarse import profile_session
from profilers.findings import findings
from targets.worker import run_numerics, time_steps
from targets.worker_protocol import NumericsData, WorkerRequest
from validators.numerics import compare

CONFIGS = [
    {}, {"optimizer_impl": "foreach"}, {"optimizer_impl": "fused"}, {"data_workers": 1}, {"metrics_every": 10},
    {"pin_memory": True, "prefetch_to_device": True}, {"compile": "default"}, {"cuda_graphs": True},
    {"tf32": True}, {"precision": "bf16-autocast"},
    {"optimizer_impl": "fused", "data_workers": 1},
    {"optimizer_impl": "fused", "data_workers": 1, "pin_memory": True, "prefetch_to_device": True,
     "metrics_every": 10},
    {"optimizer_impl": "fused", "cuda_graphs": True, "pin_memory": True, "prefetch_to_device": True,
     "metrics_every": 10},
    {"sparse_embedding_grads": True}, {"sparse_embedding_grads": True, "embedding_fusion": True},
    {"sparse_embedding_grads": True, "optimizer_impl": "fused", "data_workers": 1},
]
CUDA_ONLY = ("cuda_graphs", "pin_memory", "prefetch_to_device", "tf32")
ORDER = ("exact", "reorder", "precision", "model")


def declared(config: dict) -> str:
    space = target.knob_space
    return max((space[k].numerics_of(v) for k, v in config.items()), key=ORDER.index, default="exact")


def fingerprint(config: dict, size: str, device: str, steps: int) -> NumericsData:
    session = target.build(target.knob_space.resolve(config), size, {}, device, 0)
    return run_numerics(session, WorkerRequest(target=target.name, size=size, mode="numerics", steps=steps))


def print_findings(size: str, device: str) -> None:
    config = target.knob_space.resolve({})
    profile = profile_session(target.build(config, size, {}, device, 0), device, warmup=5, steps=5)
    for f in findings(profile, None, {}, config, target):
        print(f"- {f.category} (x{f.amdahl_gain:.2f}, attacked by {', '.join(f.knob_categories or [])}): "
              f"{f.evidence}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--size", default="small")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--numerics-steps", type=int, default=20)
    parser.add_argument("--findings", action="store_true")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    if args.findings:
        print_findings(args.size, args.device)
    base = fingerprint({}, args.size, args.device, args.numerics_steps)
    print(f"| config | step ms | vs baseline | class | numerics |\n|---|---|---|---|---|")
    first = None
    for config in CONFIGS:
        if device.type != "cuda" and any(k in CUDA_ONLY for k in config):
            continue
        session = target.build(target.knob_space.resolve(config), args.size, {}, args.device, 0)
        for _ in range(args.warmup + session.banked_steps):
            session.step()
        step_s, _ = time_steps(session, device, args.steps)
        ms = 1e3 * statistics.median(step_s)
        first = first or ms
        cls = declared(config)
        if cls == "model":  # judged by held-out quality in a run, not by its trajectory
            said = "judged by quality"
        else:
            verdict = compare(base, fingerprint(config, args.size, args.device, args.numerics_steps), cls)
            said = f"{'ok' if verdict.ok else 'BROKEN'}: {verdict.detail[:90]}"
        name = ", ".join(f"{k}={v}" for k, v in config.items()) or "baseline"
        print(f"| {name} | {ms:.2f} | x{first / ms:.2f} | {cls} | {said} |", flush=True)


if __name__ == "__main__":
    main()
