"""What one LLM request is charged: the ledger's accounting rules, in one place.

A request is authorized for ``prompt_tokens`` (a strict bound on its input) and ``max_output_tokens``, and is
never charged more than that worst case, nor less than what an honest server could have billed for it:

- no usage at all (timed out, cut off, the stream broken, the process killed): the worst case;
- a count missing, negative or not a number: that count's worst case (input: the prompt bound; output: the
  authorized output tokens);
- a count above what was authorized (a server that ignored ``max_completion_tokens``): the authorized count,
  the reported one kept in the row, and a note;
- cached input missing or nonsense: none cached (all at the full input price); above the input: all of it;
- reasoning tokens are part of the output tokens, so never added again.
"""

from __future__ import annotations

from sg_opt.tiers import Price
from state_machine.llm_interfaces import ReportedUsage, Usage

PER_MILLION = 1_000_000
NO_USAGE = "no usage reported: charged the authorized worst case"
OVER_LIMIT = "is over the authorized"  # in the note of a count a server reported past its limit


def call_cost(price: Price, usage: Usage) -> float:
    """Dollars for one request. Reasoning tokens are part of the output tokens, so not added again."""
    uncached = max(usage.input_tokens - usage.cached_input_tokens, 0)
    return (uncached * price.input + usage.cached_input_tokens * price.cached
            + usage.output_tokens * price.output) / PER_MILLION


def worst_case_cost(price: Price, prompt_tokens: int, max_output_tokens: int) -> float:
    """Every prompt token at the dearer input price and every authorized output token."""
    return (prompt_tokens * max(price.input, price.cached) + max_output_tokens * price.output) / PER_MILLION


def charged_usage(reported: ReportedUsage | None, prompt_tokens: int,
                  max_output_tokens: int) -> tuple[Usage, list[str]]:
    """The usage a request is charged, and a note for each count not charged as reported."""
    if reported is None:
        return Usage(input_tokens=prompt_tokens, output_tokens=max_output_tokens), [NO_USAGE]
    notes: list[str] = []
    inputs = _bounded("input_tokens", reported.input_tokens, prompt_tokens, notes)
    outputs = _bounded("output_tokens", reported.output_tokens, max_output_tokens, notes)
    cached = min(_part(reported.cached_input_tokens), inputs)
    reasoning = min(_part(reported.reasoning_tokens), outputs)
    return Usage(input_tokens=inputs, cached_input_tokens=cached, output_tokens=outputs,
                 reasoning_tokens=reasoning), notes


def _bounded(name: str, value: int | None, authorized: int, notes: list[str]) -> int:
    if not _count(value):
        notes.append(f"{name} {'missing' if value is None else repr(value)}: charged the authorized {authorized}")
        return authorized
    if value > authorized:
        notes.append(f"{name} {value} {OVER_LIMIT} {authorized} (the server ignored the limit): charged {authorized}")
        return authorized
    return value


def _part(value: int | None) -> int:
    """A count that only lowers the charge when present (cached) or only describes it (reasoning)."""
    return value if _count(value) else 0


def _count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0
