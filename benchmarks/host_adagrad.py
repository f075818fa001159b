"""Row-wise Adagrad on a host table's touched rows: the formula as written (a new tensor per operation)
against ``row_ops.apply_rowwise_adagrad_`` (in place on the gathered rows, one temporary), same bits.

At size large-cached the host tables update about 85K rows of 128 a step (43.5 MB each way); this times that
much on a table of --rows rows (a quarter of large-cached's 26M by default, to fit a small machine).

    python benchmarks/host_adagrad.py [--rows 6500000] [--touched 80000] [--repeats 6]
"""

from __future__ import annotations

import argparse
import time

import torch

from targets.haste_rec.embeddings.row_ops import apply_rowwise_adagrad_

LR, EPS = 0.01, 1e-8


def as_written(weight: torch.Tensor, index: torch.Tensor, state: torch.Tensor, grads: torch.Tensor) -> None:
    """The formula one operation at a time, each into a new tensor (the form before 2026-11-30)."""
    new_state = state.index_select(0, index) + grads.pow(2).mean(dim=1, keepdim=True)
    new_rows = weight.index_select(0, index) - LR * grads / (new_state.sqrt() + EPS)
    weight.index_copy_(0, index, new_rows)
    state.index_copy_(0, index, new_state)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=6_500_000)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--touched", type=int, default=80_000)
    parser.add_argument("--repeats", type=int, default=6)
    args = parser.parse_args()
    gen = torch.Generator().manual_seed(0)
    weight, state = torch.randn(args.rows, args.dim, generator=gen), torch.zeros(args.rows, 1)
    forms = {"as written": lambda i, g: as_written(weight, i, state, g),
             "in place": lambda i, g: apply_rowwise_adagrad_(weight, i, state, i, g, LR, EPS)}
    times: dict[str, list[float]] = {name: [] for name in forms}
    for _ in range(args.repeats):
        for name, form in forms.items():  # alternating, so drift reaches both
            index = torch.randperm(args.rows, generator=gen)[:args.touched].sort().values
            grads = torch.randn(args.touched, args.dim, generator=gen)
            start = time.perf_counter()
            form(index, grads)
            times[name].append(time.perf_counter() - start)
    small_w, small_s = weight[:1000].clone(), state[:1000].clone()
    index, grads = torch.arange(0, 1000, 3), torch.randn(334, args.dim, generator=gen)
    a_w, a_s, b_w, b_s = small_w.clone(), small_s.clone(), small_w.clone(), small_s.clone()
    as_written(a_w, index, a_s, grads)
    apply_rowwise_adagrad_(b_w, index, b_s, index, grads, LR, EPS)
    same = torch.equal(a_w, b_w) and torch.equal(a_s, b_s)
    print(f"{args.touched} rows of {args.dim} out of {args.rows}, {torch.get_num_threads()} threads; ms, fastest first "
          f"(same bits: {same}):")
    for name, spent in times.items():
        print(f"  {name}: " + ", ".join(f"{1e3 * t:.1f}" for t in sorted(spent)))


if __name__ == "__main__":
    main()
