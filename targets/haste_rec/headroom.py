"""The bundled trainer's headroom model (``Target.headroom``): how much of each phase its knobs can plausibly
win, given the values they have, and its own finding, fp32-products, where the Triton tail multiplies fp32 without
TF32. The core asks it first and falls back on its generic figures (``profilers.findings``).

Headroom per category (in parentheses, what the finding's share measures; H200 figures from
BENCHMARKS.md):

- data-wait (data phase): 3.5 with in-process loading (data_workers 0, no prefetch), else 1.5;
  worker processes with pinned prefetch took data from 9.8 to 2.8 ms.
- optimizer (optimizer phase): 20 with embedding_grad_mode dense (fused row-wise updates took it
  from 48.2 to 1.24 ms, 39x; half of that claimed); 3 with host tables (their row-wise Adagrad runs
  on the host: 41.5 ms a step at large-cached, 4.5 ms with device tables at large, both with
  sparse gradients; a device cache moves the hot rows' updates to the device); 2 with
  default/for-loop optimizers; else 1.3.
- embedding-bound (embed phase): 3 with host or cached tables (rows cross the bus / cache
  bookkeeping); else 2 (one fused pooled gather).
- tail-gather-bound (tail phase): 3 with tail_backend torch (gather + einsum materialise [B, K, F],
  and the logits' byte floor is about 20x below the measured tail); 2 with slots (explicit products,
  the gathered tile still materialised); 1.3 with triton or triton-fused-loss (already a gather-GEMM
  kernel, only its meta-parameters left: tail_block_b=64 made the step 0.891x as long at size large
  on an H200).
- fp32-products (tail phase, Triton tail multiplying fp32 without TF32: precision fp32, tail_fp32_dot
  ieee or tf32x3, or auto at matmul_precision highest): 2.5 with ieee (tl.dot on fp32 runs as CUDA-core
  FMAs, and the fused loss kernel took 7.47 ms at size large's shape against 3.07 as three TF32
  tensor-core products on an H200); 1.5 with tf32x3 (2.95 against 1.92 in one TF32 pass). Only the
  precision rules answer it (no sweep): the tile knobs do not change how it multiplies.
- loss (loss phase): 2; BCE with dense targets moves the logits' size about four times, a fused
  loss twice. 1.2 with tail_backend triton-fused-loss, whose tail kernel already computes the loss.
- backward (backward phase): 3 while the tail differentiates through gather + einsum (tail_backend
  torch: autograd's index_put_ scatter took 50.2 of the 58.9 ms backward at size large on an
  H200), else 1.5 (dense layers' backward GEMMs, near their floor).
- cache-misses: the core's figure from the miss rate, and only with cached tables (none otherwise).
"""

from __future__ import annotations

from typing import Any, Mapping

from targets.haste_rec.knobs import tail_dot_precision
from targets.tuning import Headroom

PHASE_CATEGORIES = ("data-wait", "optimizer", "embedding-bound", "tail-gather-bound", "loss", "backward")
NO_CACHE = Headroom(1.0, "no device cache: the tables are not cached")


def phase_headroom(category: str, knobs: Mapping[str, Any]) -> Headroom:
    """The documented headroom of a phase category under the current knob values (see the module docstring)."""
    if category == "data-wait":
        if knobs.get("data_workers", 0) == 0 and not knobs.get("prefetch_to_device", False):
            return Headroom(3.5, "batches are built in the training process; worker processes with pinned "
                                 "prefetch took data from 9.8 to 2.8 ms on an H200")
        return Headroom(1.5, "loading already overlaps the step; what is left is the copy and the wait")
    if category == "optimizer":
        if knobs.get("embedding_grad_mode") == "dense":
            return Headroom(20.0, "dense table-sized embedding gradients; fused row-wise updates took the "
                                  "optimizer from 48.2 to 1.24 ms on an H200")
        if knobs.get("embedding_placement") == "host":
            return Headroom(3.0, "row-wise Adagrad over host tables runs on the host's CPUs (41.5 ms a step at "
                                 "large-cached on an H200 host, 4.5 ms with device tables at large, both sparse); "
                                 "a device cache updates the hot rows on the device")
        if knobs.get("optimizer_impl", "default") in ("default", "for-loop"):
            return Headroom(2.0, "one update kernel per parameter; foreach/fused optimizers batch them")
        return Headroom(1.3, "the optimizer is already batched; little is left to fuse")
    if category == "embedding-bound":
        if knobs.get("embedding_placement") in ("host", "cached"):
            return Headroom(3.0, "rows cross the host bus or go through cache bookkeeping; device placement "
                                 "(when the tables fit) or host pooling avoids it")
        return Headroom(2.0, "pooled gathers from device tables; one fused lookup kernel reads each row once")
    if category == "tail-gather-bound":
        backend = knobs.get("tail_backend", "torch")
        if backend in ("triton", "triton-fused-loss"):
            return Headroom(1.3, "the tail is already a gather-GEMM Triton kernel; what is left is its meta-parameters "
                                 "(tail_block_b=64 made the whole step 0.891x as long at size large on an H200)")
        if backend == "slots":
            return Headroom(2.0, "explicit forward/backward products, but the gathered [B, K, F] tile is still "
                                 "materialised; a fused gather-GEMM kernel keeps it in registers")
        return Headroom(3.0, "gather + einsum materialise [B, K, F]; the logits' byte floor is about 20x lower, "
                             "a fused gather-GEMM kernel writes them once")
    if category == "loss":
        if knobs.get("tail_backend") == "triton-fused-loss":
            return Headroom(1.2, "the BCE and its gradient are already fused into the tail kernel; the logits never "
                                 "reach memory")
        return Headroom(2.0, "BCE with materialised dense targets moves the logits' size about four times; "
                             "a fused loss moves it twice")
    if category == "backward":
        if knobs.get("tail_backend", "torch") == "torch":
            return Headroom(3.0, "autograd through the tail's gather scatters its gradient with index_put_ "
                                 "(50.2 of 58.9 ms at size large on an H200); explicit backward kernels avoid it")
        return Headroom(1.5, "the backward's GEMMs and row gradients; little is left beyond kernel tuning")
    raise ValueError(f"no phase headroom for category {category!r}")



def fp32_products_headroom(knobs: Mapping[str, Any]) -> Headroom | None:
    """The Triton tail multiplying fp32 without TF32 (precision fp32, tail_fp32_dot ieee or tf32x3, or auto at
    matmul_precision highest): what TF32 products could win there; None otherwise."""
    dot = tail_dot_precision(knobs) if "tail_fp32_dot" in knobs else None
    fp32_tail = (knobs.get("tail_backend") in ("triton", "triton-fused-loss") and knobs.get("precision") == "fp32"
                 and dot in ("ieee", "tf32x3"))
    if not fp32_tail:
        return None
    if dot == "ieee":
        return Headroom(2.5, "tl.dot on fp32 runs as CUDA-core FMAs: the fused loss kernel took 7.47 ms at size "
                             "large's shape against 3.07 as three TF32 tensor-core products (tail_fp32_dot) on an H200",
                        cause="the Triton tail multiplies exact fp32 on the CUDA cores")
    return Headroom(1.5, "three TF32 tensor-core passes where one may do: the fused loss kernel took 2.95 ms "
                         "at size large's shape against 1.92 in one TF32 pass on an H200, if the precision "
                         "band allows", cause="the Triton tail multiplies fp32 as three TF32 tensor-core products")


def haste_headroom(category: str, knobs: Mapping[str, Any]) -> Headroom | None:
    """Its figure for a finding category under the incumbent's knobs; None: the core's generic one."""
    if category in PHASE_CATEGORIES:
        return phase_headroom(category, knobs)
    if category == "fp32-products":
        return fp32_products_headroom(knobs)
    if category == "cache-misses" and knobs.get("embedding_placement") != "cached":
        return NO_CACHE
    return None
