"""The openai-backed client against a real scripted server on loopback: streamed replies, retries, failures, the
ledger metering every request (charged what the server billed, or a bound above it), the run's deadline, and no
trace of the API key anywhere."""

from __future__ import annotations

import json
import logging
import socket
import time
import traceback

import pytest

from sg_opt.ledger import TokenLedger
from sg_opt.llm_client import NO_KEY, LLMFatalError, OpenAIClient, make_client, stop_reading_at
from sg_opt.tiers import Price, load_tiers
from state_machine.llm_interfaces import LLM, BudgetExceeded, Completion, DeadlineReached, LLMError, estimate_tokens
from targets.protocol import ConfigError
from tests.fixtures.openai_server import (reply_body, reply_delay, reply_json, reply_raw, reply_runaway,
                                          reply_status, usage_block)

KEY = "sk-test-Zq8vN3xK7pL2mW9rT4yB6cD1"
SYSTEM, PROMPT = "You tune training jobs.", "Propose one knob change."
MESSAGES = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": PROMPT}]
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["knob", "value"],
          "properties": {"knob": {"type": "string"}, "value": {"type": "integer"}}}
GOOD = {"knob": "data_workers", "value": 4}
PRICE = Price(input=1.0, cached_input=0.1, output=4.0)
PROMPT_BOUND = estimate_tokens(SYSTEM, PROMPT, json.dumps(SCHEMA))


def client(server, **kwargs) -> OpenAIClient:
    options = {"model": "m", "api_key": KEY, "base_url": server.url, "timeout_s": 5.0, "max_attempts": 3,
               "backoff_base_s": 0.01, "backoff_max_s": 0.05} | kwargs
    return OpenAIClient(**options)


def ask(llm: OpenAIClient, effort: str | None = None, max_out: int = 1000, ledger: TokenLedger | None = None,
        deadline: float | None = None) -> Completion:
    meter = ledger.meter("propose", "normal", llm.model, PROMPT_BOUND, max_out) if ledger is not None else None
    return llm.complete(MESSAGES, SCHEMA, "proposal", max_output_tokens=max_out, reasoning_effort=effort,
                        meter=meter, deadline=deadline)


def ledger_for(tmp_path, budget: float = 10.0) -> TokenLedger:
    return TokenLedger(tmp_path, {"m": PRICE}, budget_usd=budget)


def worst(max_out: int = 1000) -> float:
    return (PROMPT_BOUND * PRICE.input + max_out * PRICE.output) / 1e6


def billed(server) -> float:
    return server.billed_usd(PRICE.input, PRICE.output, PRICE.cached)


def test_a_streamed_reply_comes_back_as_text_with_its_usage_and_the_request_asks_for_it(openai_server, tmp_path):
    openai_server.script(reply_json(GOOD, prompt_tokens=120, cached_tokens=100, completion_tokens=40,
                                    reasoning_tokens=25))
    llm, ledger = client(openai_server), ledger_for(tmp_path)
    assert isinstance(llm, LLM)
    completion = ask(llm, effort="high", max_out=777, ledger=ledger)
    assert json.loads(completion.text) == GOOD and completion.finish_reason == "stop" and completion.attempts == 1
    assert completion.usage.model_dump() == {"input_tokens": 120, "cached_input_tokens": 100,
                                             "output_tokens": 40, "reasoning_tokens": 25}
    (request,) = openai_server.requests
    assert request.path == "/v1/chat/completions" and request.headers["authorization"] == f"Bearer {KEY}"
    assert request.body["response_format"] == {
        "type": "json_schema", "json_schema": {"name": "proposal", "schema": SCHEMA, "strict": True}}
    assert request.body["messages"] == MESSAGES
    assert request.body["stream"] is True and request.body["stream_options"] == {"include_usage": True}
    assert request.body["max_completion_tokens"] == 777 and request.body["reasoning_effort"] == "high"
    assert ledger.spent_usd() == pytest.approx(billed(openai_server)) == pytest.approx(completion.cost_usd)


def test_a_server_that_ignores_streaming_is_read_as_one_body(openai_server):
    openai_server.script(reply_json(GOOD, prompt_tokens=7, completion_tokens=3, ignore_stream=True))
    completion = ask(client(openai_server))
    assert json.loads(completion.text) == GOOD and "reasoning_effort" not in openai_server.requests[0].body


@pytest.mark.parametrize("first", [reply_status(429, "slow down", retry_after=0.01),
                                   reply_status(500, "boom"), reply_status(503, "busy")],
                         ids=["429", "500", "503"])
def test_a_transient_error_then_success_takes_two_attempts_and_the_error_costs_nothing(openai_server, tmp_path,
                                                                                       first):
    openai_server.script(first, reply_json(GOOD, prompt_tokens=5, completion_tokens=5))
    ledger = ledger_for(tmp_path)
    completion = ask(client(openai_server), ledger=ledger)
    assert json.loads(completion.text) == GOOD and completion.attempts == 2 and len(openai_server.requests) == 2
    assert [row["ok"] for row in ledger.rows] == [False, True] and ledger.rows[0]["cost_usd"] == 0
    assert ledger.spent_usd() == pytest.approx(billed(openai_server))


def test_a_timed_out_request_that_the_server_completed_is_charged_its_worst_case(openai_server, tmp_path):
    """The server answers (and bills) a request the client gave up on: the ledger cannot know its usage, so it
    keeps the worst case it reserved, never $0."""
    openai_server.script(reply_delay(1.0, reply_json(GOOD, prompt_tokens=30, completion_tokens=900)),
                         reply_json(GOOD, prompt_tokens=30, completion_tokens=20))
    ledger = ledger_for(tmp_path)
    completion = ask(client(openai_server, timeout_s=0.25), ledger=ledger)
    assert json.loads(completion.text) == GOOD and completion.attempts == 2
    first, second = ledger.rows
    assert first["basis"] == "bound" and first["cost_usd"] == pytest.approx(worst()) and not first["ok"]
    assert second["basis"] == "reported" and second["output_tokens"] == 20
    assert ledger.spent_usd() >= billed(openai_server) > 0


def test_retries_exhausted_is_a_failed_proposal_not_a_fatal_error(openai_server):
    openai_server.script(*[reply_status(500, "still broken")] * 3)
    with pytest.raises(LLMError, match=r"HTTP 500 on all 3 attempts: still broken") as info:
        ask(client(openai_server))
    assert not info.value.fatal and len(openai_server.requests) == 3


def test_timeouts_exhausted_say_so(openai_server):
    openai_server.script(reply_delay(1.0), reply_delay(1.0))
    with pytest.raises(LLMError, match=r"did not answer within 0.2s \(2 attempts\)"):
        ask(client(openai_server, timeout_s=0.2, max_attempts=2))


def test_a_cut_off_reply_comes_back_as_such(openai_server):
    openai_server.script(reply_raw('{"knob": "x", "va', prompt_tokens=9, completion_tokens=3, finish_reason="length"))
    completion = ask(client(openai_server))
    assert completion.finish_reason == "length" and completion.text == '{"knob": "x", "va'


def test_a_refusal_is_an_llm_error_and_its_tokens_are_charged(openai_server, tmp_path):
    refusal = reply_raw("", prompt_tokens=9, completion_tokens=3)
    refusal.body["choices"][0]["message"]["refusal"] = "I can't help with that."
    openai_server.script(refusal)
    ledger = ledger_for(tmp_path)
    with pytest.raises(LLMError, match="is a refusal: I can't help with that"):
        ask(client(openai_server, max_attempts=1), ledger=ledger)
    assert ledger.spent_usd() == pytest.approx((9 * 1.0 + 3 * 4.0) / 1e6) == pytest.approx(billed(openai_server))


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


def test_an_unreachable_endpoint_is_fatal_and_costs_nothing(tmp_path):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # closed again before the call: nothing listens there
    llm = OpenAIClient("m", KEY, base_url=f"http://127.0.0.1:{port}/v1", max_attempts=2, backoff_base_s=0.01)
    ledger = ledger_for(tmp_path)
    with pytest.raises(LLMFatalError, match=rf"the LLM endpoint http://127.0.0.1:{port}/v1 is unreachable"):
        ask(llm, ledger=ledger)
    assert len(ledger.rows) == 2 and ledger.spent_usd() == 0  # never sent: never billed


def test_the_ledger_charges_exactly_what_the_server_billed_when_it_reports_honestly(openai_server, tmp_path):
    openai_server.script(reply_json(GOOD, prompt_tokens=200, cached_tokens=100, completion_tokens=50,
                                    reasoning_tokens=20),
                         reply_raw("oops", prompt_tokens=100, completion_tokens=10))
    ledger = ledger_for(tmp_path)
    ask(client(openai_server), ledger=ledger)
    ask(client(openai_server), ledger=ledger)
    total = ledger.totals().overall
    assert (total.calls, total.worst_case_calls, total.input_tokens, total.cached_input_tokens,
            total.output_tokens, total.reasoning_tokens) == (2, 0, 300, 100, 60, 20)
    assert ledger.spent_usd() == pytest.approx((200 * 1.0 + 100 * 0.1 + 60 * 4.0) / 1e6)
    assert ledger.spent_usd() == pytest.approx(billed(openai_server))


def test_a_budget_for_two_requests_refuses_the_third_before_it_is_sent(openai_server, tmp_path):
    full = dict(prompt_tokens=PROMPT_BOUND, completion_tokens=1000)  # each request bills its worst case
    openai_server.script(reply_json(GOOD, **full), reply_json(GOOD, **full), reply_json(GOOD, **full))
    ledger = ledger_for(tmp_path, budget=2.5 * worst())
    llm = client(openai_server)
    ask(llm, ledger=ledger)
    ask(llm, ledger=ledger)
    with pytest.raises(BudgetExceeded, match="would not cover another m request"):
        ask(llm, ledger=ledger)
    assert len(openai_server.requests) == 2 and openai_server.pending == 1
    assert ledger.spent_usd() == pytest.approx(2 * worst()) and ledger.spent_usd() <= ledger.budget_usd


def test_a_runaway_stream_is_cut_short_of_the_authorized_tokens_and_charged_its_worst_case(openai_server, tmp_path):
    """A server that ignores max_completion_tokens would stream 2,000,000 tokens; the client stops reading 5%
    short of the 1000 it authorized, the server stops generating when the stream closes, and the ledger charges
    the worst case it reserved, which covers what was generated."""
    openai_server.script(reply_runaway(prompt_tokens=50))
    ledger = ledger_for(tmp_path, budget=worst() + 1e-9)
    started = time.monotonic()
    completion = ask(client(openai_server), ledger=ledger)
    assert completion.finish_reason == "cut" and time.monotonic() - started < 5.0
    for _ in range(100):  # the server thread bills once it notices the closed stream
        if openai_server.bills:
            break
        time.sleep(0.05)
    (bill,) = openai_server.bills
    assert stop_reading_at(1000) <= bill.output <= 1000
    assert billed(openai_server) <= ledger.spent_usd() <= ledger.budget_usd
    assert ledger.spent_usd() == pytest.approx(worst())
    assert ledger.rows[0]["basis"] == "bound"


def test_a_server_that_bills_past_the_limit_in_one_body_stops_the_run_and_never_passes_the_budget(openai_server,
                                                                                                  tmp_path):
    openai_server.script(reply_json(GOOD, prompt_tokens=50, completion_tokens=2_000_000, ignore_stream=True))
    ledger = ledger_for(tmp_path, budget=0.5)
    with pytest.raises(LLMFatalError, match="reported more tokens than were authorized .* the run stops"):
        ask(client(openai_server), ledger=ledger)
    (row,) = ledger.rows
    assert row["output_tokens"] == 1000 and row["reported"]["output_tokens"] == 2_000_000
    assert ledger.spent_usd() == pytest.approx((50 * 1.0 + 1000 * 4.0) / 1e6) and ledger.spent_usd() <= 0.5


@pytest.mark.parametrize("usage, charged_output, charged_input", [
    (usage_block(prompt_tokens=-5000, completion_tokens=-100), 1000, PROMPT_BOUND),
    (usage_block(prompt_tokens=40, completion_tokens=None), 1000, 40),
    (None, 1000, PROMPT_BOUND),
    ({"prompt_tokens": "forty", "completion_tokens": 12.0}, 12, PROMPT_BOUND),
], ids=["negative", "output-missing", "no-usage", "nonsense"])
def test_negative_or_missing_usage_is_charged_its_worst_case_and_never_lowers_the_spend(openai_server, tmp_path,
                                                                                        usage, charged_output,
                                                                                        charged_input):
    kwargs = {"with_usage": False} if usage is None else {"usage": usage}
    openai_server.script(reply_json(GOOD, prompt_tokens=40, completion_tokens=12, **kwargs))
    ledger = ledger_for(tmp_path)
    completion = ask(client(openai_server), ledger=ledger)
    assert completion.usage.output_tokens == charged_output and completion.usage.input_tokens == charged_input
    assert completion.notes and ledger.rows[0]["basis"] == "bound"
    assert ledger.spent_usd() >= billed(openai_server) > 0


def test_the_deadline_bounds_a_call_whose_server_never_answers(openai_server, tmp_path):
    """180 s a request and 5 attempts would hold the run 15 minutes; the deadline ends it in about a second, and
    the abandoned request keeps its worst case."""
    openai_server.script(*[reply_delay(30.0, reply_json(GOOD, prompt_tokens=5, completion_tokens=5))] * 5)
    ledger = ledger_for(tmp_path)
    started = time.monotonic()
    with pytest.raises(DeadlineReached, match="--max-minutes"):
        ask(client(openai_server, timeout_s=180.0, max_attempts=5), ledger=ledger, deadline=time.monotonic() + 1.5)
    assert time.monotonic() - started < 3.0
    assert len(openai_server.requests) == 1 and ledger.spent_usd() == pytest.approx(worst())


def test_the_deadline_bounds_a_stream_that_trickles(openai_server, tmp_path):
    slow = reply_json({"knob": "x" * 4000, "value": 1}, prompt_tokens=5, completion_tokens=1000, chunk_delay_s=0.05)
    openai_server.script(slow)
    ledger = ledger_for(tmp_path)
    started = time.monotonic()
    with pytest.raises(DeadlineReached):
        ask(client(openai_server, timeout_s=180.0), ledger=ledger, deadline=time.monotonic() + 1.5)
    assert time.monotonic() - started < 3.0 and not ledger.rows[0]["ok"]
    assert ledger.spent_usd() == pytest.approx(worst()) and ledger.spent_usd() >= billed(openai_server)


def test_no_back_off_outlives_the_deadline(openai_server):
    openai_server.script(reply_status(429, retry_after=20), reply_json(GOOD))
    started = time.monotonic()
    with pytest.raises(DeadlineReached, match="before the LLM endpoint could be asked again"):
        ask(client(openai_server, backoff_max_s=30.0), deadline=time.monotonic() + 3.0)
    assert time.monotonic() - started < 1.0 and len(openai_server.requests) == 1


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


def test_the_key_appears_in_no_message_repr_log_output_reply_or_ledger(monkeypatch, openai_server, tmp_path,
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
    texts = []
    for _ in range(5):
        try:
            texts.append(ask(llm, ledger=ledger).text)
        except LLMError as exc:
            errors.append(exc)
    assert len(errors) == 3 and isinstance(errors[-1], LLMFatalError)
    seen = [repr(llm), ledger.path.read_text(), caplog.text, *capsys.readouterr(), *texts]
    for exc in errors:
        seen += [str(exc), repr(exc), "".join(traceback.format_exception(exc))]
    assert openai_server.requests[0].headers["authorization"] == f"Bearer {KEY}"  # it was sent...
    for text in seen:
        assert KEY not in text and KEY[3:15] not in text  # ...and is nowhere else
