"""Replies as servers really send them: fenced, wrapped in prose, values of any JSON type, cut off, malformed.
Each is read if it can be and refused in a sentence the model can act on if not; none raises anything else."""

from __future__ import annotations

import json

import pytest

from state_machine.context import ProposerPolicy, RunContext
from state_machine.llm_reply import ReplyInvalid, extract_json, parse_reply
from state_machine.proposers.llm import Reply, parse_value, to_proposals
from state_machine.state import RunState
from targets.registry import resolve_target

ONE = {"candidates": [{"rationale": "r", "knob_changes": [{"knob": "data_workers", "value": "2"}],
                       "kernel_slot": "", "kernel_source": ""}]}


@pytest.mark.parametrize("text", [
    json.dumps(ONE),
    f"```json\n{json.dumps(ONE, indent=1)}\n```",
    f"Here is my proposal:\n```\n{json.dumps(ONE)}\n```\nIt should help.",
    f"Sure! {json.dumps(ONE)} Hope that helps.",
    f"```json\nnot this one\n```\n```JSON\n{json.dumps(ONE)}\n```",
], ids=["bare", "json-fence", "plain-fence-with-prose", "prose-around", "second-fence"])
def test_json_is_found_in_fences_and_prose(text):
    assert extract_json(text) == ONE
    assert parse_reply(text, Reply).candidates[0].knob_changes[0].value == "2"


@pytest.mark.parametrize("text, problem", [
    ('{"candidates": [{"rationale": "unterminated', "is not valid JSON (Unterminated string starting at: line 1"),
    ("", "is empty"),
    ("I cannot help with that.", "is not valid JSON (Expecting value: line 1 column 1)"),
    ('{"candidates": [{"knob_changes": [{"value": 1}]}]}',
     "does not match the schema: candidates.0.knob_changes.0.knob: Field required"),
    ('{"proposals": []}', "does not match the schema: candidates: Field required"),
    ('{"candidates": [{"knob_changes": [{"knob": "a", "value": {"nested": 1}}]}]}',
     "does not match the schema: candidates.0.knob_changes.0.value"),
], ids=["unterminated", "empty", "prose", "missing-knob", "wrong-key", "object-value"])
def test_what_cannot_be_read_is_one_sentence_for_the_model(text, problem):
    with pytest.raises(ReplyInvalid) as info:
        parse_reply(text, Reply)
    assert str(info.value).startswith(problem) and "at at" not in str(info.value) and "\n" not in str(info.value)


def test_a_reply_cut_off_at_the_limit_is_refused_as_such_even_when_it_parses():
    for finish in ("length", "cut"):
        with pytest.raises(ReplyInvalid, match="cut off at the output token limit") as info:
            parse_reply(json.dumps(ONE), Reply, finish)
        assert info.value.cut_off


def test_servers_that_ignore_the_schema_send_other_json_types_and_those_are_read():
    reply = parse_reply(json.dumps({"candidates": [
        {"rationale": None, "knob_changes": [{"knob": "data_workers", "value": 2.0},
                                             {"knob": "embedding_cache_fraction", "value": 0.5},
                                             {"knob": "pin_memory", "value": True},
                                             {"knob": "precision", "value": None}],
         "kernel_slot": None, "kernel_source": None, "expected_gain": 1.3}]}), Reply)
    assert [c.value for c in reply.candidates[0].knob_changes] == [2.0, 0.5, True, None]
    assert parse_reply('[{"knob_changes": {"data_workers": 4}}]', Reply).candidates[0].knob_changes[0].value == 4


def test_each_value_becomes_its_knobs_own_type_and_what_does_not_parse_is_left_for_the_check_node(tmp_path):
    target = resolve_target("haste-rec")
    space = target.knob_space
    assert parse_value(space, "data_workers", 2.0) == 2 and parse_value(space, "data_workers", "2") == 2
    assert parse_value(space, "embedding_cache_fraction", 0.5) == 0.5
    bool_knob = next(k.name for k in space if k.kind == "bool")
    assert parse_value(space, bool_knob, True) is True and parse_value(space, bool_knob, "false") is False
    assert parse_value(space, "precision", 3) == 3 and parse_value(space, "no_such_knob", 1.5) == 1.5
    state = RunState(run_id="t", run_dir=str(tmp_path), target="haste-rec", size="tiny")
    ctx = RunContext(target=target, policy=ProposerPolicy(tier="normal", kinds=("knob", "kernel")))
    reply = Reply.model_validate({"candidates": [{"knob_changes": [{"knob": "data_workers", "value": 3}],
                                                  "kernel_slot": "../../../etc/evil", "kernel_source": "x = 1"}]})
    (proposal,) = to_proposals(reply, state, ctx)
    assert proposal.patch == {"data_workers": 3} and list(proposal.kernel_sources) == ["_________etc_evil"]
    assert proposal.rationale == "(no rationale given)"
