"""The generic knob space the adapter applies itself, shaped by what it learned about the job (``facts``).

Every default is what the user's own loop does: fp32, the optimizer as they built it, eager mode, batches built in
the training process from pageable memory, the loss read on the host every step, dense embedding gradients.
"""

from __future__ import annotations

from sg_opt.job.facts import JobFacts
from targets.protocol import Constraint, Knob, KnobSpace

COMPILE_MODES = ("none", "default", "reduce-overhead", "max-autotune-no-cudagraphs")
METRICS_EVERY = (1, 10, 100)


def _optimizer_knobs(facts: JobFacts) -> tuple[Knob, ...]:
    return (Knob("optimizer_impl", "choice", "default", category="kernel", numerics="reorder", choices=facts.impls,
                 why=f"how {facts.optimizer.__name__} runs its update: default lets torch pick (a loop over parameters "
                     "on the CPU), foreach batches the parameters' ops, fused runs the whole update as one kernel "
                     "per group: one pass over the state instead of one per elementwise op"),)


def _embedding_knobs(facts: JobFacts) -> tuple[Knob, ...]:
    if facts.sparse is None:
        return ()
    match = facts.sparse
    knobs = [Knob("sparse_embedding_grads", "bool", False, category="embedding",
                  numerics="reorder" if match.same_math else "model",
                  why=f"dense gradients write and update every row of every embedding table every step; sparse "
                      f"ones only the looked-up rows, updated by {match.optimizer.__name__} ({match.why})")]
    if facts.fusable:
        knobs.append(Knob("embedding_fusion", "bool", False, category="embedding", numerics="reorder",
                          active_when=(("sparse_embedding_grads", (True,)),),
                          why="the embedding bags of one list as one table: one parameter, one sparse gradient "
                              "and one optimizer update instead of one per table (with sparse gradients only: a "
                              "dense gradient of the fused table would be written per lookup)"))
    return tuple(knobs)


def _graph_legal(config) -> bool:
    return not config["cuda_graphs"] or (config["compile"] == "none" and not config.get("sparse_embedding_grads"))


def knob_space(facts: JobFacts) -> KnobSpace:
    knobs = (
        Knob("precision", "choice", "fp32", category="precision", numerics="precision",
             choices=("fp32", "bf16-autocast", "fp16-autocast"),
             why="fp32 is the safe first choice; autocast runs matmuls and convolutions in bf16 or fp16 (tensor cores, "
                 "half the bytes) with fp32 weights, at a bounded loss of precision"),
        Knob("tf32", "bool", False, category="precision", numerics="precision",
             why="fp32 matmuls on TF32 tensor cores (10-bit mantissa inputs, fp32 accumulation): several times "
                 "faster fp32 products on Ampere and later (CUDA only; convolutions use TF32 by torch's default)"),
        *_optimizer_knobs(facts),
        Knob("compile", "choice", "none", category="compile", numerics="reorder", choices=COMPILE_MODES,
             why="torch.compile of the model: fused elementwise kernels and fewer launches (reduce-overhead adds CUDA "
                 "graphs), at a compile cost when the job starts"),
        Knob("cuda_graphs", "bool", False, category="compile", numerics="reorder",
             why="capture forward, backward and optimizer step once and replay them as one CUDA graph: one launch a "
                 "step where an eager step launches hundreds (CUDA only; static shapes, not with compile or sparse "
                 "gradients)"),
        Knob("data_workers", "choice", 0, category="data", numerics="exact", choices=(0, 1, 2, 4),
             why="0 builds batches in the training process between steps; workers build them in other processes "
                 "while the step runs, in the same order"),
        Knob("pin_memory", "bool", False, category="data", numerics="exact",
             why="batches in page-locked memory: copied at bus speed, and asynchronously (CUDA only)"),
        Knob("prefetch_to_device", "bool", False, category="data", numerics="exact",
             why="copy the next batch to the device on a side stream while the current step runs (CUDA only)"),
        Knob("metrics_every", "choice", 1, category="host", numerics="exact", choices=METRICS_EVERY,
             why="steps between host reads of the loss (.item()): each read waits for the device to finish, so the "
                 "host cannot queue the next step meanwhile; deferred reads log the very same values"),
        *_embedding_knobs(facts),
    )
    constraints = (Constraint("cuda_graphs needs compile none and dense embedding gradients", _graph_legal),)
    return KnobSpace(knobs, constraints)
