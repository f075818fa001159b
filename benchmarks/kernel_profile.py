"""What bounds the HASTE tail kernels at the main shape: one profiled call of each under Nsight Compute.

Builds benchmarks.kernels' main-shape inputs (B=256, Ht=768, L=670,080, F=64, G=32, bf16), compiles and times
each kernel (CUDA events, L2 flushed, median of 50), then calls each once between cudaProfilerStart/Stop, so
``ncu --profile-from-start off`` profiles those launches only.

    ncu --profile-from-start off --set full -o tail python -m benchmarks.kernel_profile
"""

from __future__ import annotations

import statistics

import torch

from benchmarks.kernels import MAIN, _tail_inputs
from profilers.ceilings import time_calls
from targets.haste_rec.tail.triton_fused_bce import tail_fused_bce_triton
from targets.haste_rec.tail.triton_tail import tail_forward_triton


def main() -> None:
    device = torch.device("cuda")
    gen = torch.Generator(device=device).manual_seed(0)
    shape, h, idx, w, bias, dz, rows, cols, csr = _tail_inputs(MAIN, torch.bfloat16, device, gen)
    kernels = {
        "tail_forward": lambda: tail_forward_triton(h, idx, w, bias),
        "fused_bce": lambda: tail_fused_bce_triton(h, idx, w, bias, None, rows, cols, 1.0 / MAIN["B"], csr=csr),
    }
    flush = torch.empty(256 * 2**20, dtype=torch.uint8, device=device)
    for name, fn in kernels.items():
        times = time_calls(fn, device, 5, 50, before=flush.zero_)
        print(f"{name}: median {statistics.median(times) * 1e3:.4f} ms over 50 calls (L2 flushed)", flush=True)
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    for fn in kernels.values():
        flush.zero_()
        fn()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


if __name__ == "__main__":
    main()
