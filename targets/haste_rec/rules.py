"""The bundled trainer's own rules for the offline proposer (``Target.rules``): knob patches over its knobs, each
triggered by finding categories, with the plausibility that ranks it (see ``state_machine.proposers.offline``).

They name its backends, placements and caches, so they live with it; the core adds its generic rules over the
knobs these leave alone (none, for this trainer: every generic rule's knob it has, it has rules of its own for).
"""

from __future__ import annotations

from targets.tuning import Rule

# The phases the dense CUDA graphs replay (the encoder, head, fused tail and losses, forward and backward); the
# backward phase also holds the embeddings' row update, which they do not.
DENSE_PHASES = ("encoder", "head", "tail", "loss", "backward")

RULES: tuple[Rule, ...] = (
    Rule("fused-embedding-update", ("optimizer", "embedding-bound"), {"embedding_grad_mode": "fused"}, 0.9,
         "row-wise Adagrad applied inside backward to the touched rows only: no table-sized gradient",
         requires={"embedding_placement": ("device", "cached")}),  # host tables: the device-cache rule carries it
    Rule("sparse-embedding-grad", ("optimizer",), {"embedding_grad_mode": "sparse"}, 0.6,
         "sparse table gradients touch only the looked-up rows"),
    Rule("fused-optimizer", ("optimizer",), {"optimizer_impl": "fused"}, 0.3,
         "one kernel per parameter group for Adam/SGD", devices=("cuda",)),
    Rule("fused-optimizer-launches", ("launch/host-bound",), {"optimizer_impl": "fused"}, 0.8,
         "one kernel per parameter group for Adam/SGD: on a host-bound step, a few launches where there were dozens, "
         "and less of the host's time held by the optimizer's Python (at large-cached with the cache prefetch, 10.34 "
         "-> 8.32 ms a step back to back, benchmarks/embed_host.py on an H200, 2026-12-04)", devices=("cuda",),
         host_phases=("optimizer",)),
    Rule("foreach-optimizer", ("optimizer",), {"optimizer_impl": "foreach"}, 0.25,
         "batched parameter updates"),
    Rule("loader-workers", ("data-wait",), {"data_workers": 2}, 0.6,
         "build batches in worker processes, overlapping the step"),
    Rule("pinned-prefetch", ("data-wait",), {"pin_memory": True, "prefetch_to_device": True}, 0.7,
         "page-locked batches copied on a side stream while the step runs", devices=("cuda",),
         requires={"data_workers": (1, 2, 4)}),
    Rule("loader-workers-4", ("data-wait",), {"data_workers": 4}, 0.4, "more loader processes"),
    Rule("packed-batches", ("data-wait", "embedding-bound"), {"pack_batches": True}, 0.5,
         "each batch packed by the loader into a few flat tensors already in the tables' shared row space: a few "
         "pins and copies instead of one per table, no per-table adds before the lookup"),
    Rule("loader-ring", ("data-wait",), {"data_workers": 2, "pack_batches": True}, 0.45,
         "loader workers that write packed batches into shared slots made once: a batch crosses as a slot number, "
         "not as fresh shared-memory storages handed over one by one (at large-cached on an H200, 2026-12-01, "
         "two and four workers handing over unpacked batches made the step 1.45x and 2.49x slower, with 11 ms "
         "of the 45 ms step spent building batches in the trainer)",
         requires={"pack_batches": (False,)}),  # over packed batches, loader-workers alone goes through the slots
    Rule("triton-tail", ("tail-gather-bound", "backward", "memory-bound kernel", "compute-bound kernel"),
         {"tail_backend": "triton"}, 0.8, "gather-GEMM tail kernels: the gathered tile stays in registers",
         devices=("cuda",), requires={"tail_backend": ("torch", "slots")}),
    Rule("triton-fused-loss", ("loss", "tail-gather-bound", "backward"), {"tail_backend": "triton-fused-loss"}, 0.85,
         "tail forward, BCE and its gradient in one pass: the logits never reach memory", devices=("cuda",),
         requires={"tail_backend": ("torch", "slots", "triton")}),
    Rule("triton-fused-loss-3xtf32", ("loss", "tail-gather-bound", "backward"),
         {"tail_backend": "triton-fused-loss", "tail_fp32_dot": "tf32x3"}, 0.84,
         "the fused tail with its fp32 products as three TF32 tensor-core products whatever matmul_precision says: "
         "faster than exact fp32 and, under TF32 matmuls, within a few ulps where the tail's own TF32 pass broke "
         "the precision band at xl", devices=("cuda",),
         requires={"tail_backend": ("torch", "slots", "triton"), "precision": ("fp32",)}),
    Rule("bf16-autocast", ("fp32-products", "tail-gather-bound", "backward", "compute-bound kernel",
                           "memory-bound kernel", "loss"),
         {"precision": "bf16-autocast"}, 0.6, "tensor cores and half the bytes, fp32 master weights",
         devices=("cuda",), device_only=True),
    Rule("tf32-matmuls", ("fp32-products", "tail-gather-bound", "backward", "compute-bound kernel", "loss"),
         {"matmul_precision": "high"}, 0.6,
         "fp32 products on TF32 tensor cores (torch's matmuls and the Triton tail's tl.dot): a smaller precision "
         "step than bf16, inputs rounded to a 10-bit mantissa, fp32 everywhere else", devices=("cuda",),
         requires={"precision": ("fp32",)}, device_only=True),
    Rule("tf32x3-tail", ("fp32-products",), {"tail_fp32_dot": "tf32x3"}, 0.8,
         "the Triton tail's fp32 products as three TF32 tensor-core products instead of CUDA-core FMAs, held "
         "to the reorder band", devices=("cuda",), requires={"tail_fp32_dot": ("auto", "ieee"),
                                                             "matmul_precision": ("highest",)}, device_only=True),
    Rule("tf32-tail", ("fp32-products",), {"tail_fp32_dot": "tf32"}, 0.65,
         "the Triton tail's fp32 products in one TF32 tensor-core pass, for the tail alone: a precision change, "
         "held to the precision band (TF32 for every matmul also moves torch's own)", devices=("cuda",),
         requires={"tail_fp32_dot": ("auto", "ieee", "tf32x3"), "matmul_precision": ("highest",)}, device_only=True),
    Rule("tail-slots", ("tail-gather-bound", "backward"), {"tail_backend": "slots"}, 0.3,
         "explicit forward/backward products instead of autograd through gather + einsum",
         requires={"tail_backend": ("torch",)}),
    Rule("triton-embeddings", ("embedding-bound",), {"embedding_backend": "triton"}, 0.6,
         "one pooled lookup over all tables in one launch", devices=("cuda",), device_only=True),
    Rule("pinned-row-traffic", ("optimizer", "embedding-bound"), {"pin_memory": True}, 0.6,
         "host tables' rows and row gradients, and each batch, cross the bus through page-locked buffers: one DMA "
         "at bus speed where pageable memory is staged by the driver and a batch's copy waits for every kernel "
         "queued before it (at large-cached with host tables, the optimizer phase waited on the device 26.8 ms of "
         "its 52)", devices=("cuda",),
         # Under the cache overlap the cached rows cross through page-locked buffers already; what pinning still
         # changes is each batch's copy, blocking from pageable memory (torch synchronises the stream after it, so
         # the host waits for every queued kernel). Two runs measured it there at 0.918 and 0.876, each
         # leaning faster under its floor.
         requires={"embedding_placement": ("host", "cached")}),
    Rule("host-pooling", ("embedding-bound",), {"embedding_pool_on_host": True}, 0.6,
         "only pooled vectors cross the bus", requires={"embedding_placement": ("host",)}),  # cached ignores it
    Rule("device-cache", ("embedding-bound", "optimizer", "data-wait"),
         {"embedding_placement": "cached", "embedding_grad_mode": "fused"}, 0.8,
         "keep the hot rows in a device cache over the host tables (SparseGear's multi-level store) and apply "
         "row-wise Adagrad inside backward", requires={"embedding_placement": ("host",)}),
    Rule("device-cache-index", ("embedding-bound", "launch/host-bound", "optimizer", "backward"),
         {"embedding_cache_index": "device"}, 0.7,
         "the device caches' bookkeeping (slot maps, eviction stamps, victims) as kernels on the device instead of "
         "host work on every step: once the caches are full every miss evicts, and at large-cached a step's "
         "prepares took 41-51 ms of host time on the 2-core VM (benchmarks/cache_steady.py)", devices=("cuda",),
         requires={"embedding_placement": ("cached",), "embedding_cache_index": ("host",)}),
    Rule("cache-overlap", ("embedding-bound", "launch/host-bound"), {"embedding_cache_overlap": True}, 0.8,
         "decide the next batch's cache moves on a side stream while the device still runs the step, and write "
         "evicted rows back from a worker thread: at large-cached an H200 step waited 3.40 ms in embed for the "
         "previous step, then spent 8.7 ms of host work there while the device idled; with it, the step ran 1.29x "
         "faster (sg-opt bench --vs, 2026-12-02)", devices=("cuda",),
         requires={"embedding_placement": ("cached",), "embedding_cache_index": ("device",),
                   "embedding_cache_overlap": (False,)}, host_phases=("embed",)),
    Rule("cache-prefetch", ("embedding-bound", "launch/host-bound"), {"embedding_cache_prefetch": True}, 0.7,
         "prepare the next batch's cache lookup (slot decisions, gathers of missed rows, their copies in) on a thread "
         "of its own while the step runs: at large-cached's best configuration (2026-12-04), 4.2 of a step's 12.1 ms "
         "of host time went to the caches' prepare (benchmarks/embed_host.py on an H200, 2026-12-04)",
         devices=("cuda",), requires={"embedding_placement": ("cached",), "embedding_cache_prefetch": (False,)},
         host_phases=("embed",)),
    Rule("fewer-host-threads", ("launch/host-bound", "embedding-bound"), {"host_threads": "half"}, 0.2,
         "half the trainer's CPU threads: beside a GPU its team has a thread on every CPU of a 16-core host, and stalls "
         "at every parallel op's end while a loader worker, a driver or pinning thread takes one of them (on the "
         "32-core host, 32 threads stepped in 216 ms median against 117 with 16, 2026-11-29)", devices=("cuda",),
         requires={"host_threads": ("auto",)}, host_phases=("embed",)),  # launches run on one thread anyway
    Rule("planned-cache", ("cache-misses",), {"embedding_cache_plan": "planned"}, 0.6,
         "split the cache by measured access frequencies"),
    Rule("lfu-cache", ("cache-misses",), {"embedding_eviction": "lfu"}, 0.4, "keep the stable Zipf head cached"),
    Rule("dense-cuda-graph", ("launch/host-bound",), {"dense_cuda_graph": True}, 0.7,
         "replay the dense part of the step as CUDA graphs: one launch per phase instead of dozens",
         devices=("cuda",), host_phases=DENSE_PHASES),
    Rule("compile-encoder", ("launch/host-bound",), {"compile_encoder": True}, 0.4,
         "fewer, fused kernels in the encoder", devices=("cuda",), host_phases=("encoder", "backward")),
)
