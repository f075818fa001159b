"""The report's LLM cost line names the repair turns a run paid for, beside calls, tokens and $ per win."""

from __future__ import annotations

from types import SimpleNamespace

from sg_opt.ledger import Total
from sg_opt.report import spend_line


def test_the_spend_line_counts_repair_turns_only_when_there_were_some():
    paid = Total(calls=5, reply_repairs=1, kernel_repairs=2, input_tokens=900, output_tokens=300, cost_usd=0.012)
    line = spend_line(SimpleNamespace(spend=paid, cost_per_win_usd=0.006))
    assert line == ("LLM spend $0.0120 in 5 calls (900 input, 300 output tokens), $0.0060 per accepted win, "
                    "1 reply and 2 kernel repair turns")
    assert "repair" not in spend_line(SimpleNamespace(spend=Total(calls=2), cost_per_win_usd=None))
