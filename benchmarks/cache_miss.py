"""Misses of the embedding row cache at equal device memory: uniform vs frequency-planned budget split.

SparseGear claims that a per-table cache plan with the optimizer state cached independently cuts the sparse miss
rate by over half at the same HBM budget. This script tests that through the trainer's real cache code on the CPU
(miss counts do not depend on timing): it plans on one window of batches, replays a later, disjoint window through
one ``RowCache`` per table (a warm-up, then the measured batches) and counts misses per lookup, a lookup being one
distinct row of one table in one batch (the trainer's ``miss_rate``). Splits, at each total budget:

- uniform: every table the same share of its rows (``cache_plan.plan_uniform``), the state riding in its slots;
- planned: the same total ranked by measured access counts (``cache_plan.plan_by_frequency``), the state riding;
- planned + own state: the state in its own caches, as small as the code allows (one batch's rows per table), and
  the device bytes that frees given to planned parameter rows (state rows are 4 bytes, parameter rows 4 * dim).

Workloads: ``trainer`` is the trainer's own synthetic data at ``--size``, floors by the trainer's rule (a batch's
ids all distinct). ``production`` is a set of tables that differ as production ones do: 12 tables, rows spaced
log-evenly from 10^4 to 2*10^6 (times ``--scale``), Zipf exponents spread over 0.6-1.3 and DLRM-style lookups per
sample (six one-hot tables, multi-hot ones of 2-64 ids), exponents and poolings dealt to tables by seeded
permutations, so size, skew and traffic are uncorrelated. Ids come from the trainer's generator
(``SyntheticData``) with ``feature_signal`` 0, so each table's ids follow its Zipf law exactly; floors are the most
distinct rows a planning batch held, plus 25% (the trainer's rule would reserve 1.5 * batch * pooling rows, more
than the 1% budget here).

The ceiling (production only: its id laws are known exactly): with independent draws, a static cache of each
table's truly most probable rows misses least for a given split, and the globally most probable rows (with the
same floors and total) is the best split of all. Expected misses of the uniform, the planner's and that best split
tell whether a 50% cut is there to be had and whether the planner gets it. ``--draws`` gives the best split's cut
for other seeded deals of the production tables' exponents and poolings: it depends on the mix. Warm-up: a flat
table's share fills slowly, so the production replay warms 2048 batches (the "filled" column says how full).

    PYTHONPATH=. python benchmarks/cache_miss.py [--workload trainer|production] [--quick] [--size small]
        [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from targets.haste_rec.cache.cache_plan import plan_by_frequency, plan_uniform
from targets.haste_rec.cache.row_cache import RowCache
from targets.haste_rec.data.data import SyntheticData, SyntheticSpec, count_id_accesses, seeded_generator
from targets.haste_rec.sizes import SIZES

VERSION = 1
BUDGETS = {"trainer": (0.05, 0.10, 0.20), "production": (0.01, 0.02, 0.05, 0.10)}
EVICTIONS = ("lru", "lfu")
SPLITS = ("uniform", "planned", "planned+own-state")
HELDOUT_START = 100_000  # replayed batches come from far past the planning window
# the production tables, before --scale and the seeded deal of exponents and poolings to tables
PROD_TABLES, PROD_ROWS, PROD_ROWS_DECADES = 12, 10_000, math.log10(200)
PROD_ZIPF = (0.6, 1.3)
PROD_POOLING = (1, 1, 1, 1, 1, 1, 2, 4, 8, 16, 32, 64)
PROD_BATCH, PROD_DIM = 512, 128
FLOOR_HEADROOM = 1.25
CPU = torch.device("cpu")


@dataclass
class Workload:
    name: str
    table_rows: list[int]
    table_zipf: list[float]
    pooling: list[int]
    batch_size: int
    dim: int                          # parameter row = 4 * dim bytes, row-wise Adagrad state = 4 bytes
    floors: list[int]                 # rows each table's cache must hold: one batch's distinct rows
    plan_counts: list[torch.Tensor]   # accesses per row over the planning window
    heldout: list[list[torch.Tensor]]  # per replayed batch, per table: sorted distinct rows; warm-up first
    warm: int


def production_tables(seed: int, scale: float) -> tuple[list[int], list[float], list[int], int]:
    """(rows, Zipf exponents, pooling, batch size) of the production workload's deal `seed`."""
    rows = [max(100, round(scale * PROD_ROWS * 10 ** (PROD_ROWS_DECADES * t / (PROD_TABLES - 1))))
            for t in range(PROD_TABLES)]
    lo, hi = PROD_ZIPF
    spread = [round(lo + (hi - lo) * t / (PROD_TABLES - 1), 3) for t in range(PROD_TABLES)]
    gen = seeded_generator(seed, "production-tables")
    zipf = [spread[i] for i in torch.randperm(PROD_TABLES, generator=gen).tolist()]
    pooling = [PROD_POOLING[i] for i in torch.randperm(PROD_TABLES, generator=gen).tolist()]
    return rows, zipf, pooling, max(8, round(scale * PROD_BATCH))


def distinct_rows(data: SyntheticData, start: int, count: int) -> list[list[torch.Tensor]]:
    return [[torch.unique(ids) for ids in data.train_batch(i).ids] for i in range(start, start + count)]


def build_workload(args: argparse.Namespace) -> Workload:
    if args.workload == "trainer":
        size = SIZES[args.size]
        rows, zipf, pooling, batch = list(size.table_rows), list(size.table_zipf), list(size.pooling), size.batch_size
        spec = dict(num_labels=size.num_labels, num_clusters=size.num_clusters, num_dense=size.num_dense,
                    heldout_size=size.heldout_size)
        dim = size.embedding_dim
    else:
        rows, zipf, pooling, batch = production_tables(args.seed, args.scale)
        spec = dict(num_labels=1024, num_clusters=16, num_dense=1, feature_signal=0.0)
        dim = PROD_DIM
    data = SyntheticData(SyntheticSpec(table_rows=tuple(rows), table_zipf=tuple(zipf), pooling=tuple(pooling),
                                       batch_size=batch, seed=args.seed, **spec))
    plan = [data.train_batch(i) for i in range(args.plan_batches)]
    if args.workload == "trainer":  # the trainer's rule (model.cache_plan_inputs): bags are pooling +- 50%
        floors = [min(r, batch * (p + p // 2)) for r, p in zip(rows, pooling)]
    else:
        most = [max(torch.unique(b.ids[t]).numel() for b in plan) for t in range(len(rows))]
        floors = [min(r, math.ceil(FLOOR_HEADROOM * m)) for r, m in zip(rows, most)]
    heldout = distinct_rows(data, HELDOUT_START, args.warm_batches + args.measure_batches)
    return Workload(args.workload, rows, zipf, pooling, batch, dim, floors, count_id_accesses(plan, rows), heldout,
                    args.warm_batches)


def own_state_split(work: Workload, fraction: float) -> tuple[list[int], list[int]]:
    """(parameter, state) rows per table when the state has its own caches at their floors and the bytes the
    riding split spends on state go to planned parameter rows: the largest planned split that fits them."""
    riding = sum(plan_uniform(work.table_rows, fraction, work.floors))
    param_budget = (riding * (work.dim + 1) - sum(work.floors)) // work.dim  # the riding bytes less the state's
    lo, hi = fraction, 1.0
    for _ in range(50):  # plan totals grow with the fraction: bisect for the largest that fits
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if sum(plan_uniform(work.table_rows, mid, work.floors)) <= param_budget else (lo, mid)
    return plan_by_frequency(work.plan_counts, lo, work.floors), list(work.floors)


def _caches(work: Workload, capacities: list[int], eviction: str) -> list[RowCache]:
    return [RowCache(torch.zeros(rows, 1), cap, eviction, CPU) for rows, cap in zip(work.table_rows, capacities)]


def replay(work: Workload, capacities: list[int], eviction: str, state_caps: list[int] | None = None) -> dict:
    """Counts over the measured batches of per-table RowCaches warmed by the warm-up batches: parameter misses
    and lookups, state misses (riding: the parameters'), bytes moved both ways, slots filled when measuring began."""
    params = _caches(work, capacities, eviction)
    states = [] if state_caps is None else _caches(work, state_caps, eviction)
    filled = 0.0
    for i, batch in enumerate(work.heldout):
        if i == work.warm:
            filled = sum(c.filled for c in params) / sum(capacities)
            for cache in params + states:
                cache.hits = cache.misses = cache.bytes_h2d = cache.bytes_d2h = 0
        for t, rows in enumerate(batch):
            params[t].prepare(rows)          # the lookup
            if states:
                states[t].prepare(rows)      # the update's state (the update's parameter prepare only hits)
    moves = sum(c.bytes_h2d + c.bytes_d2h for c in params) / 4  # rows moved; the host rows are one fp32 wide
    state_moves = moves if not states else sum(c.bytes_h2d + c.bytes_d2h for c in states) / 4
    lookups = sum(c.hits + c.misses for c in params)
    misses = sum(c.misses for c in params)
    return {"lookups": lookups, "misses": misses, "miss_rate": misses / lookups,
            "state_miss_rate": misses / lookups if not states else sum(c.misses for c in states) / lookups,
            "bytes_per_lookup": 4 * (moves * work.dim + state_moves) / lookups, "filled": filled,
            "param_rows": sum(capacities), "state_rows": sum(capacities if state_caps is None else state_caps)}


def presence(rows: list[int], zipf: list[float], pooling: list[int], batch: int) -> list[torch.Tensor]:
    """Per table, by rank: the probability that a batch looks the row up. ``zipf_ranks`` draws rank k with
    probability G(k + 1) - G(k), G(k) = ((k + 1)^(1 - s) - 1) / ((n + 1)^(1 - s) - 1) (log(k + 1) / log(n + 1) at
    s = 1); a batch draws about batch * pooling ids, so a row is in it with probability
    1 - exp(-batch * pooling * p)."""
    out = []
    for n, s, pool in zip(rows, zipf, pooling):
        edges = torch.arange(1, n + 2, dtype=torch.float64)
        slope = 1.0 - s
        cdf = torch.log(edges) if abs(slope) < 1e-9 else torch.expm1(slope * torch.log(edges))
        out.append(-torch.expm1(-batch * pool * torch.diff(cdf / cdf[-1])))
    return out


def static_miss_rates(present: list[torch.Tensor], floors: list[int], splits: dict[str, list[int]]) -> dict:
    """Expected misses / lookup of static caches holding each table's most probable rows, under each of `splits`
    and under the best split of the same total and floors (every table's floor, then the globally most probable
    of the other rows): with independent draws no cache of that many rows misses less."""
    lookups = sum(float(q.sum()) for q in present)
    rates = {name: 1 - sum(float(q[:c].sum()) for q, c in zip(present, caps)) / lookups
             for name, caps in splits.items()}
    spare = sum(next(iter(splits.values()))) - sum(floors)
    rest = torch.sort(torch.cat([q[f:] for q, f in zip(present, floors)]), descending=True).values[:max(0, spare)]
    rates["best"] = 1 - (sum(float(q[:f].sum()) for q, f in zip(present, floors)) + float(rest.sum())) / lookups
    return rates | {"best_cut": 1 - rates["best"] / rates["uniform"]}


def analytic_cuts(seed: int, scale: float, budgets: tuple[float, ...]) -> list[float]:
    """The best static split's cut of the uniform split's misses for the production deal `seed`, per budget;
    floors 1.25 times a batch's expected distinct rows (the measured floors' rule, in expectation)."""
    rows, zipf, pooling, batch = production_tables(seed, scale)
    present = presence(rows, zipf, pooling, batch)
    floors = [min(n, math.ceil(FLOOR_HEADROOM * float(q.sum()))) for n, q in zip(rows, present)]
    return [static_miss_rates(present, floors, {"uniform": plan_uniform(rows, f, floors)})["best_cut"]
            for f in budgets]


def measure(work: Workload, budgets: tuple[float, ...]) -> list[dict]:
    present = presence(work.table_rows, work.table_zipf, work.pooling, work.batch_size) \
        if work.name == "production" else None
    results = []
    for fraction in budgets:
        uniform = plan_uniform(work.table_rows, fraction, work.floors)
        planned = plan_by_frequency(work.plan_counts, fraction, work.floors)
        own_params, own_states = own_state_split(work, fraction)
        runs = {e: {"uniform": replay(work, uniform, e), "planned": replay(work, planned, e),
                    "planned+own-state": replay(work, own_params, e, own_states)} for e in EVICTIONS}
        results.append({"budget": fraction, "uniform_caps": uniform, "planned_caps": planned,
                        "own_state_caps": {"params": own_params, "states": own_states}, "replay": runs,
                        "static": None if present is None else
                        static_miss_rates(present, work.floors, {"uniform": uniform, "planned": planned})})
    return results


def markdown(work: Workload, results: list[dict], draws: dict[int, list[float]] | None) -> list[str]:
    all_rows = sum(work.table_rows)
    lines = ["| budget | eviction | split | param rows | state rows | misses / lookup | vs uniform "
             "| state misses / lookup | bytes / lookup | filled |", "|" + " --- |" * 10]
    for r in results:
        for eviction, runs in r["replay"].items():
            base = runs["uniform"]["miss_rate"]
            for split in SPLITS:
                x = runs[split]
                lines.append(f"| {r['budget']:.0%} ({x['param_rows'] / all_rows:.2%}) | {eviction} | {split} "
                             f"| {x['param_rows']} | {x['state_rows']} | {x['miss_rate']:.4f} "
                             f"| {x['miss_rate'] / base - 1:+.1%} | {x['state_miss_rate']:.4f} "
                             f"| {x['bytes_per_lookup']:.0f} | {x['filled']:.0%} |")
    if results[0]["static"] is not None:
        lines += ["", "Ceiling: expected misses / lookup of static caches of each table's truly most probable rows "
                  "(from the generator's Zipf laws), under the uniform split, the planner's split and the best "
                  "split of the same total and floors; then the cuts vs uniform, static and replayed.", "",
                  "| budget | uniform | planner's split | best split | best cut | planner's cut, static "
                  "| planned cut, LRU | planned cut, LFU |", "|" + " --- |" * 8]
        for r in results:
            c, runs = r["static"], r["replay"]
            cut = {e: 1 - runs[e]["planned"]["miss_rate"] / runs[e]["uniform"]["miss_rate"] for e in EVICTIONS}
            lines.append(f"| {r['budget']:.0%} | {c['uniform']:.4f} | {c['planned']:.4f} | {c['best']:.4f} "
                         f"| {c['best_cut']:.1%} | {1 - c['planned'] / c['uniform']:.1%} | {cut['lru']:.1%} "
                         f"| {cut['lfu']:.1%} |")
    if draws:
        lines += ["", f"The best static cut vs uniform over {len(draws)} seeded deals of the production tables' "
                  "exponents and poolings (analytic, floors 1.25 x a batch's expected distinct rows; seed "
                  f"{min(draws)} is the workload above):", "",
                  "| budget | min | median | max | deals with a cut >= 50% |", "|" + " --- |" * 5]
        for b, r in enumerate(results):
            cuts = [d[b] for d in draws.values()]
            lines.append(f"| {r['budget']:.0%} | {min(cuts):.1%} | {statistics.median(cuts):.1%} | {max(cuts):.1%} "
                         f"| {sum(c >= 0.5 for c in cuts)} of {len(cuts)} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="trainer", choices=("trainer", "production"))
    parser.add_argument("--size", default="small", choices=sorted(SIZES), help="workload trainer: its size")
    parser.add_argument("--scale", type=float, default=1.0, help="workload production: rows and batch times this")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--plan-batches", type=int, default=64, help="training batches whose counts plan the split")
    parser.add_argument("--warm-batches", type=int, help="held-out batches that fill the caches first (trainer 32, "
                        "production 2048: a flat table's share fills slowly)")
    parser.add_argument("--measure-batches", type=int, default=128, help="held-out batches whose misses count")
    parser.add_argument("--draws", type=int, default=20, help="workload production: seeded deals in the analytic "
                        "ceiling (0: none)")
    parser.add_argument("--quick", action="store_true", help="16 planning, 8 warm-up and 24 measured batches")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    if args.warm_batches is None:
        args.warm_batches = 32 if args.workload == "trainer" else 2048
    if args.quick:
        args.plan_batches, args.warm_batches, args.measure_batches = 16, 8, 24
    torch.set_num_threads(1)  # the replay is many small host-side operations
    start = time.perf_counter()
    work = build_workload(args)
    budgets = BUDGETS[args.workload]
    print(f"workload {work.name}{f' {args.size}' if work.name == 'trainer' else f' x{args.scale:g}'}: "
          f"{len(work.table_rows)} tables, batch {work.batch_size}, dim {work.dim}, seed {args.seed}\n")
    print("| table | rows | zipf | ids / sample | floor | planning accesses |\n|" + " --- |" * 6)
    for t, (rows, s, pool, floor, c) in enumerate(zip(work.table_rows, work.table_zipf, work.pooling, work.floors,
                                                      work.plan_counts)):
        print(f"| {t} | {rows} | {s:g} | {pool} | {floor} | {int(c.sum())} |")
    print(f"\nplanned on training batches [0, {args.plan_batches}); replayed batches {HELDOUT_START}+ "
          f"({args.warm_batches} warm-up, {args.measure_batches} measured). Budget: share of all "
          f"{sum(work.table_rows)} rows (in brackets the parameter rows' actual share: floors raise small tables); "
          f"every split of a budget takes the same device bytes. A lookup is one distinct row of a table in a batch; "
          f"bytes / lookup counts rows loaded and written back; filled: parameter slots holding a row when the "
          f"measurement began.\n")
    results = measure(work, budgets)
    draws = None
    if work.name == "production" and args.draws:
        draws = {seed: analytic_cuts(seed, args.scale, budgets) for seed in range(args.seed, args.seed + args.draws)}
    print("\n".join(markdown(work, results, draws)))
    elapsed = time.perf_counter() - start
    print(f"\n({elapsed:.1f} s)")
    if args.json:
        args.json.write_text(json.dumps({
            "version": VERSION, "workload": work.name, "args": {k: str(v) for k, v in vars(args).items()},
            "tables": {"rows": work.table_rows, "zipf": work.table_zipf, "pooling": work.pooling,
                       "floors": work.floors}, "batch_size": work.batch_size, "dim": work.dim,
            "results": results, "analytic_best_cuts": draws, "seconds": elapsed}, indent=1))


if __name__ == "__main__":
    main()
