"""The ledger prices calls exactly, keeps its rows across a restart, and never lets $ overshoot."""

from __future__ import annotations

import json

import pytest

from sg_opt.ledger import TokenLedger, call_cost
from sg_opt.tiers import Price
from state_machine.llm_interfaces import BudgetExceeded, Ledger, Usage, estimate_tokens
from targets.protocol import ConfigError

PRICES = {"m": Price(input=2.0, cached_input=0.5, output=8.0)}
USAGE = Usage(input_tokens=1000, cached_input_tokens=400, output_tokens=300, reasoning_tokens=200)
USAGE_COST = (600 * 2.0 + 400 * 0.5 + 300 * 8.0) / 1e6  # reasoning is inside output: not added


def test_cost_splits_cached_input_and_does_not_double_count_reasoning():
    assert call_cost(PRICES["m"], USAGE) == pytest.approx(USAGE_COST)


def test_record_appends_one_complete_row_per_call(tmp_path):
    ledger = TokenLedger(tmp_path, PRICES, budget_usd=1.0)
    assert isinstance(ledger, Ledger)
    assert ledger.record("propose", "normal", "m", USAGE, 1.23456) == pytest.approx(USAGE_COST)
    ledger.record("propose", "normal", "m", Usage(), 0.5, ok=False)
    rows = [json.loads(line) for line in (tmp_path / "ledger.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and rows[1]["ok"] is False
    assert {k: rows[0][k] for k in ("version", "node", "tier", "model", "input_tokens", "cached_input_tokens",
                                    "output_tokens", "reasoning_tokens", "latency_s", "ok")} == {
        "version": 1, "node": "propose", "tier": "normal", "model": "m", "input_tokens": 1000,
        "cached_input_tokens": 400, "output_tokens": 300, "reasoning_tokens": 200, "latency_s": 1.2346, "ok": True}
    assert rows[0]["cost_usd"] == pytest.approx(USAGE_COST) and "T" in rows[0]["timestamp"]


def test_a_restarted_ledger_continues_the_spend(tmp_path):
    TokenLedger(tmp_path, PRICES, 1.0).record("propose", "normal", "m", USAGE, 1.0)
    resumed = TokenLedger(tmp_path, PRICES, 1.0)
    assert resumed.spent_usd() == pytest.approx(USAGE_COST)
    resumed.record("propose", "normal", "m", USAGE, 1.0)
    assert TokenLedger(tmp_path, PRICES, 1.0).spent_usd() == pytest.approx(2 * USAGE_COST)


def test_a_row_torn_by_a_kill_is_skipped_and_the_next_row_lands_on_its_own_line(tmp_path):
    ledger = TokenLedger(tmp_path, PRICES, 1.0)
    ledger.record("propose", "normal", "m", USAGE, 1.0)
    with open(tmp_path / "ledger.jsonl", "a") as handle:
        handle.write('{"version": 1, "cost_u')  # killed mid-write
    resumed = TokenLedger(tmp_path, PRICES, 1.0)
    assert resumed.skipped_lines == 1 and resumed.spent_usd() == pytest.approx(USAGE_COST)
    resumed.record("propose", "normal", "m", USAGE, 1.0)
    assert len(TokenLedger(tmp_path, PRICES, 1.0).rows) == 2


def test_authorize_prices_the_worst_case_and_refuses_what_could_overshoot(tmp_path):
    worst = (1000 * 2.0 + 500 * 8.0) / 1e6  # all prompt tokens uncached, all output tokens used
    ledger = TokenLedger(tmp_path, PRICES, budget_usd=worst)
    ledger.authorize("propose", "normal", "m", 1000, 500)  # exactly the budget: allowed
    with pytest.raises(BudgetExceeded, match=r"\$0\.01 budget would not cover"):
        ledger.authorize("propose", "normal", "m", 1000, 500)  # the first is still reserved
    ledger.record("propose", "normal", "m", Usage(input_tokens=10, output_tokens=10), 0.1)
    with pytest.raises(BudgetExceeded):  # spend + worst case > budget
        ledger.authorize("propose", "normal", "m", 1000, 500)
    ledger.authorize("propose", "normal", "m", 900, 400)


def test_unpriced_models_are_refused_before_they_spend(tmp_path):
    with pytest.raises(ConfigError, match="model 'other' has no price"):
        TokenLedger(tmp_path, PRICES, 1.0, models=["m", "other"])
    ledger = TokenLedger(tmp_path, PRICES, 1.0)
    with pytest.raises(ConfigError, match="model 'other' has no price"):
        ledger.authorize("propose", "normal", "other", 10, 10)
    free = TokenLedger(tmp_path, PRICES | {"*": Price(input=0, output=0)}, 0.0, models=["other"])
    free.authorize("propose", "local", "other", 10_000, 10_000)


def test_totals_per_tier_and_model_and_cost_per_win(tmp_path):
    ledger = TokenLedger(tmp_path, PRICES | {"n": Price(input=1.0, output=1.0)}, 1.0)
    ledger.record("propose", "normal", "m", USAGE, 1.0)
    ledger.record("propose", "ultra", "m", USAGE, 1.0, ok=False)
    ledger.record("propose", "ultra", "n", Usage(input_tokens=100, output_tokens=100), 1.0)
    totals = ledger.totals()
    assert totals.overall.calls == 3 and totals.overall.failed_calls == 1
    assert totals.by_tier["ultra"].calls == 2 and totals.by_model["m"].calls == 2
    assert totals.by_model["m"].reasoning_tokens == 400 and totals.by_model["m"].cached_input_tokens == 800
    assert totals.by_model["n"].cost_usd == pytest.approx(200 / 1e6)
    assert totals.overall.cost_usd == pytest.approx(ledger.spent_usd())
    assert ledger.cost_per_win(2) == pytest.approx(ledger.spent_usd() / 2) and ledger.cost_per_win(0) is None


def test_token_estimate_errs_high():
    text = "def kernel(x):\n    return x * 2  # some code\n" * 50
    assert estimate_tokens(text) >= len(text) / 4
    assert estimate_tokens("a", "b") > estimate_tokens("ab") > 0
