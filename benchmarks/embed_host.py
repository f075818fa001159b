"""Where a cached-placement step's host time goes: the step and each part of the embedding store's work, timed on
the host (perf_counter around each part, inclusive of what it calls; no synchronisation added), on the real
session a worker builds. The step itself is timed both ways: until `step()` returns (host) and until the device
has finished (wall), so a host-bound step shows host close to wall. Each part is listed per thread: with
embedding_cache_prefetch the lookup is prepared on the prefetch thread (``cache-prefetch``), beside the step.

At `large-cached` the best configuration found so far ran 13.99 ms of host work in a 14.93 ms profiled step,
7.09 of it in `embed` while the device ran 1.40 there (an H200 profile, 2026-12-03): which parts of the cache's
lookup, bookkeeping, row moves and update hold that time decides what to cut.

    python benchmarks/embed_host.py --size large-cached --device cuda --config docs/results/.../best_config.toml \
        [--set optimizer_impl=fused] [--steps 40] [--warmup 10] [--ops]

``--ops`` adds the torch operations each part runs a step (innermost part; each a kernel launch on a GPU), counted
in a pass of its own after the timed ones: a part's host time over its operations says whether it launches too
much or waits. A dispatch mode is per thread, so only the main thread's are counted: without the prefetch the
caches' prepare runs there.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import threading
import time
from collections import defaultdict

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from targets.haste_rec import session as session_mod
from targets.haste_rec import dense_graph, optimizers
from targets.haste_rec.cache import cache_overlap, cache_prefetch, row_cache, table_caches
from targets.haste_rec.embeddings import embedding_rows, embeddings
from sg_opt.config import build_overrides
from targets.registry import resolve_target
from targets.worker import build_session, open_device, sync_device
from targets.worker_protocol import WorkerRequest

SPENT: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0.0, 0])  # (label, thread) -> [seconds, calls]
OPS: dict[tuple[str, str], int] = defaultdict(int)  # (innermost label, thread) -> torch operations (--ops)
_PARTS_IN = threading.local()  # .stack: the labels of the parts this thread is in, outermost first

# (owner, attribute, label): the parts of a cached step, outermost first. Module functions are patched where their
# callers look them up.
PARTS = [
    (session_mod.HasteRecSession, "step", "step"),
    (session_mod.HasteRecSession, "_next_batch", "data (the next batch)"),
    (session_mod.HasteRecSession, "fused_loss", "forward and loss (fused tail)"),
    (dense_graph.DenseGraphs, "loss", "forward and loss (CUDA graphs)"),
    (torch.Tensor, "backward", "backward"),
    (optimizers.Optimizers, "step", "optimizer"),
    (embeddings.EmbeddingStore, "forward", "embed forward"),
    (embedding_rows.CachedRows, "lookup", "  lookup"),
    (cache_prefetch.PrefetchThread, "take", "    take the prefetched lookup (waits for it)"),
    (embedding_rows.CachedRows, "prefetch", "  submit the next batch's prefetch"),
    (embedding_rows.CachedRows, "_prepared", "    prepare the lookup (here or on the prefetch thread)"),
    (embedding_rows, "make_lookup", "    make_lookup (unique, offsets)"),
    (table_caches.TableCaches, "prepare", "    prepare"),
    (table_caches.TableCaches, "_assign", "      decide (_assign)"),
    (row_cache.RowMoves, "rows_on_host", "      moved ids to the host"),
    (table_caches, "move_rows_together", "      move rows (weights and state at once)"),
    (row_cache, "gather_together", "        host gather + copy"),
    (cache_overlap.WriteBehind, "wait", "        wait write-behind"),
    (cache_overlap.WriteBehind, "submit", "        submit write-back"),
    (cache_overlap.CacheStream, "hand_over", "    hand over"),
    (embeddings.EmbeddingStore, "_on_row_grads", "embed backward (update)"),
    (embedding_rows.CachedRows, "fused_update", "  fused_update"),
    (embedding_rows, "row_gradients", "    row gradients"),
    (embedding_rows, "apply_rowwise_adagrad_", "    adagrad"),
    (embeddings.EmbeddingStore, "optimizer_step", "embed optimizer_step"),
]


def _timed(fn, label):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        stack = _PARTS_IN.__dict__.setdefault("stack", [])
        stack.append(label)
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            spent = SPENT[label, _thread()]
            spent[0] += time.perf_counter() - start
            spent[1] += 1
            stack.pop()
    return wrapper


def _thread() -> str:
    return threading.current_thread().name.split("_")[0]


class _CountOps(TorchDispatchMode):
    """Each torch operation this thread runs, to the innermost part it runs in."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        stack = getattr(_PARTS_IN, "stack", None)
        OPS[stack[-1] if stack else "(outside every part)", _thread()] += 1
        return func(*args, **(kwargs or {}))


def instrument() -> None:
    for owner, name, label in PARTS:
        setattr(owner, name, _timed(getattr(owner, name), label))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="tiny")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--config", default=None, help="a best_config.toml ([knobs])")
    parser.add_argument("--set", action="append", default=[], metavar="KNOB=VALUE")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--ops", action="store_true", help="also count each part's torch operations a step")
    args = parser.parse_args()
    config = build_overrides(resolve_target("haste-rec").knob_space, args.config, args.set)
    req = WorkerRequest(target="haste-rec", size=args.size, mode="bench", config=config, device=args.device)
    device = open_device(req)
    instrument()
    began = time.perf_counter()
    _, _, _, session = build_session(req, device, None)
    built = time.perf_counter() - began
    for _ in range(args.warmup):
        session.step()
    sync_device(device)
    SPENT.clear()
    host, wall = [], []
    for _ in range(args.steps):
        start = time.perf_counter()
        session.step()
        host.append(time.perf_counter() - start)
        sync_device(device)
        wall.append(time.perf_counter() - start)
    back_to_back = time.perf_counter()
    for _ in range(args.steps):
        session.step()
    sync_device(device)
    chained = (time.perf_counter() - back_to_back) / args.steps
    timed = {key: list(spent) for key, spent in SPENT.items()}  # before the --ops pass adds to SPENT
    if args.ops:  # a pass of its own: the dispatch mode's own cost stays out of the times above
        with _CountOps():
            for _ in range(args.steps):
                session.step()
        sync_device(device)
    print(f"{args.size} on {device}, config {json.dumps(config, sort_keys=True)}; built in {built:.1f} s")
    print(f"step, synchronised each: host {1e3 * statistics.median(host):.2f} ms, "
          f"wall {1e3 * statistics.median(wall):.2f}"
          f" ms (medians of {args.steps}); back to back: {1e3 * chained:.2f} ms a step (mean of {args.steps})")
    ops_head = (" torch ops / step (innermost; main thread) |", "---|") if args.ops else ("", "")
    print(f"\n| part | thread | ms / step (host, inclusive) | calls / step |{ops_head[0]}\n|---|---|---|---|{ops_head[1]}")
    for _, _, label in PARTS:
        for (name, thread), (seconds, calls) in timed.items():
            if name == label:
                ops = f" {OPS.get((label, thread), 0) / args.steps:.1f} |" if args.ops else ""
                print(f"| {label.replace(' ', chr(160), len(label) - len(label.lstrip()))} | {thread} "
                      f"| {1e3 * seconds / (2 * args.steps):.3f} | {calls / (2 * args.steps):.1f} |{ops}")
    if args.ops:
        print(f"\ntorch ops / step on the main thread: {sum(OPS.values()) / args.steps:.1f}, of them outside every "
              f"part {OPS.get(('(outside every part)', 'MainThread'), 0) / args.steps:.1f}")


if __name__ == "__main__":
    main()
