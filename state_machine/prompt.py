"""The LLM proposer's prompt: what a performance engineer would want on one page, stable part first.

The system message holds what stays the same for the whole run (the rules, the target, each knob's domain and
reason, each offered kernel slot's signature, shapes, checked dtypes, the knob it needs and its torch
reference), so that a server's prompt cache covers it on every call. The user message holds what changes: the
measurements, the findings, the knobs' current values, each slot's current implementation and its time and
roofline position in the incumbent's fine profile, the history of candidates, and, for a kernel repair, the
rejected source with its verdict.

Only slots that training can call in this run are offered (``KernelSlot.in_training`` and ``used_when``, the
latter only where this run may set the knob it needs), each with what it needs.
"""

from __future__ import annotations

import inspect
import json
from pathlib import Path
from typing import Any

from state_machine.context import RunContext
from state_machine.llm_interfaces import Message
from state_machine.state import RunState
from targets.protocol import ConfigError, KernelSlot, KnobSpace, Target

SYSTEM = (
    "You are sg-opt, a performance engineer for sparse-model training jobs (recommendation, search, ads, "
    "extreme multi-label). You make a training step faster WITHOUT changing what it computes beyond the numerics "
    "class each knob declares. Every candidate you propose is checked statically, validated against the torch "
    "reference on fresh random inputs and against the baseline's training trajectory, then timed side by side "
    "against the incumbent; only a confirmed, significant speedup is kept. Propose the changes with the largest "
    "expected gain on the measured bottleneck. Do not repeat a rejected change. Kernel sources must define a "
    "function named after the slot with exactly the slot's signature, may import only torch, triton, "
    "triton.language and math, and must return a fresh output tensor. Reply with the JSON object the schema "
    "asks for and nothing else; every knob value is written as a string."
)
MAX_HISTORY = 30


def build_messages(state: RunState, ctx: RunContext, request: str = "") -> list[Message]:
    """[system: rules + the run's fixed sections, user: what changes + ``request`` (the ask)]."""
    return [{"role": "system", "content": f"{SYSTEM}\n\n{fixed_section(state, ctx)}"},
            {"role": "user", "content": variable_section(state, ctx, request)}]


def build_prompt(state: RunState, ctx: RunContext) -> str:
    """Both sections as one text (what the model reads, apart from the rules)."""
    return f"{fixed_section(state, ctx)}\n{variable_section(state, ctx)}"


def kernels_allowed(state: RunState, ctx: RunContext) -> bool:
    return "kernel" in ctx.policy.kinds and bool(offered_slots(ctx.target, state))


# ----------------------------------------------------------------------------- the fixed sections

def fixed_section(state: RunState, ctx: RunContext) -> str:
    target = ctx.target
    ranks = f", {state.ranks} ranks" if state.ranks > 1 else ""
    parts = [f"Target {target.name} ({target.description}), size {state.size}, device {state.device}{ranks}.",
             "## Knobs (domain; numerics class; category): why", *_knob_definitions(target.knob_space, state)]
    if kernels_allowed(state, ctx):
        parts += ["## Kernel slots (a candidate may replace one slot)", _checks_line(state),
                  *(_slot_definition(slot, needs) for slot, needs in offered_slots(target, state))]
    return "\n".join(parts)


def _knob_definitions(space: KnobSpace, state: RunState) -> list[str]:
    return [f"- {knob.name} (domain {knob.domain(state.ranks)}; numerics {knob.numerics_text()}; "
            f"{knob.category}): {knob.why}" for knob in _offered_knobs(space, state)]


def _offered_knobs(space: KnobSpace, state: RunState) -> list:
    return [knob for knob in space.tunable(state.ranks)
            if knob.numerics != "model" or state.allow_model_changes]


def _checks_line(state: RunState) -> str:
    dtypes = ", ".join(state.plan.kernel_dtypes or []) or "float32"
    skipped = "".join(f" Not checked in {dtype}: {why}." for dtype, why in state.plan.kernel_dtypes_skipped.items())
    return (f"A replacement is checked against the slot's torch reference in {dtypes} (inputs drawn fresh, on the "
            f"shapes listed, ragged variants of them and a unit shape; every input must stay unchanged, the output "
            f"must be fully written, in the reference's dtype and shape) before a training step runs it.{skipped}")


def offered_slots(target: Target, state: RunState) -> list[tuple[KernelSlot, list[tuple[str, tuple]]]]:
    """The slots training can call in this run, each with the (knob, values) it needs: the values this run may
    set, or the user's own value where that already is one."""
    tunable = {knob.name: knob for knob in _offered_knobs(target.knob_space, state)}
    users = target.knob_space.resolve(state.baseline_config)
    offered = []
    for slot in target.kernel_slots:
        if not slot.in_training:
            continue
        needs = [(name, tuple(v for v in values if name in tunable and _settable(tunable[name], v, state.ranks))
                  or tuple(v for v in values if users.get(name) == v)) for name, values in slot.used_when]
        if all(values for _, values in needs):
            offered.append((slot, needs))
    return offered


def _settable(knob: Any, value: Any, ranks: int) -> bool:
    try:
        knob.validate(value)
    except ConfigError:
        return False
    return knob.runs_on(value, ranks)


def _slot_definition(slot: KernelSlot, needs: list[tuple[str, tuple]]) -> str:
    head = slot.signature if slot.signature.startswith(f"{slot.name}(") else f"{slot.name}({slot.signature})"
    shapes = "; ".join(", ".join(f"{k}={v}" for k, v in s.items()) for s in slot.shapes) or "see the signature"
    need = "".join(f"\nruns in training only with {name} set to {' or '.join(map(str, values))}"
                   for name, values in needs)
    try:
        reference = inspect.getsource(slot.reference)
    except (OSError, TypeError):
        reference = "(source unavailable)"
    return f"### slot {head}\n{slot.why}\nchecked on shapes: {shapes}{need}\nreference:\n```python\n{reference}```"


# ----------------------------------------------------------------------------- the variable sections

def variable_section(state: RunState, ctx: RunContext, request: str = "") -> str:
    target, policy = ctx.target, ctx.policy
    step = f"{state.baseline.step_ms:.2f} ms" if state.baseline else "unknown"
    findings = [f"- {f.category} (share {f.share:.1%}, Amdahl gain x{f.amdahl_gain:.2f}): {f.evidence}"
                for f in state.findings] or ["- no profile findings"]
    parts = [f"Baseline step {step}; the incumbent is an estimated x{state.incumbent.est_speedup:.2f} faster.",
             "## Findings (largest expected gain first)", *findings,
             "## Knobs now", *_knob_values(target.knob_space, state)]
    kernels = kernels_allowed(state, ctx)
    if kernels:
        timings = slot_timings(state)
        current = target.knob_space.resolve(state.incumbent.config)
        parts += ["## Kernel slots now", *(_slot_now(slot, needs, state, current, timings.get(slot.name, []))
                                           for slot, needs in offered_slots(target, state))]
    parts += ["## History", *history_lines(state)]
    parts.append(request or (f"Propose up to {policy.candidates_per_iteration} candidate(s). "
                             + ("Each may change knobs and/or replace one kernel slot." if kernels else
                                "Change knobs only; leave kernel_slot and kernel_source empty.")))
    return "\n".join(parts)


def _knob_values(space: KnobSpace, state: RunState) -> list[str]:
    current = space.resolve(state.incumbent.config)
    return [f"- {knob.name} = {current[knob.name]!r}" + ("" if knob.is_active(current) else
                                                         " (no effect under the current values)")
            for knob in _offered_knobs(space, state)]


def _slot_now(slot: KernelSlot, needs: list[tuple[str, tuple]], state: RunState, config: dict[str, Any],
              timings: list[dict]) -> str:
    replaced = state.incumbent.kernels.get(slot.name)
    lines = [f"### {slot.name}: " + ("replaced; its source:" if replaced else "the torch reference")]
    if replaced:
        lines.append(f"```python\n{Path(replaced).read_text(encoding='utf-8')}```")
    for name, values in needs:
        value = config.get(name)
        if value not in values:
            lines.append(f"not called in training now ({name} is {value}): a candidate replacing it must also set "
                         f"{name} to {' or '.join(map(str, values))}")
    lines += [f"measured in the incumbent's step: {_timing(t)}" for t in timings] or [
        "not timed in this run (no fine profile)"]
    return "\n".join(lines)


def _timing(t: dict[str, Any]) -> str:
    shape = ", ".join(f"{k}={v}" for k, v in t.get("shape", {}).items())
    return (f"{1e3 * t.get('median_s', 0.0):.3f} ms at {shape} in {t.get('dtype')}, "
            f"{100 * t.get('roofline_fraction', 0.0):.1f}% of the roofline ({t.get('bound')}-bound, "
            f"{t.get('implementation')})")


def slot_timings(state: RunState) -> dict[str, list[dict[str, Any]]]:
    """Each slot's timings on the real shapes from the newest profile that has a fine section."""
    for path in reversed(state.profiles):
        try:
            fine = json.loads(Path(path).read_text(encoding="utf-8")).get("fine") or {}
        except (OSError, ValueError):
            continue
        if fine.get("slots"):
            timings: dict[str, list[dict[str, Any]]] = {}
            for t in fine["slots"]:
                timings.setdefault(t.get("slot"), []).append(t)
            return timings
    return {}


def history_lines(state: RunState) -> list[str]:
    lines = []
    for e in state.history[-MAX_HISTORY:]:
        change = ", ".join(f"{k}={v!r}" for k, v in e.candidate.patch.items())
        if e.candidate.kernels:
            change += (", " if change else "") + "kernel " + ", ".join(e.candidate.kernels)
        ratio = f", ratio {e.verdict.ratio:.3f}" if e.verdict.ratio is not None else ""
        status = "ACCEPTED" if e.verdict.accepted else f"rejected at {e.verdict.stage}"
        lines.append(f"- #{e.candidate.id} {change or '(nothing)'}: {status}{ratio}: {e.verdict.reason}")
    return lines or ["- none yet"]
