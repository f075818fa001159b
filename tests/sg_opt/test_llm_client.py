"""The openai-backed client against a real scripted server on loopback: replies, retries, failures,
the ledger in the loop, and no trace of the API key anywhere."""

from __future__ import annotations

import json
import logging
import socket
import traceback

import pytest

from sg_opt.ledger import TokenLedger
from sg_opt.llm_client import NO_KEY, LLMFatalError, OpenAIClient, make_client
from sg_opt.tiers import Price, load_tiers
from state_machine.llm_interfaces import LLM, BudgetExceeded, Completion, LLMError, estimate_tokens
from targets.protocol import ConfigError
from tests.fixtures.openai_server import (reply_body, reply_delay, reply_json,
                                          reply_raw, reply_status)

KEY = "sk-test-Zq8vN3xK7pL2mW9rT4yB6cD1"
SYSTEM, PROMPT = "You tune training jobs.", "Propose one knob change."
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["knob", "value"],
          "properties": {"knob": {"type": "string"}, "value": {"type": "integer"}}}
GOOD = {"knob": "data_workers", "value": 4}


def client(server, **kwargs) -> OpenAIClient:
    options = {"model": "m", "api_key": KEY, "base_url": server.url, "timeout_s": 5.0, "max_attempts": 3,
               "backoff_base_s": 0.01, "backoff_max_s": 0.05} | kwargs
    return OpenAIClient(**options)


def ask(llm: OpenAIClient, effort: str | None = None, max_out: int = 1000) -> Completion:
    return llm.complete(SYSTEM, PROMPT, SCHEMA, "proposal", max_output_tokens=max_out, reasoning_effort=effort)


def metered(llm: OpenAIClient, ledger: TokenLedger, max_out: int = 1000) -> Completion:
    """What a proposer does: authorize the worst case, call, record whatever was billed."""
    ledger.authorize("propose", "normal", llm.model, estimate_tokens(SYSTEM, PROMPT, json.dumps(SCHEMA)), max_out)
    try:
        completion = ask(llm, max_out=max_out)
    except LLMError as exc:
        ledger.record("propose", "normal", llm.model, exc.usage, exc.latency_s, ok=False)
        raise
    ledger.record("propose", "normal", llm.model, completion.usage, completion.latency_s)
    return completion


def test_success_parses_the_object_counts_usage_and_sends_the_schema(openai_server):
    openai_server.script(reply_json(GOOD, prompt_tokens=120, cached_tokens=100, completion_tokens=40,
                                    reasoning_tokens=25))
    llm = client(openai_server)
    assert isinstance(llm, LLM)
    completion = ask(llm, effort="high", max_out=777)
    assert completion.data == GOOD and completion.attempts == 1 and completion.model == "m"
    assert completion.usage.model_dump() == {"input_tokens": 120, "cached_input_tokens": 100,
                                             "output_tokens": 40, "reasoning_tokens": 25}
    (request,) = openai_server.requests
    assert request.path == "/v1/chat/completions"
    assert request.headers["authorization"] == f"Bearer {KEY}"
    assert request.body["response_format"] == {
        "type": "json_schema", "json_schema": {"name": "proposal", "schema": SCHEMA, "strict": True}}
    assert request.body["messages"] == [{"role": "system", "content": SYSTEM}, {"role": "user", "content": PROMPT}]
    assert request.body["max_completion_tokens"] == 777 and request.body["reasoning_effort"] == "high"


def test_reasoning_effort_is_left_out_when_none_and_missing_usage_counts_are_zero(openai_server):
    openai_server.script(reply_json(GOOD, prompt_tokens=7, completion_tokens=None),
                         reply_json(GOOD, with_usage=False))
    llm = client(openai_server)
    assert ask(llm).usage.model_dump() == {"input_tokens": 7, "cached_input_tokens": 0,
                                           "output_tokens": 0, "reasoning_tokens": 0}
    assert ask(llm).usage.input_tokens == 0
    assert "reasoning_effort" not in openai_server.requests[0].body


@pytest.mark.parametrize("first", [reply_status(429, "slow down", retry_after=0.01),
                                   reply_status(500, "boom"), reply_status(503, "busy")],
                         ids=["429", "500", "503"])
def test_a_transient_error_then_success_takes_two_attempts(openai_server, first):
    openai_server.script(first, reply_json(GOOD, prompt_tokens=5, completion_tokens=5))
    completion = ask(client(openai_server))
    assert completion.data == GOOD and completion.attempts == 2 and len(openai_server.requests) == 2


def test_a_timeout_then_success_takes_two_attempts(openai_server):
    openai_server.script(reply_delay(1.0), reply_json(GOOD))
    completion = ask(client(openai_server, timeout_s=0.25))
    assert completion.data == GOOD and completion.attempts == 2


def test_retries_exhausted_is_a_failed_proposal_not_a_fatal_error(openai_server):
    openai_server.script(*[reply_status(500, "still broken")] * 3)
    with pytest.raises(LLMError, match=r"HTTP 500 on all 3 attempts: still broken") as info:
        ask(client(openai_server))
    assert not getattr(info.value, "fatal", False) and len(openai_server.requests) == 3


def test_timeouts_exhausted_say_so(openai_server):
    openai_server.script(reply_delay(1.0), reply_delay(1.0))
    with pytest.raises(LLMError, match=r"did not answer within 0.2s \(2 attempts\)"):
        ask(client(openai_server, timeout_s=0.2, max_attempts=2))


@pytest.mark.parametrize("reply, problem", [
    (reply_raw("{not json", prompt_tokens=9, completion_tokens=3), "is not valid JSON"),
    (reply_raw("[1, 2]", prompt_tokens=9, completion_tokens=3), "is JSON but a list, not an object"),
    (reply_json({"knob": "x"}, prompt_tokens=9, completion_tokens=3), "lacks the required key value"),
    (reply_raw('{"knob": "x", "va', prompt_tokens=9, completion_tokens=3, finish_reason="length"),
     "was cut off at max_output_tokens=1000"),
], ids=["not-json", "not-object", "missing-key", "truncated"])
def test_a_malformed_reply_is_an_llm_error_that_carries_the_billed_usage(openai_server, reply, problem):
    openai_server.script(reply)
    with pytest.raises(LLMError, match=problem) as info:
        ask(client(openai_server))
    assert info.value.usage.input_tokens == 9 and info.value.usage.output_tokens == 3
    assert not getattr(info.value, "fatal", False) and len(openai_server.requests) == 1


@pytest.mark.parametrize("reply", [reply_body("<html>a web page</html>", content_type="text/html"),
                                   reply_body("{broken"), reply_body('{"object": "list", "data": []}')],
                         ids=["html", "broken-json", "other-json"])
def test_a_body_that_is_no_chat_completion_is_an_llm_error(openai_server, reply):
    openai_server.script(reply)
    with pytest.raises(LLMError, match="not a chat completion; check --base-url"):
        ask(client(openai_server))


def test_a_bad_request_is_not_retried(openai_server):
    openai_server.script(reply_status(400, "reasoning_effort is not supported"))
    with pytest.raises(LLMError, match=r"rejected the request \(HTTP 400\): reasoning_effort is not supported"):
        ask(client(openai_server), effort="high")
    assert len(openai_server.requests) == 1


def test_a_refused_key_is_fatal_at_once_and_says_so_without_the_key(openai_server):
    openai_server.script(reply_status(401, f"Incorrect API key provided: {KEY}"))
    with pytest.raises(LLMFatalError) as info:
        ask(client(openai_server))
    assert info.value.fatal and isinstance(info.value, LLMError)
    assert str(info.value) == f"the API key was refused by {openai_server.url} (HTTP 401); check OPENAI_API_KEY"
    assert len(openai_server.requests) == 1


def test_an_unreachable_endpoint_is_fatal():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # closed again before the call: nothing listens there
    llm = OpenAIClient("m", KEY, base_url=f"http://127.0.0.1:{port}/v1", max_attempts=2, backoff_base_s=0.01)
    with pytest.raises(LLMFatalError, match=rf"the LLM endpoint http://127.0.0.1:{port}/v1 is unreachable"):
        ask(llm)


def test_the_ledger_counts_exactly_what_the_server_billed(openai_server, tmp_path):
    openai_server.script(reply_json(GOOD, prompt_tokens=300, cached_tokens=100, completion_tokens=50,
                                    reasoning_tokens=20),
                         reply_raw("oops", prompt_tokens=200, completion_tokens=10))
    ledger = TokenLedger(tmp_path, {"m": Price(input=1.0, cached_input=0.1, output=4.0)}, budget_usd=1.0)
    metered(client(openai_server), ledger)
    with pytest.raises(LLMError):
        metered(client(openai_server), ledger)
    total = ledger.totals().overall
    assert (total.calls, total.failed_calls, total.input_tokens, total.cached_input_tokens,
            total.output_tokens, total.reasoning_tokens) == (2, 1, 500, 100, 60, 20)
    assert ledger.spent_usd() == pytest.approx((400 * 1.0 + 100 * 0.1 + 60 * 4.0) / 1e6)


def test_a_budget_for_two_calls_refuses_the_third_before_it_is_sent(openai_server, tmp_path):
    prompt_tokens, max_out = estimate_tokens(SYSTEM, PROMPT, json.dumps(SCHEMA)), 1000
    worst = (prompt_tokens * 1.0 + max_out * 4.0) / 1e6
    full = dict(prompt_tokens=prompt_tokens, completion_tokens=max_out)  # each call bills its worst case
    openai_server.script(reply_json(GOOD, **full), reply_json(GOOD, **full), reply_json(GOOD, **full))
    ledger = TokenLedger(tmp_path, {"m": Price(input=1.0, output=4.0)}, budget_usd=2.5 * worst)
    llm = client(openai_server)
    metered(llm, ledger, max_out)
    metered(llm, ledger, max_out)
    with pytest.raises(BudgetExceeded):
        metered(llm, ledger, max_out)
    assert len(openai_server.requests) == 2 and openai_server.pending == 1
    assert ledger.spent_usd() == pytest.approx(2 * worst) and ledger.spent_usd() <= ledger.budget_usd


def test_make_client_offline_needs_nothing_and_an_llm_tier_needs_a_key_or_url(monkeypatch, openai_server):
    tiers = load_tiers()
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    monkeypatch.delenv("OPENAI_BASE_URL", raising=False)
    assert make_client(tiers.tier("offline")) is None
    with pytest.raises(ConfigError, match="^tier normal needs an LLM: set OPENAI_API_KEY or pass --base-url "
                                          "for an OpenAI-compatible server$"):
        make_client(tiers.tier("normal"))
    llm = make_client(tiers.tier("normal"), base_url=openai_server.url, model_override="qwen", timeout_s=3)
    openai_server.script(reply_json(GOOD))
    ask(llm)
    assert llm.model == "qwen" and llm.timeout_s == 3 and openai_server.requests[0].body["model"] == "qwen"
    assert openai_server.requests[0].headers["authorization"] == f"Bearer {NO_KEY}"
    monkeypatch.setenv("OPENAI_API_KEY", KEY)
    assert make_client(tiers.tier("ultra")).model == tiers.tier("ultra").model


def test_the_key_appears_in_no_message_repr_log_output_or_ledger(monkeypatch, openai_server, tmp_path,
                                                                 capsys, caplog):
    caplog.set_level(logging.DEBUG)
    monkeypatch.setenv("OPENAI_API_KEY", KEY)
    llm = make_client(load_tiers().tier("normal"), base_url=openai_server.url)
    llm.max_attempts, llm.backoff_base_s, llm.backoff_max_s = 2, 0.01, 0.01
    ledger = TokenLedger(tmp_path, {"*": Price(input=1.0, output=1.0)}, budget_usd=1.0)
    echo = f"Incorrect API key provided: {KEY} (Authorization: Bearer {KEY})"
    openai_server.script(reply_json(GOOD, prompt_tokens=5, completion_tokens=5),
                         reply_status(500, echo), reply_status(500, echo),
                         reply_status(400, echo), reply_raw(f"not json {KEY}"), reply_status(401, echo))
    errors: list[BaseException] = []
    for _ in range(5):
        try:
            metered(llm, ledger)
        except LLMError as exc:
            errors.append(exc)
    assert len(errors) == 4 and isinstance(errors[-1], LLMFatalError)
    seen = [repr(llm), ledger.path.read_text(), caplog.text, *capsys.readouterr()]
    for exc in errors:
        seen += [str(exc), repr(exc), "".join(traceback.format_exception(exc))]
    assert openai_server.requests[0].headers["authorization"] == f"Bearer {KEY}"  # it was sent...
    for text in seen:
        assert KEY not in text and KEY[3:15] not in text  # ...and is nowhere else
