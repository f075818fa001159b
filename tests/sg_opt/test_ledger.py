"""The ledger reserves each request's worst case before it is sent, charges it by the accounting rules after, keeps
its rows (and replies) across a kill and a restart, and never lets $ overshoot."""

from __future__ import annotations

import json

import pytest

from sg_opt.charges import call_cost, charged_usage
from sg_opt.ledger import ABANDONED, TokenLedger
from sg_opt.tiers import Price
from state_machine.llm_interfaces import (BudgetExceeded, Charge, Ledger, Meter, ReportedUsage, Usage,
                                          estimate_tokens)
from targets.protocol import ConfigError

PRICES = {"m": Price(input=2.0, cached_input=0.5, output=8.0)}
USAGE = Usage(input_tokens=1000, cached_input_tokens=400, output_tokens=300, reasoning_tokens=200)
USAGE_COST = (600 * 2.0 + 400 * 0.5 + 300 * 8.0) / 1e6  # reasoning is inside output: not added
REPORTED = ReportedUsage(**USAGE.model_dump())
WORST = (1000 * 2.0 + 500 * 8.0) / 1e6  # all prompt tokens uncached, all output tokens used


def request(ledger: TokenLedger, prompt: int = 1000, max_out: int = 500, **kwargs) -> Charge:
    return ledger.meter("propose", "normal", "m", prompt, max_out, **kwargs).open()


def lines(tmp_path) -> list[dict]:
    return [json.loads(line) for line in (tmp_path / "ledger.jsonl").read_text().splitlines()]


def test_cost_splits_cached_input_and_does_not_double_count_reasoning():
    assert call_cost(PRICES["m"], USAGE) == pytest.approx(USAGE_COST)


def test_a_request_is_reserved_on_disk_before_it_is_sent_and_settled_after(tmp_path):
    ledger = TokenLedger(tmp_path, PRICES, budget_usd=1.0)
    assert isinstance(ledger, Ledger) and isinstance(ledger.meter("propose", "normal", "m", 1, 1), Meter)
    charge = request(ledger, key="k1")
    (reserve,) = lines(tmp_path)
    assert reserve["event"] == "reserve" and reserve["worst_usd"] == pytest.approx(WORST) and not ledger.rows
    usage, cost, notes = charge.settle(REPORTED, 1.23456, ok=True, reply={"text": "{}", "finish_reason": "stop"})
    assert usage == USAGE and cost == pytest.approx(USAGE_COST) and notes == []
    reserve, settle = lines(tmp_path)
    assert settle["event"] == "settle" and settle["request"] == reserve["request"] and settle["basis"] == "reported"
    assert {k: settle[k] for k in ("node", "tier", "model", "purpose", "input_tokens", "cached_input_tokens",
                                   "output_tokens", "reasoning_tokens", "latency_s", "ok")} == {
        "node": "propose", "tier": "normal", "model": "m", "purpose": "propose", "input_tokens": 1000,
        "cached_input_tokens": 400, "output_tokens": 300, "reasoning_tokens": 200, "latency_s": 1.2346, "ok": True}
    assert ledger.reply_for("k1") == {"text": "{}", "finish_reason": "stop"} and ledger.reply_for("k2") is None
    with pytest.raises(RuntimeError, match="settled already"):
        charge.settle(REPORTED, 1.0, ok=True)


@pytest.mark.parametrize("reported, charged, why", [
    (None, Usage(input_tokens=1000, output_tokens=500), "no usage reported"),
    (ReportedUsage(input_tokens=-4000, output_tokens=-300), Usage(input_tokens=1000, output_tokens=500),
     "input_tokens -4000: charged the authorized 1000"),
    (ReportedUsage(input_tokens=700), Usage(input_tokens=700, output_tokens=500), "output_tokens missing"),
    (ReportedUsage(input_tokens=700, output_tokens=2_000_000), Usage(input_tokens=700, output_tokens=500),
     "output_tokens 2000000 is over the authorized 500"),
    (ReportedUsage(input_tokens=700, cached_input_tokens=900, output_tokens=10, reasoning_tokens=-3),
     Usage(input_tokens=700, cached_input_tokens=700, output_tokens=10), None),
], ids=["none", "negative", "missing", "over", "cached-over-input"])
def test_the_accounting_rules_charge_a_bound_where_the_usage_cannot_be_trusted(reported, charged, why):
    usage, notes = charged_usage(reported, prompt_tokens=1000, max_output_tokens=500)
    assert usage == charged
    assert (why is None and not notes) or any(why in note for note in notes)


def test_negative_usage_never_lowers_the_spend(tmp_path):
    ledger = TokenLedger(tmp_path, PRICES, budget_usd=1.0)
    request(ledger).settle(REPORTED, 1.0, ok=True)
    before = ledger.spent_usd()
    request(ledger).settle(ReportedUsage(input_tokens=-10**9, output_tokens=-10**9), 1.0, ok=True)
    assert ledger.spent_usd() == pytest.approx(before + WORST)


def test_a_request_killed_before_it_was_settled_is_charged_its_worst_case_on_restart(tmp_path):
    ledger = TokenLedger(tmp_path, PRICES, budget_usd=1.0)
    request(ledger).settle(REPORTED, 1.0, ok=True)
    request(ledger, key="lost")  # the process dies here, mid-request
    resumed = TokenLedger(tmp_path, PRICES, budget_usd=1.0)
    assert resumed.spent_usd() == pytest.approx(USAGE_COST + WORST)
    lost = resumed.rows[-1]
    assert lost["basis"] == "abandoned" and lost["notes"] == [ABANDONED] and not lost["ok"]
    assert resumed.reply_for("lost") is None  # nothing to reuse: the reply never came
    assert resumed.totals().overall.worst_case_calls == 1


def test_a_restarted_ledger_continues_the_spend_and_reads_version_1_rows(tmp_path):
    (tmp_path / "ledger.jsonl").write_text(json.dumps({"version": 1, "node": "propose", "tier": "normal", "model": "m",
                                                       "input_tokens": 10, "output_tokens": 5, "cost_usd": 0.5,
                                                       "ok": True}) + "\n")
    ledger = TokenLedger(tmp_path, PRICES, 2.0)
    assert ledger.spent_usd() == pytest.approx(0.5)
    request(ledger).settle(REPORTED, 1.0, ok=True)
    assert TokenLedger(tmp_path, PRICES, 2.0).spent_usd() == pytest.approx(0.5 + USAGE_COST)


def test_a_row_torn_by_a_kill_is_skipped_and_the_next_row_lands_on_its_own_line(tmp_path):
    ledger = TokenLedger(tmp_path, PRICES, 1.0)
    request(ledger).settle(REPORTED, 1.0, ok=True)
    charge = request(ledger)
    with open(tmp_path / "ledger.jsonl", "a") as handle:
        handle.write('{"version": 2, "event": "settle", "cost_u')  # killed mid-write of the settle line
    resumed = TokenLedger(tmp_path, PRICES, 1.0)
    assert resumed.skipped_lines == 1 and resumed.spent_usd() == pytest.approx(USAGE_COST + WORST)
    request(resumed).settle(REPORTED, 1.0, ok=True)
    assert len(TokenLedger(tmp_path, PRICES, 1.0).rows) == 3
    assert charge is not None


def test_reservations_refuse_what_could_overshoot_and_a_spent_budget_stops_in_one_sentence(tmp_path):
    ledger = TokenLedger(tmp_path, PRICES, budget_usd=WORST)
    first = request(ledger)  # exactly the budget: allowed
    with pytest.raises(BudgetExceeded, match=r"\$0\.01 budget would not cover another m request"):
        request(ledger)  # the first is still reserved
    first.settle(ReportedUsage(input_tokens=10, output_tokens=10), 0.1, ok=True)
    with pytest.raises(BudgetExceeded):  # spend + worst case > budget
        request(ledger)
    request(ledger, prompt=900, max_out=400).settle(None, 0.1, ok=False)  # fits, and is charged in full
    assert ledger.spent_usd() <= ledger.budget_usd
    spent = TokenLedger(tmp_path / "other", PRICES, budget_usd=WORST)
    request(spent).settle(None, 0.1, ok=False)  # timed out: its worst case, the whole budget
    with pytest.raises(BudgetExceeded, match=r"^the \$0\.01 budget is spent \(\$0\.0060 charged\)$"):
        request(spent, prompt=1, max_out=1)


def test_unpriced_models_are_refused_before_they_spend(tmp_path):
    with pytest.raises(ConfigError, match="model 'other' has no price"):
        TokenLedger(tmp_path, PRICES, 1.0, models=["m", "other"])
    ledger = TokenLedger(tmp_path, PRICES, 1.0)
    with pytest.raises(ConfigError, match="model 'other' has no price"):
        ledger.meter("propose", "normal", "other", 10, 10)
    free = TokenLedger(tmp_path, PRICES | {"*": Price(input=0, output=0)}, 0.0, models=["other"])
    free.meter("propose", "local", "other", 10_000, 10_000).open().settle(None, 1.0, ok=True)


def test_totals_per_tier_and_model_count_repairs_bounds_and_cost_per_win(tmp_path):
    ledger = TokenLedger(tmp_path, PRICES | {"n": Price(input=1.0, output=1.0)}, 1.0)
    ledger.record("propose", "normal", "m", USAGE, 1.0)
    ledger.record("propose", "ultra", "m", USAGE, 1.0, ok=False, purpose="reply-repair")
    ledger.record("propose", "ultra", "n", Usage(input_tokens=100, output_tokens=100), 1.0, purpose="kernel-repair")
    ledger.meter("propose", "ultra", "n", 100, 100).open().settle(None, 1.0, ok=False)
    totals = ledger.totals()
    assert totals.overall.calls == 4 and totals.overall.failed_calls == 2
    ultra = totals.by_tier["ultra"]
    assert (ultra.calls, ultra.reply_repairs, ultra.kernel_repairs, ultra.worst_case_calls) == (3, 1, 1, 1)
    assert ultra.worst_case_usd == pytest.approx(200 / 1e6)
    assert totals.by_model["m"].reasoning_tokens == 400 and totals.by_model["m"].cached_input_tokens == 800
    assert totals.by_model["n"].cost_usd == pytest.approx(400 / 1e6)
    assert totals.overall.cost_usd == pytest.approx(ledger.spent_usd())
    assert ledger.cost_per_win(2) == pytest.approx(ledger.spent_usd() / 2) and ledger.cost_per_win(0) is None


def test_token_estimate_is_a_strict_bound():
    text = "def kernel(x):\n    return x * 2  # some code ü\n" * 50
    assert estimate_tokens(text) >= len(text.encode("utf-8"))
    assert estimate_tokens("a", "b") > estimate_tokens("ab") > 0
