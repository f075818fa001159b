"""Triton embedding kernels against nn.EmbeddingBag and the store's torch path, timed in one run.

    python -m benchmarks.embedding_kernels --out embedding_kernels.json           # CUDA, the full shape
    python -m benchmarks.embedding_kernels --smoke --out smoke.json               # tiny, CPU, Triton interpreter
    python -m benchmarks.embedding_kernels --tune --out embedding_kernels.json    # also sweep the kernel knobs

Shape: 26 tables x 1M rows x 128 dims, pooling 20, batch 8192, fp32 (slot shape keys T B P R D Q;
Q = 151,124, the expected distinct count of 163,840 uniform draws from 1M rows, so the byte models
are exact). A second, skewed shape (``--hot-q`` distinct rows per table, so each row is looked up
about 164 times) exercises the fused update's hot-row path, which a Zipf-skewed trainer hits.

Measured, each in the same run and process:
1. pooled forward: nn.EmbeddingBag(mode="sum") (``F.embedding_bag``) vs the Triton kernel; time and
   TB/s of rows read (N*D*4 bytes: every lookup's row, as the anchor counts) and of the slot's
   byte model (each distinct row once).
2. forward + backward + row-wise optimizer: nn.EmbeddingBag with a dense gradient (and without,
   then with, torch.optim.Adagrad on the table) vs the store's torch fused path (``row_ops``) vs
   the Triton pooled forward + fused backward + row-wise Adagrad in place.

Anchors (ANCHORS.md, H200): EmbeddingBag forward 1.51 ms = 1.44 TB/s of rows read; forward +
backward with a dense gradient 16.0 ms. Goals: pooled forward >= 2 TB/s; forward + fused backward +
row-wise Adagrad <= 4 ms.

Timing: the byte models are computed from the shape before anything runs; each implementation is
checked against torch at the benchmark shape first (a wrong kernel is never timed); then CUDA
events around each call, with a write of a buffer of max(256 MiB, 4 x L2) between repeats
(untimed) so operands come from HBM, the median of ``--repeats`` (>= 20 on CUDA) after warm-up
calls. Markdown table to stdout, JSON to ``--out``.

``--tune`` also times the Triton pooled forward and the pooled forward + fused update at every
(embedding_tile_elements, embedding_num_warps, embedding_num_stages) of ``TUNE_GRID`` at the main
shape (``SMOKE_TUNE_GRID`` at the smoke shape): the data to set the "auto" rule of
``triton_embedding.EmbeddingKernelConfig`` by. Each point is checked against torch first (a wrong one
is marked, not timed); a point that raises is recorded by the error's name
(``benchmarks.kernels._median_or_error``). The rows go under "tune" in the JSON, and a Markdown table
with the best of each column in bold to stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F

FULL = {"T": 26, "B": 8192, "P": 20, "R": 1_000_000, "D": 128, "Q": 151_124, "weighted": 0, "ragged": 0}
# few bags (each a program under the CPU interpreter); B*P = 40 lookups a table, more than the update's 32-chunk
SMOKE = {"T": 2, "B": 5, "P": 8, "R": 200, "D": 24, "Q": 12, "weighted": 0, "ragged": 0}
ANCHORS = {"embedding_bag_forward_ms": 1.51, "embedding_bag_forward_rows_tb_per_s": 1.44,
           "embedding_bag_forward_backward_dense_ms": 16.0}
GOALS = {"pool_forward_rows_tb_per_s": 2.0, "forward_fused_backward_adagrad_ms": 4.0}
LR, EPS = 0.01, 1e-8  # the store's defaults
CHECK_RTOL = 1e-5     # fp32 against torch fp32: the same sums in another order
# (tile_elements, num_warps, num_stages) of EmbeddingKernelConfig; "auto" stages: Triton's default
TUNE_GRID = tuple((t, w, s) for t in (1024, 2048, 4096, 8192) for w in (2, 4, 8) for s in ("auto", 1, 2, 4))
SMOKE_TUNE_GRID = ((1024, 2, 1), (4096, "auto", "auto"), (8192, 8, 2))
TUNE_KEYS = ("tile_elements", "num_warps", "num_stages")
TUNE_OPS = {"pool_forward": "triton pooled forward", "forward_fused_update": "triton pooled fwd + fused update"}
WRONG = "WrongResult"  # a tune point whose results disagree with torch beyond CHECK_RTOL: not timed


@dataclass
class Result:
    name: str
    group: str
    shape: str
    times_s: list[float] = field(repr=False)
    rows_read_bytes: float = 0.0
    model_bytes: float = 0.0

    def to_dict(self) -> dict:
        from profilers.stats import quantile
        median = statistics.median(self.times_s)
        return {"name": self.name, "group": self.group, "shape": self.shape, "repeats": len(self.times_s),
                "median_ms": median * 1e3, "p10_ms": quantile(self.times_s, 0.1) * 1e3,
                "p90_ms": quantile(self.times_s, 0.9) * 1e3,
                "rows_read_tb_per_s": self.rows_read_bytes / median / 1e12 if self.rows_read_bytes else None,
                "model_tb_per_s": self.model_bytes / median / 1e12 if self.model_bytes else None}


class Bench:
    """One shape's inputs and timer: ids, offsets, rows (shared by every implementation), d(pooled)."""

    def __init__(self, shape: dict, device: torch.device, repeats: int, warmup: int, seed: int = 0):
        from targets.haste_rec.embeddings.embedding_slots import (bag_inputs, fused_update_cost, pool_forward_cost,
                                                                  rows_read_bytes)
        self.shape, self.device, self.repeats, self.warmup = shape, device, repeats, warmup
        # byte models first, from the shape alone
        self.rows_read = rows_read_bytes(shape, torch.float32)
        self.pool_bytes = pool_forward_cost(shape, torch.float32).bytes
        self.update_bytes = fused_update_cost(shape, torch.float32).bytes
        gen = torch.Generator(device=device).manual_seed(seed)
        self.ids, self.offsets = bag_inputs(shape, device, gen)
        self.rows = torch.randn(shape["T"] * shape["R"], shape["D"], generator=gen, device=device).mul_(0.01)
        self.state = torch.zeros(self.rows.shape[0], 1, device=device)
        self.grad = torch.randn(self.offsets.numel(), shape["D"], generator=gen, device=device).mul_(1e-3)
        self.label = "T{T} B{B} P{P} R{R} D{D} Q{Q}".format(**shape)
        self.flush = None
        if device.type == "cuda":
            l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0)
            self.flush = torch.empty(max(256 << 20, 4 * l2), dtype=torch.uint8, device=device)

    def time(self, name: str, group: str, fn: Callable[[], object], before: Callable[[], object] | None = None,
             rows_read: float = 0.0, model: float = 0.0) -> Result:
        from profilers.ceilings import time_calls

        def prepare() -> None:
            if before is not None:
                before()
            if self.flush is not None:
                self.flush.zero_()
        times = time_calls(fn, self.device, self.warmup, self.repeats, before=prepare)
        return Result(name, group, self.label, times, rows_read, model)


# ----------------------------------------------------------------------------- the implementations

def torch_fused_step(b: Bench) -> None:
    """The store's embedding_backend torch, grad mode fused: row_ops end to end."""
    from targets.haste_rec.embeddings.row_ops import apply_rowwise_adagrad_, make_lookup, pool, row_gradients
    lookup = make_lookup(b.ids, b.offsets, None, b.device)
    pool(b.ids, b.rows, lookup.offsets, None)
    grads = row_gradients(b.grad, lookup)
    apply_rowwise_adagrad_(b.rows, lookup.rows, b.state, lookup.rows, grads, LR, EPS)


def triton_fused_step(b: Bench, config=None) -> None:
    """embedding_backend triton, grad mode fused: the pooled forward, then the fused update in place
    (``config``: an ``EmbeddingKernelConfig``, default the kernels' own)."""
    from targets.haste_rec.embeddings.triton_embedding import (DEFAULT_EMBEDDING_CONFIG, embedding_fused_update_,
                                                               embedding_pool_forward)
    config = config or DEFAULT_EMBEDDING_CONFIG
    embedding_pool_forward(b.ids, b.offsets, None, b.rows, config=config)
    embedding_fused_update_(b.ids, b.offsets, None, b.grad, b.rows, b.state, LR, EPS, config=config)


def check(b: Bench, config=None) -> dict[str, float]:
    """Triton (at ``config``, default the kernels' own) against torch at this shape, before anything is
    timed: max error / max |torch|."""
    from targets.haste_rec.embeddings.embedding_slots import fused_update_reference
    from targets.haste_rec.embeddings.triton_embedding import (DEFAULT_EMBEDDING_CONFIG, embedding_fused_update,
                                                               embedding_pool_forward)
    config = config or DEFAULT_EMBEDDING_CONFIG

    def rel(got: torch.Tensor, want: torch.Tensor) -> float:
        return float((got - want).abs().max() / want.abs().max().clamp_min(1e-30))
    with torch.no_grad():
        pooled = rel(embedding_pool_forward(b.ids, b.offsets, None, b.rows, config=config),
                     F.embedding_bag(b.ids, b.rows, b.offsets, mode="sum"))
        args = (b.ids, b.offsets, None, b.grad, b.rows, b.state.add(0.5), LR, EPS)
        update = rel(embedding_fused_update(*args, config=config), fused_update_reference(*args))
    return {"pool_forward_max_rel_error": pooled, "fused_update_max_rel_error": update}


def tune(b: Bench, grid: tuple) -> list[dict]:
    """One row per (tile_elements, num_warps, num_stages) of grid: the median ms of each of ``TUNE_OPS``
    (or the name of the error it raised, or ``WRONG``) and the point's max relative error against torch."""
    from benchmarks.kernels import _median_or_error
    from targets.haste_rec.embeddings.triton_embedding import EmbeddingKernelConfig, embedding_pool_forward
    rows = []
    for point in grid:
        row = dict(zip(TUNE_KEYS, point))
        try:
            config = EmbeddingKernelConfig(*point)
            row["max_rel_error"] = max(check(b, config).values())
        except Exception as err:  # a point the kernels reject or cannot launch is a result of the sweep
            rows.append(row | {"max_rel_error": None} | dict.fromkeys(TUNE_OPS, type(err).__name__))
            continue
        if not row["max_rel_error"] <= CHECK_RTOL:
            rows.append(row | dict.fromkeys(TUNE_OPS, WRONG))
            continue
        with torch.no_grad():
            ops = {"pool_forward": lambda: embedding_pool_forward(b.ids, b.offsets, None, b.rows, config=config),
                   "forward_fused_update": lambda: triton_fused_step(b, config)}
            rows.append(row | {name: _median_or_error(fn, b.device, b.warmup, b.repeats, b.flush)
                               for name, fn in ops.items()})
    return rows


def measure(b: Bench, full: bool) -> list[Result]:
    """The forward pair and the training-step comparisons (``full``: also the dense EmbeddingBag steps)."""
    from targets.haste_rec.embeddings.triton_embedding import embedding_pool_forward
    out: list[Result] = []
    with torch.no_grad():
        out.append(b.time("nn.EmbeddingBag forward", "forward",
                          lambda: F.embedding_bag(b.ids, b.rows, b.offsets, mode="sum"),
                          rows_read=b.rows_read, model=b.pool_bytes))
        out.append(b.time("triton pooled forward", "forward",
                          lambda: embedding_pool_forward(b.ids, b.offsets, None, b.rows),
                          rows_read=b.rows_read, model=b.pool_bytes))
    if full:
        bag = torch.nn.EmbeddingBag.from_pretrained(b.rows, freeze=False, mode="sum")  # shares b.rows' storage
        opt = torch.optim.Adagrad(bag.parameters(), lr=LR, eps=EPS)

        def dense_backward() -> None:
            bag(b.ids, b.offsets).backward(b.grad)

        def dense_step() -> None:
            dense_backward()
            opt.step()
        clear = lambda: opt.zero_grad(set_to_none=True)  # noqa: E731 (a new dense gradient every step)
        out.append(b.time("nn.EmbeddingBag fwd + bwd (dense grad)", "train step", dense_backward, clear))
        out.append(b.time("nn.EmbeddingBag fwd + bwd (dense grad) + Adagrad", "train step", dense_step, clear))
        del bag, opt
    with torch.no_grad():
        out.append(b.time("torch fused (row_ops: unique, segment sum, row-wise Adagrad)", "train step",
                          lambda: torch_fused_step(b), model=b.pool_bytes + b.update_bytes))
        out.append(b.time("triton pooled fwd + fused bwd + row-wise Adagrad", "train step",
                          lambda: triton_fused_step(b), model=b.pool_bytes + b.update_bytes))
    return out


# ----------------------------------------------------------------------------- report

def _tbs(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def table(results: list[Result]) -> str:
    lines = ["| shape | group | implementation | median ms | p10-p90 ms | rows read TB/s | model TB/s |",
             "|---|---|---|---|---|---|---|"]
    for r in (r.to_dict() for r in results):
        lines.append(f"| {r['shape']} | {r['group']} | {r['name']} | {r['median_ms']:.3f} | "
                     f"{r['p10_ms']:.3f}-{r['p90_ms']:.3f} | {_tbs(r['rows_read_tb_per_s'])} | "
                     f"{_tbs(r['model_tb_per_s'])} |")
    return "\n".join(lines)


def tune_table(rows: list[dict], label: str) -> str:
    """The tune rows as Markdown: median ms per op, the best of each column in bold; failed points by name."""
    from benchmarks.kernels import knob_table
    shown = [r | {"max_rel_error": "-" if r["max_rel_error"] is None else f"{r['max_rel_error']:.2g}"} for r in rows]
    return knob_table(shown, {k: k for k in TUNE_KEYS},
                      {**{n: f"{op} ms" for n, op in TUNE_OPS.items()}, "max_rel_error": "max rel error"},
                      f"embedding kernel knob sweep at {label} (median ms, best per column in bold):")


def verdict(results: list[Result]) -> dict:
    by_name = {(r.shape, r.name): r.to_dict() for r in results}
    label = results[0].shape
    fwd = by_name[(label, "triton pooled forward")]
    step = by_name[(label, "triton pooled fwd + fused bwd + row-wise Adagrad")]
    return {"pool_forward_rows_tb_per_s": fwd["rows_read_tb_per_s"],
            "pool_forward_meets_goal": fwd["rows_read_tb_per_s"] >= GOALS["pool_forward_rows_tb_per_s"],
            "forward_fused_backward_adagrad_ms": step["median_ms"],
            "train_step_meets_goal": step["median_ms"] <= GOALS["forward_fused_backward_adagrad_ms"]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU under TRITON_INTERPRET=1")
    parser.add_argument("--repeats", type=int, default=25)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--hot-q", type=int, default=1000, help="distinct rows per table of the skewed shape (0: skip)")
    parser.add_argument("--out", default="", help="write the JSON record here")
    parser.add_argument("--tune", action="store_true",
                        help="also sweep the embedding kernel knobs (TUNE_GRID; SMOKE_TUNE_GRID with --smoke)")
    args = parser.parse_args(argv)
    cuda = torch.cuda.is_available() and not args.smoke
    if not cuda:
        if not args.smoke:
            parser.error("needs a CUDA device; use --smoke for the CPU interpreter run")
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported (the kernels import it)
    if cuda and args.repeats < 20:
        parser.error("time at least 20 repeats on CUDA")
    import triton

    device = torch.device("cuda" if cuda else "cpu")
    shape = dict(SMOKE if args.smoke else FULL)
    repeats, warmup = (3, 1) if args.smoke else (args.repeats, args.warmup)
    bench = Bench(shape, device, repeats, warmup)
    checks = check(bench)
    print(f"checks against torch at {bench.label}: " + ", ".join(f"{k} {v:.2g}" for k, v in checks.items()))
    if max(checks.values()) > CHECK_RTOL:
        print(f"a Triton kernel disagrees with torch beyond {CHECK_RTOL}: not timing it", file=sys.stderr)
        return 1
    results = measure(bench, full=True)
    tuned = tune(bench, SMOKE_TUNE_GRID if args.smoke else TUNE_GRID) if args.tune else None
    tuned_text = tune_table(tuned, bench.label) if tuned is not None else None
    del bench
    if args.hot_q:  # smoke: one row per table, looked up more often than the update kernel's chunk
        hot_q = 1 if args.smoke else max(1, min(args.hot_q, shape["B"] * shape["P"]))
        results += measure(Bench(dict(shape, Q=hot_q), device, repeats, warmup, seed=1), full=False)
    name = torch.cuda.get_device_name(device) if cuda else "cpu (Triton interpreter)"
    print(f"\nEmbedding kernels on {name}, fp32, torch {torch.__version__}, triton {triton.__version__}, "
          f"{'CUDA events + L2 flush' if cuda else 'perf_counter'}, median of {repeats}\n")
    print(table(results))
    summary = verdict(results)
    print(f"\npooled forward {summary['pool_forward_rows_tb_per_s']:.2f} TB/s of rows read (anchor nn.EmbeddingBag "
          f"{ANCHORS['embedding_bag_forward_rows_tb_per_s']} TB/s, goal >= {GOALS['pool_forward_rows_tb_per_s']}); "
          f"forward + fused backward + row-wise Adagrad {summary['forward_fused_backward_adagrad_ms']:.3f} ms "
          f"(anchor dense {ANCHORS['embedding_bag_forward_backward_dense_ms']} ms, goal <= "
          f"{GOALS['forward_fused_backward_adagrad_ms']} ms)")
    if tuned_text is not None:
        print("\n" + tuned_text)
    record = {"device": name, "torch": torch.__version__, "triton": triton.__version__, "smoke": args.smoke,
              "dtype": "float32", "shape": shape, "timing": "cuda-events+l2-flush" if cuda else "perf_counter",
              "repeats": repeats, "warmup": warmup, "checks": checks, "anchors": ANCHORS, "goals": GOALS,
              "verdict": summary, "results": [r.to_dict() for r in results]} | ({"tune": tuned} if args.tune else {})
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(record, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
