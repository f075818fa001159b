"""Rules live with their targets: the bundled trainer proposes exactly its own, a user's job the generic ones over
the job adapter's knobs, and a finding that names a cause brings the rule that removes it first."""

from __future__ import annotations

import pytest

from examples.dlrm.job import target as DLRM
from state_machine.context import RunContext
from state_machine.proposers.offline import propose_offline
from state_machine.rules.catalog import catalog
from state_machine.rules.generic import GENERIC_RULES
from state_machine.state import RunState
from targets.haste_rec.rules import RULES
from targets.haste_rec.target import TARGET as TRAINER
from tests.state_machine.records import finding


def test_the_trainer_is_proposed_its_own_rules_only():
    names = {k.name for k in TRAINER.knob_space}
    assert tuple(rule for rule in catalog(TRAINER) if set(rule.patch) <= names) == RULES


def test_every_generic_rule_sets_knobs_of_the_job_adapter():
    names = {k.name for k in DLRM.knob_space}
    for rule in GENERIC_RULES:
        assert set(rule.patch) <= names, rule.name
        for name, value in rule.patch.items():
            DLRM.knob_space[name].validate(value)
    assert catalog(DLRM) == GENERIC_RULES


@pytest.fixture
def job_state(tmp_path) -> RunState:
    return RunState(run_id="r", run_dir=str(tmp_path), target="examples.dlrm.job:target", size="tiny", device="cpu",
                    tier="offline")


@pytest.mark.parametrize("cause,patch", [
    ("unfused-optimizer", {"optimizer_impl": "fused"}),
    ("data-wait", {"data_workers": 1}),
])
def test_a_cause_brings_the_rule_that_removes_it(job_state, cause, patch):
    state = job_state.model_copy(update={"findings": [finding(cause, 0.5, 2.0)]})
    (first,) = propose_offline(state, RunContext(target=DLRM), limit=1)
    assert first.patch == patch and cause in first.rationale


def test_a_model_change_needs_leave_and_then_answers_dense_table_gradients(job_state):
    state = job_state.model_copy(update={"findings": [finding("dense-embedding-grads", 0.6, 3.0)]})
    ctx = RunContext(target=DLRM)
    assert all("sparse_embedding_grads" not in p.patch for p in propose_offline(state, ctx, limit=50))
    allowed = propose_offline(state.model_copy(update={"allow_model_changes": True}), ctx, limit=1)
    assert allowed[0].patch == {"sparse_embedding_grads": True}


def test_knob_categories_no_finding_names_are_still_swept_last(job_state):
    state = job_state.model_copy(update={"findings": [finding("data-wait", 0.3, 1.5)]})
    proposals = propose_offline(state, RunContext(target=DLRM), limit=100)
    late = [p for p in proposals if "no finding points at" in p.rationale]
    assert {"metrics_every", "optimizer_impl"} <= {k for p in late for k in p.patch}
    assert all(p.expected_gain <= 1.01 for p in late) and proposals[0].expected_gain > 1.01
