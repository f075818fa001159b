"""The TPE proposer as a plain function of the state: the study it rebuilds from a history, and what it asks."""

from __future__ import annotations

import pytest

from state_machine import nodes
from state_machine.context import ProposerPolicy, RunContext
from state_machine.proposers.tpe import observations, propose_tpe, rebuild_study
from state_machine.specs import config_digest
from state_machine.state import Candidate, Evaluated, InFlight, Incumbent, RunState, Verdict
from targets.protocol import Constraint, Knob, KnobSpace, Target

SPACE = KnobSpace((
    Knob("backend", "choice", "torch", why="t", category="kernel", numerics="reorder",
         choices=("torch", "triton")),
    Knob("tile", "choice", "auto", why="t", category="kernel", numerics="reorder", choices=("auto", 16, 32),
         active_when=(("backend", ("triton",)),)),
    Knob("fraction", "float", 0.5, why="t", category="embedding", numerics="exact", low=0.0, high=1.0),
    Knob("workers", "int", 0, why="t", category="data", numerics="exact", low=0, high=3),
    Knob("pin", "bool", False, why="t", category="data", numerics="exact"),
    Knob("unbounded", "float", 1.0, why="t", category="data", numerics="exact"),
    Knob("budget_gb", "float", -1.0, why="t", category="memory", numerics="exact", low=-1.0, high=80.0,
         user_setting=True),
    Knob("groups", "choice", 8, why="t", category="model", numerics="model", choices=(8, 16)),
), (Constraint("pin needs workers", lambda c: not c["pin"] or c["workers"] > 0),))

TARGET = Target(name="tpe-unit", description="a knob space for the TPE proposer's tests", knob_space=SPACE,
                sizes=("tiny",), build=lambda *a, **k: None)


@pytest.fixture
def ctx():
    return RunContext(target=TARGET, policy=ProposerPolicy(search="tpe"))


@pytest.fixture
def state(tmp_path):
    return RunState(run_id="t", run_dir=str(tmp_path), target="tpe-unit", size="tiny")


def evaluated(state: RunState, cid: int, patch: dict, stage: str, ratio: float | None = None,
              accepted: bool = False) -> RunState:
    """The state after the decide node recorded one knob candidate (and made it the incumbent if accepted)."""
    config = {**state.incumbent.config, **patch}
    digest = None if stage == "check" else config_digest(SPACE.resolve(config), {})  # as the check node sets it
    record = Evaluated(candidate=Candidate(id=cid, kind="knob", patch=patch, rationale="r", proposer="tpe"),
                       verdict=Verdict(accepted=accepted, stage=stage, reason="r", ratio=ratio),
                       incumbent_id=state.incumbent.from_candidate, config=config, digest=digest)
    updates = {"history": state.history + [record]}
    if accepted:
        updates["incumbent"] = Incumbent(config=config, from_candidate=cid,
                                         est_speedup=state.incumbent.est_speedup / ratio)
    return state.model_copy(update=updates)


def test_the_study_holds_the_baseline_and_each_candidate_at_its_estimated_speedup(state):
    state = evaluated(state, 1, {"workers": 2}, "measure", ratio=0.5, accepted=True)   # x2 over the baseline
    state = evaluated(state, 2, {"pin": True}, "measure", ratio=0.8)                   # x2.5, not confirmed
    state = evaluated(state, 3, {"fraction": 0.25}, "validate")                        # numerics broke
    state = evaluated(state, 4, {"backend": "triton", "tile": 32}, "measure", ratio=0.5, accepted=True)  # x4
    state = evaluated(state, 5, {"workers": 9}, "check")                               # never resolves: left out
    study, dists = rebuild_study(state, SPACE)
    assert [t.value for t in study.trials] == pytest.approx([1.0, 2.0, 2.5, 0.0, 4.0])
    assert study.trials[0].params == {"backend": "torch", "tile": "auto", "fraction": 0.5, "workers": 0,
                                      "pin": False}
    assert study.trials[4].params["tile"] == 32 and study.trials[4].params["workers"] == 2
    assert sorted(dists) == ["backend", "fraction", "pin", "tile", "workers"]  # no model, unbounded or user knob
    assert type(dists["workers"]).__name__ == "IntDistribution" and dists["fraction"].high == 1.0
    assert dists["pin"].choices == (False, True) and dists["tile"].choices == ("auto", 16, 32)


def test_model_knobs_are_searched_only_when_allowed(state):
    _, dists = rebuild_study(state.model_copy(update={"allow_model_changes": True}), SPACE)
    assert "groups" in dists and "unbounded" not in dists


def test_inactive_knobs_take_the_baseline_value(state):
    state = evaluated(state, 1, {"tile": 16}, "measure", ratio=0.9)  # tile does nothing under backend torch
    assert observations(state, SPACE)[1][0]["tile"] == "auto"


def test_proposals_are_new_valid_patches_against_the_incumbent(state, ctx):
    state = evaluated(state, 1, {"workers": 2}, "measure", ratio=0.5, accepted=True)
    seen = {config_digest(SPACE.resolve(state.baseline_config), {}), state.history[0].digest}
    for cid in range(2, 14):
        (proposal,) = propose_tpe(state, ctx)
        assert proposal.proposer == "tpe" and proposal.kind == "knob" and "TPE sample" in proposal.rationale
        assert proposal.patch and not {"groups", "unbounded", "budget_gb"} & set(proposal.patch)
        resolved = SPACE.resolve({**state.incumbent.config, **proposal.patch})  # constraints hold
        incumbent = SPACE.resolve(state.incumbent.config)
        assert all(value != incumbent[name] for name, value in proposal.patch.items())
        if resolved["backend"] == "torch":
            assert resolved["tile"] == "auto"
        digest = config_digest(resolved, {})
        assert digest not in seen
        seen.add(digest)
        checked = nodes.check(state.model_copy(update={"current": InFlight(candidate=Candidate(
            id=cid, kind="knob", patch=proposal.patch, rationale=proposal.rationale, proposer="tpe"))}), ctx)
        assert checked["current"].verdict is None, checked  # the check node takes it as it is
        state = evaluated(state, cid, proposal.patch, "measure", ratio=1.0)


def test_a_batch_for_several_gpus_holds_distinct_new_samples(state, ctx):
    state = evaluated(state, 1, {"workers": 2}, "measure", ratio=0.5, accepted=True)
    batch = propose_tpe(state, ctx, limit=3)
    digests = {config_digest(SPACE.resolve({**state.incumbent.config, **p.patch}), {}) for p in batch}
    assert len(batch) == 3 and len(digests) == 3 and state.history[0].digest not in digests


def test_the_same_history_gives_the_same_proposal(state, ctx):
    state = evaluated(state, 1, {"pin": True, "workers": 1}, "validate")
    assert propose_tpe(state, ctx) == propose_tpe(state, ctx)


def test_an_exhausted_space_gives_no_proposal_and_the_run_converges(tmp_path):
    space = KnobSpace((SPACE["backend"], SPACE["tile"]))  # torch (the baseline), triton with 3 tiles
    target = Target(name="small", description="four distinct configs", knob_space=space, sizes=("tiny",),
                    build=lambda *a, **k: None)
    ctx = RunContext(target=target, policy=ProposerPolicy(search="tpe"))
    state = RunState(run_id="t", run_dir=str(tmp_path), target="small", size="tiny")
    found = []
    while proposals := propose_tpe(state, ctx):
        config = {**state.incumbent.config, **proposals[0].patch}
        found.append(space.resolve(config))
        record = Evaluated(candidate=Candidate(id=len(found), kind="knob", patch=proposals[0].patch,
                                               rationale="r", proposer="tpe"),
                           verdict=Verdict(accepted=False, stage="validate", reason="r"), incumbent_id=None,
                           config=config, digest=config_digest(space.resolve(config), {}))
        state = state.model_copy(update={"history": state.history + [record]})
        assert len(found) <= 3, found
    assert all(c["backend"] == "triton" for c in found)
    assert sorted((c["tile"] for c in found), key=str) == [16, 32, "auto"]
    assert nodes.propose(state, ctx)["stop_reason"].startswith("converged")


def test_the_offline_tier_asks_tpe_only_when_told(state, ctx):
    assert nodes.propose(state, ctx)["current"].candidate.proposer == "tpe"
    rules = RunContext(target=TARGET, policy=ProposerPolicy())
    assert nodes.propose(state, rules)["current"].candidate.proposer.startswith("offline:")


def test_past_the_baselines_profile_the_tpe_search_profiles_no_incumbent(state, ctx, monkeypatch):
    """TPE reads no findings: after the baseline's profile a diagnose only calibrates the floor again (when due);
    the rules' search profiles every new incumbent."""
    from state_machine.state import Baseline
    profiled = []

    def run_profile(req, timeout_s):
        profiled.append(req)
        raise RuntimeError("profiled")
    monkeypatch.setattr(nodes, "run_profile", run_profile)
    accepted = evaluated(state.model_copy(update={"profiles": ["baseline.json"], "baseline": Baseline(
        numerics_file="n", step_ms=10.0, noise_floor=0.02, calibration_file="c")}), 1, {"pin": False, "workers": 1},
        "measure", ratio=0.9, accepted=True)
    assert nodes.diagnose(accepted, ctx) == {} and not profiled
    with pytest.raises(RuntimeError, match="profiled"):
        nodes.diagnose(accepted, RunContext(target=TARGET, policy=ProposerPolicy()))
    first = accepted.model_copy(update={"profiles": []})
    with pytest.raises(RuntimeError, match="profiled"):
        nodes.diagnose(first, ctx)  # the baseline's own profile is taken


def test_the_report_says_why_a_tpe_runs_incumbent_has_no_profile(state, tmp_path):
    from sg_opt.summary_build import read_profiles
    accepted = evaluated(state, 1, {"workers": 1}, "measure", ratio=0.9, accepted=True)
    notes: list[str] = []
    assert read_profiles(accepted, tmp_path, notes) == []
    assert notes == ["the TPE search does not profile each new incumbent: it reads no findings (nodes.diagnose)"]


def test_on_several_ranks_tpe_samples_only_what_a_ranked_run_can_take():
    from state_machine.proposers.tpe import distributions
    knobs = [Knob("backend", "choice", "torch", why="t", category="kernel", numerics="reorder",
                  choices=("torch", "triton", "fused"), single_process=("fused",))]
    assert distributions(knobs, 2)["backend"].choices == ("torch", "triton")
    assert distributions(knobs, 1)["backend"].choices == ("torch", "triton", "fused")
