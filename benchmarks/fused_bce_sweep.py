"""The fused loss kernel's meta-parameter sweep: each positives format at each (BLOCK_B, warps, stages),
in fp32 (at each fp32 dot precision asked for: ieee, tf32, tf32x3) and bf16, at the paper's main shape
(B=256, Ht=768, L=670,080, F=64, G=32).

Why a sweep of its own: the fused kernel holds more live tiles than the other tail kernels, so its best
BLOCK_B differs by dtype (the trainer runs it in fp32 unless bf16 autocast passes validation).
``benchmarks.kernels --tune`` times every tail kernel at each point; this times only the fused one, at
each positives format and fp32 dot precision (a config that runs out of shared memory is recorded by its
error). It is the data behind the "auto" rules of ``triton_tail.TailKernelConfig.resolve(fused_dtype=...)``
and ``triton_fused_bce.resolve_positives_format``.

Usage (CUDA): python -m benchmarks.fused_bce_sweep --out sweep.json [--dtypes float32 --precisions ieee tf32 --quick]
       (CPU, tiny shape on Triton's interpreter): python -m benchmarks.fused_bce_sweep --smoke --out sweep.json
Prints one line per (dtype, block_b, warps, stages): the median ms of each format (8 repeats, L2 flushed).
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import sys

import torch

GRID = tuple(itertools.product((32, 64, 128), (4, 8), (1, 2, 3)))
QUICK_GRID = ((32, 4, 3), (64, 4, 1), (64, 4, 3), (64, 8, 3), (128, 4, 3))
SMOKE_GRID = ((16, 4, 1), (32, 4, 2))
SMOKE_SHAPE = {"B": 20, "Ht": 9, "L": 24, "F": 8, "G": 8}  # K=3 groups; B=20: two chunks at BLOCK_B 16
FORMATS = ("list", "bits")


def sweep(shape: dict, dtypes: tuple[torch.dtype, ...], grid: tuple, device: torch.device, repeats: int,
          precisions: tuple[str, ...] = ("ieee",)) -> list[dict]:
    """One row per (dtype, fp32 dot precision, block_b, num_warps, num_stages) with each format's median ms,
    or the error's name; 16-bit dtypes ignore the precision, so they get one row per config."""
    from benchmarks.kernels import _median_or_error, _tail_inputs
    from profilers.fine import _flush_buffer
    from targets.haste_rec.tail.triton_fused_bce import tail_fused_bce_triton
    from targets.haste_rec.tail.triton_tail import TailKernelConfig

    flush = _flush_buffer(device)
    rows = []
    for dtype in dtypes:
        _, h, idx, w, bias, _, pos_rows, pos_cols, csr = _tail_inputs(shape, dtype, device,
                                                                       torch.Generator(device=device).manual_seed(0))
        for precision, (block_b, warps, stages) in itertools.product(
                precisions if dtype == torch.float32 else ("tf32",), grid):
            config = TailKernelConfig(block_b, warps, stages, fp32_precision=precision)
            row = {"dtype": str(dtype).replace("torch.", ""), "precision": config.dot_precision(dtype),
                   "block_b": block_b, "num_warps": warps, "num_stages": stages}
            for fmt in FORMATS:
                call = functools.partial(tail_fused_bce_triton, h, idx, w, bias, None, pos_rows, pos_cols,
                                         1 / shape["B"], csr=csr, config=config, positives_format=fmt)
                row[fmt] = _median_or_error(call, device, 2, repeats, flush)
            rows.append(row)
            print(" ".join(str(v if not isinstance(v, float) else f"{v:.3f}") for v in row.values()), flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="write the JSON rows here")
    parser.add_argument("--smoke", action="store_true", help="tiny shape, two configs, fp32, on the CPU interpreter")
    parser.add_argument("--dtypes", nargs="+", choices=("float32", "bfloat16"), default=["float32", "bfloat16"])
    parser.add_argument("--precisions", nargs="+", choices=("ieee", "tf32", "tf32x3"), default=["ieee"],
                        help="tl.dot input precisions of the fp32 rows")
    parser.add_argument("--quick", action="store_true", help=f"only {len(QUICK_GRID)} configs around the defaults")
    args = parser.parse_args(argv)
    from benchmarks.kernels import MAIN, kernel_device
    device = kernel_device("benchmarks.fused_bce_sweep", args.smoke)
    if device is None:
        return 2
    cuda = device.type == "cuda"
    if args.smoke:
        rows = sweep(SMOKE_SHAPE, (torch.float32,), SMOKE_GRID, device, 1, tuple(args.precisions))
    else:
        rows = sweep(MAIN, tuple(getattr(torch, d) for d in args.dtypes), QUICK_GRID if args.quick else GRID, device,
                     8, tuple(args.precisions))
    with open(args.out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(device) if cuda else "cpu", "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
