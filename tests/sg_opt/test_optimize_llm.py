"""`sg-opt optimize` with the normal and ultra tiers against a scripted OpenAI-compatible server.

Real components throughout: the `openai` client over real HTTP on loopback, the real ledger, real
workers and validators on the agent test target (whose baseline kernel is a correct but slow loop).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from sg_opt.cli import app
from tests.fixtures.openai_server import reply_delay, reply_json, reply_raw, reply_status
from tests.fixtures.quick_measurement import quick_measurement

AGENT_TARGET = "tests.fixtures.agent_target:target"
FAKE_KEY = "sk-test-DO-NOT-LEAK-4242424242"
PRICES = """
[tiers.normal]
model = "scripted-model"
max_iterations = 8
budget_usd = {budget}
max_output_tokens = 1000

[tiers.ultra]
model = "scripted-model"
candidates_per_iteration = 2
max_iterations = 8
budget_usd = {budget}
max_output_tokens = 1000

[prices."scripted-model"]
input = 1.0
cached_input = 0.5
output = {output_price}
"""

CORRECT = "import torch\n\ndef project(x, w):\n    return torch.matmul(x, w)\n"
WRONG = "import torch\n\ndef project(x, w):\n    return torch.matmul(x, w) * 1.01\n"


def candidate(rationale: str, knobs: dict | None = None, slot: str = "", source: str = "") -> dict:
    return {"rationale": rationale, "knob_changes": [{"knob": k, "value": v} for k, v in (knobs or {}).items()],
            "kernel_slot": slot, "kernel_source": source}


def reply(*candidates: dict, prompt_tokens: int = 900, completion_tokens: int = 120, cached: int = 100):
    return reply_json({"candidates": list(candidates)}, prompt_tokens=prompt_tokens,
                      completion_tokens=completion_tokens, cached_tokens=cached)


def run(tmp_path: Path, server, monkeypatch, tier: str, *args: str, budget: float = 5.0,
        output_price: float = 2.0) -> tuple[dict, Path]:
    monkeypatch.setenv("OPENAI_API_KEY", FAKE_KEY)
    tiers = tmp_path / "tiers.toml"
    tiers.write_text(PRICES.format(budget=budget, output_price=output_price))
    result = CliRunner().invoke(app, ["optimize", "--target", AGENT_TARGET, "--size", "tiny", "--tier", tier,
                                      "--tiers", str(tiers), "--base-url", server.url, "--llm-timeout", "2",
                                      "--timeout", "60", "--threads", "1", *quick_measurement(),
                                      "--out", str(tmp_path / "runs"),
                                      "--json", *args])
    assert result.exit_code == 0, result.output + result.stderr
    assert FAKE_KEY not in result.output + result.stderr
    (run_dir,) = list((tmp_path / "runs").iterdir())
    return json.loads(result.stdout), run_dir


def ledger_rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "ledger.jsonl").read_text().splitlines()]


def assert_no_secret_written(run_dir: Path) -> None:
    for path in run_dir.rglob("*"):
        if path.is_file():
            assert FAKE_KEY.encode() not in path.read_bytes(), path


def test_ultra_accepts_a_correct_kernel_rewrite_and_rejects_a_wrong_one(tmp_path, openai_server, monkeypatch):
    openai_server.script(
        reply(candidate("scaled by mistake", slot="project", source=WRONG),
              candidate("one matmul instead of a loop over rows", slot="project", source=CORRECT)),
        reply())  # nothing more to propose
    summary, run_dir = run(tmp_path, openai_server, monkeypatch, "ultra", "--set", "slow_loader=false")
    wrong, right = summary["candidates"]
    assert not wrong["accepted"] and wrong["stage"] == "validate" and "kernel project" in wrong["reason"]
    assert right["accepted"] and right["change"] == "kernel project" and right["numerics_class"] == "reorder"
    assert summary["final"]["verdict"] == "faster"
    assert summary["stop_reason"].startswith("converged")
    assert (run_dir / "best_kernels" / "project.py").read_text() == CORRECT
    assert "+    return torch.matmul(x, w)" in (run_dir / "best_kernels" / "project.diff").read_text()
    body = openai_server.requests[0].body
    assert body["response_format"]["type"] == "json_schema" and "def project_rowwise" not in body["messages"][1][
        "content"] and "slot project(x, w)" in body["messages"][1]["content"]
    assert_no_secret_written(run_dir)


def test_normal_survives_malformed_replies_rate_limits_server_errors_and_timeouts(tmp_path, openai_server,
                                                                                  monkeypatch):
    openai_server.script(
        reply_raw("this is not JSON", prompt_tokens=800, completion_tokens=10),      # one failed proposal
        reply_status(500), reply(candidate("the loader sleeps", {"slow_loader": "false"})),  # retried
        reply_status(429, retry_after=0), reply_delay(5.0), reply())                 # retried twice, then done
    summary, run_dir = run(tmp_path, openai_server, monkeypatch, "normal")
    assert [c["change"] for c in summary["candidates"]] == ["slow_loader=False"]
    assert summary["candidates"][0]["accepted"] and summary["stop_reason"].startswith("converged")
    assert len(openai_server.requests) == 6
    rows = ledger_rows(run_dir)
    assert [r["ok"] for r in rows] == [False, True, True]
    assert sum(r["input_tokens"] for r in rows) == 800 + 900 + 900  # what the server billed, exactly
    assert sum(r["output_tokens"] for r in rows) == 10 + 120 + 120
    assert sum(r["cached_input_tokens"] for r in rows) == 200
    assert summary["spend"]["calls"] == 3 and summary["spend"]["cost_usd"] == pytest.approx(
        sum(r["cost_usd"] for r in rows))
    assert summary["cost_per_win_usd"] == pytest.approx(summary["spend"]["cost_usd"])
    assert_no_secret_written(run_dir)


def test_a_budget_for_two_calls_stops_before_the_third(tmp_path, openai_server, monkeypatch):
    # Worst case per call: ~0.002 $ of prompt + 1000 output tokens at 1000 $/M = 1.00 $; each call really
    # costs 200 output tokens = 0.20 $. After two calls 0.40 $ is spent and 0.40 + 1.00 > 1.25: refused.
    unknown = candidate("no such knob", {"turbo": "true"})
    openai_server.script(*(reply(unknown, completion_tokens=200) for _ in range(3)))
    summary, run_dir = run(tmp_path, openai_server, monkeypatch, "normal", budget=1.25, output_price=1000.0)
    assert len(openai_server.requests) == 2
    assert summary["stop_reason"].startswith("budget")
    assert summary["spend"]["cost_usd"] <= 1.25 and len(ledger_rows(run_dir)) == 2
    assert all("unknown knob" in c["reason"] for c in summary["candidates"])
