"""The small interfaces the agent needs from the outside world: an LLM, and a token ledger that meters it.

``state_machine`` never imports ``sg_opt``: ``sg_opt`` builds the graph and hands it an
openai-backed ``LLM`` and a file-backed ``Ledger`` that satisfy these protocols. Tests can hand it
anything else that does (for instance a real client pointed at a scripted server on loopback).

Every HTTP request the LLM sends is metered: the client asks its ``Meter`` for a ``Charge`` before
the request leaves (the ledger reserves the request's worst case on disk, or refuses it), and settles
that charge once the request is over, with the usage the server reported or None where it reported
none (a timeout, a cut stream, a killed process: the worst case stands).
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from pydantic import BaseModel, Field

MESSAGE_OVERHEAD_TOKENS = 16  # role markers and framing around each text sent

Message = dict[str, str]  # {"role": "system" | "user" | "assistant", "content": "..."}


class Usage(BaseModel):
    """Token counts of one request as charged: every count known and within what was authorized."""

    input_tokens: int = 0
    cached_input_tokens: int = Field(0, description="the part of input_tokens served from the prompt cache")
    output_tokens: int = 0
    reasoning_tokens: int = Field(0, description="the part of output_tokens spent on hidden reasoning")


class ReportedUsage(BaseModel):
    """Token counts as the server reported them: any may be missing (None) or nonsense (negative)."""

    input_tokens: int | None = None
    cached_input_tokens: int | None = None
    output_tokens: int | None = None
    reasoning_tokens: int | None = None


class Completion(BaseModel):
    """One reply's text, as sent (redacted of secrets), what it was charged and how long it took."""

    text: str
    finish_reason: str | None = Field(None, description="'stop', 'length', or 'cut' when sg-opt stopped reading "
                                                        "at the authorized output tokens")
    usage: Usage = Field(default_factory=Usage)
    cost_usd: float = 0.0
    model: str
    latency_s: float = 0.0
    attempts: int = Field(1, description="HTTP attempts, retries included")
    notes: list[str] = Field(default_factory=list, description="what the ledger charged other than reported")
    reused: bool = Field(False, description="read back from the ledger (a resumed run), not asked again")


class LLMError(RuntimeError):
    """A call that produced no usable reply (retries exhausted, refused by the server, malformed replies).
    What its requests cost is already settled in the ledger."""

    fatal = False

    def __init__(self, message: str, latency_s: float = 0.0):
        super().__init__(message)
        self.latency_s = latency_s


class BudgetExceeded(RuntimeError):
    """The ledger refused a request whose worst case could exceed the run's $ budget."""


class DeadlineReached(RuntimeError):
    """The run's --max-minutes leaves no time for an LLM call to finish: the run stops."""


@runtime_checkable
class Charge(Protocol):
    """One reserved request, settled exactly once when it is over."""

    def settle(self, reported: ReportedUsage | None, latency_s: float, ok: bool, note: str = "",
               reply: dict[str, Any] | None = None) -> tuple[Usage, float, list[str]]:
        """Record the request: ``reported`` None charges the reserved worst case. ``reply`` (the text and finish
        reason) is stored in the same row, so a resumed run finds it. Returns what was charged, its $ and notes."""


@runtime_checkable
class Meter(Protocol):
    """Reserves one request's worst case before it is sent."""

    def open(self) -> Charge:
        """Raise BudgetExceeded when the worst case could pass the budget; else the reserved charge."""


@runtime_checkable
class LLM(Protocol):
    """Completes a conversation into text that should be a JSON object matching ``schema``."""

    model: str

    def complete(self, messages: list[Message], schema: dict[str, Any], schema_name: str, max_output_tokens: int,
                 reasoning_effort: str | None = None, *, meter: Meter | None = None,
                 deadline: float | None = None) -> Completion:
        """The reply (text not yet parsed); LLMError when none came back, DeadlineReached when ``deadline``
        (time.monotonic) came first, BudgetExceeded when ``meter`` refused a request."""


@runtime_checkable
class Ledger(Protocol):
    """Meters every LLM request so that the $ budget cannot be overshot, and keeps their replies."""

    def meter(self, node: str, tier: str, model: str, prompt_tokens: int, max_output_tokens: int,
              purpose: str = "propose", key: str | None = None) -> Meter:
        """A meter for the requests of one call (its retries included); ``key`` names the call for reuse."""

    def reply_for(self, key: str) -> dict[str, Any] | None:
        """The settled reply of an earlier call with this key (a resumed run), or None."""

    def spent_usd(self) -> float:
        """Dollars charged so far in this run (abandoned requests at their worst case)."""


def estimate_tokens(*texts: str) -> int:
    """A strict upper bound on the prompt tokens of ``texts``: a BPE token holds at least one byte, so a text
    never has more tokens than UTF-8 bytes, plus per-message framing. Authorizing on it means no honest
    count of the server's can pass what was authorized."""
    return sum(len(text.encode("utf-8")) + MESSAGE_OVERHEAD_TOKENS for text in texts)
