"""`sg-opt optimize` with the normal and ultra tiers against a scripted OpenAI-compatible server.

Real components throughout: the `openai` client streaming over real HTTP on loopback, the real ledger, real
workers and validators on the agent test target (whose baseline kernel is a correct but slow loop). Every run
ends in a report with its spend recorded at what the server billed or a bound above it, and never above the
budget, whatever the server sends.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from sg_opt import ledger as ledger_module
from sg_opt.cli import app
from tests.fixtures.openai_server import (reply_delay, reply_json, reply_raw, reply_runaway, reply_status,
                                          usage_block)
from tests.fixtures.quick_measurement import quick_measurement

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow  # each test is a real agent run, or two
AGENT_TARGET = "tests.fixtures.agent_target:target"
FAKE_KEY = "sk-test-DO-NOT-LEAK-4242424242"
INPUT, CACHED, OUTPUT = 1.0, 0.5, 2.0
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


def reply(*candidates: dict, prompt_tokens: int = 900, completion_tokens: int = 120, cached: int = 100, **kwargs):
    return reply_json({"candidates": list(candidates)}, prompt_tokens=prompt_tokens,
                      completion_tokens=completion_tokens, cached_tokens=cached, **kwargs)


def invoke(tmp_path: Path, server, monkeypatch, tier: str, *args: str, budget: float = 5.0,
           output_price: float = OUTPUT, base_url: str | None = None, code: int = 0):
    monkeypatch.setenv("OPENAI_API_KEY", FAKE_KEY)
    tiers = tmp_path / "tiers.toml"
    tiers.write_text(PRICES.format(budget=budget, output_price=output_price))
    result = CliRunner().invoke(app, ["optimize", "--target", AGENT_TARGET, "--size", "tiny", "--tier", tier,
                                      "--tiers", str(tiers), "--base-url", base_url or server.url,
                                      "--llm-timeout", "2", "--timeout", "60", "--threads", "1",
                                      *quick_measurement(), "--out", str(tmp_path / "runs"), "--json", *args])
    assert result.exit_code == code, result.output + result.stderr
    assert FAKE_KEY not in result.output + result.stderr
    return result


def run(tmp_path: Path, server, monkeypatch, tier: str, *args: str, **kwargs) -> tuple[dict, Path]:
    result = invoke(tmp_path, server, monkeypatch, tier, *args, **kwargs)
    (run_dir,) = list((tmp_path / "runs").iterdir())
    return json.loads(result.stdout), run_dir


def ledger_rows(run_dir: Path) -> list[dict]:
    return ledger_module.TokenLedger(run_dir, {}, 0.0).rows


def recorded(run_dir: Path) -> float:
    return sum(row["cost_usd"] for row in ledger_rows(run_dir))


def billed(server, output_price: float = OUTPUT) -> float:
    return server.billed_usd(INPUT, output_price, CACHED)


def assert_no_secret_written(run_dir: Path, secret: str = FAKE_KEY) -> None:
    for path in run_dir.rglob("*"):
        if path.is_file():
            assert secret.encode() not in path.read_bytes(), path


def test_ultra_accepts_a_correct_kernel_rewrite_and_rejects_a_wrong_one(tmp_path, openai_server, monkeypatch):
    openai_server.script(
        reply(candidate("scaled by mistake", slot="project", source=WRONG),
              candidate("one matmul instead of a loop over rows", slot="project", source=CORRECT)),
        reply())  # nothing more to propose (the wrong one's slot has an accepted kernel: no repair)
    summary, run_dir = run(tmp_path, openai_server, monkeypatch, "ultra", "--set", "slow_loader=false")
    wrong, right = summary["candidates"]
    assert not wrong["accepted"] and wrong["stage"] == "validate" and "kernel project" in wrong["reason"]
    assert right["accepted"] and right["change"] == "kernel project" and right["numerics_class"] == "reorder"
    assert summary["final"]["verdict"] == "faster"
    assert summary["stop_reason"].startswith("converged")
    assert (run_dir / "best_kernels" / "project.py").read_text() == CORRECT
    assert "+    return torch.matmul(x, w)" in (run_dir / "best_kernels" / "project.diff").read_text()
    system, user = (m["content"] for m in openai_server.requests[0].body["messages"])
    assert "slot project(x, w)" in system and "def project_rowwise" not in system + user
    assert "checked against the slot's torch reference in float32" in system
    assert_no_secret_written(run_dir)


def test_a_kernel_the_model_fixes_only_after_seeing_its_error_is_accepted_through_the_repair_loop(
        tmp_path, openai_server, monkeypatch):
    """The scripted model writes a wrong kernel first, and the right one only when the prompt shows the
    validator's message about the wrong one: the repair loop is what gets the kernel accepted."""
    def model(body: dict):
        text = "\n".join(m["content"] for m in body["messages"])
        if "## Repair 1 of" in text and "failed its accuracy check" in text and WRONG in text:
            return reply(candidate("the 1.01 scale was the bug the validator found", slot="project", source=CORRECT))
        if "- none yet" in text:
            return reply(candidate("one matmul instead of a loop over rows", slot="project", source=WRONG))
        return reply()

    openai_server.script(*[model] * 4)
    summary, run_dir = run(tmp_path, openai_server, monkeypatch, "normal", "--set", "slow_loader=false")
    first, repaired = summary["candidates"]
    assert not first["accepted"] and first["stage"] == "validate" and "accuracy" in first["reason"]
    assert repaired["accepted"] and repaired["change"] == "kernel project"
    assert (run_dir / "best_kernels" / "project.py").read_text() == CORRECT
    assert [row["purpose"] for row in ledger_rows(run_dir)] == ["propose", "kernel-repair", "propose"]
    assert summary["spend_by_tier"]["normal"]["kernel_repairs"] == 1
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    assert [e["of"] for e in events if e["event"] == "kernel-repair"] == [1]


def test_normal_survives_fences_scalars_malformed_replies_errors_timeouts_and_untrusted_usage(
        tmp_path, openai_server, monkeypatch):
    openai_server.script(
        reply_raw("this is not JSON", prompt_tokens=800, completion_tokens=10),            # a repair turn...
        reply_raw("```json\n" + json.dumps({"candidates": [candidate("the loader sleeps", {"slow_loader": False})]})
                  + "\n```", prompt_tokens=900, completion_tokens=60,
                  usage=usage_block(prompt_tokens=-900, completion_tokens=-60)),           # ...fenced, a bool, lies
        reply_status(500),                                                                  # retried
        reply(candidate("no such knob", {"turbo": 1.5}), with_usage=False),                 # a float, no usage
        reply_status(429, retry_after=0), reply_delay(5.0, reply(prompt_tokens=700)),       # retried, timed out
        reply())                                                                            # done
    summary, run_dir = run(tmp_path, openai_server, monkeypatch, "normal")
    assert [c["change"] for c in summary["candidates"]] == ["slow_loader=False", "turbo=1.5"]
    assert summary["candidates"][0]["accepted"] and "unknown knob" in summary["candidates"][1]["reason"]
    assert summary["stop_reason"].startswith("converged") and len(openai_server.requests) == 7
    rows = ledger_rows(run_dir)
    assert [r["purpose"] for r in rows] == ["propose", "reply-repair"] + ["propose"] * 5
    assert [r["basis"] for r in rows] == ["reported", "bound", "reported", "bound", "reported", "bound", "reported"]
    assert rows[2]["cost_usd"] == rows[4]["cost_usd"] == 0  # HTTP errors are not billed
    assert billed(openai_server) <= recorded(run_dir) <= 5.0
    assert summary["spend"]["calls"] == 7 and summary["spend"]["cost_usd"] == pytest.approx(recorded(run_dir))
    assert summary["spend"]["reply_repairs"] == 1 and summary["spend"]["worst_case_calls"] == 3
    assert summary["cost_per_win_usd"] == pytest.approx(summary["spend"]["cost_usd"])
    assert_no_secret_written(run_dir)


def test_a_budget_for_two_calls_stops_before_the_third(tmp_path, openai_server, monkeypatch):
    # Worst case per request: ~0.01 $ of prompt + 1000 output tokens at 1000 $/M = ~1.01 $; each really costs
    # 200 output tokens = 0.20 $. After two 0.40 $ is spent and 0.40 + 1.01 > 1.25: refused, in one sentence.
    unknown = candidate("no such knob", {"turbo": "true"})
    openai_server.script(*(reply(unknown, completion_tokens=200) for _ in range(3)))
    summary, run_dir = run(tmp_path, openai_server, monkeypatch, "normal", budget=1.25, output_price=1000.0)
    assert len(openai_server.requests) == 2
    assert summary["stop_reason"].startswith("budget: the $1.25 budget would not cover another scripted-model "
                                             "request")
    assert recorded(run_dir) == pytest.approx(billed(openai_server, 1000.0)) and recorded(run_dir) <= 1.25
    assert all("unknown knob" in c["reason"] for c in summary["candidates"])


@pytest.mark.parametrize("runaway, stop, cut", [
    (lambda body: reply_runaway(prompt_tokens=900),
     "error: 3 proposals in a row failed; last: the scripted-model reply was cut off at the output token limit", True),
    (lambda body: reply(completion_tokens=2_000_000, ignore_stream=True),
     "error: the LLM endpoint http://127.0.0.1", False),
], ids=["streams-forever", "bills-2M-in-one-body"])
def test_a_server_that_ignores_max_tokens_cannot_pass_the_budget(tmp_path, openai_server, monkeypatch, runaway,
                                                                 stop, cut):
    """2,000,000 output tokens at $2/M would be $4.00 on a $0.50 budget. A runaway stream is cut short of the
    authorized 1000 tokens and charged that bound, which covers what the server generated; a server that bills
    past the limit in one body stops the run, saying so, with the reported count kept in its ledger row."""
    openai_server.script(*[runaway] * 8)
    result = invoke(tmp_path, openai_server, monkeypatch, "normal", budget=0.5, code=1)
    (run_dir,) = list((tmp_path / "runs").iterdir())
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["stop_reason"].startswith(stop), summary["stop_reason"]
    assert recorded(run_dir) <= 0.5 and (run_dir / "report.md").is_file()
    if cut:
        assert billed(openai_server) <= recorded(run_dir) and len(openai_server.requests) == 6
    else:
        assert "reported more tokens than were authorized" in " ".join(result.stderr.split())
        assert ledger_rows(run_dir)[0]["reported"]["output_tokens"] == 2_000_000


def test_max_minutes_bound_a_call_the_server_never_answers(tmp_path, openai_server, monkeypatch):
    """18 s: the call starts after the baseline and diagnosis (4 s on the quiet 2-core VM), and the rest of the run
    is the wait for its deadline."""
    openai_server.script(*[reply_delay(300.0, reply())] * 2)
    monkeypatch.setenv("OPENAI_API_KEY", FAKE_KEY)
    summary, run_dir = run(tmp_path, openai_server, monkeypatch, "normal", "--max-minutes", "0.3",
                           "--llm-timeout", "180")
    assert summary["stop_reason"].startswith("max-minutes: the run's --max-minutes deadline"), summary["stop_reason"]
    assert len(openai_server.requests) == 1 and summary["wall_s"] <= 18 + 5
    (row,) = ledger_rows(run_dir)
    assert row["basis"] == "bound" and not row["ok"]


def test_a_run_killed_during_a_call_charges_its_worst_case_and_resumes_without_paying_twice(tmp_path, openai_server,
                                                                                           monkeypatch):
    """kill -9 of the sg-opt process while the server holds its request (and will bill it): the reserved worst
    case stays charged; --resume asks again and finishes."""
    tiers = tmp_path / "tiers.toml"
    tiers.write_text(PRICES.format(budget=5.0, output_price=OUTPUT))
    openai_server.script(reply_delay(60.0, reply(candidate("held", {"slow_loader": "false"}))))
    cmd = [sys.executable, "-m", "sg_opt.cli", "optimize", "--target", AGENT_TARGET, "--size", "tiny", "--tier",
           "normal", "--tiers", str(tiers), "--base-url", openai_server.url, "--llm-timeout", "120", "--timeout",
           "60", "--threads", "1", *quick_measurement(), "--out", str(tmp_path / "runs"), "--json"]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=os.environ | {"OPENAI_API_KEY": FAKE_KEY},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        openai_server.wait_for_requests(1, timeout_s=240)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the process group this test started
        proc.wait()
    (run_dir,) = list((tmp_path / "runs").iterdir())
    (lost,) = ledger_rows(run_dir)
    assert lost["basis"] == "abandoned" and lost["cost_usd"] == pytest.approx(lost["worst_usd"])
    openai_server.script(reply(candidate("the loader sleeps", {"slow_loader": "false"})), reply())
    monkeypatch.setenv("OPENAI_API_KEY", FAKE_KEY)
    result = CliRunner().invoke(app, ["optimize", "--resume", str(run_dir), "--json"])
    assert result.exit_code == 0, result.output + result.stderr
    summary = json.loads(result.stdout)
    assert summary["candidates"][0]["accepted"] and summary["stop_reason"].startswith("converged")
    assert len(openai_server.requests) == 3 and len(ledger_rows(run_dir)) == 3
    assert billed(openai_server) <= recorded(run_dir) <= 5.0
    assert summary["spend"]["cost_usd"] == pytest.approx(recorded(run_dir))


class Killed(BaseException):
    """Stands for kill -9 right after a ledger row is on disk: nothing after it runs, no checkpoint is written."""


def test_a_run_killed_just_after_the_ledger_row_reuses_the_settled_reply_on_resume(tmp_path, openai_server,
                                                                                  monkeypatch):
    openai_server.script(reply(candidate("the loader sleeps", {"slow_loader": "false"})), reply())
    append = ledger_module.TokenLedger._append

    def append_then_die(self, row):
        append(self, row)
        if row.get("event") == "settle" and row.get("reply"):
            raise Killed()
    monkeypatch.setattr(ledger_module.TokenLedger, "_append", append_then_die)
    with pytest.raises(Killed):
        invoke(tmp_path, openai_server, monkeypatch, "normal")
    monkeypatch.setattr(ledger_module.TokenLedger, "_append", append)
    (run_dir,) = list((tmp_path / "runs").iterdir())
    result = CliRunner().invoke(app, ["optimize", "--resume", str(run_dir), "--json"])
    assert result.exit_code == 0, result.output + result.stderr
    summary = json.loads(result.stdout)
    assert [c["change"] for c in summary["candidates"]] == ["slow_loader=False"]
    assert len(openai_server.requests) == 2 and len(ledger_rows(run_dir)) == 2  # the first reply bought once
    assert recorded(run_dir) == pytest.approx(billed(openai_server))
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    assert [e["reused"] for e in events if e["event"] == "llm-call"] == [True, False]


def test_credentials_in_the_base_url_are_never_stored_and_a_resume_asks_for_them(tmp_path, openai_server,
                                                                                monkeypatch):
    secret = "s3cret-tok3n-in-the-url"
    url = openai_server.url.replace("http://", f"http://user:{secret}@")
    openai_server.script(reply())
    summary, run_dir = run(tmp_path, openai_server, monkeypatch, "normal", base_url=url)
    stored = json.loads((run_dir / "run.json").read_text())["base_url"]
    assert stored == openai_server.url.replace("http://", "http://***@")
    assert_no_secret_written(run_dir, secret)
    monkeypatch.delenv("OPENAI_BASE_URL", raising=False)
    refused = CliRunner().invoke(app, ["optimize", "--resume", str(run_dir), "--json"])
    assert refused.exit_code == 2
    said = " ".join(refused.stderr.split())
    assert "held credentials, which are not stored: pass the same --base-url with --resume" in said
    assert secret not in said
    again = CliRunner().invoke(app, ["optimize", "--resume", str(run_dir), "--base-url", url, "--json"])
    assert again.exit_code == 0, again.output + again.stderr
