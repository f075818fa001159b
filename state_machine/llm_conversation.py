"""One LLM call as the agent makes it: metered by the ledger, bounded by the run's deadline, read back on a
resume instead of bought twice, and repaired when the reply does not parse.

A call is a conversation: the prompt, then for each malformed reply the reply and its error (a repair turn,
its own charged request, ``reply_repairs`` of them at most) until a reply validates. Each turn's request is
keyed by the proposal round (``RunState.proposal_rounds``, checkpointed), the turn and the exact messages;
the ledger stores the reply with the request's settled row, so a run killed after that row and resumed from
the checkpoint before it finds the reply there and does not pay for it again.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass
from typing import Any, TypeVar

from pydantic import BaseModel

from state_machine import events
from state_machine.context import RunContext
from state_machine.llm_interfaces import Completion, DeadlineReached, LLMError, Message, estimate_tokens
from state_machine.llm_reply import ReplyInvalid, parse_reply
from state_machine.state import RunState
from state_machine.time_budget import final_measurement_s

T = TypeVar("T", bound=BaseModel)
ECHO_CHARS = 4000  # of a malformed reply, sent back in its repair turn
EVENT_REPLY_CHARS = 2000


@dataclass(frozen=True)
class Ask:
    """What to ask: the messages, the reply's schema, and what the call is for (the ledger's purpose)."""

    node: str
    purpose: str
    messages: list[Message]
    schema: dict[str, Any]
    schema_name: str


def llm_deadline(state: RunState) -> float:
    """The time.monotonic by which an LLM call must be over: what --max-minutes leaves, less the final
    measurement that must still fit after it."""
    left = 60.0 * state.limits.max_minutes - state.elapsed_s - final_measurement_s(state)
    return time.monotonic() + left


def converse(state: RunState, ctx: RunContext, ask: Ask, model: type[T]) -> T:
    """The first reply that validates as ``model``; LLMError once the repair turns are spent (every request
    is settled in the ledger by then)."""
    messages, deadline = list(ask.messages), llm_deadline(state)
    if deadline - time.monotonic() <= 0:
        raise DeadlineReached("the run's --max-minutes leave no time for an LLM call")
    for turn in range(ctx.policy.reply_repairs + 1):
        purpose = ask.purpose if turn == 0 else "reply-repair"
        completion = _complete(state, ctx, ask, messages, purpose, turn, deadline)
        try:
            return parse_reply(completion.text, model, completion.finish_reason)
        except ReplyInvalid as exc:
            problem = exc
            ctx.event(state.run_dir, events.LLMReplyInvalid(turn=turn, reason=str(exc)))
            messages = messages + repair_turn(completion.text, exc)
    repairs = ctx.policy.reply_repairs
    raise LLMError(f"the {ctx.llm.model} reply {problem}" + (f" after {repairs} repair turn{'s' * (repairs > 1)}"
                                                             if repairs else ""))


def repair_turn(text: str, problem: ReplyInvalid) -> list[Message]:
    """The malformed reply (its start) and what is wrong with it, as the next two messages."""
    echo = text if len(text) <= ECHO_CHARS else text[:ECHO_CHARS] + "\n... (the rest left out)"
    shorter = " Keep it shorter: fewer candidates, no comments in kernel sources." if problem.cut_off else ""
    return [{"role": "assistant", "content": echo or "(empty)"},
            {"role": "user", "content": f"Your reply {problem}. Reply again with only the JSON object the schema "
                                        f"asks for.{shorter}"}]


def request_key(round_: int, turn: int, model: str, ask: Ask, messages: list[Message], max_output_tokens: int,
                reasoning_effort: str | None) -> str:
    """Names one request of one proposal round: the same on a resume from the checkpoint before it, different
    for the next round (whose prompt may well be identical)."""
    text = json.dumps([round_, turn, model, ask.schema_name, ask.schema, messages, max_output_tokens,
                       reasoning_effort], sort_keys=True)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:32]


def _complete(state: RunState, ctx: RunContext, ask: Ask, messages: list[Message], purpose: str, turn: int,
              deadline: float) -> Completion:
    llm, ledger, policy = ctx.llm, ctx.ledger, ctx.policy
    key = request_key(state.proposal_rounds, turn, llm.model, ask, messages, policy.max_output_tokens,
                      policy.reasoning_effort)
    stored = ledger.reply_for(key)
    if stored is not None:
        completion = Completion(text=str(stored.get("text", "")), finish_reason=stored.get("finish_reason"),
                                model=llm.model, reused=True)
    else:
        prompt_tokens = estimate_tokens(*(m["content"] for m in messages), json.dumps(ask.schema))
        meter = ledger.meter(ask.node, policy.tier, llm.model, prompt_tokens, policy.max_output_tokens, purpose, key)
        completion = llm.complete(messages, ask.schema, ask.schema_name, policy.max_output_tokens,
                                  policy.reasoning_effort, meter=meter, deadline=deadline)
    ctx.event(state.run_dir, events.LLMCall(
        tier=policy.tier, model=completion.model, purpose=purpose, turn=turn, usage=completion.usage.model_dump(),
        cost_usd=completion.cost_usd, latency_s=completion.latency_s, attempts=completion.attempts,
        reused=completion.reused, notes=completion.notes, prompt_chars=sum(len(m["content"]) for m in messages),
        reply=completion.text[:EVENT_REPLY_CHARS]))
    if completion.notes:
        ctx.event(state.run_dir, events.LLMWarning(reason="; ".join(completion.notes)))
    return completion
