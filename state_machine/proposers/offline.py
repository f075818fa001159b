"""The offline proposer: a catalog of rules, no LLM, $0.

Each rule is triggered by a finding category and proposes a knob patch that is known to attack
that kind of bottleneck (fused row-wise embedding updates for a dense-gradient optimizer phase,
worker processes for data waits, Triton tail kernels for a gather-bound tail, ...). A rule's
*plausibility* is the share of the finding's Amdahl gain it can be expected to realise, so its
expected gain is ``1 + (finding.amdahl_gain - 1) * plausibility``, from the finding among its triggers that
promises the most; candidates are tried in that order. A rule that cuts the host work of some phases only
(``host_phases``: the dense CUDA graphs replay the encoder, head, tail and losses, not the embeddings' cache
moves) expects, from a launch/host-bound finding, only those phases' share of the host's work: at large-cached
after the device index (session 20) 60% of it was in `embed`, and the graphs had measured no difference there.
Likewise a kernel or precision rule (``device_only``) expects, from a phase's finding, only the share of the phase
the device works (``Finding.device_fraction``): there `embed` ran 1.61 ms on the device in 12.07 on the host, and
the Triton embeddings measured 1.376 (slower).

Rules name knobs of the bundled trainer; a rule whose knobs a target lacks is skipped, and so is one
whose ``requires`` the resolved incumbent does not meet (a tail rule never proposes a backend the
incumbent already went past: from the fused Triton tail, the autograd one is a step back). For any
target, a generic fallback then sweeps the other values of the knobs whose category matches a
finding (``CATEGORY_KNOBS``), a low plausibility shared among the values of a finding's sweep, so a user's
own target is searched too.

Learning within the run: a change that was rejected is not proposed again, nor any part of it (a
rejected ``{a, b}`` rules out ``{a}``), but a larger change that holds it is: host tables with a fused
update can be slower while the device cache with the same fused update is SparseGear's fast path. The
exceptions, the changes worth one more try, are in ``state_machine.proposers.retries``. The
sweep leaves out the values the incumbent went past: one an accepted change moved a knob away from (it
measured slower right there), and one a rule would only propose from behind (from the fused Triton tail,
neither the slots nor the unfused Triton tail). No configuration is proposed twice.

Changes that leaned faster without clearing the noise floor are also joined into one candidate
(``state_machine.proposers.joined``).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Iterator, Mapping

from profilers.records import Finding
from state_machine.context import RunContext
from state_machine.proposers import Pairs, Proposal, patch_pairs
from state_machine.proposers.joined import JOINED, joined_proposals
from state_machine.proposers.retries import retryable
from state_machine.state import RunState
from targets.protocol import ConfigError, Knob, KnobSpace

GENERIC_PLAUSIBILITY = 0.15
NO_FINDING_GAIN = 1.01  # the expected gain of a sweep that no finding points at


@dataclass(frozen=True)
class Rule:
    name: str
    triggers: tuple[str, ...]
    patch: Mapping[str, Any]
    plausibility: float
    why: str
    devices: tuple[str, ...] = ("cpu", "cuda")
    requires: Mapping[str, tuple[Any, ...]] = field(default_factory=dict)  # incumbent knob -> allowed values
    # The phases whose host work the change cuts: triggered by a launch/host-bound finding, the rule expects only
    # those phases' share of the host's work to go (empty: all of it).
    host_phases: tuple[str, ...] = ()
    # Kernels or precision only: the change shortens device time alone, so from a phase's finding it expects only
    # the phase's device share of its wall time (``Finding.device_fraction``).
    device_only: bool = False


# The phases the dense CUDA graphs replay (the encoder, head, fused tail and losses, forward and backward); the
# backward phase also holds the embeddings' row update, which they do not.
DENSE_PHASES = ("encoder", "head", "tail", "loss", "backward")

CATALOG: tuple[Rule, ...] = (
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
         # the host waits for every queued kernel). Sessions 27 and 29 measured it there at 0.918 and 0.876, each
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
         "of its own while the step runs: at large-cached's best configuration of session 27, 4.2 of a step's 12.1 ms "
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

# (knob, value) -> the devices where a rule says it applies; the generic sweep respects it too.
DEVICE_ONLY: dict[tuple[str, str], tuple[str, ...]] = {
    (name, repr(value)): rule.devices for rule in CATALOG if set(rule.devices) != {"cpu", "cuda"}
    for name, value in rule.patch.items()}

# (knob, value) -> the incumbent values a rule proposes it from (its ``requires`` on that knob): elsewhere a
# sweep of that value would be a step back.
STEPS_FORWARD: dict[tuple[str, str], tuple[Any, ...]] = {
    (name, repr(value)): rule.requires[name] for rule in CATALOG for name, value in rule.patch.items()
    if name in rule.requires}

# Finding category -> knob categories the generic fallback sweeps for it. Launch gaps: compile and the host's
# threads only (tile sizes cut no launches; optimizer_impl and embedding_backend are swept for their own phases'
# findings). The threads are swept for launch gaps alone, a GPU's finding: on a CPU they do the math.
CATEGORY_KNOBS: dict[str, tuple[str, ...]] = {
    "data-wait": ("data",), "optimizer": ("kernel", "embedding"), "embedding-bound": ("embedding", "kernel"),
    "tail-gather-bound": ("kernel", "precision"), "loss": ("kernel", "precision"), "backward": ("kernel", "precision"),
    "launch/host-bound": ("compile", "host"), "cache-misses": ("embedding",),
    "memory-bound kernel": ("kernel", "precision"), "compute-bound kernel": ("kernel", "precision"),
    "communication": ("distributed",), "fp32-products": (),  # only the precision rules answer it
}


def _tried(state: RunState, space: KnobSpace,
           again: Mapping[Pairs, str]) -> tuple[list[tuple[Pairs, bool]], list[dict[str, Any]]]:
    """The rejected candidates' patches as (knob, value) pairs (less those in ``again``, to try once more), each
    with whether it rules out its parts too (a joined one does not: proposers.joined), and the resolved configs
    of every knob-only candidate (a config that does not resolve, e.g. an LLM's unknown knob rejected at check,
    is skipped)."""
    rejected = [(patch_pairs(e.candidate.patch), e.candidate.proposer not in JOINED) for e in state.history
                if not e.verdict.accepted and e.candidate.patch and patch_pairs(e.candidate.patch) not in again]
    seen = []
    for e in state.history:
        if not e.candidate.kernels:
            try:
                seen.append(space.resolve(e.config))
            except ConfigError:
                continue
    return rejected, seen


def _ruled_out(pairs: Pairs, rejected: list[tuple[Pairs, bool]]) -> bool:
    """Whether a rejection rules these (knob, value) pairs out: the same change, or a part of a rejected change
    that rules out its parts (see ``_tried``)."""
    return any(pairs == r or (parts and pairs <= r) for r, parts in rejected)


def _went_past(state: RunState, space: KnobSpace) -> set[tuple[str, str]]:
    """(knob, value) pairs that an accepted knob change moved the incumbent away from."""
    configs = {e.candidate.id: e.config for e in state.history}
    past = set()
    for e in state.history:
        if not e.verdict.accepted:
            continue
        try:
            before = space.resolve(configs.get(e.incumbent_id, state.baseline_config)
                                   if e.incumbent_id is not None else state.baseline_config)
        except ConfigError:
            continue
        past |= {(k, repr(before[k])) for k, v in e.candidate.patch.items() if k in before and before[k] != v}
    return past


def _applicable(space: KnobSpace, state: RunState, current: Mapping[str, Any], patch: Mapping[str, Any]) -> bool:
    """Valid, every knob it sets in effect under the patched config (``Knob.active_when``), a real change from
    the resolved incumbent ``current``, and not a model change unless allowed."""
    names = {k.name for k in space}
    if not set(patch) <= names:
        return False
    try:
        for name, value in patch.items():
            space[name].validate(value)
        patched = space.resolve({**state.incumbent.config, **patch})
    except ConfigError:
        return False
    if not all(space[name].is_active(patched) for name in patch):  # a knob that does nothing there
        return False
    if not all(space[name].runs_on(value, state.ranks) for name, value in patch.items()):  # one process only
        return False
    changes = {k: v for k, v in patch.items() if current[k] != v}
    if not changes:
        return False
    return state.allow_model_changes or all(space[k].numerics != "model" for k in changes)


def _gain(finding: Finding | None, plausibility: float, rule: "Rule | None" = None) -> float:
    if finding is None:
        return NO_FINDING_GAIN
    if rule is not None and rule.host_phases and finding.host_by_phase:  # launch/host-bound: these phases' host work
        plausibility *= sum(finding.host_by_phase.get(phase, 0.0) for phase in rule.host_phases)
    if rule is not None and rule.device_only and finding.device_fraction is not None:  # a host-bound phase
        plausibility *= finding.device_fraction
    return 1.0 + (finding.amdahl_gain - 1.0) * plausibility


def _rule_proposals(state: RunState, space: KnobSpace, findings: list[Finding]) -> Iterator[Proposal]:
    current = space.resolve(state.incumbent.config)
    for rule in CATALOG:
        if state.device_kind not in rule.devices:
            continue
        if any(current.get(k) not in allowed for k, allowed in rule.requires.items()):
            continue
        triggers = [f for f in findings if f.category in rule.triggers]
        if not triggers:
            continue
        # the finding that promises the rule the most (its first in the findings' order on a tie)
        trigger = max(triggers, key=lambda f: _gain(f, rule.plausibility, rule))
        yield Proposal(kind="knob", patch=dict(rule.patch), proposer=f"offline:{rule.name}",
                       expected_gain=_gain(trigger, rule.plausibility, rule),
                       rationale=f"{rule.why}; triggered by {trigger.category}: {trigger.evidence}")


def _generic_proposals(state: RunState, space: KnobSpace, findings: list[Finding]) -> Iterator[Proposal]:
    """One proposal per sweep value; a finding's sweep shares GENERIC_PLAUSIBILITY among its values (a blind
    sweep of n values holds one winner at best), so a big finding's long sweep does not go before the rules
    that answer a smaller one."""
    device = state.device_kind
    current = space.resolve(state.incumbent.config)
    past = _went_past(state, space)
    for finding in findings or [None]:
        categories = CATEGORY_KNOBS.get(finding.category, ()) if finding else tuple({k.category for k in space})
        values = [(knob, value) for knob in space.tunable(state.ranks)
                  if knob.category in categories and knob.is_active(current) for value in knob.values(state.ranks)
                  if _sweepable(knob, value, current, device, past)]
        for knob, value in values:
            yield Proposal(kind="knob", patch={knob.name: value}, proposer="offline:sweep",
                           expected_gain=_gain(finding, GENERIC_PLAUSIBILITY / len(values)),
                           rationale=f"sweep {knob.name} = {value!r} ({knob.why})"
                                     + (f"; {finding.category}: {finding.evidence}" if finding else ""))


def _sweepable(knob: Knob, value: Any, current: Mapping[str, Any], device: str, past: set[tuple[str, str]]) -> bool:
    """A change, not a device-only value elsewhere, not a value the incumbent went past, and not one a rule
    proposes only from elsewhere."""
    pair = (knob.name, repr(value))
    return (value != current[knob.name] and device in DEVICE_ONLY.get(pair, (device,)) and pair not in past
            and current[knob.name] in STEPS_FORWARD.get(pair, (current[knob.name],)))


def propose_offline(state: RunState, ctx: RunContext, limit: int = 1) -> list[Proposal]:
    """The ``limit`` most promising untried knob patches (empty when nothing is left to try)."""
    space = ctx.target.knob_space
    again = retryable(state, space)
    rejected, seen = _tried(state, space, again)
    current = space.resolve(state.incumbent.config)
    ranked = sorted(list(_rule_proposals(state, space, state.findings))
                    + list(_generic_proposals(state, space, state.findings))
                    + list(joined_proposals(state, space)),
                    key=lambda p: -(p.expected_gain or 0.0))  # stable: catalog order breaks ties
    chosen: list[Proposal] = []
    for proposal in ranked:
        config = {**state.incumbent.config, **proposal.patch}
        if (not _applicable(space, state, current, proposal.patch)
                or _ruled_out(patch_pairs(proposal.patch), rejected)
                or space.resolve(config) in seen
                or any(p.patch == proposal.patch for p in chosen)):
            continue
        if (why := again.get(patch_pairs(proposal.patch))) is not None:
            proposal = replace(proposal, rationale=f"{why}; {proposal.rationale}")
        chosen.append(proposal)
        if len(chosen) == limit:
            break
    return chosen
