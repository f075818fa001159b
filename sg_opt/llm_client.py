"""The agent's LLM: streamed Chat Completions with a strict JSON schema, over the ``openai`` package.

Chat Completions is what every OpenAI-compatible server speaks (OpenAI, Azure, vLLM, Ollama), so a
``base_url`` is all it takes to move off OpenAI. Replies are streamed so that sg-opt, not the server,
decides when a reply is too long: reading stops just short of the authorized output tokens, and a server
that ignores ``max_completion_tokens`` cannot run up the bill (a server that sends the whole body at once is
read as a plain completion). Every request is reserved with the run's ``Meter`` before it is sent and settled
after it: the reported usage, or None where none came (timed out, cut off, broken), which the ledger charges
at its worst case.

This module owns the retry policy (the openai client's own retries are off, so attempts are counted and
backed off here, with jitter and the server's Retry-After) and the run's deadline: no attempt, read or
back-off outlives it. Every failure becomes one ``LLMError`` sentence (a failed proposal); those no retry
can fix (no server there, key refused, a server that bills past the limit) are ``LLMFatalError`` so the run
stops and says so. The API key is never put in a message, repr, log line or stored reply.
"""

from __future__ import annotations

import json
import logging
import os
import random
import time
from dataclasses import dataclass, field
from typing import Any

import openai

from sg_opt.charges import OVER_LIMIT
from sg_opt.redact import Redactor, public_url
from sg_opt.tiers import Tier
from state_machine.llm_interfaces import (Charge, Completion, DeadlineReached, LLMError, Message, Meter,
                                          ReportedUsage, Usage)
from targets.protocol import ConfigError

log = logging.getLogger(__name__)

OPENAI_URL = "https://api.openai.com/v1"
NO_KEY = "sk-no-key"  # local servers ignore the key, but the openai client insists on one
DEFAULT_TIMEOUT_S = 180.0
MIN_ATTEMPT_S = 1.0  # an attempt with less time than this before the deadline is not started
RETRYABLE_STATUS = frozenset({408, 409, 429})
MAY_HAVE_RUN_STATUS = frozenset({504, 524})  # gateway timeouts: the model may have answered, and billed, behind it
SERVER_MESSAGE_CHARS = 300
CHARS_PER_TOKEN_MAX = 32  # no token of a real tokenizer is longer: chars / 32 never counts more tokens than sent
NOT_A_COMPLETION = ("answered with something that is not a chat completion; "
                    "check --base-url (usually ending in /v1)")


class LLMFatalError(LLMError):
    """A failure no retry or other proposal can fix (endpoint unreachable, key refused): stop the run."""

    fatal = True


def stop_reading_at(max_output_tokens: int) -> int:
    """The streamed tokens at which reading stops: 5% short of the authorized count (at least 16), so that what
    a runaway server generates before it notices the closed stream still falls within what was authorized."""
    return max(1, max_output_tokens - max(16, max_output_tokens // 20))


@dataclass
class _Reply:
    """What one attempt read: the text so far, why it ended, and the usage the server reported (if any)."""

    text: str = ""
    finish_reason: str | None = None
    reported: ReportedUsage | None = None
    refusal: str = ""
    past_deadline: bool = False
    notes: list[str] = field(default_factory=list)


class _AttemptTimeout(Exception):
    """The attempt ran past the client's timeout while the stream still trickled in."""


class OpenAIClient:
    """``LLM`` over an OpenAI-compatible Chat Completions endpoint."""

    def __init__(self, model: str, api_key: str, base_url: str | None = None,
                 timeout_s: float = DEFAULT_TIMEOUT_S, max_attempts: int = 5,
                 backoff_base_s: float = 1.0, backoff_max_s: float = 30.0, rng: random.Random | None = None):
        self.model = model
        self.base_url = base_url or OPENAI_URL
        self.timeout_s = timeout_s
        self.max_attempts = max(1, max_attempts)
        self.backoff_base_s, self.backoff_max_s = backoff_base_s, backoff_max_s
        self._rng = rng or random.Random()
        self._redactor = Redactor(api_key)
        self._client = openai.OpenAI(api_key=api_key, base_url=self.base_url, max_retries=0, timeout=timeout_s)

    def __repr__(self) -> str:
        return f"OpenAIClient(model={self.model!r}, base_url={public_url(self.base_url)!r})"

    def complete(self, messages: list[Message], schema: dict[str, Any], schema_name: str, max_output_tokens: int,
                 reasoning_effort: str | None = None, *, meter: Meter | None = None,
                 deadline: float | None = None) -> Completion:
        start = time.monotonic()
        request = self._request(messages, schema, schema_name, max_output_tokens, reasoning_effort)
        charged, cost = Usage(), 0.0
        for attempt in range(1, self.max_attempts + 1):
            timeout = self._attempt_timeout(deadline)
            charge = meter.open() if meter is not None else None
            sent = time.monotonic()
            reply, error = self._attempt(request, timeout, max_output_tokens, deadline)
            if error is None and reply.refusal:
                error = self._fail(f"is a refusal: {reply.refusal[:SERVER_MESSAGE_CHARS]}")
            usage, spent, notes = self._settle(charge, reply, error, time.monotonic() - sent)
            charged, cost = _add(charged, usage), cost + spent
            if reply.past_deadline:
                raise DeadlineReached("the run's --max-minutes deadline came while the LLM was still answering")
            if any(OVER_LIMIT in note for note in notes):
                raise LLMFatalError(f"the LLM endpoint {public_url(self.base_url)} reported more tokens than were "
                                    f"authorized ({'; '.join(notes)}), so its spend cannot be bounded: the run stops")
            if error is None:
                return Completion(text=reply.text, finish_reason=reply.finish_reason, usage=charged, cost_usd=cost,
                                  model=self.model, latency_s=time.monotonic() - start, attempts=attempt,
                                  notes=notes)
            failure = error if isinstance(error, LLMError) else self._failure(error, attempt)
            if failure is not None:
                failure.latency_s = time.monotonic() - start
                raise failure
            self._wait(error, attempt, deadline)
        raise AssertionError("unreachable: the last attempt always returns or fails")

    def _request(self, messages: list[Message], schema: dict[str, Any], schema_name: str, max_output_tokens: int,
                 reasoning_effort: str | None) -> dict[str, Any]:
        request: dict[str, Any] = {
            "model": self.model,
            "messages": messages,
            "response_format": {"type": "json_schema",
                                "json_schema": {"name": schema_name, "schema": schema, "strict": True}},
            "max_completion_tokens": max_output_tokens,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if reasoning_effort is not None:
            request["reasoning_effort"] = reasoning_effort
        return request

    def _attempt_timeout(self, deadline: float | None) -> float:
        """This attempt's timeout: the client's, cut to what is left before the run's deadline."""
        if deadline is None:
            return self.timeout_s
        left = deadline - time.monotonic()
        if left < MIN_ATTEMPT_S:
            raise DeadlineReached("the run's --max-minutes deadline leaves no time for another LLM request")
        return min(self.timeout_s, left)

    # ------------------------------------------------------------------------- one attempt

    def _attempt(self, request: dict[str, Any], timeout: float, max_output_tokens: int,
                 deadline: float | None) -> tuple[_Reply, Exception | None]:
        """What one HTTP request read, and the error that ended it (None: a reply came). The openai exception is
        returned, not raised, so that no error raised later chains it (its text may quote the key)."""
        sent = time.monotonic()
        try:
            stream = self._client.chat.completions.create(**request, timeout=timeout)
        except openai.APIError as exc:
            return _Reply(reported=_unbilled(exc)), exc
        try:
            if "event-stream" not in stream.response.headers.get("content-type", ""):
                return self._whole_body(stream.response.read())
            return self._stream(stream, stop_reading_at(max_output_tokens), min(
                sent + self.timeout_s, deadline if deadline is not None else float("inf")), deadline)
        except _AttemptTimeout:
            return _Reply(), openai.APITimeoutError(request=stream.response.request)
        except openai.APIError as exc:  # the stream broke, or its read timed out, mid-reply
            return _Reply(), exc
        except (ValueError, KeyError, IndexError, AttributeError, TypeError):
            return _Reply(), self._fail_endpoint()
        finally:
            stream.close()

    def _stream(self, stream: Any, stop_at: int, end: float, deadline: float | None) -> tuple[_Reply, Exception | None]:
        reply, parts, chunks, chars = _Reply(), [], 0, 0
        for chunk in stream:
            if getattr(chunk, "usage", None) is not None:
                reply.reported = reported_usage(chunk.usage)
            for choice in getattr(chunk, "choices", None) or []:
                delta = getattr(choice, "delta", None)
                content = getattr(delta, "content", None)
                thought = getattr(delta, "reasoning_content", None) or getattr(delta, "reasoning", None)
                if content:
                    parts.append(content)
                if content or thought:  # visible reasoning (vLLM, OpenRouter) is billed output too
                    chunks, chars = chunks + 1, chars + len(content or "") + len(str(thought or ""))
                reply.refusal += getattr(delta, "refusal", None) or ""
                reply.finish_reason = getattr(choice, "finish_reason", None) or reply.finish_reason
            if max(chunks, chars // CHARS_PER_TOKEN_MAX) >= stop_at and reply.reported is None:
                reply.finish_reason = "cut"  # a runaway: stop paying for it
                break
            now = time.monotonic()
            if now > end and reply.reported is None:
                if deadline is not None and now > deadline:
                    reply.past_deadline = True
                    break
                raise _AttemptTimeout()
        reply.text = self._redactor("".join(parts))
        reply.refusal = self._redactor(reply.refusal)
        if not parts and reply.reported is None and not reply.refusal and not reply.past_deadline:
            return reply, self._fail("was an empty stream")
        return reply, None

    def _whole_body(self, raw: bytes) -> tuple[_Reply, Exception | None]:
        """A server that ignored ``stream``: the body is one chat completion (or not one at all)."""
        body = json.loads(raw)
        choice = body["choices"][0]
        message = choice["message"]
        reply = _Reply(text=self._redactor(message.get("content") or ""), finish_reason=choice.get("finish_reason"),
                       reported=reported_usage(body["usage"]) if isinstance(body.get("usage"), dict) else None,
                       refusal=self._redactor(message.get("refusal") or ""))
        return reply, None

    def _settle(self, charge: Charge | None, reply: _Reply, error: Exception | None,
                latency_s: float) -> tuple[Usage, float, list[str]]:
        """Settle the request; a reply is stored with it (for a resumed run) only when one came in full."""
        if charge is None:
            return Usage(), 0.0, []
        ok = error is None and not reply.past_deadline
        stored = {"text": reply.text, "finish_reason": reply.finish_reason} if ok else None
        if error is not None:
            note = self._redactor(f"{_kind(error)}: {error}")[:SERVER_MESSAGE_CHARS]
        elif reply.past_deadline:
            note = "stopped reading at the run's deadline"
        else:
            note = "stopped reading just short of the authorized output tokens" if reply.finish_reason == "cut" else ""
        return charge.settle(reply.reported, latency_s, ok=ok, note=note, reply=stored)

    # ------------------------------------------------------------------------- failures and retries

    def _fail(self, problem: str) -> LLMError:
        return LLMError(f"the {self.model} reply {problem}")

    def _fail_endpoint(self) -> LLMError:
        return LLMError(f"the LLM endpoint {public_url(self.base_url)} {NOT_A_COMPLETION}")

    def _failure(self, exc: Exception, attempt: int) -> LLMError | None:
        """None when ``exc`` is worth another attempt, else the error to raise."""
        url, tries = public_url(self.base_url), f"{attempt} attempt{'s' * (attempt > 1)}"
        if _retryable(exc) and attempt < self.max_attempts:
            return None
        if isinstance(exc, openai.APITimeoutError):
            return LLMError(f"the LLM endpoint {url} did not answer within {self.timeout_s:g}s ({tries})")
        if isinstance(exc, openai.APIConnectionError):
            return LLMFatalError(f"the LLM endpoint {url} is unreachable ({tries}); check --base-url "
                                 f"and that the server is running")
        status, said = getattr(exc, "status_code", None), self._server_message(exc)
        if status == 401:
            return LLMFatalError(f"the API key was refused by {url} (HTTP 401); check OPENAI_API_KEY")
        if status == 403:
            return LLMFatalError(f"{url} denied this API key access (HTTP 403): {said}")
        if status == 404:
            return LLMFatalError(f"{url} has no model {self.model!r} or no chat completions endpoint "
                                 f"(HTTP 404): {said}")
        if _retryable(exc):
            return LLMError(f"the LLM endpoint {url} answered HTTP {status} on all {tries}: {said}")
        return LLMError(f"the LLM endpoint {url} rejected the request (HTTP {status}): {said}")

    def _wait(self, exc: Exception, attempt: int, deadline: float | None) -> None:
        ceiling = min(self.backoff_max_s, self.backoff_base_s * 2 ** (attempt - 1))
        delay = ceiling / 2 + self._rng.uniform(0, ceiling / 2)
        hint = _retry_after(exc)
        if hint is not None:
            delay = max(delay, min(hint, self.backoff_max_s))
        if deadline is not None and time.monotonic() + delay + MIN_ATTEMPT_S > deadline:
            raise DeadlineReached(f"the run's --max-minutes deadline comes before the LLM endpoint could be asked "
                                  f"again (the last attempt failed: {_kind(exc)})")
        log.warning("LLM call to %s failed (%s); attempt %d of %d in %.2fs", public_url(self.base_url),
                    _kind(exc), attempt + 1, self.max_attempts, delay)
        time.sleep(delay)

    def _server_message(self, exc: Exception) -> str:
        body = getattr(exc, "body", None)
        error = body.get("error", body) if isinstance(body, dict) else None
        text = error.get("message") if isinstance(error, dict) else None
        text = str(text or body or getattr(exc, "message", exc))
        return self._redactor(text)[:SERVER_MESSAGE_CHARS]


def reported_usage(usage: Any) -> ReportedUsage:
    """A Chat Completions ``usage`` (object or dict) as reported; counts absent or not integers are None."""
    prompt_details = _field(usage, "prompt_tokens_details")
    completion_details = _field(usage, "completion_tokens_details")
    return ReportedUsage(input_tokens=_int(_field(usage, "prompt_tokens")),
                         cached_input_tokens=_int(_field(prompt_details, "cached_tokens")),
                         output_tokens=_int(_field(usage, "completion_tokens")),
                         reasoning_tokens=_int(_field(completion_details, "reasoning_tokens")))


def make_client(tier: Tier, base_url: str | None = None, model_override: str | None = None,
                timeout_s: float = DEFAULT_TIMEOUT_S) -> OpenAIClient | None:
    """The tier's client; None for a tier without an LLM. ``OPENAI_BASE_URL`` stands in for
    ``base_url``; with a base URL but no key a placeholder key is sent (local servers ignore it)."""
    if not tier.uses_llm:
        return None
    base_url = base_url or os.environ.get("OPENAI_BASE_URL") or None
    api_key = os.environ.get("OPENAI_API_KEY") or None
    if api_key is None and base_url is None:
        raise ConfigError(f"tier {tier.name} needs an LLM: set OPENAI_API_KEY or pass --base-url "
                          f"for an OpenAI-compatible server")
    model = model_override or tier.model
    assert model is not None  # uses_llm
    return OpenAIClient(model=model, api_key=api_key or NO_KEY, base_url=base_url, timeout_s=timeout_s)


def check_reachable(base_url: str, timeout_s: float = 5.0) -> None:
    """Fail before the baseline starts, not an hour later, when nothing listens at a --base-url."""
    import socket
    from urllib.parse import urlsplit

    parts = urlsplit(base_url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(f"--base-url {public_url(base_url)} is not an http(s) URL")
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        socket.create_connection((parts.hostname, port), timeout=timeout_s).close()
    except OSError as exc:
        raise ConfigError(f"the LLM endpoint {public_url(base_url)} is unreachable ({exc.strerror or exc})") from None


def _unbilled(exc: openai.APIError) -> ReportedUsage | None:
    """What a request that failed before any reply was read is charged: nothing where the server said it failed or
    the request never left (a refused connection); None (the worst case) where the model may have run."""
    if isinstance(exc, openai.APIConnectionError) and not isinstance(exc, openai.APITimeoutError):
        never_sent = type(exc.__cause__).__name__ in ("ConnectError", "ConnectTimeout", "PoolTimeout")
        return ReportedUsage(input_tokens=0, output_tokens=0) if never_sent else None
    status = getattr(exc, "status_code", None)
    if isinstance(status, int) and status not in MAY_HAVE_RUN_STATUS:
        return ReportedUsage(input_tokens=0, output_tokens=0)
    return None


def _retryable(exc: Exception) -> bool:
    if isinstance(exc, openai.APIConnectionError):  # timeouts included
        return True
    status = getattr(exc, "status_code", None)
    return isinstance(status, int) and (status in RETRYABLE_STATUS or status >= 500)


def _retry_after(exc: Exception) -> float | None:
    """The server's Retry-After (seconds) or retry-after-ms hint, if it sent one."""
    response = getattr(exc, "response", None)
    headers = getattr(response, "headers", None) or {}
    for name, scale in (("retry-after-ms", 0.001), ("retry-after", 1.0)):
        try:
            return max(float(headers[name]) * scale, 0.0)
        except (KeyError, TypeError, ValueError):
            continue
    return None


def _kind(exc: Exception) -> str:
    status = getattr(exc, "status_code", None)
    return f"HTTP {status}" if status else type(exc).__name__


def _add(a: Usage, b: Usage) -> Usage:
    return Usage(**{name: getattr(a, name) + getattr(b, name) for name in Usage.model_fields})


def _field(obj: Any, name: str) -> Any:
    if isinstance(obj, dict):
        return obj.get(name)
    return getattr(obj, name, None) if obj is not None else None


def _int(value: Any) -> int | None:
    """An integer count (negative ones kept, for the ledger to refuse); anything else is missing."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return int(value) if float(value).is_integer() else None
