"""The two small interfaces the agent needs from the outside world: an LLM and a token ledger.

``state_machine`` never imports ``sg_opt``: ``sg_opt`` builds the graph and hands it an
openai-backed ``LLM`` and a file-backed ``Ledger`` that satisfy these protocols. Tests can hand it
anything else that does (for instance a real client pointed at a scripted server on loopback).
"""

from __future__ import annotations

import math
from typing import Any, Protocol, runtime_checkable

from pydantic import BaseModel, Field

CHARS_PER_TOKEN = 3  # OpenAI tokenizers average ~4 characters a token on English and code
MESSAGE_OVERHEAD_TOKENS = 16  # role markers and framing around each text sent


class Usage(BaseModel):
    """Token counts of one call, as the server's ``usage`` reports them."""

    input_tokens: int = 0
    cached_input_tokens: int = Field(0, description="the part of input_tokens served from the prompt cache")
    output_tokens: int = 0
    reasoning_tokens: int = Field(0, description="the part of output_tokens spent on hidden reasoning")


class Completion(BaseModel):
    """One successful structured reply: the parsed JSON object, what it cost and how long it took."""

    data: dict[str, Any]
    usage: Usage
    model: str
    latency_s: float
    attempts: int = Field(1, description="HTTP attempts, retries included")


class LLMError(RuntimeError):
    """A call that produced no usable reply (retries exhausted, malformed JSON, refused by the server).

    ``usage`` carries whatever the failed attempts were billed for, so the ledger still records it.
    """

    def __init__(self, message: str, usage: Usage | None = None, latency_s: float = 0.0):
        super().__init__(message)
        self.usage = usage or Usage()
        self.latency_s = latency_s


class BudgetExceeded(RuntimeError):
    """The ledger refused a call whose worst case could exceed the run's $ budget."""


@runtime_checkable
class LLM(Protocol):
    """Completes a prompt into a JSON object that satisfies ``schema`` (OpenAI structured outputs)."""

    model: str

    def complete(self, system: str, prompt: str, schema: dict[str, Any], schema_name: str,
                 max_output_tokens: int, reasoning_effort: str | None = None) -> Completion:
        """Return the parsed reply; raise LLMError when no valid reply came back."""


@runtime_checkable
class Ledger(Protocol):
    """Asked before and told after every LLM call; never lets the $ budget be overshot."""

    def authorize(self, node: str, tier: str, model: str, prompt_tokens: int, max_output_tokens: int) -> None:
        """Raise BudgetExceeded if this call's worst case (prompt + max output) could exceed the budget."""

    def record(self, node: str, tier: str, model: str, usage: Usage, latency_s: float, ok: bool = True) -> float:
        """Append one row for a finished call (successful or not); return its cost in $."""

    def spent_usd(self) -> float:
        """Dollars spent so far in this run."""


def estimate_tokens(*texts: str) -> int:
    """A deliberately high estimate of the prompt tokens for ``texts`` (system, prompt, schema...).

    OpenAI's tokenizers average about 4 characters per token; dividing by 3 and adding per-message
    framing leaves room for symbol-dense code, which tokenizes worse. It is no strict bound (only
    byte count is), but ``authorize`` also assumes the full ``max_output_tokens``, which dwarfs any
    shortfall here, and the real count from ``usage`` is what gets recorded.
    """
    return sum(math.ceil(len(text) / CHARS_PER_TOKEN) + MESSAGE_OVERHEAD_TOKENS for text in texts)
