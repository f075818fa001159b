"""What every registered proposer must do (``state_machine.proposers.base.Proposer``), whatever it searches with.

Each test runs once per entry of ``proposers.registry.PROPOSERS``: the rule catalog and TPE on the bundled trainer at
`tiny` (TPE skipped where optuna is not installed, as ``check_available`` says), the LLM through the real client
against the scripted OpenAI-compatible server on loopback. No worker starts: a candidate's verdict is written into
the state as the decide node would. A proposer added to the registry without a policy here fails, so that it is held
to the same contract.
"""

from __future__ import annotations

import pytest

from sg_opt.ledger import TokenLedger
from sg_opt.llm_client import OpenAIClient
from sg_opt.tiers import Price
from state_machine import nodes
from state_machine.context import ProposerPolicy, RunContext
from state_machine.proposers import Proposal
from state_machine.proposers.base import Proposer
from state_machine.proposers.registry import PROPOSERS, proposer_for
from state_machine.specs import config_digest
from state_machine.state import Candidate, Evaluated, RunState, Verdict
from targets.protocol import ConfigError, Knob, KnobSpace, Target
from targets.registry import resolve_target
from tests.fixtures.openai_server import openai_server, reply_json  # noqa: F401 (the scripted server fixture)
from tests.state_machine.records import checked, finding

POLICIES = {  # how the contract runs each registered proposer
    "rules": ProposerPolicy(kinds=("knob",)),
    "tpe": ProposerPolicy(search="tpe"),
    "llm": ProposerPolicy(tier="normal", kinds=("knob", "kernel"), candidates_per_iteration=2, max_output_tokens=1000),
}
FINDINGS = [finding("data-wait", 0.3, 1.2), finding("optimizer", 0.6, 2.3)]
PRICE = Price(input=1.0, output=2.0)
LANES = 3

HASTE = resolve_target("haste-rec")
SMALL = Target(  # four configurations: torch, and triton with three tiles
    name="contract-small", description="a backend and a tile size only the Triton backend reads", sizes=("tiny",),
    build=lambda *a, **k: None, knob_space=KnobSpace((
        Knob("backend", "choice", "torch", why="t", category="kernel", numerics="reorder", choices=("torch", "triton")),
        Knob("tile", "choice", "auto", why="t", category="kernel", numerics="reorder", choices=("auto", 16, 32),
             active_when=(("backend", ("triton",)),)))))


def knob_reply(*changes: tuple[str, str]) -> dict:
    """A model's reply proposing one candidate per knob change, values written as strings as the schema asks."""
    return {"candidates": [{"rationale": f"{knob} to {value}", "knob_changes": [{"knob": knob, "value": value}],
                            "kernel_slot": "", "kernel_source": ""} for knob, value in changes]}


MODEL_SAYS = knob_reply(("data_workers", "2"), ("optimizer_impl", "foreach"))  # the same every time it is asked
NOTHING_LEFT = {"candidates": []}


@pytest.fixture(params=list(PROPOSERS))
def name(request) -> str:
    assert request.param in POLICIES, f"give the contract a policy that runs proposer {request.param!r}"
    try:
        PROPOSERS[request.param].check_available()
    except ConfigError as exc:
        pytest.skip(str(exc))
    return request.param


@pytest.fixture
def run(name, request, tmp_path):
    """(target, model's replies) -> (proposer, state at the first proposal, context); a model that is asked more
    often than it has replies fails the test (the server answers 500)."""
    def start(target: Target, *replies: dict) -> tuple[Proposer, RunState, RunContext]:
        policy = POLICIES[name]
        proposer = proposer_for(policy)
        llm = ledger = None
        if proposer.uses_llm:
            server = request.getfixturevalue("openai_server")
            server.script(*(reply_json(r, prompt_tokens=900, completion_tokens=100) for r in replies))
            llm = OpenAIClient("m", "sk-test-contract-123456", base_url=server.url, timeout_s=5.0, max_attempts=1)
            ledger = TokenLedger(tmp_path, {"m": PRICE}, 5.0)
        state = RunState(run_id="t", run_dir=str(tmp_path), target=target.name, size="tiny", tier=policy.tier,
                         findings=FINDINGS)
        return proposer, state, RunContext(target=target, policy=policy, llm=llm, ledger=ledger)
    return start


def rejected_after(state: RunState, ctx: RunContext, proposal: Proposal) -> RunState:
    """The state once `proposal` was measured slower and rejected, as the decide node records it."""
    cid = state.next_id
    config = {**state.incumbent.config, **proposal.patch}
    record = Evaluated(candidate=Candidate(id=cid, kind=proposal.kind, patch=proposal.patch,
                                           rationale=proposal.rationale, proposer=proposal.proposer),
                       verdict=Verdict(accepted=False, stage="measure", reason="slower", ratio=1.05),
                       incumbent_id=None, config=config,
                       digest=config_digest(ctx.target.knob_space.resolve(config), {}))
    return state.model_copy(update={"history": state.history + [record], "next_id": cid + 1,
                                    "proposal_rounds": state.proposal_rounds + 1})


def test_it_is_a_proposer_the_registry_finds_by_its_name(name):
    proposer = PROPOSERS[name]
    assert isinstance(proposer, Proposer) and proposer.name == name and proposer_for(POLICIES[name]) is proposer


def test_it_proposes_valid_changes_inside_the_targets_knob_space(run):
    proposer, state, ctx = run(HASTE, MODEL_SAYS)
    proposals = proposer.propose(state, ctx, LANES)
    space = ctx.target.knob_space
    assert proposals and len(proposals) <= max(LANES, ctx.policy.candidates_per_iteration)
    for p in proposals:
        assert isinstance(p, Proposal) and p.kind in ("knob", "kernel") and (p.kind == "kernel") == bool(
            p.kernel_sources)
        assert isinstance(p.proposer, str) and p.proposer.strip() and p.rationale.strip()
        assert p.patch or p.kernel_sources
        assert {k: space[k].validate(v) for k, v in p.patch.items()} == p.patch  # ConfigError outside a domain
        space.resolve({**state.incumbent.config, **p.patch})  # and the constraints between knobs hold


def test_the_same_state_gives_the_same_proposals(run):
    proposer, state, ctx = run(HASTE, MODEL_SAYS, MODEL_SAYS)
    assert proposer.propose(state, ctx, LANES) == proposer.propose(state, ctx, LANES)


def test_a_tried_configuration_never_reaches_a_worker_again(run):
    """A search never proposes a configuration the run evaluated. The LLM passes on what its model says, repeats
    included: the check node turns such a repeat away as a duplicate before any worker starts."""
    proposer, state, ctx = run(HASTE, MODEL_SAYS, MODEL_SAYS)
    tried = rejected_after(state, ctx, proposer.propose(state, ctx, 1)[0])
    space, config = ctx.target.knob_space, tried.history[-1].config
    repeats = [p for p in proposer.propose(tried, ctx, LANES)
               if space.resolve({**tried.incumbent.config, **p.patch}) == space.resolve(config)]
    assert bool(repeats) == proposer.uses_llm, repeats  # the replayed model says the same again (MODEL_SAYS)
    for p in repeats:
        candidate = Candidate(id=tried.next_id, kind=p.kind, patch=p.patch, rationale=p.rationale, proposer=p.proposer)
        verdict = checked(tried, ctx, candidate)["current"].verdict
        assert verdict.stage == "check" and "a duplicate of candidate #" in verdict.reason


def test_when_nothing_is_left_it_proposes_nothing_and_the_run_converges(run):
    """Every configuration of a small space tried (for the LLM: a model with nothing more to suggest), the proposer
    returns [] rather than raising, and the propose node ends the run as converged."""
    proposer, state, ctx = run(SMALL, NOTHING_LEFT, NOTHING_LEFT, NOTHING_LEFT)
    for _ in range(4):  # the space's configurations: at most three to try besides the baseline
        proposals = proposer.propose(state, ctx, 1)
        if not proposals:
            break
        state = rejected_after(state, ctx, proposals[0])
    assert proposer.propose(state, ctx, 1) == []
    assert nodes.propose(state, ctx)["stop_reason"].startswith("converged")
