"""The agent's LLM: Chat Completions with a strict JSON schema, over the ``openai`` package.

Chat Completions is what every OpenAI-compatible server speaks (OpenAI, Azure, vLLM, Ollama), so a
``base_url`` is all it takes to move off OpenAI. This module owns the retry policy (the openai
client's own retries are off, so attempts are counted and backed off here, with jitter and the
server's Retry-After), turns every failure into one ``LLMError`` sentence (a failed proposal), and
marks the failures a retry cannot fix (no server there, key refused) as ``LLMFatalError`` so the
run stops and tells the user. The API key is never put in a message, repr or log line.
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
import time
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import openai

from sg_opt.tiers import Tier
from state_machine.llm_interfaces import Completion, LLMError, Usage
from targets.protocol import ConfigError

log = logging.getLogger(__name__)

OPENAI_URL = "https://api.openai.com/v1"
NO_KEY = "sk-no-key"  # local servers ignore the key, but the openai client insists on one
DEFAULT_TIMEOUT_S = 180.0
RETRYABLE_STATUS = frozenset({408, 409, 429})
SERVER_MESSAGE_CHARS = 300
NOT_A_COMPLETION = ("answered with something that is not a chat completion; "
                    "check --base-url (usually ending in /v1)")


class LLMFatalError(LLMError):
    """A failure no retry or other proposal can fix (endpoint unreachable, key refused): stop the run."""

    fatal = True


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

    def complete(self, system: str, prompt: str, schema: dict[str, Any], schema_name: str,
                 max_output_tokens: int, reasoning_effort: str | None = None) -> Completion:
        start = time.monotonic()
        request = self._request(system, prompt, schema, schema_name, max_output_tokens, reasoning_effort)
        response, attempts = self._send(request, start)
        latency = time.monotonic() - start
        usage = read_usage(getattr(response, "usage", None))
        data = self._parse(response, schema, max_output_tokens, usage, latency)
        return Completion(data=data, usage=usage, model=self.model, latency_s=latency, attempts=attempts)

    def _request(self, system: str, prompt: str, schema: dict[str, Any], schema_name: str,
                 max_output_tokens: int, reasoning_effort: str | None) -> dict[str, Any]:
        request: dict[str, Any] = {
            "model": self.model,
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": prompt}],
            "response_format": {"type": "json_schema",
                                "json_schema": {"name": schema_name, "schema": schema, "strict": True}},
            "max_completion_tokens": max_output_tokens,
            "timeout": self.timeout_s,
        }
        if reasoning_effort is not None:
            request["reasoning_effort"] = reasoning_effort
        return request

    def _send(self, request: dict[str, Any], start: float) -> tuple[Any, int]:
        """The response and the attempts it took, or LLMError. The error is raised outside the
        ``except`` block so the openai exception (whose text may quote the key) is not chained."""
        for attempt in range(1, self.max_attempts + 1):
            failure: LLMError | None = None
            try:
                return self._client.chat.completions.create(**request), attempt
            except openai.APIError as exc:
                failure = self._failure(exc, attempt)
                if failure is None:
                    self._wait(exc, attempt)
            except ValueError:  # a 200 whose JSON body does not parse
                failure = LLMError(f"the LLM endpoint {public_url(self.base_url)} {NOT_A_COMPLETION}")
            if failure is not None:
                failure.latency_s = time.monotonic() - start
                raise failure
        raise AssertionError("unreachable: the last attempt always returns or fails")

    def _failure(self, exc: openai.APIError, attempt: int) -> LLMError | None:
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

    def _wait(self, exc: openai.APIError, attempt: int) -> None:
        ceiling = min(self.backoff_max_s, self.backoff_base_s * 2 ** (attempt - 1))
        delay = ceiling / 2 + self._rng.uniform(0, ceiling / 2)
        hint = _retry_after(exc)
        if hint is not None:
            delay = max(delay, min(hint, self.backoff_max_s))
        log.warning("LLM call to %s failed (%s); attempt %d of %d in %.2fs", public_url(self.base_url),
                    _kind(exc), attempt + 1, self.max_attempts, delay)
        time.sleep(delay)

    def _server_message(self, exc: openai.APIError) -> str:
        body = getattr(exc, "body", None)
        error = body.get("error", body) if isinstance(body, dict) else None
        text = error.get("message") if isinstance(error, dict) else None
        text = str(text or body or exc.message)
        return self._redactor(text)[:SERVER_MESSAGE_CHARS]

    def _parse(self, response: Any, schema: dict[str, Any], max_output_tokens: int,
               usage: Usage, latency: float) -> dict[str, Any]:
        """The reply's JSON object, or LLMError (carrying the billed usage) saying what is wrong."""
        def fail(problem: str) -> LLMError:
            return LLMError(f"the {self.model} reply {problem}", usage=usage, latency_s=latency)

        choices = getattr(response, "choices", None) or []
        message = getattr(choices[0], "message", None) if choices else None
        if message is None:
            raise LLMError(f"the LLM endpoint {public_url(self.base_url)} {NOT_A_COMPLETION}",
                           usage=usage, latency_s=latency)
        if getattr(message, "refusal", None):
            raise fail(f"is a refusal: {self._redactor(str(message.refusal))[:SERVER_MESSAGE_CHARS]}")
        if getattr(choices[0], "finish_reason", None) == "length":
            raise fail(f"was cut off at max_output_tokens={max_output_tokens} before its JSON was complete")
        try:
            data = json.loads(message.content or "")
        except json.JSONDecodeError as exc:
            raise fail(f"is not valid JSON ({exc.msg} at character {exc.pos})") from None
        if not isinstance(data, dict):
            raise fail(f"is JSON but a {type(data).__name__}, not an object")
        missing = [key for key in schema.get("required", []) if key not in data]
        if missing:
            raise fail(f"lacks the required key{'s' * (len(missing) > 1)} {', '.join(missing)}")
        return data


def read_usage(usage: Any) -> Usage:
    """``usage`` of a Chat Completions response as ``Usage``; absent counts are 0."""
    prompt_details = getattr(usage, "prompt_tokens_details", None)
    completion_details = getattr(usage, "completion_tokens_details", None)
    return Usage(input_tokens=_count(usage, "prompt_tokens"),
                 cached_input_tokens=_count(prompt_details, "cached_tokens"),
                 output_tokens=_count(usage, "completion_tokens"),
                 reasoning_tokens=_count(completion_details, "reasoning_tokens"))


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


class Redactor:
    """Blanks the API key and anything shaped like a key or bearer token out of server text."""

    PATTERNS = (re.compile(r"\bsk-[A-Za-z0-9_\-*.]{3,}"), re.compile(r"(?i)bearer\s+\S+"))

    def __init__(self, secret: str):
        self._secret = secret if len(secret) >= 8 else ""

    def __call__(self, text: str) -> str:
        if self._secret:
            text = text.replace(self._secret, "***")
        for pattern in self.PATTERNS:
            text = pattern.sub("***", text)
        return text

    def __repr__(self) -> str:
        return "Redactor(***)"


def public_url(url: str) -> str:
    """``url`` without user:password or query, safe to show."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    netloc = f"{host}:{parts.port}" if parts.port else host
    return urlunsplit((parts.scheme, netloc, parts.path, "", ""))


def check_reachable(base_url: str, timeout_s: float = 5.0) -> None:
    """Fail before the baseline starts, not an hour later, when nothing listens at a --base-url."""
    import socket

    parts = urlsplit(base_url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(f"--base-url {public_url(base_url)} is not an http(s) URL")
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        socket.create_connection((parts.hostname, port), timeout=timeout_s).close()
    except OSError as exc:
        raise ConfigError(f"the LLM endpoint {public_url(base_url)} is unreachable ({exc.strerror or exc})") from None


def _retryable(exc: openai.APIError) -> bool:
    if isinstance(exc, openai.APIConnectionError):  # timeouts included
        return True
    status = getattr(exc, "status_code", None)
    return isinstance(status, int) and (status in RETRYABLE_STATUS or status >= 500)


def _retry_after(exc: openai.APIError) -> float | None:
    """The server's Retry-After (seconds) or retry-after-ms hint, if it sent one."""
    response = getattr(exc, "response", None)
    headers = getattr(response, "headers", None) or {}
    for name, scale in (("retry-after-ms", 0.001), ("retry-after", 1.0)):
        try:
            return max(float(headers[name]) * scale, 0.0)
        except (KeyError, TypeError, ValueError):
            continue
    return None


def _kind(exc: openai.APIError) -> str:
    status = getattr(exc, "status_code", None)
    return f"HTTP {status}" if status else type(exc).__name__


def _count(obj: Any, name: str) -> int:
    value = getattr(obj, name, None) if obj is not None else None
    return int(value) if isinstance(value, (int, float)) else 0
