"""The LLM proposer with the real client over loopback and the real ledger, without workers: repair turns for
malformed replies, replies read back on a resume instead of bought again, the deadline and the budget stopping
the run in a sentence, the prompt's stable prefix and what it tells the model, and the kernel repair loop."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sg_opt.ledger import TokenLedger
from sg_opt.llm_client import OpenAIClient
from sg_opt.tiers import Price
from state_machine import nodes
from state_machine.context import ProposerPolicy, RunContext
from state_machine.llm_interfaces import DeadlineReached, LLMError
from state_machine.prompt import SYSTEM, build_messages
from state_machine.proposers.kernel_repair import repair_target
from state_machine.proposers.llm import propose_llm
from state_machine.state import Candidate, Evaluated, Limits, RunState, Verdict
from targets.registry import resolve_target
from tests.fixtures.openai_server import ScriptedReply, reply_json, reply_raw
from tests.state_machine.records import candidate as make_candidate
from tests.state_machine.records import checked

PRICE = Price(input=1.0, output=2.0)
FINE = Path(__file__).with_name("test_report_fine.json")
WRONG_TAIL = "import torch\n\ndef tail_forward(h, idx, w, bias):\n    return torch.zeros(1)\n"
RIGHT_TAIL = "import torch\n\ndef tail_forward(h, idx, w, bias):\n    return h[:, idx].sum()\n"


def knob(name: str, value, rationale: str = "r") -> dict:
    return {"rationale": rationale, "knob_changes": [{"knob": name, "value": value}], "kernel_slot": "",
            "kernel_source": ""}


def kernel(slot: str, source: str, **knobs) -> dict:
    return {"rationale": "k", "knob_changes": [{"knob": k, "value": v} for k, v in knobs.items()],
            "kernel_slot": slot, "kernel_source": source}


def reply(*candidates: dict, **usage) -> ScriptedReply:
    return reply_json({"candidates": list(candidates)}, **({"prompt_tokens": 900, "completion_tokens": 100} | usage))


@pytest.fixture
def run(tmp_path, openai_server):
    """(state, ctx) of a haste-rec tiny run at its first proposal, the normal tier over the scripted server."""
    state = RunState(run_id="t", run_dir=str(tmp_path), target="haste-rec", size="tiny", tier="normal")
    llm = OpenAIClient("m", "sk-test-proposer-123456", base_url=openai_server.url, timeout_s=5.0, max_attempts=2,
                       backoff_base_s=0.01, backoff_max_s=0.02)
    ctx = RunContext(target=resolve_target("haste-rec"), llm=llm, ledger=TokenLedger(tmp_path, {"m": PRICE}, 5.0),
                     policy=ProposerPolicy(tier="normal", kinds=("knob", "kernel"), max_output_tokens=1000,
                                           reply_repairs=1, kernel_repairs=2))
    return state, ctx


def purposes(ctx) -> list[str]:
    return [row["purpose"] for row in ctx.ledger.rows]


def test_a_float_value_and_null_strings_make_a_proposal_not_a_crash(run, openai_server):
    state, ctx = run
    openai_server.script(reply_json({"candidates": [{"rationale": None, "kernel_slot": None, "kernel_source": None,
                                                     "knob_changes": [{"knob": "data_workers", "value": 2.0}]}]}))
    (proposal,) = propose_llm(state, ctx)
    assert proposal.patch == {"data_workers": 2} and proposal.kind == "knob"


def test_a_malformed_reply_goes_back_to_the_model_in_a_repair_turn_that_is_charged(run, openai_server):
    state, ctx = run
    openai_server.script(reply_raw('{"candidates": [{"rationale": "unterminated', prompt_tokens=900,
                                   completion_tokens=40),
                         reply(knob("data_workers", "2")))
    (proposal,) = propose_llm(state, ctx)
    assert proposal.patch == {"data_workers": 2}
    first, second = openai_server.requests
    assert second.body["messages"][:2] == first.body["messages"]
    assert second.body["messages"][2] == {"role": "assistant", "content": '{"candidates": [{"rationale": "unterminated'}
    assert "Your reply is not valid JSON (Unterminated string starting at: line 1" in second.body["messages"][3][
        "content"]
    assert purposes(ctx) == ["propose", "reply-repair"] and ctx.ledger.totals().overall.reply_repairs == 1
    assert ctx.ledger.spent_usd() == pytest.approx(openai_server.billed_usd(1.0, 2.0))


def test_when_the_repair_turns_are_spent_the_proposal_fails_in_a_sentence(run, openai_server):
    state, ctx = run
    openai_server.script(reply_raw("no JSON here"), reply_raw("still none"))
    with pytest.raises(LLMError, match=r"^the m reply is not valid JSON \(Expecting value: line 1 column 1\) "
                                       r"after 1 repair turn$"):
        propose_llm(state, ctx)
    out = nodes.propose(state, ctx)
    assert out["proposer_failures"] and "stop_reason" not in out  # the next round tries again


def test_a_resumed_run_reads_a_settled_reply_back_instead_of_buying_it_again(run, openai_server, tmp_path):
    state, ctx = run
    openai_server.script(reply(knob("data_workers", "4")))
    first = propose_llm(state, ctx)
    resumed = RunContext(target=ctx.target, llm=ctx.llm, policy=ctx.policy,
                         ledger=TokenLedger(tmp_path, {"m": PRICE}, 5.0))  # the process died after the row
    assert propose_llm(state, resumed) == first and len(openai_server.requests) == 1
    assert len(resumed.ledger.rows) == 1
    openai_server.script(reply(knob("data_workers", "2")))  # the next round asks anew, same prompt or not
    (again,) = propose_llm(state.model_copy(update={"proposal_rounds": 1}), resumed)
    assert again.patch == {"data_workers": 2} and len(openai_server.requests) == 2


def test_no_call_starts_once_max_minutes_are_spent_and_the_run_stops_in_a_sentence(run, openai_server):
    state, ctx = run
    late = state.model_copy(update={"limits": Limits(max_minutes=1.0), "elapsed_s": 59.9})
    with pytest.raises(DeadlineReached):
        propose_llm(late, ctx)
    out = nodes._ask(late, ctx)[1]
    assert out["stop_reason"].startswith("max-minutes: the run's --max-minutes") and not openai_server.requests


def test_a_budget_that_cannot_cover_a_request_stops_the_run_before_it_is_sent(run, openai_server, tmp_path):
    state, ctx = run
    poor = RunContext(target=ctx.target, llm=ctx.llm, policy=ctx.policy,
                      ledger=TokenLedger(tmp_path / "poor", {"m": PRICE}, 0.001))
    out = nodes._ask(state, poor)[1]
    assert out["stop_reason"].startswith("budget: the $0.00 budget would not cover another m request")
    assert not openai_server.requests and poor.ledger.spent_usd() == 0


def test_the_stable_part_of_the_prompt_comes_first_and_does_not_change_between_calls(run):
    state, ctx = run
    history = [Evaluated(candidate=make_candidate(1, patch={"data_workers": 4}), incumbent_id=None,
                         verdict=Verdict(accepted=False, stage="measure", reason="slower", ratio=1.3))]
    before = build_messages(state, ctx)
    after = build_messages(state.model_copy(update={"history": history, "proposal_rounds": 3}), ctx)
    assert before[0] == after[0] and before[0]["content"].startswith(SYSTEM)  # a prompt cache covers all of it
    assert "#1 data_workers=4" in after[1]["content"] and "#1 data_workers" not in after[0]["content"]
    assert after[1]["content"].index("## History") > after[1]["content"].index("## Knobs now")


def test_only_slots_training_calls_are_offered_with_the_knob_they_need_dtypes_and_roofline(run, tmp_path):
    state, ctx = run
    profile = tmp_path / "profiles" / "00.json"
    profile.parent.mkdir()
    profile.write_text(json.dumps({"fine": json.loads(FINE.read_text())}))
    system, user = (m["content"] for m in build_messages(state.model_copy(update={"profiles": [str(profile)]}), ctx))
    for slot in ("tail_forward", "tail_backward_weight", "tail_backward_input"):
        assert f"### slot {slot}(" in system
    for never in ("embedding_pool_forward", "embedding_fused_update", "perlabel_forward"):
        assert never not in system
    assert "runs in training only with tail_backend set to slots or triton" in system
    assert "checked against the slot's torch reference in float32, float16" in system
    assert "Not checked in bfloat16: not checked on the CPU" in system
    assert ("not called in training now (tail_backend is torch): a candidate replacing it must also set "
            "tail_backend to slots or triton") in user
    assert "measured in the incumbent's step: 0.112 ms at B=32, Ht=32, K=61, G=8, F=8, bias=1 in float32" in user
    assert "% of the roofline" in user


def test_the_check_node_rejects_a_kernel_training_would_not_call(run, tmp_path):
    state, ctx = run
    source = tmp_path / "k.py"
    source.write_text(WRONG_TAIL)
    unset = checked(state, ctx, make_candidate(kind="kernel", kernels={"tail_forward": str(source)}))
    assert unset["current"].verdict.reason == ("training calls a replacement of kernel slot tail_forward only with "
                                               "tail_backend slots or triton (it is torch)")
    embedding = checked(state, ctx, make_candidate(kind="kernel", kernels={"embedding_pool_forward": str(source)},
                                                   patch={"data_workers": 2}))
    assert "training never calls kernel slot embedding_pool_forward" in embedding["current"].verdict.reason


def rejected_kernel(state: RunState, cid: int, source: str, repair_of: int | None = None, stage: str = "validate",
                    reason: str = "kernel tail_forward (float32) failed its accuracy check: tail_forward is "
                                  "inaccurate at shape {'B': 64}: its worst element is off by 3.1e+00",
                    ratio: float | None = None) -> Evaluated:
    folder = Path(state.run_dir) / "candidates" / f"{cid:03d}"
    (folder / "kernels").mkdir(parents=True, exist_ok=True)
    (folder / "kernels" / "tail_forward.py").write_text(source)
    (folder / "kernel-tail_forward-float32.json").write_text(json.dumps({
        "ok": False, "slot": "tail_forward", "check": "accuracy", "reason": reason, "dtype": "float32",
        "errors": [{"shape": {"B": 64, "Ht": 96}, "rel_error": 0.9, "max_abs_error": 3.1, "ref_scale": 4.0}],
        "detail": "Traceback (most recent call last):\n  ...\nRuntimeError: shape mismatch in tail_forward"}))
    cand = Candidate(id=cid, kind="kernel", kernels={"tail_forward": str(folder / "kernels" / "tail_forward.py")},
                     patch={"tail_backend": "slots"}, rationale="fused", proposer="llm:normal", repair_of=repair_of)
    return Evaluated(candidate=cand, incumbent_id=None,
                     verdict=Verdict(accepted=False, stage=stage, reason=reason, ratio=ratio))


def test_a_rejected_kernel_goes_back_with_its_source_and_the_validators_message(run, openai_server):
    state, ctx = run
    state = state.model_copy(update={"history": [rejected_kernel(state, 1, WRONG_TAIL)], "next_id": 2})
    openai_server.script(reply(kernel("tail_forward", RIGHT_TAIL, tail_backend="slots")))
    (proposal,) = propose_llm(state, ctx)
    assert proposal.repair_of == 1 and proposal.kernel_sources == {"tail_forward": RIGHT_TAIL}
    asked = openai_server.requests[0].body["messages"][1]["content"]
    for words in ("## Repair 1 of 2: candidate #1", "replaced slot tail_forward and set tail_backend='slots'",
                  WRONG_TAIL, "It was rejected at validate: kernel tail_forward (float32) failed its accuracy check",
                  "Worst errors in float32: shape {'B': 64, 'Ht': 96}: relative error 9.00e-01",
                  "RuntimeError: shape mismatch in tail_forward", 'kernel_slot "tail_forward"'):
        assert words in asked
    assert asked.index("## History") < asked.index("## Repair")  # the variable part, last
    assert purposes(ctx) == ["kernel-repair"]


def test_a_slower_kernel_goes_back_with_its_timing_verdict(run, openai_server):
    state, ctx = run
    slow = rejected_kernel(state, 1, RIGHT_TAIL, stage="measure", ratio=1.2,
                           reason="slower: ratio 1.200 beyond the noise floor twice")
    slow.verdict.ci_low, slow.verdict.ci_high = 1.1, 1.3
    openai_server.script(reply(kernel("tail_forward", RIGHT_TAIL + "# faster\n", tail_backend="slots")))
    propose_llm(state.model_copy(update={"history": [slow]}), ctx)
    asked = openai_server.requests[0].body["messages"][1]["content"]
    assert "step time ratio 1.200 (95% interval 1.100-1.300)" in asked and "Correct first, then fast" in asked


def test_a_repair_chain_stops_at_kernel_repairs_rounds(run):
    state, ctx = run
    chain = [rejected_kernel(state, 1, WRONG_TAIL), rejected_kernel(state, 2, WRONG_TAIL, repair_of=1)]
    assert repair_target(state.model_copy(update={"history": chain}), ctx.policy).candidate.id == 2
    chain.append(rejected_kernel(state, 3, WRONG_TAIL, repair_of=2))
    assert repair_target(state.model_copy(update={"history": chain}), ctx.policy) is None  # 2 repairs made
    assert repair_target(state.model_copy(update={"history": chain[:1]}), ProposerPolicy(
        tier="normal", kinds=("knob", "kernel"), kernel_repairs=0)) is None
