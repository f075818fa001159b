"""The LLM proposer (tiers ``normal`` and ``ultra``): the prompt in, JSON-schema candidates out.

The prompt (``state_machine.prompt``) carries the run's measurements, knobs, offered kernel slots and history;
after a round whose LLM kernel was rejected or not faster, the call is a kernel repair instead
(``kernel_repair``): the source goes back with its verdict. The reply must match ``REPLY_SCHEMA`` (strict
structured outputs) and is validated as ``Reply``, which also takes what servers that do not enforce the
schema send: knob values as JSON numbers or booleans, nulls for empty strings, knob changes as an object.
Each value is parsed against its knob; anything unparseable is passed through so the check node rejects it
with a reason. The call itself (ledger, deadline, reuse on resume, repair turns) is ``llm_conversation``'s.
"""

from __future__ import annotations

import re
from typing import Any

from pydantic import BaseModel, ConfigDict, field_validator, model_validator

from state_machine import events
from state_machine.context import RunContext
from state_machine.llm_conversation import Ask, converse
from state_machine.prompt import SYSTEM, build_messages, build_prompt  # noqa: F401 (the proposer's prompt)
from state_machine.proposers import Proposal
from state_machine.proposers.kernel_repair import repair_request, repair_target
from state_machine.state import Candidate, RunState
from targets.protocol import ConfigError, KnobSpace

NODE = "propose"
SCHEMA_NAME = "sg_opt_candidates"
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
Scalar = str | int | float | bool | None
SAFE_SLOT = re.compile(r"[^A-Za-z0-9_]")


class KnobChange(BaseModel):
    model_config = ConfigDict(extra="ignore")

    knob: str
    value: Scalar


class CandidateReply(BaseModel):
    model_config = ConfigDict(extra="ignore")

    rationale: str = ""
    knob_changes: list[KnobChange] = []
    kernel_slot: str = ""
    kernel_source: str = ""

    @field_validator("rationale", "kernel_slot", "kernel_source", mode="before")
    @classmethod
    def _null_is_empty(cls, value: Any) -> Any:
        return "" if value is None else value

    @field_validator("knob_changes", mode="before")
    @classmethod
    def _object_is_a_list(cls, value: Any) -> Any:
        """``{"knob": value, ...}`` as the list the schema asks for; null as none."""
        if value is None:
            return []
        if isinstance(value, dict) and not {"knob", "value"} <= set(value):
            return [{"knob": k, "value": v} for k, v in value.items()]
        return [value] if isinstance(value, dict) else value


class Reply(BaseModel):
    model_config = ConfigDict(extra="ignore")

    candidates: list[CandidateReply]

    @model_validator(mode="before")
    @classmethod
    def _bare_list(cls, data: Any) -> Any:
        return {"candidates": data} if isinstance(data, list) else data


def parse_value(space: KnobSpace, name: str, value: Scalar) -> Any:
    """A reply's value as the knob's own (a JSON 2.0 for an int knob included); as sent when it does not parse."""
    if isinstance(value, bool):
        text = "true" if value else "false"
    elif isinstance(value, float) and value.is_integer():
        text = str(int(value))
    else:
        text = "" if value is None else str(value)
    try:
        return space[name].parse(text)
    except ConfigError:
        return value  # the check node rejects it, naming the knob and its domain


def to_proposals(reply: Reply | dict[str, Any], state: RunState, ctx: RunContext,
                 repair_of: int | None = None) -> list[Proposal]:
    """The reply's candidates (at most candidates_per_iteration); ``repair_of``: the candidate a kernel repair
    call sent back, which its rewrites of the same slot repair."""
    reply = reply if isinstance(reply, Reply) else Reply.model_validate(reply)
    repaired_slots = set(_candidate(state, repair_of).kernels) if repair_of is not None else set()
    proposals = []
    for item in reply.candidates[: ctx.policy.candidates_per_iteration]:
        patch = {c.knob: parse_value(ctx.target.knob_space, c.knob, c.value) for c in item.knob_changes}
        slot = SAFE_SLOT.sub("_", item.kernel_slot.strip())[:64]  # it names a file before the check node runs
        sources = {slot: item.kernel_source} if slot and item.kernel_source.strip() else {}
        proposals.append(Proposal(kind="kernel" if sources else "knob", patch=patch, kernel_sources=sources,
                                  rationale=item.rationale.strip() or "(no rationale given)",
                                  proposer=f"llm:{ctx.policy.tier}",
                                  repair_of=repair_of if set(sources) & repaired_slots else None))
    return proposals


def _candidate(state: RunState, cid: int) -> Candidate:
    return next(e.candidate for e in state.history if e.candidate.id == cid)


def propose_llm(state: RunState, ctx: RunContext) -> list[Proposal]:
    """One LLM call (a kernel repair where one is due); raises BudgetExceeded, DeadlineReached or LLMError for
    the node to handle."""
    if ctx.llm is None or ctx.ledger is None:
        raise RuntimeError(f"tier {ctx.policy.tier} needs an LLM client and a ledger")
    entry = repair_target(state, ctx.policy)
    request = repair_request(state, entry, ctx.policy) if entry is not None else ""
    if entry is not None:
        ctx.event(state.run_dir, events.KernelRepair(of=entry.candidate.id, slots=list(entry.candidate.kernels),
                                                     stage=entry.verdict.stage, reason=entry.verdict.reason))
    ask = Ask(NODE, "kernel-repair" if entry is not None else "propose", build_messages(state, ctx, request),
              REPLY_SCHEMA, SCHEMA_NAME)
    reply = converse(state, ctx, ask, Reply)
    return to_proposals(reply, state, ctx, entry.candidate.id if entry is not None else None)


class LLMProposer:
    """The proposer of every tier with a model (``normal``, ``ultra``, a user's own)."""

    name = "llm"
    uses_llm = True
    reads_findings = True

    def check_available(self) -> None:
        """Nothing to import here: ``sg_opt`` builds the client and checks its endpoint before the run starts."""

    def propose(self, state: RunState, ctx: RunContext, limit: int) -> list[Proposal]:
        """One call's candidates: as many as the tier asks of a call, whatever ``limit`` (the node queues them)."""
        return propose_llm(state, ctx)
