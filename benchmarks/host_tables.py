"""Where building host-resident embedding tables goes: allocating them, touching their pages, drawing and copying.

A timing worker of `large-cached` took 11-15 s to build on an H200 (2026-12-04), twice a measurement, and 13.3 GB
of its tables live on the host (placements host and cached). ``TableLayout.initial_rows`` draws each table on the
device and, since 2026-12-04, copies it to the host through one reused page-locked buffer (``row_ops.copy_to_host``) and
torch's threaded host copy; before, it copied straight into the pageable host tensor, through the driver's own
staging on one thread, which also took the first touch of every page. This times both ways, then the parts apart,
in fresh buffers each time:

    python benchmarks/host_tables.py --size large-cached --device cuda
"""

from __future__ import annotations

import argparse
import time

import torch

from targets.haste_rec.embeddings.row_ops import TableLayout
from targets.haste_rec.sizes import get_size


def timed(what: str, fn) -> float:
    start = time.perf_counter()
    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    print(f"{what}: {seconds:.2f} s", flush=True)
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="small")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    size, device = get_size(args.size), torch.device(args.device)
    layout = TableLayout(tuple(size.table_rows))
    rows, dim = sum(size.table_rows), size.embedding_dim
    print(f"{args.size}: {len(size.table_rows)} tables, {rows * dim * 4 / 1e9:.1f} GB on the host, "
          f"{torch.get_num_threads()} threads", flush=True)
    timed("initial_rows as the trainer draws them (staged)",
          lambda: layout.initial_rows(dim, 0.01, 0, device, torch.device("cpu")))
    if device.type == "cuda":
        timed("the same, copied straight into pageable memory (the trainer before 2026-12-04)",
              lambda: pageable_rows(layout, dim, device))
    timed("torch.empty alone (no page touched)", lambda: torch.empty(rows, dim))
    timed("torch.empty + zero_ (every page touched, threaded)", lambda: torch.empty(rows, dim).zero_())
    touched = torch.empty(rows, dim).zero_()
    timed("zero_ again (pages already mapped)", lambda: touched.zero_())

    def copy_into_touched() -> None:
        table = torch.empty(max(size.table_rows), dim, device=device)
        for part in layout.split(touched):
            part.copy_(table[:part.shape[0]])
    timed("copies of every table into mapped pages (no draw)", copy_into_touched)


def pageable_rows(layout: TableLayout, dim: int, device: torch.device) -> torch.Tensor:
    """Tables of ``initial_rows``' shapes drawn on the device (other seeds: only the time is compared), each copied
    straight into the fresh pageable host tensor, as the trainer did before 2026-12-04."""
    out = torch.empty(sum(layout.table_rows), dim)
    for t, table in enumerate(layout.split(out)):
        gen = torch.Generator(device=device).manual_seed(t)
        table.copy_(torch.randn(table.shape, generator=gen, device=device).mul_(0.01))
    return out


if __name__ == "__main__":
    main()
