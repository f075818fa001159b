"""The token ledger: every LLM request's tokens and dollars on disk, written so that the budget cannot be
overshot and no request's cost can be lost.

``<run dir>/ledger.jsonl`` is written ahead: before a request leaves, a ``reserve`` line (fsynced) holds
its worst case, every prompt token at the full input price plus the authorized output tokens at the
output price; a request whose worst case could pass the budget, with what is spent and reserved, is
refused there. When the request is over a ``settle`` line replaces the worst case with the charge
(``charges.charged_usage``) and keeps the reply, so a resumed run finds a settled reply rather than
buying it again. A reservation never settled (the process was killed mid-request) stays charged at its
worst case. ``rows`` holds one settled row per request, old single-row files (version 1) included.
"""

from __future__ import annotations

import json
import os
import threading
import uuid
from collections import defaultdict
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Iterable, Mapping

from pydantic import BaseModel

from sg_opt.charges import call_cost, charged_usage, worst_case_cost
from sg_opt.tiers import Price, price_for
from state_machine.llm_interfaces import BudgetExceeded, ReportedUsage, Usage

LEDGER_FILE = "ledger.jsonl"
ROW_VERSION = 2
ABANDONED = "the process ended during the request: charged its authorized worst case"
TOKEN_FIELDS = ("input_tokens", "cached_input_tokens", "output_tokens", "reasoning_tokens")


class Total(BaseModel):
    """Tokens, dollars and requests summed over some rows (also the spend record of summary.json)."""

    calls: int = 0  # requests sent: each retry and each repair turn is one
    failed_calls: int = 0
    worst_case_calls: int = 0  # requests charged a bound (timed out, cut off, killed, usage missing or nonsense)
    reply_repairs: int = 0  # requests that sent a malformed reply's error back to the model
    kernel_repairs: int = 0  # requests that sent a rejected or slower kernel back to the model
    input_tokens: int = 0
    cached_input_tokens: int = 0
    output_tokens: int = 0
    reasoning_tokens: int = 0
    cost_usd: float = 0.0
    worst_case_usd: float = 0.0  # the part of cost_usd charged as bounds rather than reported counts

    def add(self, row: Mapping[str, Any]) -> None:
        self.calls += 1
        self.failed_calls += 0 if row.get("ok", True) else 1
        bound = row.get("basis", "reported") != "reported"
        self.worst_case_calls += bound
        self.reply_repairs += row.get("purpose") == "reply-repair"
        self.kernel_repairs += row.get("purpose") == "kernel-repair"
        for name in TOKEN_FIELDS:
            setattr(self, name, getattr(self, name) + int(row.get(name, 0)))
        cost = float(row.get("cost_usd", 0.0))
        self.cost_usd += cost
        self.worst_case_usd += cost if bound else 0.0


@dataclass
class Totals:
    """The run's spend overall, per tier and per model."""

    overall: Total
    by_tier: dict[str, Total]
    by_model: dict[str, Total]


@dataclass
class Reservation:
    """One request's reserve line: who asks, for what, and its worst case in tokens and dollars."""

    request: str
    call: str
    node: str
    tier: str
    model: str
    purpose: str
    key: str | None
    prompt_tokens: int
    max_output_tokens: int
    worst_usd: float

    def row(self) -> dict[str, Any]:
        return {"version": ROW_VERSION, "event": "reserve", "timestamp": _now(), **self.__dict__}


class ReservedRequest:
    """``Charge``: a reserved request, settled once."""

    def __init__(self, ledger: "TokenLedger", reservation: Reservation):
        self._ledger, self.reservation, self._settled = ledger, reservation, False

    def settle(self, reported: ReportedUsage | None, latency_s: float, ok: bool, note: str = "",
               reply: dict[str, Any] | None = None) -> tuple[Usage, float, list[str]]:
        if self._settled:
            raise RuntimeError(f"request {self.reservation.request} is settled already")
        self._settled = True
        return self._ledger._settle(self.reservation, reported, latency_s, ok, note, reply)


@dataclass
class RequestMeter:
    """``Meter``: one call's requests (its retries), each reserved on its own."""

    ledger: "TokenLedger"
    node: str
    tier: str
    model: str
    prompt_tokens: int
    max_output_tokens: int
    purpose: str = "propose"
    key: str | None = None
    call: str = ""

    def __post_init__(self) -> None:
        self.call = self.call or uuid.uuid4().hex[:12]

    def open(self) -> ReservedRequest:
        return self.ledger._reserve(self)


class TokenLedger:
    """File-backed ``Ledger``: reserves each request's worst case before it is sent, settles it after."""

    def __init__(self, run_dir: str | Path, prices: Mapping[str, Price], budget_usd: float,
                 models: Iterable[str] = ()):
        """``models`` are checked against ``prices`` now, so an unpriced model fails at setup."""
        self.path = Path(run_dir) / LEDGER_FILE
        self.prices = dict(prices)
        self.budget_usd = float(budget_usd)
        for model in models:
            price_for(self.prices, model)
        self._lock = threading.Lock()
        self._open: dict[str, float] = {}  # request -> worst case, reserved by this process and not yet settled
        self.rows: list[dict[str, Any]] = []
        self.skipped_lines = 0
        self._reload()

    def meter(self, node: str, tier: str, model: str, prompt_tokens: int, max_output_tokens: int,
              purpose: str = "propose", key: str | None = None) -> RequestMeter:
        price_for(self.prices, model)  # an unpriced model fails before anything is sent
        return RequestMeter(self, node, tier, model, prompt_tokens, max_output_tokens, purpose, key)

    def reply_for(self, key: str) -> dict[str, Any] | None:
        with self._lock:
            return next((row["reply"] for row in reversed(self.rows)
                         if row.get("key") == key and row.get("ok") and isinstance(row.get("reply"), dict)), None)

    def record(self, node: str, tier: str, model: str, usage: Usage, latency_s: float, ok: bool = True,
               purpose: str = "propose") -> float:
        """One finished request in a single row, charged as given (imported or made-up spend: reports, tests)."""
        cost = call_cost(price_for(self.prices, model), usage)
        row = {"version": ROW_VERSION, "event": "settle", "timestamp": _now(), "request": uuid.uuid4().hex[:12],
               "node": node, "tier": tier, "model": model, "purpose": purpose, **usage.model_dump(),
               "cost_usd": cost, "latency_s": round(latency_s, 4), "ok": ok, "basis": "reported"}
        with self._lock:
            self._append(row)
            self.rows.append(row)
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

    # ------------------------------------------------------------------------- reserve and settle

    def _reserve(self, meter: RequestMeter) -> ReservedRequest:
        price = price_for(self.prices, meter.model)
        worst = worst_case_cost(price, meter.prompt_tokens, meter.max_output_tokens)
        reservation = Reservation(uuid.uuid4().hex[:12], meter.call, meter.node, meter.tier, meter.model,
                                  meter.purpose, meter.key, meter.prompt_tokens, meter.max_output_tokens, worst)
        with self._lock:
            spent = self._spent()
            committed = spent + sum(self._open.values())
            used_up = self.budget_usd > 0 and spent >= self.budget_usd - 1e-12
            if used_up or committed + worst > self.budget_usd + 1e-12:
                raise BudgetExceeded(self._refusal(meter.model, spent, committed, worst))
            self._append(reservation.row())  # on disk before the request leaves
            self._open[reservation.request] = worst
        return ReservedRequest(self, reservation)

    def _refusal(self, model: str, spent: float, committed: float, worst: float) -> str:
        if spent >= self.budget_usd - 1e-12:
            return f"the ${self.budget_usd:.2f} budget is spent (${spent:.4f} charged)"
        return (f"the ${self.budget_usd:.2f} budget would not cover another {model} request: ${committed:.4f} spent "
                f"or reserved plus up to ${worst:.4f} for it")

    def _settle(self, reservation: Reservation, reported: ReportedUsage | None, latency_s: float, ok: bool,
                note: str, reply: dict[str, Any] | None) -> tuple[Usage, float, list[str]]:
        usage, notes = charged_usage(reported, reservation.prompt_tokens, reservation.max_output_tokens)
        cost = min(call_cost(price_for(self.prices, reservation.model), usage), reservation.worst_usd)
        row = _settled_row(reservation, usage, cost, latency_s, ok, [note] * bool(note) + notes,
                           "reported" if reported is not None and not notes else "bound")
        if reported is not None and notes:
            row["reported"] = reported.model_dump()
        if reply is not None:
            row["reply"] = reply
        with self._lock:
            self._append(row)
            self.rows.append(row)
            self._open.pop(reservation.request, None)
        return usage, cost, notes

    def _spent(self) -> float:
        return sum(float(row.get("cost_usd", 0.0)) for row in self.rows)

    # ------------------------------------------------------------------------- the file

    def _append(self, row: dict[str, Any]) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a", encoding="utf-8") as handle:
            handle.write(json.dumps(row) + "\n")
            handle.flush()
            os.fsync(handle.fileno())

    def _reload(self) -> None:
        """Rows of an earlier attempt at this run. A line torn by a kill mid-write is skipped; a reservation
        left unsettled is charged its worst case."""
        if not self.path.is_file():
            return
        text = self.path.read_text(encoding="utf-8")
        pending: dict[str, dict[str, Any]] = {}
        for line in text.splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                row = None
            if not isinstance(row, dict):
                self.skipped_lines += bool(line.strip())
            elif row.get("event") == "reserve":
                pending[str(row.get("request"))] = row
            else:
                pending.pop(str(row.get("request")), None)
                self.rows.append(row)
        self.rows += [_abandoned_row(row) for row in pending.values()]
        if text and not text.endswith("\n"):
            with open(self.path, "a", encoding="utf-8") as handle:
                handle.write("\n")  # keep the next row off the torn line


def _settled_row(reservation: Reservation, usage: Usage, cost: float, latency_s: float, ok: bool,
                 notes: list[str], basis: str) -> dict[str, Any]:
    fields = {k: v for k, v in reservation.__dict__.items() if k not in ("worst_usd",)}
    return {"version": ROW_VERSION, "event": "settle", "timestamp": _now(), **fields, **usage.model_dump(),
            "cost_usd": cost, "worst_usd": reservation.worst_usd, "latency_s": round(latency_s, 4), "ok": ok,
            "basis": basis, "notes": notes}


def _abandoned_row(reserve: dict[str, Any]) -> dict[str, Any]:
    """The row of a reservation whose process died before settling it: its worst case, charged."""
    return {**reserve, "event": "settle", "input_tokens": int(reserve.get("prompt_tokens", 0)),
            "cached_input_tokens": 0, "output_tokens": int(reserve.get("max_output_tokens", 0)),
            "reasoning_tokens": 0, "cost_usd": float(reserve.get("worst_usd", 0.0)), "latency_s": 0.0, "ok": False,
            "basis": "abandoned", "notes": [ABANDONED]}


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")
