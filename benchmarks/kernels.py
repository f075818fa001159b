"""Kernel benchmarks of the HASTE tail: Triton group-shared kernels against torch autograd, a
FLOPs-matched dense layer and the per-label (Spartex-style) baseline, placed against the ceilings.

    python -m benchmarks.kernels --out results/kernels.json            # H200: main shape + sweeps
    python -m benchmarks.kernels --configs main --out k.json           # the main shape only
    python -m benchmarks.kernels --smoke --out /tmp/k.json             # tiny shapes; CPU interpreter
    python -m benchmarks.kernels --configs main --tune --out t.json    # also sweep the tail_* kernel knobs

Main shape (HASTE Amazon-670K, ANCHORS.md): B=256, H=Ht=768, L=670,080 tail labels, F=64, G=32,
bf16; sweeps G in {16, 32, 64} x L in {670,080, 2,812,224}. Every implementation is first checked
against a torch reference in fp32 (group-shared kernels at the full shape, per-label at L <= 65,536);
a failed check is reported and its timings are marked, not hidden. Timing: CUDA events, the L2
flushed (a >= 256 MiB buffer zeroed) before each repeat, median of --repeats (>= 20 on the GPU);
perf_counter on the CPU. Rates come from the minimum-traffic models of ``tail_slots`` (each input
read once, each output written once); where a kernel moves more by design (the input gradient's
dX scratch), a second rate uses its own traffic model. Ceilings: measured by profilers.ceilings on
CUDA (cached), else ANCHORS' 4.24 TB/s copy and 780 TFLOP/s bf16.

``--tune`` also times the group-tile kernels at every (tail_block_b, tail_num_warps, tail_num_stages)
of ``TUNE_GRID``: the data to set the "auto" rule of ``triton_tail.TailKernelConfig`` by.

The forward is timed (and checked) as configured by default ("auto": 2 groups per program for G <= 16)
and at each ``groups_per_program`` ("tail_forward" and "tail_forward_2gpp" in the tune rows: 1 and 2, two
adjacent groups stored as one 2G-wide tile for wider stores of z); the fused loss at each positives
format ("tail_fused_bce_list", "tail_fused_bce_bits"; the default is bits for G <= 64). So one GPU run
compares the variants the defaults were chosen from.

Markdown tables go to stdout, everything to the --out JSON.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
from dataclasses import dataclass, replace
from typing import Any, Callable

import torch
import torch.nn.functional as F

from profilers.ceilings import time_calls
from profilers.stats import quantile
from targets.protocol import FlopsBytes

ANCHOR_COPY_BYTES_PER_S = 4.24e12
ANCHOR_BF16_FLOPS = 780e12
POSITIVES_PER_ROW = 5
PERLABEL_CHECK_LABELS = 65_536
TOLERANCE = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 2e-2}  # max error / max |reference|
MAIN = {"B": 256, "Ht": 768, "L": 670_080, "F": 64, "G": 32}
# CPU interpreter: few groups (odd K=3, even K=2) and dims (each a segment-sum program), non-power-of-two G and F
SMOKE = ({"B": 8, "Ht": 9, "L": 24, "F": 8, "G": 8}, {"B": 5, "Ht": 7, "L": 24, "F": 6, "G": 12})
TUNE_GRID = tuple((b, w, s) for b in (32, 64, 128) for w in (4, 8) for s in (2, 3, 4))
SMOKE_TUNE_GRID = ((16, 4, 2), (32, 2, 3))
FORWARD_PAIRED = "tail_forward_2gpp"  # check / tune name of the forward at groups_per_program=2
# the fused kernel's positives formats (triton_fused_bce), by check / tune name
FUSED_FORMATS = {"tail_fused_bce_list": "list", "tail_fused_bce_bits": "bits"}


@dataclass(frozen=True)
class Roof:
    peak_flops: float
    copy_bytes_per_s: float
    source: str


@dataclass
class Op:
    name: str
    fn: Callable[[], object]
    cost: FlopsBytes
    moved: FlopsBytes | None = None


def _configs(which: str) -> list[dict]:
    if which == "main":
        return [dict(MAIN)]
    return [dict(MAIN, L=L, G=G) for L in (670_080, 2_812_224) for G in (32, 16, 64)]


def _roof(device: torch.device, dtype: torch.dtype, measured: bool) -> Roof:
    if measured and device.type == "cuda":
        from profilers.ceilings import dtype_name, get_ceilings
        c = get_ceilings(device)
        return Roof(c.peak_flops(dtype_name(dtype)), c.copy_bytes_per_s, f"measured ({c.device_name})")
    return Roof(ANCHOR_BF16_FLOPS, ANCHOR_COPY_BYTES_PER_S, "ANCHORS.md (H200: bf16 GEMM, device copy)")


def _rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.float(), want.float()
    if torch.isnan(got).any():
        return float("inf")
    return ((got - want).abs().max() / want.abs().max().clamp_min(1e-30)).item() if want.numel() else 0.0


def _dense_cost(B: int, Fi: int, L: int, e: int, backward: bool) -> FlopsBytes:
    """A Linear(F -> L) with bias: forward reads x, W, b and writes y; backward also reads dy (and x, W)
    and writes dx, dW, db."""
    fwd = FlopsBytes(2.0 * B * Fi * L + B * L, float(e * (B * Fi + L * Fi + L + B * L)))
    if not backward:
        return fwd
    bwd = FlopsBytes(4.0 * B * Fi * L + B * L, float(e * (B * L + B * Fi + L * Fi + B * Fi + L * Fi + L)))
    return FlopsBytes(fwd.flops + bwd.flops, fwd.bytes + bwd.bytes)


def _add(*costs: FlopsBytes) -> FlopsBytes:
    return FlopsBytes(sum(c.flops for c in costs), sum(c.bytes for c in costs))


def _tail_inputs(cfg: dict, dtype: torch.dtype, device: torch.device, gen: torch.Generator) -> tuple:
    """(shape dict, h, idx, w, bias, dz, positives' rows and cols, CSR) of one benchmark config."""
    from targets.haste_rec.tail import tail_slots as ts
    from targets.haste_rec.tail.triton_tail_backward import build_slot_csr

    B, Ht, L, Fi, G = (cfg[k] for k in ("B", "Ht", "L", "F", "G"))
    K, P = L // G, POSITIVES_PER_ROW * B
    shape = {"B": B, "Ht": Ht, "K": K, "G": G, "F": Fi, "bias": 1, "P": P, "weight": 0}
    h, idx, w, bias = ts.tail_forward_inputs(shape, dtype, device, gen)
    dz = torch.randn(B, K * G, generator=gen, device=device, dtype=dtype)
    rows = torch.randint(0, B, (P,), generator=gen, device=device)
    cols = torch.randint(0, K * G, (P,), generator=gen, device=device)
    return shape, h, idx, w, bias, dz, rows, cols, build_slot_csr(idx, Ht)


def _times_ms(fn: Callable[[], object], device: torch.device, warmup: int, repeats: int,
               flush: torch.Tensor | None) -> list[float]:
    return [t * 1e3 for t in time_calls(fn, device, warmup, repeats, before=None if flush is None else flush.zero_)]


def tune(cfg: dict, dtype: torch.dtype, device: torch.device, repeats: int, warmup: int,
         flush: torch.Tensor | None, grid: tuple) -> list[dict]:
    """Median ms of the group-tile kernels at each (block_b, num_warps, num_stages) of grid."""
    from targets.haste_rec.tail.triton_fused_bce import tail_fused_bce_triton
    from targets.haste_rec.tail.triton_tail import TailKernelConfig, tail_backward_weight_triton, tail_forward_triton
    from targets.haste_rec.tail.triton_tail_backward import tail_backward_input_triton

    shape, h, idx, w, bias, dz, rows, cols, csr = _tail_inputs(cfg, dtype, device,
                                                               torch.Generator(device=device).manual_seed(0))
    out = []
    for block_b, warps, stages in grid:
        c = TailKernelConfig(block_b, warps, stages)
        ops = {"tail_forward": functools.partial(tail_forward_triton, h, idx, w, bias,
                                                 config=replace(c, groups_per_program=1)),
               FORWARD_PAIRED: functools.partial(tail_forward_triton, h, idx, w, bias,
                                                 config=replace(c, groups_per_program=2)),
               "tail_backward_weight": lambda: tail_backward_weight_triton(dz, h, idx, config=c),
               "tail_backward_input": lambda: tail_backward_input_triton(dz, idx, w, shape["Ht"], csr=csr, config=c),
               **{name: functools.partial(tail_fused_bce_triton, h, idx, w, bias, None, rows, cols, 1 / shape["B"],
                                          csr=csr, config=c, positives_format=fmt)
                  for name, fmt in FUSED_FORMATS.items()}}
        out.append({"block_b": block_b, "num_warps": warps, "num_stages": stages,
                    **{name: _median_or_error(fn, device, warmup, repeats, flush) for name, fn in ops.items()}})
    return out


def _median_or_error(fn: Callable[[], object], device: torch.device, warmup: int, repeats: int,
                     flush: torch.Tensor | None) -> float | str:
    """The median ms of fn, or the name of the error it raised: a config the GPU cannot hold (fp32 tiles
    can run out of shared memory) is a result of the sweep, not its end."""
    try:
        return statistics.median(_times_ms(fn, device, warmup, repeats, flush))
    except Exception as err:
        return type(err).__name__


def run_config(cfg: dict, dtype: torch.dtype, device: torch.device, repeats: int, warmup: int,
               roof: Roof, flush: torch.Tensor | None) -> dict:
    from targets.haste_rec.tail import tail_slots as ts
    from targets.haste_rec.tail.triton_fused_bce import tail_fused_bce_traffic, tail_fused_bce_triton
    from targets.haste_rec.tail.triton_perlabel import (perlabel_backward_input_triton, perlabel_backward_weight_triton,
                                                        perlabel_forward_triton)
    from targets.haste_rec.tail.triton_tail import TailKernelConfig, tail_backward_weight_triton, tail_forward_triton
    from targets.haste_rec.tail.triton_tail_backward import (build_slot_csr, tail_backward_input_atomic,
                                                             tail_backward_input_traffic, tail_backward_input_triton)

    gen = torch.Generator(device=device).manual_seed(0)
    shape, h, idx, w, bias, dz, rows, cols, csr = _tail_inputs(cfg, dtype, device, gen)
    B, Ht, K, G, Fi = (shape[k] for k in ("B", "Ht", "K", "G", "F"))
    pshape = {"B": B, "Ht": Ht, "L": K * G, "F": Fi}
    f32 = lambda *ts_: tuple(t.float() if torch.is_tensor(t) and t.is_floating_point() else t for t in ts_)  # noqa: E731

    tf1, tf2 = (functools.partial(tail_forward_triton, h, idx, w, bias, config=TailKernelConfig(groups_per_program=g))
                for g in (1, 2))
    z_want = ts.tail_forward(*f32(h, idx, w, bias))
    checks = {
        "tail_forward": _rel_err(tail_forward_triton(h, idx, w, bias), z_want),
        FORWARD_PAIRED: _rel_err(tf2(), z_want),
        "tail_backward_weight": _rel_err(tail_backward_weight_triton(dz, h, idx),
                                         ts.tail_backward_weight(*f32(dz, h, idx))),
        "tail_backward_input": _rel_err(tail_backward_input_triton(dz, idx, w, Ht, csr=csr),
                                        ts.tail_backward_input(*f32(dz, idx, w), Ht)),
        "tail_backward_input_atomic": _rel_err(tail_backward_input_atomic(dz, idx, w, Ht),
                                               ts.tail_backward_input(*f32(dz, idx, w), Ht)),
    }
    del z_want
    fused = {fmt: functools.partial(tail_fused_bce_triton, h, idx, w, bias, None, rows, cols, 1.0 / B, csr=csr,
                                    positives_format=fmt) for fmt in FUSED_FORMATS.values()}
    want = ts.tail_fused_bce(*f32(h, idx, w, bias), None, rows, cols, 1.0 / B)
    for check, fmt in FUSED_FORMATS.items():
        for name, a, b in zip(("loss", "dh", "dw", "dbias"), fused[fmt](), want):
            checks[f"{check}.{name}"] = _rel_err(a.reshape(-1), b.reshape(-1))
    del want

    pidx = ts.random_fan_in(K * G, Ht, Fi, gen)
    pw = torch.randn(K * G, Fi, generator=gen, device=device, dtype=dtype) * Fi ** -0.5
    pcsr = build_slot_csr(pidx, Ht)
    n = min(K * G, PERLABEL_CHECK_LABELS)
    checks["perlabel_forward"] = _rel_err(perlabel_forward_triton(h, pidx[:n], pw[:n]),
                                          ts.perlabel_forward(*f32(h, pidx[:n], pw[:n])))
    checks["perlabel_backward_weight"] = _rel_err(perlabel_backward_weight_triton(dz[:, :n], h, pidx[:n]),
                                                  ts.perlabel_backward_weight(*f32(dz[:, :n], h, pidx[:n])))
    checks["perlabel_backward_input"] = _rel_err(perlabel_backward_input_triton(dz[:, :n], pidx[:n], pw[:n], Ht),
                                                 ts.perlabel_backward_input(*f32(dz[:, :n], pidx[:n], pw[:n]), Ht))
    tol = TOLERANCE[dtype]
    failed = sorted(k for k, v in checks.items() if not v <= tol)

    hg, wg, bg = (t.detach().requires_grad_(True) for t in (h, w, bias))
    x = torch.randn(B, Fi, generator=gen, device=device, dtype=dtype)
    wd = torch.randn(K * G, Fi, generator=gen, device=device, dtype=dtype) * Fi ** -0.5
    bd = torch.zeros(K * G, device=device, dtype=dtype)
    xg, wdg, bdg = (t.requires_grad_(True) for t in (x.clone(), wd.clone(), bd.clone()))
    e = dtype.itemsize
    c_fwd, c_bw = ts.tail_forward_cost(shape, dtype), ts.tail_backward_weight_cost(shape, dtype)
    c_bi, c_fused = ts.tail_backward_input_cost(shape, dtype), ts.tail_fused_bce_cost(shape, dtype)
    m_bi = tail_backward_input_traffic(shape, dtype)
    c_pf, c_pbw = ts.perlabel_forward_cost(pshape, dtype), ts.perlabel_backward_weight_cost(pshape, dtype)
    c_pbi = ts.perlabel_backward_input_cost(pshape, dtype)

    def torch_fwd_bwd():
        z = ts.tail_forward(hg, idx, wg, bg)
        return torch.autograd.grad(z, (hg, wg, bg), dz)

    def dense_fwd_bwd():
        return torch.autograd.grad(F.linear(xg, wdg, bdg), (xg, wdg, bdg), dz)

    tf = lambda: tail_forward_triton(h, idx, w, bias)  # noqa: E731
    tbw = lambda: tail_backward_weight_triton(dz, h, idx)  # noqa: E731
    tbi = lambda: tail_backward_input_triton(dz, idx, w, Ht, csr=csr)  # noqa: E731
    pbw = lambda: perlabel_backward_weight_triton(dz, h, pidx)  # noqa: E731
    pbi = lambda: perlabel_backward_input_triton(dz, pidx, pw, Ht, csr=pcsr)  # noqa: E731
    ops = [
        Op("torch group-shared autograd fwd", lambda: ts.tail_forward(h, idx, w, bias), c_fwd),
        Op("torch group-shared autograd fwd+bwd", torch_fwd_bwd, _add(c_fwd, c_bw, c_bi)),
        Op("dense FLOPs-matched fwd", lambda: F.linear(x, wd, bd), _dense_cost(B, Fi, K * G, e, False)),
        Op("dense FLOPs-matched fwd+bwd", dense_fwd_bwd, _dense_cost(B, Fi, K * G, e, True)),
        Op("triton tail_forward", tf, c_fwd),
        Op("triton tail_forward (1 group per program)", tf1, c_fwd),
        Op("triton tail_forward (2 groups per program)", tf2, c_fwd),
        Op("triton tail_backward_weight", tbw, c_bw),
        Op("triton tail_backward_input (CSR, deterministic)", tbi, c_bi, m_bi),
        Op("triton tail_backward_input (atomicAdd)", lambda: tail_backward_input_atomic(dz, idx, w, Ht), c_bi),
        Op("triton fwd + both bwd", lambda: (tf(), tbw(), tbi()), _add(c_fwd, c_bw, c_bi), _add(c_fwd, c_bw, m_bi)),
        *(Op(f"triton fused bce fwd+loss+bwd (positives as {'a list' if fmt == 'list' else fmt})", fused[fmt],
             c_fused, tail_fused_bce_traffic(shape, dtype, fmt)) for fmt in FUSED_FORMATS.values()),
        Op("triton per-label fwd", lambda: perlabel_forward_triton(h, pidx, pw), c_pf),
        Op("triton per-label bwd weight", pbw, c_pbw),
        Op("triton per-label bwd input", pbi, c_pbi),
        Op("triton per-label bwd (both)", lambda: (pbw(), pbi()), _add(c_pbw, c_pbi)),
        Op("CSR build (once per rewiring)", lambda: build_slot_csr(idx, Ht), FlopsBytes(0.0, 8.0 * K * Fi)),
    ]
    results = []
    for op in ops:
        times_ms = _times_ms(op.fn, device, warmup, repeats, flush)
        med = statistics.median(times_ms) / 1e3
        row = {"name": op.name, "ms": med * 1e3, "p10_ms": quantile(times_ms, 0.1),
               "p90_ms": quantile(times_ms, 0.9), "repeats": len(times_ms), "flops": op.cost.flops,
               "bytes": op.cost.bytes, "tflops": op.cost.flops / med / 1e12, "tbps": op.cost.bytes / med / 1e12,
               "pct_peak_flops": 100 * op.cost.flops / med / roof.peak_flops,
               "pct_copy": 100 * op.cost.bytes / med / roof.copy_bytes_per_s}
        if op.moved is not None:
            row.update(moved_bytes=op.moved.bytes, moved_tbps=op.moved.bytes / med / 1e12,
                       moved_pct_copy=100 * op.moved.bytes / med / roof.copy_bytes_per_s)
        results.append(row)
    ms = {r["name"]: r["ms"] for r in results}
    ratios = {"per-label / group-shared fwd": ms["triton per-label fwd"] / ms["triton tail_forward"],
              "per-label / group-shared bwd": ms["triton per-label bwd (both)"]
              / (ms["triton tail_backward_weight"] + ms["triton tail_backward_input (CSR, deterministic)"]),
              "group-shared fwd+bwd / dense FLOPs-matched fwd+bwd": ms["triton fwd + both bwd"]
              / ms["dense FLOPs-matched fwd+bwd"]}
    return {"shape": {**cfg, "K": K, "P": shape["P"]}, "dtype": str(dtype).replace("torch.", ""), "tolerance": tol,
            "checks": checks, "failed_checks": failed, "rows": results, "ratios": ratios}


def markdown(result: dict) -> str:
    s = result["shape"]
    head = (f"### B={s['B']}, Ht={s['Ht']}, L={s['L']:,} (K={s['K']:,} x G={s['G']}), F={s['F']}, {result['dtype']}\n\n"
            + ("checks: all within {:.0e} of the fp32 torch reference\n\n".format(result["tolerance"])
               if not result["failed_checks"] else f"**FAILED checks (timings not valid): {result['failed_checks']}**\n\n"))
    lines = ["| implementation | ms (p10-p90) | TFLOP/s | TB/s (min bytes) | % copy | % peak FLOP/s | TB/s moved |",
             "|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        moved = f"{r['moved_tbps']:.3g} ({r['moved_pct_copy']:.3g}%)" if "moved_tbps" in r else ""
        lines.append(f"| {r['name']} | {r['ms']:.3f} ({r['p10_ms']:.3f}-{r['p90_ms']:.3f}) | {r['tflops']:.3g} | "
                     f"{r['tbps']:.3g} | {r['pct_copy']:.3g}% | {r['pct_peak_flops']:.3g}% | {moved} |")
    ratios = "\n".join(f"- {k}: {v:.2f}x" for k, v in result["ratios"].items())
    return head + "\n".join(lines) + "\n\n" + ratios + "\n"


def knob_table(rows: list[dict], keys: dict[str, str], columns: dict[str, str], title: str) -> str:
    """A knob sweep as Markdown: the knob values (``keys``: row key -> header), then one column per
    ``columns`` entry; in each, the least float (a median ms) is in bold, floats print to 3 decimals and any
    other cell (a failed point's error name, a preformatted note) as it is."""
    def cell(value: Any, best: float | None) -> str:
        if not isinstance(value, float):
            return str(value)
        return f"**{value:.3f}**" if value == best else f"{value:.3f}"
    best = {n: min((r[n] for r in rows if isinstance(r[n], float)), default=None) for n in columns}
    lines = ["| " + " | ".join([*keys.values(), *columns.values()]) + " |", "|" + "---|" * (len(keys) + len(columns))]
    lines += ["| " + " | ".join([*(str(r[k]) for k in keys), *(cell(r[n], best[n]) for n in columns)]) + " |"
              for r in rows]
    return f"{title}\n\n" + "\n".join(lines) + "\n"


def tune_markdown(rows: list[dict]) -> str:
    """The tail kernels' sweep (``tune``) as Markdown."""
    keys = {"block_b": "block_b", "num_warps": "warps", "num_stages": "stages"}
    columns = {n: f"{n} ms" for n in rows[0] if n not in keys}
    return knob_table(rows, keys, columns, "kernel knob sweep (best per column in bold):")


def kernel_device(script: str, smoke: bool) -> torch.device | None:
    """CUDA when there is a GPU and the interpreter is off; else, for a --smoke run, the CPU with Triton's
    interpreter (switched on here, before the kernels are first imported); else None, after one sentence."""
    if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        return torch.device("cuda")
    if not smoke:
        print(f"{script} needs a CUDA device (or --smoke on the CPU interpreter)", file=sys.stderr)
        return None
    os.environ.setdefault("TRITON_INTERPRET", "1")
    return torch.device("cpu")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="write the JSON results here")
    parser.add_argument("--configs", choices=("main", "all"), default="all")
    parser.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default=None)
    parser.add_argument("--repeats", type=int, default=None, help="timed calls per op (default 20, smoke 2)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--ceilings", choices=("measured", "anchors"), default="measured")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, few repeats; on a CPU via TRITON_INTERPRET=1")
    parser.add_argument("--tune", action="store_true", help="also sweep the tail_* kernel knobs (TUNE_GRID)")
    args = parser.parse_args(argv)
    device = kernel_device("benchmarks.kernels", args.smoke)
    if device is None:
        return 2
    cuda = device.type == "cuda"
    # The interpreter computes bf16 wrongly: the CPU smoke runs fp32.
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if cuda else torch.float32)
    repeats = args.repeats or (2 if args.smoke else 20)
    warmup = 1 if args.smoke else args.warmup
    roof = _roof(device, dtype, args.ceilings == "measured")
    from profilers.fine import _flush_buffer
    flush = _flush_buffer(device)
    configs = list(SMOKE) if args.smoke else _configs(args.configs)
    import triton
    results = []
    print(f"# HASTE tail kernels on {torch.cuda.get_device_name(device) if cuda else 'CPU (Triton interpreter)'}, "
          f"torch {torch.__version__}, triton {triton.__version__}\n\nceilings: {roof.peak_flops / 1e12:.0f} TFLOP/s, "
          f"{roof.copy_bytes_per_s / 1e12:.2f} TB/s copy ({roof.source}); timing: "
          f"{'CUDA events, L2 flushed' if flush is not None else 'perf_counter'}, median of {repeats}\n")
    for cfg in configs:
        result = run_config(cfg, dtype, device, repeats, warmup, roof, flush)
        results.append(result)
        print(markdown(result), flush=True)
        if args.tune:
            result["tune"] = tune(cfg, dtype, device, repeats, warmup, flush, SMOKE_TUNE_GRID if args.smoke else TUNE_GRID)
            print(tune_markdown(result["tune"]), flush=True)
        if cuda:
            torch.cuda.empty_cache()
    with open(args.out, "w") as f:
        json.dump({"device": str(device), "torch": torch.__version__, "triton": triton.__version__,
                   "ceilings": {"peak_flops": roof.peak_flops, "copy_bytes_per_s": roof.copy_bytes_per_s,
                                "source": roof.source}, "repeats": repeats, "configs": results}, f, indent=1)
    return 1 if any(r["failed_checks"] for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
