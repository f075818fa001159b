"""Scaling of the reference trainer over GPUs: step time, throughput per GPU and the communication share.

For each size, config and sharding plan, one `sg-opt` bench worker per number of ranks (the ranked one
under torchrun, NCCL on GPUs): the step time is each step's SLOWEST rank, the throughput per GPU is
global batch / step time / ranks, and the exchange share is the synchronised phase times of the
collectives (input_dist, output_dist, tail_dist, loss_sync: waits for the slowest rank included) over
the step's phase total.
The backward's reverse exchanges run inside "backward"; a ranked profile (``--profile``) gives their
share as NCCL kernel time. With ``--numerics`` each plan's 2-rank training is also checked against the
single-process trajectory within the reorder class (at ``--numerics-size``).

    python benchmarks/scaling.py --sizes large --ranks 1 2 --plans table-wise/replicated \\
        row-wise/replicated table-wise/label-groups --set embedding_grad_mode=fused --out scaling.json

Writes JSON and prints a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from targets.haste_rec.knobs import KNOB_SPACE
from targets.worker_client import run_worker
from targets.worker_protocol import WorkerRequest
from validators.numerics import compare

EXCHANGE_PHASES = ("input_dist", "output_dist", "tail_dist", "loss_sync")


def parse_sets(items: list[str]) -> dict:
    return {k: KNOB_SPACE[k].parse(v) for k, v in (item.split("=", 1) for item in items)}


def plan_config(plan: str) -> dict:
    embedding, _, tail = plan.partition("/")
    return {"embedding_sharding": embedding, "tail_sharding": tail or "replicated"}


def bench(size: str, config: dict, ranks: int, args) -> dict:
    req = WorkerRequest(target="haste-rec", size=size, mode="bench", config=config, device=args.device,
                        steps=args.steps, warmup=args.warmup, phase_steps=args.phase_steps, ranks=ranks)
    start = time.perf_counter()
    result = run_worker(req, timeout_s=args.timeout)
    row = {"size": size, "ranks": ranks, "config": config, "wall_s": round(time.perf_counter() - start, 1)}
    if not result.ok:
        return {**row, "failure": f"{result.failure.kind}: {result.failure.message}"}
    b = result.bench
    step = statistics.median(b.step_s)
    phases = b.phase_s
    total = sum(phases.values())
    exchange = sum(v for k, v in phases.items() if k in EXCHANGE_PHASES)
    return {**row, "step_ms": 1e3 * step, "samples_per_step": b.samples_per_step,
            "samples_per_s_per_gpu": b.samples_per_step / step / ranks,
            "rank_median_ms": [1e3 * m for m in (b.rank_median_s or [step])],
            "phase_ms": {k: 1e3 * v for k, v in phases.items()},
            "exchange_share_of_phases": exchange / total if total else None,
            "counters": b.counters}


def profile(size: str, config: dict, ranks: int, args) -> dict:
    from profilers.client import run_profile
    from profilers.records import ProfileRequest

    req = ProfileRequest(target="haste-rec", size=size, config=config, device=args.device, ranks=ranks,
                         warmup=args.warmup, profile_steps=args.profile_steps)
    result = run_profile(req, timeout_s=args.timeout)
    if not result.ok:
        return {"failure": f"{result.failure.kind}: {result.failure.message}"}
    data = result.model_dump(include={"ranks", "notes", "findings"})
    data["findings"] = [f"{f['category']}: {f['evidence']}" for f in data.get("findings", [])[:5]]
    return data


def numerics(size: str, config: dict, args) -> dict:
    runs = {}
    for ranks in (1, 2):
        req = WorkerRequest(target="haste-rec", size=size, mode="numerics", config=config, device=args.device,
                            steps=args.numerics_steps, ranks=ranks)
        runs[ranks] = run_worker(req, timeout_s=args.timeout)
        if not runs[ranks].ok:
            return {"ok": False, "detail": f"{ranks} rank(s): {runs[ranks].failure.message}"}
    verdict = compare(runs[1].numerics, runs[2].numerics, "reorder")
    return {"ok": verdict.ok, "detail": verdict.detail}


def _unsharded(row: dict) -> tuple[str, str]:
    """A row's size and config without the sharding plan: what its one-GPU row shares with it."""
    return row["size"], json.dumps({k: v for k, v in row["config"].items() if "sharding" not in k}, sort_keys=True)


def table(rows: list[dict]) -> str:
    lines = ["| size | config | ranks | step ms (slowest rank) | samples/s per GPU | scaling | exchange share | "
             "numerics vs 1 rank |", "|---|---|---|---|---|---|---|---|"]
    single = {_unsharded(r): r for r in rows if r["ranks"] == 1 and "step_ms" in r}
    for r in rows:
        shown = ", ".join(f"{k}={v}" for k, v in KNOB_SPACE.diff(KNOB_SPACE.resolve(r["config"])).items()) or "defaults"
        if "failure" in r:
            lines.append(f"| {r['size']} | {shown} | {r['ranks']} | failed: {r['failure'][:120]} | | | | |")
            continue
        one = single.get(_unsharded(r))
        scaling = f"x{r['samples_per_s_per_gpu'] * r['ranks'] / one['samples_per_s_per_gpu']:.2f}" if one else "-"
        share = f"{100 * r['exchange_share_of_phases']:.0f}%" if r.get("exchange_share_of_phases") is not None else "-"
        num = r.get("numerics")
        num_text = "-" if num is None else ("ok" if num["ok"] else "BROKEN") + f" ({num['detail'][:80]})"
        lines.append(f"| {r['size']} | {shown} | {r['ranks']} | {r['step_ms']:.1f} | {r['samples_per_s_per_gpu']:.0f} "
                     f"| {scaling} | {share} | {num_text} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", nargs="+", default=["tiny"])
    p.add_argument("--ranks", nargs="+", type=int, default=[1, 2])
    p.add_argument("--plans", nargs="+", default=["table-wise/replicated"],
                   help="embedding_sharding/tail_sharding pairs for the ranked runs")
    p.add_argument("--set", action="append", default=[], help="knob=value for every run (repeatable)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--phase-steps", type=int, default=5)
    p.add_argument("--profile", action="store_true", help="also a ranked profile of each multi-rank run")
    p.add_argument("--profile-steps", type=int, default=5)
    p.add_argument("--numerics", action="store_true", help="check each plan: 2 ranks vs 1 within reorder")
    p.add_argument("--numerics-size", default="small")
    p.add_argument("--numerics-steps", type=int, default=20)
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    base = parse_sets(args.set)
    rows = []
    for size in args.sizes:
        for ranks in args.ranks:
            for plan in (["table-wise/replicated"] if ranks == 1 else args.plans):
                config = {**base, **plan_config(plan)}
                row = bench(size, config, ranks, args)
                if ranks > 1 and args.profile and "failure" not in row:
                    row["profile"] = profile(size, config, ranks, args)
                if ranks > 1 and args.numerics and size == args.sizes[0]:
                    row["numerics"] = numerics(args.numerics_size, config, args)
                rows.append(row)
                print(json.dumps({k: v for k, v in row.items() if k not in ("counters", "profile")}), flush=True)
                if args.out:  # after every row: a run cut short keeps what it measured
                    with open(args.out, "w") as f:
                        json.dump(rows, f, indent=1)
    print(table(rows))


if __name__ == "__main__":
    main()
