"""The token ledger: every LLM call's tokens and dollars, on disk, and the gate that keeps the budget.

Each call appends one JSON row to ``<run dir>/ledger.jsonl`` and fsyncs it, so a killed run keeps
what it spent and a resumed run (which reloads the rows) continues from that spend rather than from
zero. Before a call, ``authorize`` prices its worst case (every prompt token at the full input price
plus ``max_output_tokens`` at the output price) and refuses it if that could pass the budget. The
worst case stays reserved until the call is recorded, so calls made concurrently cannot overshoot
together either.
"""

from __future__ import annotations

import json
import os
import threading
from collections import defaultdict
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Iterable, Mapping

from pydantic import BaseModel

from sg_opt.tiers import Price, price_for
from state_machine.llm_interfaces import BudgetExceeded, Usage

LEDGER_FILE = "ledger.jsonl"
ROW_VERSION = 1
PER_MILLION = 1_000_000


def call_cost(price: Price, usage: Usage) -> float:
    """Dollars for one call. Reasoning tokens are part of the output tokens, so not added again."""
    uncached = max(usage.input_tokens - usage.cached_input_tokens, 0)
    return (uncached * price.input + usage.cached_input_tokens * price.cached
            + usage.output_tokens * price.output) / PER_MILLION


def worst_case_cost(price: Price, prompt_tokens: int, max_output_tokens: int) -> float:
    return (prompt_tokens * price.input + max_output_tokens * price.output) / PER_MILLION


class Total(BaseModel):
    """Tokens, dollars and calls summed over some rows (also the spend record of summary.json)."""

    calls: int = 0
    failed_calls: int = 0
    input_tokens: int = 0
    cached_input_tokens: int = 0
    output_tokens: int = 0
    reasoning_tokens: int = 0
    cost_usd: float = 0.0

    def add(self, row: Mapping[str, Any]) -> None:
        self.calls += 1
        self.failed_calls += 0 if row.get("ok", True) else 1
        for name in ("input_tokens", "cached_input_tokens", "output_tokens", "reasoning_tokens"):
            setattr(self, name, getattr(self, name) + int(row.get(name, 0)))
        self.cost_usd += float(row.get("cost_usd", 0.0))


@dataclass
class Totals:
    """The run's spend overall, per tier and per model."""

    overall: Total
    by_tier: dict[str, Total]
    by_model: dict[str, Total]


class TokenLedger:
    """File-backed ``Ledger``: asked before each LLM call, told after it, never lets $ overshoot."""

    def __init__(self, run_dir: str | Path, prices: Mapping[str, Price], budget_usd: float,
                 models: Iterable[str] = ()):
        """``models`` are checked against ``prices`` now, so an unpriced model fails at setup."""
        self.path = Path(run_dir) / LEDGER_FILE
        self.prices = dict(prices)
        self.budget_usd = float(budget_usd)
        for model in models:
            price_for(self.prices, model)
        self._lock = threading.Lock()
        self._reserved: list[tuple[tuple[str, str, str], float]] = []
        self.rows: list[dict[str, Any]] = []
        self.skipped_lines = 0
        self._reload()

    def authorize(self, node: str, tier: str, model: str, prompt_tokens: int, max_output_tokens: int) -> None:
        worst = worst_case_cost(price_for(self.prices, model), prompt_tokens, max_output_tokens)
        with self._lock:
            committed = self._spent() + sum(amount for _, amount in self._reserved)
            if committed + worst > self.budget_usd + 1e-12:
                raise BudgetExceeded(
                    f"the ${self.budget_usd:.2f} budget would not cover this {model} call: "
                    f"${committed:.4f} spent or reserved plus up to ${worst:.4f} for it")
            self._reserved.append(((node, tier, model), worst))

    def record(self, node: str, tier: str, model: str, usage: Usage, latency_s: float, ok: bool = True) -> float:
        cost = call_cost(price_for(self.prices, model), usage)
        row = {"version": ROW_VERSION, "timestamp": datetime.now(timezone.utc).isoformat(timespec="seconds"),
               "node": node, "tier": tier, "model": model, **usage.model_dump(),
               "cost_usd": cost, "latency_s": round(latency_s, 4), "ok": ok}
        with self._lock:
            self._append(row)
            self.rows.append(row)
            self._release((node, tier, model))
        return cost

    def spent_usd(self) -> float:
        with self._lock:
            return self._spent()

    def remaining_usd(self) -> float:
        return max(self.budget_usd - self.spent_usd(), 0.0)

    def totals(self) -> Totals:
        overall, by_tier, by_model = Total(), defaultdict(Total), defaultdict(Total)
        with self._lock:
            rows = list(self.rows)
        for row in rows:
            for total in (overall, by_tier[row.get("tier", "?")], by_model[row.get("model", "?")]):
                total.add(row)
        return Totals(overall, dict(by_tier), dict(by_model))

    def cost_per_win(self, accepted: int) -> float | None:
        """Dollars spent per accepted candidate; None when nothing was accepted."""
        return self.spent_usd() / accepted if accepted > 0 else None

    def _spent(self) -> float:
        return sum(float(row.get("cost_usd", 0.0)) for row in self.rows)

    def _release(self, key: tuple[str, str, str]) -> None:
        """Drop the oldest reservation made for this (node, tier, model), if any."""
        for index, (reserved_key, _) in enumerate(self._reserved):
            if reserved_key == key:
                del self._reserved[index]
                return

    def _append(self, row: dict[str, Any]) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a", encoding="utf-8") as handle:
            handle.write(json.dumps(row) + "\n")
            handle.flush()
            os.fsync(handle.fileno())

    def _reload(self) -> None:
        """Rows of an earlier attempt at this run; a line torn by a kill mid-write is skipped."""
        if not self.path.is_file():
            return
        text = self.path.read_text(encoding="utf-8")
        for line in text.splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                row = None
            if isinstance(row, dict):
                self.rows.append(row)
            elif line.strip():
                self.skipped_lines += 1
        if text and not text.endswith("\n"):
            with open(self.path, "a", encoding="utf-8") as handle:
                handle.write("\n")  # keep the next row off the torn line
