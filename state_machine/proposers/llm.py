"""The LLM proposer (tiers ``normal`` and ``ultra``): findings and history in, JSON-schema candidates out.

The prompt carries what a performance engineer would want on one page: the measured findings, the
knob space with each knob's reason, domain, numerics class and current value, the history of
candidates with their verdicts, and, when the tier may rewrite kernels, each kernel slot's call
signature, shape contract, current source and torch reference. The reply must match
``REPLY_SCHEMA`` (strict structured outputs): a list of candidates, each a knob patch and/or one
slot's full replacement source, with a rationale. Values arrive as strings and are parsed against
their knob here; anything unparseable is passed through so the check node rejects it with a reason.

Every call is authorised by the ledger first (worst case must fit the budget) and recorded after,
successful or not.
"""

from __future__ import annotations

import inspect
import json
from pathlib import Path
from typing import Any

from state_machine.context import RunContext
from state_machine.llm_interfaces import LLMError, estimate_tokens
from state_machine.proposers import Proposal
from state_machine.state import RunState
from targets.protocol import ConfigError, KnobSpace, Target

NODE = "propose"
SYSTEM = (
    "You are sg-opt, a performance engineer for sparse-model training jobs (recommendation, search, ads, "
    "extreme multi-label). You make a training step faster WITHOUT changing what it computes beyond the numerics "
    "class each knob declares. Every candidate you propose is checked statically, validated against the torch "
    "reference on fresh random inputs and against the baseline's training trajectory, then timed side by side "
    "against the incumbent; only a confirmed, significant speedup is kept. Propose the changes with the largest "
    "expected gain on the measured bottleneck. Do not repeat a rejected change. Kernel sources must define a "
    "function named after the slot with exactly the slot's signature, may import only torch, triton, "
    "triton.language and math, and must return a fresh output tensor."
)
REPLY_SCHEMA: dict[str, Any] = {
    "type": "object", "additionalProperties": False, "required": ["candidates"],
    "properties": {"candidates": {"type": "array", "items": {
        "type": "object", "additionalProperties": False,
        "required": ["rationale", "knob_changes", "kernel_slot", "kernel_source"],
        "properties": {
            "rationale": {"type": "string", "description": "why this change is faster and keeps the numerics"},
            "knob_changes": {"type": "array", "items": {
                "type": "object", "additionalProperties": False, "required": ["knob", "value"],
                "properties": {"knob": {"type": "string"}, "value": {"type": "string"}}}},
            "kernel_slot": {"type": "string", "description": "slot to replace, or empty"},
            "kernel_source": {"type": "string", "description": "full Python source of the slot, or empty"},
        }}}},
}
MAX_HISTORY = 30


def _knob_lines(space: KnobSpace, state: RunState) -> list[str]:
    current = space.resolve(state.incumbent.config)
    lines = []
    for knob in space.tunable(state.ranks):
        if knob.numerics == "model" and not state.allow_model_changes:
            continue
        lines.append(f"- {knob.name} = {current[knob.name]!r} (domain {knob.domain(state.ranks)}; "
                     f"numerics {knob.numerics_text()}; {knob.category}): {knob.why}")
    return lines


def _history_lines(state: RunState) -> list[str]:
    lines = []
    for e in state.history[-MAX_HISTORY:]:
        change = ", ".join(f"{k}={v!r}" for k, v in e.candidate.patch.items())
        if e.candidate.kernels:
            change += (", " if change else "") + "kernel " + ", ".join(e.candidate.kernels)
        ratio = f", ratio {e.verdict.ratio:.3f}" if e.verdict.ratio is not None else ""
        status = "ACCEPTED" if e.verdict.accepted else f"rejected at {e.verdict.stage}"
        lines.append(f"- #{e.candidate.id} {change or '(nothing)'}: {status}{ratio}: {e.verdict.reason}")
    return lines or ["- none yet"]


def _slot_sections(target: Target, state: RunState) -> list[str]:
    sections = []
    for slot in target.kernel_slots:
        current = state.incumbent.kernels.get(slot.name)
        source = Path(current).read_text() if current else None
        try:
            reference = inspect.getsource(slot.reference)
        except (OSError, TypeError):
            reference = "(source unavailable)"
        shapes = "; ".join(", ".join(f"{k}={v}" for k, v in s.items()) for s in slot.shapes) or "see signature"
        sections.append(f"### slot {slot.name}({slot.signature})\n{slot.why}\nshapes: {shapes}\n"
                        f"current implementation: {'replaced, source below' if source else 'the torch reference'}\n"
                        f"```python\n{source or reference}\n```")
    return sections


def build_prompt(state: RunState, ctx: RunContext) -> str:
    target, policy = ctx.target, ctx.policy
    step = f"{state.baseline.step_ms:.2f} ms" if state.baseline else "unknown"
    findings = [f"- {f.category} (share {f.share:.1%}, Amdahl gain x{f.amdahl_gain:.2f}): {f.evidence}"
                for f in state.findings] or ["- no profile findings"]
    parts = [
        f"Target {target.name} ({target.description}), size {state.size}, device {state.device}.",
        f"Baseline step {step}; the incumbent is an estimated x{state.incumbent.est_speedup:.2f} faster.",
        "## Findings (largest expected gain first)", *findings,
        "## Knobs (current value first)", *_knob_lines(target.knob_space, state),
        "## History", *_history_lines(state),
    ]
    kernels = "kernel" in policy.kinds and target.kernel_slots
    if kernels:
        parts += ["## Kernel slots (you may replace one slot per candidate)", *_slot_sections(target, state)]
    parts.append(f"Propose up to {policy.candidates_per_iteration} candidate(s). "
                 + ("Each may change knobs and/or replace one kernel slot." if kernels else
                    "Change knobs only; leave kernel_slot and kernel_source empty."))
    return "\n".join(parts)


def _parse_value(space: KnobSpace, name: str, text: str) -> Any:
    try:
        return space[name].parse(text)
    except ConfigError:
        return text  # the check node rejects it, naming the knob and its domain


def to_proposals(reply: dict[str, Any], state: RunState, ctx: RunContext) -> list[Proposal]:
    proposals = []
    for item in reply.get("candidates", [])[: ctx.policy.candidates_per_iteration]:
        patch = {c["knob"]: _parse_value(ctx.target.knob_space, c["knob"], c["value"])
                 for c in item.get("knob_changes", [])}
        slot, source = item.get("kernel_slot", "").strip(), item.get("kernel_source", "")
        sources = {slot: source} if slot and source.strip() else {}
        proposals.append(Proposal(kind="kernel" if sources else "knob", patch=patch, kernel_sources=sources,
                                  rationale=item.get("rationale", "").strip() or "(no rationale given)",
                                  proposer=f"llm:{ctx.policy.tier}"))
    return proposals


def propose_llm(state: RunState, ctx: RunContext) -> list[Proposal]:
    """One ledger-authorised LLM call; raises BudgetExceeded or LLMError for the node to handle."""
    if ctx.llm is None or ctx.ledger is None:
        raise RuntimeError(f"tier {ctx.policy.tier} needs an LLM client and a ledger")
    prompt = build_prompt(state, ctx)
    policy = ctx.policy
    ctx.ledger.authorize(NODE, policy.tier, ctx.llm.model, estimate_tokens(SYSTEM, prompt, json.dumps(REPLY_SCHEMA)), policy.max_output_tokens)
    try:
        reply = ctx.llm.complete(SYSTEM, prompt, REPLY_SCHEMA, "sg_opt_candidates", policy.max_output_tokens,
                                 policy.reasoning_effort)
    except LLMError as exc:
        ctx.ledger.record(NODE, policy.tier, ctx.llm.model, exc.usage, exc.latency_s, ok=False)
        raise
    ctx.ledger.record(NODE, policy.tier, ctx.llm.model, reply.usage, reply.latency_s)  # priced as configured
    ctx.event(state.run_dir, "llm-call", tier=policy.tier, model=reply.model, usage=reply.usage.model_dump(),
              latency_s=reply.latency_s, prompt_chars=len(prompt), reply=json.dumps(reply.data)[:2000])
    return to_proposals(reply.data, state, ctx)
