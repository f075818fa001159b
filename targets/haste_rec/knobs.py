"""The reference trainer's knob space: every value sg-opt may change, with its reason.

The defaults are the baseline config a team writes first: fp32, the torch reference backends,
device-resident tables with plain dense gradients, and simple in-process data loading. None is
sabotaged; the room for improvement comes from real engineering (precision, fused kernels, sparse
updates, overlap of data loading), as in the seed's 670 ms -> 309 ms.
"""

from __future__ import annotations

from typing import Any, Mapping

from targets.haste_rec.host_threads import HOST_THREADS
from targets.protocol import Constraint, Knob, KnobSpace

PRESET = "preset"  # a model-shape knob at this value takes the size preset's number
TRITON_TAIL = (("tail_backend", ("triton", "triton-fused-loss")),)  # when the tail's tile knobs matter
# when the Triton tail multiplies fp32 (no bf16): the only case tail_fp32_dot changes anything
TRITON_TAIL_FP32 = TRITON_TAIL + (("precision", ("fp32",)),)
# when the embedding kernels' knobs matter: backend triton runs its kernels unless grad mode is dense
TRITON_EMBEDDING = (("embedding_backend", ("triton",)), ("embedding_grad_mode", ("sparse", "fused")))
CACHED_TABLES = (("embedding_placement", ("cached",)),)  # when the device caches' own knobs matter

KNOBS = (
    Knob("precision", "choice", "fp32", category="precision", numerics="precision",
         choices=("fp32", "bf16-autocast", "bf16"),
         why="fp32 is the safe first choice; bf16 halves bytes and uses the tensor cores, at a bounded loss of precision"),
    Knob("matmul_precision", "choice", "highest", category="precision", numerics="precision",
         choices=("highest", "high"),
         why="how fp32 matrix products multiply (torch.set_float32_matmul_precision, and the Triton tail's tl.dot): "
             "highest keeps exact fp32 products; high lets them use TF32 tensor cores (10-bit mantissa inputs, "
             "fp32 accumulation), several times faster for fp32 GEMMs on Ampere and later (CUDA only)"),
    # The tail backends compute the same products in the dtype and matmul precision the two knobs above
    # chose (fp32 Triton products use IEEE fp32 unless matmul_precision says otherwise), so switching
    # backend only reassociates sums: "reorder".
    # Running the tail in bf16 is a change of precision and stays the precision knob's business.
    Knob("tail_backend", "choice", "torch", category="kernel", numerics="reorder",
         choices=("torch", "slots", "triton", "triton-fused-loss"),
         why="torch: autograd through gather+einsum, simple and obviously right; slots: the tail's forward and "
             "backward products as replaceable kernel slots (torch references unless a kernel replaces them); "
             "triton: the slots as Triton gather-GEMM kernels, deterministic; triton-fused-loss: also fuses the "
             "tail's BCE loss and all its gradients into one pass, so the B x L logits are never written (one "
             "process only)",
         single_process=("triton-fused-loss",)),
    Knob("tail_block_b", "choice", "auto", category="kernel", numerics="reorder", choices=("auto", 16, 32, 64, 128),
         why="batch rows per tile of the Triton tail kernels (tl.dot's M): larger tiles reuse each group's weights "
             "more but hold more registers; it sets the chunking of the weight-gradient sums (auto: a fixed shape rule)",
         active_when=TRITON_TAIL),
    Knob("tail_num_warps", "choice", "auto", category="kernel", numerics="reorder", choices=("auto", 2, 4, 8),
         why="warps per program of the Triton tail kernels: more warps hide more latency but can change the MMA "
             "instruction (auto: a fixed shape rule)", active_when=TRITON_TAIL),
    Knob("tail_num_stages", "choice", "auto", category="kernel", numerics="exact", choices=("auto", 1, 2, 3, 4),
         why="software-pipelining depth of the Triton tail kernels' batch loop: deeper stages prefetch the next "
             "gathered tile while the current one multiplies, at the cost of shared memory; no change to the sums",
         active_when=TRITON_TAIL),
    # 3xTF32 splits each fp32 operand into a TF32 head and a TF32 tail and sums three tensor-core products,
    # dropping only tail x tail: a few fp32 ulps per product, fp32 accumulation. That is the size of the
    # float-reassociation drift the reorder band is calibrated on, so that value is declared "reorder" and
    # held to that band. One TF32 pass (10-bit mantissa inputs) is a precision change, for the tail alone:
    # held to the precision band, like matmul_precision=high, which also moves torch's own matmuls.
    # "auto" follows matmul_precision; a set value holds under TF32 matmuls too: at `xl` on an H200 the Triton
    # tail's own TF32 pass moved the loss 0.021-0.033 (precision band 0.02) where TF32 for torch's matmuls
    # alone had moved it 0.0055, so the fused tail could join TF32 matmuls only with 3xTF32 products.
    Knob("tail_fp32_dot", "choice", "auto", category="kernel", numerics="reorder",
         choices=("auto", "ieee", "tf32x3", "tf32"), value_numerics=(("tf32", "precision"),),
         why="how the Triton tail's tl.dot multiplies fp32: auto as matmul_precision says (ieee at highest, tf32 "
             "at high); ieee on the CUDA cores (exact products); tf32x3 as three TF32 tensor-core products (a "
             "few fp32 ulps per product; the fused loss kernel took 3.07 ms against 7.47 at size large's shape "
             "on an H200); tf32 as one (inputs rounded to TF32, a precision change; 1.92 ms at fp32 TF32 in the "
             "same sweep)",
         active_when=TRITON_TAIL_FP32),
    Knob("embedding_placement", "choice", "device", category="embedding", numerics="reorder",
         choices=("device", "host", "cached"),
         why="device is simplest while the tables fit in device memory; host frees it; cached keeps the hot rows "
             "on the device over host tables (SparseGear's multi-level store)"),
    Knob("embedding_grad_mode", "choice", "dense", category="embedding", numerics="reorder",
         choices=("dense", "sparse", "fused"),
         why="dense is plain autograd on nn.Parameter tables, a table-sized gradient every step; sparse and fused "
             "touch only the rows a batch used (fused applies row-wise Adagrad inside backward)"),
    Knob("embedding_backend", "choice", "torch", category="kernel", numerics="reorder",
         choices=("torch", "triton"),
         why="torch: embedding_bag and a dozen small row ops; triton: one pooling kernel over all tables (device "
             "rows, cache slots, host rows gathered to the device) and, with grad mode fused, one fused "
             "backward + row-wise Adagrad over the touched rows (device or cached); grad mode dense stays torch"),
    Knob("embedding_tile_elements", "choice", "auto", category="kernel", numerics="reorder",
         choices=("auto", 1024, 2048, 4096, 8192),
         why="fp32 elements of one Triton embedding program's [rows, row-slice] tile: larger tiles add more looked-up "
             "rows per step (more loads in flight, more registers); it sets the chunking of the pooled sums "
             "(auto: 1024, the H200 sweep's best)", active_when=TRITON_EMBEDDING),
    Knob("embedding_num_warps", "choice", "auto", category="kernel", numerics="reorder", choices=("auto", 2, 4, 8),
         why="warps per program of the Triton embedding kernels: more warps keep more row loads in flight but "
             "split the tile's reductions differently (auto: a fixed shape rule)", active_when=TRITON_EMBEDDING),
    Knob("embedding_num_stages", "choice", "auto", category="kernel", numerics="exact", choices=("auto", 1, 2, 3, 4),
         why="software-pipelining depth of the Triton embedding kernels' loops over looked-up positions: deeper "
             "stages prefetch the next rows while the current ones are summed; no change to the sums "
             "(auto: Triton's default)", active_when=TRITON_EMBEDDING),
    Knob("embedding_cache_fraction", "float", 0.2, category="embedding", numerics="exact", low=0.01, high=1.0,
         why="rows the device cache holds, as a share of all rows (placement cached): more hits, more device memory"),
    Knob("embedding_cache_plan", "choice", "uniform", category="embedding", numerics="exact",
         choices=("uniform", "planned"),
         why="uniform gives each table the same share of the cache; planned splits one budget by measured access "
             "frequencies to minimise expected misses"),
    Knob("embedding_eviction", "choice", "lru", category="embedding", numerics="exact", choices=("lru", "lfu"),
         why="which cached row leaves on a miss: least recently used, or least frequently used (better for stable Zipf skew)"),
    Knob("embedding_cache_index", "choice", "host", category="embedding", numerics="exact", choices=("host", "device"),
         why="where the device caches' id -> slot maps and eviction stamps live (placement cached): on the host a "
             "lookup needs no device round trip, but every step's bookkeeping is host work; on the device it runs "
             "as kernels and only the moved rows' ids come back. The same decisions either way",
         active_when=CACHED_TABLES),
    Knob("embedding_cache_overlap", "bool", False, category="embedding", numerics="exact",
         why="placement cached: decide the next batch's cache moves while the device still runs the current step "
             "(the decisions on a side stream of their own when the index is on the device) and write evicted rows "
             "back from a worker thread, so that the host neither waits for the step nor for the write-backs; the "
             "same rows move between the same slots",
         active_when=CACHED_TABLES),
    Knob("embedding_cache_prefetch", "bool", False, category="embedding", numerics="exact",
         why="placement cached: prepare the next batch's cache lookup (slot decisions, gathers of missed rows from "
             "the host tables, their copies in) on a thread of its own while the current step runs, holding the "
             "current batch's rows so that none is evicted before its update; every row keeps its value (on "
             "several ranks the next batch's input exchange runs a step early, and each owner prepares its rows)",
         active_when=CACHED_TABLES),
    Knob("embedding_opt_state_cache_fraction", "float", 0.2, category="embedding", numerics="exact",
         low=0.01, high=1.0,
         why="optimizer state is cached independently of the parameters; its share of rows on the device (placement cached)"),
    Knob("embedding_hbm_budget_gb", "float", -1.0, category="memory", numerics="exact", low=-1.0, high=100_000.0,
         why="device memory (GB, 1e9 bytes) the embedding tables and their caches may use; a build over it fails. "
             "Set by the user, never tuned (-1 takes the size preset's: unlimited except large-cached, 1/4 of its tables)",
         user_setting=True),
    Knob("embedding_pool_on_host", "bool", False, category="embedding", numerics="reorder",
         why="for host tables, pool on the host so only pooled vectors cross the bus instead of every looked-up row",
         active_when=(("embedding_placement", ("host",)),)),
    Knob("data_workers", "choice", 0, category="data", numerics="exact", choices=(0, 1, 2, 4),
         why="0 builds batches in the training process (simple, no IPC); workers overlap batch building with the step"),
    Knob("pin_memory", "bool", False, category="data", numerics="exact",
         why="page-locked host memory for the batches and for host tables' row traffic (rows looked up, their "
             "gradients, cache moves): copies at bus speed, and to the device asynchronously (CUDA only)"),
    Knob("prefetch_to_device", "bool", False, category="data", numerics="exact",
         why="copy the next batch to the device on a side stream while the current step runs (CUDA only)"),
    Knob("pack_batches", "bool", False, category="data", numerics="exact",
         why="the loader flattens each batch's sparse features into the embedding store's shared row space and "
             "packs the batch into one byte buffer: one pin, hand-over and copy instead of one per "
             "table's tensor (55 at 26 tables), and no per-table adds in the embed phase (one process only: a "
             "sharded run exchanges per-table ids)",
         single_process=(True,)),
    Knob("host_threads", "choice", "auto", category="host", numerics="reorder", choices=HOST_THREADS,
         why="the trainer's intra-op CPU threads: the worker's count (torch's own on a CPU run, at most 16 beside a "
             "GPU), half or a quarter of it. A team with a thread on every CPU stalls at each parallel op's end "
             "whenever another thread takes one of its CPUs; fewer threads parallelise each host op less (reorder: "
             "CPU reductions split over fewer threads)"),
    Knob("compile_encoder", "bool", False, category="compile", numerics="reorder",
         why="torch.compile fuses the encoder's elementwise ops into its matmuls; costs compile time at start"),
    Knob("dense_cuda_graph", "bool", False, category="compile", numerics="reorder",
         active_when=(("tail_backend", ("triton-fused-loss",)), ("precision", ("fp32", "bf16")),
                      ("compile_encoder", (False,))),
         why="replay the encoder, head, fused tail and losses, forward and backward, as CUDA graphs: one launch "
             "per phase where a host-bound step launched dozens (CUDA only, one process only; captured again after "
             "each rewire)",
         single_process=(True,)),
    Knob("optimizer_impl", "choice", "default", category="kernel", numerics="reorder",
         choices=("default", "for-loop", "foreach", "fused"),
         why="default lets torch pick; foreach batches parameter updates; fused runs Adam/SGD as one kernel per group"),
    # The sharding plan of a run on several ranks (torch.distributed); one process ignores both. Any
    # plan trains the single-process model; only the association of sums changes: "reorder".
    Knob("embedding_sharding", "choice", "table-wise", category="distributed", numerics="reorder",
         choices=("table-wise", "row-wise"),
         why="table-wise puts whole tables on ranks (few, large all-to-all messages, load as uneven as the tables); "
             "row-wise splits every table's rows over all ranks (even load and memory, every rank in every lookup)"),
    Knob("tail_sharding", "choice", "replicated", category="distributed", numerics="reorder",
         choices=("replicated", "label-groups"),
         why="replicated trains the HASTE output layer data parallel (its gradient all-reduced every step); "
             "label-groups gives each rank whole label groups over the global batch (hidden states all-gathered, "
             "input gradients reduce-scattered, no output-layer all-reduce, 1/world of its memory)"),
    Knob("grouping", "choice", "semantic", category="model", numerics="model",
         choices=("random", "frequency", "semantic"),
         why="how tail labels share fan-in: semantic (k-means of label features) is HASTE's best; others are ablations"),
    Knob("group_size", "choice", PRESET, category="model", numerics="model", choices=(PRESET, 8, 16, 32, 64),
         why="G labels share one fan-in set: larger G means fewer, denser groups (faster) at some accuracy"),
    Knob("fan_in", "choice", PRESET, category="model", numerics="model", choices=(PRESET, 8, 16, 32, 64, 128),
         why="F input dims per tail group: the tail's FLOPs and accuracy both grow with it"),
    Knob("head_fraction", "float", -1.0, category="model", numerics="model", low=-1.0, high=0.5,
         why="share of most frequent labels in the dense head (-1 takes the size preset)"),
    Knob("rewire_every", "int", 200, category="model", numerics="model", low=0, high=100_000,
         why="steps between HASTE's rewiring of low-magnitude fan-in slots (0 = never)"),
)


def _dense_grad_only_on_device(config) -> bool:
    return config["embedding_placement"] == "device" or config["embedding_grad_mode"] != "dense"


CONSTRAINTS = (
    Constraint("embedding_grad_mode dense needs embedding_placement device: host and cached tables are "
               "updated row-wise (use sparse or fused)", _dense_grad_only_on_device),
)

KNOB_SPACE = KnobSpace(KNOBS, CONSTRAINTS)


def tail_dot_precision(config: Mapping[str, Any]) -> str:
    """The Triton tail's fp32 tl.dot precision under a resolved config: tail_fp32_dot, its "auto" resolved by
    matmul_precision ("tf32" at high, "ieee" at highest)."""
    dot = config["tail_fp32_dot"]
    if dot == "auto":
        return "tf32" if config["matmul_precision"] == "high" else "ieee"
    return dot
