"""A reply's text into a validated object, tolerant of how models wrap JSON and strict about what it says.

Servers that do not enforce the schema send JSON inside ```json fences, with prose around it, or values
of another JSON type than asked; those are accepted (the pydantic model says which types a field takes).
Anything still wrong becomes ``ReplyInvalid``, a sentence the model can act on in a repair turn.
"""

from __future__ import annotations

import json
import re
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

FENCE = re.compile(r"```[ \t]*(?:json|JSON)?[ \t]*\r?\n(.*?)```", re.DOTALL)
MAX_ERRORS = 3
T = TypeVar("T", bound=BaseModel)


class ReplyInvalid(ValueError):
    """Why a reply cannot be used, phrased to follow "the reply ..." (and to be sent back to the model)."""

    def __init__(self, problem: str, cut_off: bool = False):
        super().__init__(problem)
        self.cut_off = cut_off


def extract_json(text: str) -> Any:
    """The JSON value of a reply: the whole text, else the first fenced block that parses, else the outermost
    ``{...}`` span. ReplyInvalid names the first parse error (of the whole text)."""
    stripped = text.strip()
    if not stripped:
        raise ReplyInvalid("is empty")
    try:
        return json.loads(stripped)
    except json.JSONDecodeError as exc:
        first = exc
    candidates = [block.strip() for block in FENCE.findall(stripped)]
    start, end = stripped.find("{"), stripped.rfind("}")
    if 0 <= start < end:
        candidates.append(stripped[start:end + 1])
    for candidate in candidates:
        try:
            return json.loads(candidate)
        except json.JSONDecodeError:
            continue
    raise ReplyInvalid(f"is not valid JSON ({first.msg}: line {first.lineno} column {first.colno})")


def parse_reply(text: str, model: type[T], finish_reason: str | None = None) -> T:
    """The reply as ``model``, or ReplyInvalid. A reply cut off at the output limit is refused as such, even
    where a JSON object can be read from it: what the model meant to add is missing."""
    if finish_reason in ("length", "cut"):
        raise ReplyInvalid("was cut off at the output token limit before it was complete", cut_off=True)
    data = extract_json(text)
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise ReplyInvalid(f"does not match the schema: {schema_errors(exc)}") from None


def schema_errors(exc: ValidationError) -> str:
    """Pydantic's first errors as ``candidates.0.knob_changes.0.knob: Field required; ...``."""
    parts = []
    for error in exc.errors()[:MAX_ERRORS]:
        where = ".".join(str(part) for part in error["loc"]) or "the reply"
        parts.append(f"{where}: {error['msg'].removeprefix('Value error, ')}")
    more = exc.error_count() - MAX_ERRORS
    return "; ".join(parts) + (f" (and {more} more)" if more > 0 else "")
