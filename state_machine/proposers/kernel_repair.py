"""The kernel loop: a rejected or slower kernel goes back to the model with its source and what became of it.

Kernel agents that work iterate: write, check, read the error, fix. After a round whose LLM kernel candidate
was rejected (the check's rule, the validator's first failing shape, dtype and error, a training run that
diverged) or timed no faster than the incumbent, the next call sends that source back with its verdict and
asks for the slot again, instead of a fresh proposal. Each rewrite gets up to ``kernel_repairs`` rounds (a tier
setting): a repair's own failure is repaired in turn until the chain is that long. Candidates record the one
they repair (``Candidate.repair_of``), so the chain survives a resume.
"""

from __future__ import annotations

import json
from pathlib import Path

from state_machine.context import ProposerPolicy
from state_machine.state import Candidate, Evaluated, RunState

DETAIL_CHARS = 1500  # of a validator's traceback or stderr tail
SHAPE_ERRORS = 3


def repair_depth(state: RunState, cand: Candidate) -> int:
    """How many repairs led to ``cand`` (0: a fresh rewrite)."""
    by_id = {e.candidate.id: e.candidate for e in state.history}
    depth = 0
    while cand.repair_of is not None and cand.repair_of in by_id and depth <= len(by_id):
        cand, depth = by_id[cand.repair_of], depth + 1
    return depth


def repair_target(state: RunState, policy: ProposerPolicy) -> Evaluated | None:
    """The LLM kernel candidate of the last round to send back, or None: the newest one rejected or not faster
    that no candidate repairs yet, whose chain is shorter than ``kernel_repairs``, and whose slot no later
    accepted candidate has replaced."""
    if policy.kernel_repairs <= 0 or "kernel" not in policy.kinds:
        return None
    candidates = [e.candidate for e in state.history] + list(state.queue)
    repaired = {c.repair_of for c in candidates if c.repair_of is not None}
    recent = state.history[-max(1, policy.candidates_per_iteration):]
    for index in range(len(recent) - 1, -1, -1):
        entry = recent[index]
        cand = entry.candidate
        if (not cand.kernels or entry.verdict.accepted or cand.id in repaired or not cand.proposer.startswith("llm:")
                or repair_depth(state, cand) >= policy.kernel_repairs):
            continue
        if any(later.verdict.accepted and set(later.candidate.kernels) & set(cand.kernels)
               for later in recent[index + 1:]):
            continue
        return entry
    return None


def repair_request(state: RunState, entry: Evaluated, policy: ProposerPolicy) -> str:
    """The ask of a repair call: the rejected source, its verdict in full, and what to send back."""
    cand, verdict = entry.candidate, entry.verdict
    slot, path = next(iter(cand.kernels.items()))
    round_ = repair_depth(state, cand) + 1
    knobs = f" and set {', '.join(f'{k}={v!r}' for k, v in cand.patch.items())}" if cand.patch else ""
    lines = [f"## Repair {round_} of {policy.kernel_repairs}: candidate #{cand.id}",
             f"Candidate #{cand.id} replaced slot {slot}{knobs}. Its source:",
             f"```python\n{_read(path)}```",
             f"It was rejected at {verdict.stage}: {verdict.reason}" if not verdict.accepted else ""]
    lines += _validator_details(state, cand, slot)
    if verdict.numerics_detail:
        lines.append(f"Training numerics: {verdict.numerics_detail}")
    if verdict.ratio is not None:
        interval = (f" (95% interval {verdict.ci_low:.3f}-{verdict.ci_high:.3f})"
                    if verdict.ci_low is not None and verdict.ci_high is not None else "")
        floor = f" of {100 * state.noise_floor:.1f}%" if state.baseline is not None else ""
        lines.append(f"Timed side by side against the incumbent: step time ratio {verdict.ratio:.3f}{interval}; "
                     f"below 1 is faster, and a win must clear the noise floor{floor}.")
    lines.append(f"Fix it: reply with up to {policy.candidates_per_iteration} candidate(s), each replacing slot "
                 f"{slot} (kernel_slot \"{slot}\") with its full corrected source, and the knob_changes the slot "
                 f"needs to run in training. Correct first, then fast.")
    return "\n".join(line for line in lines if line)


def _validator_details(state: RunState, cand: Candidate, slot: str) -> list[str]:
    """The failing kernel check's per-shape errors and its traceback tail, from the candidate's verdict files."""
    for dtype in state.plan.kernel_dtypes or []:
        try:
            verdict = json.loads(state.path("candidates", f"{cand.id:03d}", f"kernel-{slot}-{dtype}.json")
                                 .read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        if verdict.get("ok", True):
            continue
        lines = [f"Worst errors in {dtype}: " + "; ".join(
            f"shape {e.get('shape')}: relative error {e.get('rel_error', 0.0):.2e}, worst element off by "
            f"{e.get('max_abs_error', 0.0):.2e} (reference scale {e.get('ref_scale', 0.0):.2e})"
            for e in verdict.get("errors", [])[:SHAPE_ERRORS])] if verdict.get("errors") else []
        detail = str(verdict.get("detail") or "").strip()
        if detail:
            lines.append(f"What it printed (the end):\n```\n{detail[-DETAIL_CHARS:]}\n```")
        return lines
    return []


def _read(path: str) -> str:
    try:
        return Path(path).read_text(encoding="utf-8")
    except OSError:
        return "(the source file is gone)\n"
