"""Generic rules: knob patches over the job adapter's knobs (``sg_opt.job``), each triggered by the finding
categories that name a cause it removes. A target without those knobs skips them; a target's own rules over the
same knob replace them (``state_machine.rules.catalog``). A rule's ``devices`` also keep the sweep off its value
elsewhere: compile and reduced precision are tried on a GPU only (a 2-core CPU run would spend minutes compiling).
"""

from __future__ import annotations

from targets.tuning import Rule

GENERIC_RULES: tuple[Rule, ...] = (
    Rule("generic-fused-optimizer", ("unfused-optimizer", "optimizer"), {"optimizer_impl": "fused"}, 0.8,
         "the optimizer's update as one fused kernel per group: one pass over parameters and state where the loop "
         "makes one per elementwise op", requires={"optimizer_impl": ("default", "for-loop", "foreach")}),
    Rule("generic-foreach-optimizer", ("unfused-optimizer", "optimizer", "launch/host-bound"),
         {"optimizer_impl": "foreach"}, 0.5, "the optimizer's ops batched over all parameters",
         requires={"optimizer_impl": ("default", "for-loop")}),  # from fused, a step back
    Rule("generic-sparse-embedding-grads", ("dense-embedding-grads", "optimizer"), {"sparse_embedding_grads": True},
         0.85, "sparse table gradients: only the looked-up rows are written and updated, not the whole table"),
    Rule("generic-embedding-fusion", ("embedding-bound", "launch/host-bound", "optimizer"),
         {"embedding_fusion": True}, 0.3, "the tables as one: one sparse gradient and one update instead of one "
                                          "per table", requires={"sparse_embedding_grads": (True,)}),
    Rule("generic-loader-worker", ("data-wait",), {"data_workers": 1}, 0.6,
         "build batches in a loader worker process while the step runs: one process more, the fewest CPUs taken "
         "from the step's own threads"),
    Rule("generic-loader-workers", ("data-wait",), {"data_workers": 2}, 0.5,
         "build batches in two loader processes, for batches that take longer to build than a step"),
    Rule("generic-loader-workers-4", ("data-wait",), {"data_workers": 4}, 0.4, "more loader processes"),
    Rule("generic-pinned-prefetch", ("data-wait", "unpinned-copies"), {"pin_memory": True, "prefetch_to_device": True},
         0.7, "page-locked batches copied on a side stream while the step runs", devices=("cuda",)),
    Rule("generic-pinned-copies", ("unpinned-copies",), {"pin_memory": True}, 0.6,
         "page-locked batches: one DMA at bus speed, without waiting for the kernels queued before it",
         devices=("cuda",)),
    Rule("generic-deferred-metrics", ("host-sync", "launch/host-bound"), {"metrics_every": 10}, 0.7,
         "read the loss on the host every 10 steps: the host queues the next steps while the device works"),
    Rule("generic-cuda-graphs", ("launch/host-bound", "host-sync"), {"cuda_graphs": True}, 0.7,
         "replay the whole step as one CUDA graph: one launch instead of hundreds", devices=("cuda",)),
    Rule("generic-compile-reduce-overhead", ("launch/host-bound", "forward"), {"compile": "reduce-overhead"}, 0.5,
         "torch.compile with CUDA graphs: fused kernels, replayed", devices=("cuda",)),
    Rule("generic-compile", ("launch/host-bound", "forward", "backward"), {"compile": "default"}, 0.4,
         "torch.compile: fused elementwise kernels, fewer launches", devices=("cuda",)),
    Rule("generic-compile-max-autotune", ("forward", "backward"), {"compile": "max-autotune-no-cudagraphs"}, 0.3,
         "torch.compile with autotuned kernels: the longest compile, for long jobs", devices=("cuda",)),
    Rule("generic-bf16-autocast", ("forward", "backward", "compute-bound kernel", "memory-bound kernel"),
         {"precision": "bf16-autocast"}, 0.6, "tensor cores and half the bytes, fp32 master weights",
         devices=("cuda",), device_only=True),
    Rule("generic-fp16-autocast", ("forward", "backward", "compute-bound kernel"), {"precision": "fp16-autocast"},
         0.3, "fp16 tensor cores: more mantissa than bf16, less range (no loss scaling: the precision band judges "
              "it)", devices=("cuda",), device_only=True),
    Rule("generic-tf32", ("forward", "backward", "compute-bound kernel"), {"tf32": True}, 0.6,
         "fp32 products on TF32 tensor cores, fp32 everywhere else", devices=("cuda",),
         requires={"precision": ("fp32",)}, device_only=True),
)
