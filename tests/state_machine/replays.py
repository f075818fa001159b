"""Real H200 runs replayed into a RunState, for the proposer tests.

A recorded run is two kinds of fixture, both written by ``regen_replays.py`` from the run's directory: its decided
candidates in ``tests/fixtures/replays/<name>.json`` (a ``Replay``), and its profile of the incumbent after
candidate #N in ``tests/fixtures/<name>_after_<N>.json``. ``recorded`` puts the two together where the run stood;
``sound`` is what every offline proposal on any replay must satisfy, however the rules are ranked.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable

from pydantic import BaseModel, Field

from profilers.findings import findings as profile_findings
from profilers.records import ProfileResult
from state_machine.context import RunContext
from state_machine.proposers import Proposal, patch_pairs
from state_machine.state import Evaluated, RunState, Verdict
from tests.state_machine.records import candidate

FIXTURES = Path(__file__).parents[1] / "fixtures"
REPLAYS = FIXTURES / "replays"
REPLAY_VERSION = 1
RETRIED = "tried again"  # how a proposal that repeats a rejected change begins its rationale (proposers.retries)

LARGE_CACHED_BASE = {"embedding_placement": "host", "embedding_grad_mode": "sparse"}  # haste_rec_large_cached.toml


class Step(BaseModel):
    """One decided candidate of a recorded run, as much of it as the proposers read."""

    id: int
    patch: dict[str, Any]
    accepted: bool
    stage: str = "measure"
    numerics_class: str | None = Field(None, description="the class whose bands it was held to")
    ratio: float | None = None
    ci_low: float | None = None
    ci_high: float | None = None
    proposer: str = "replayed"
    reason: str = "as in that run"

    @classmethod
    def of(cls, step: Step | tuple) -> Step:
        """A step, or the shorthand tests write by hand: (id, patch, accepted[, measured ratio, or (ratio, interval
        low, interval high), or the numerics class whose bands it broke at validation])."""
        if isinstance(step, Step):
            return step
        cid, patch, accepted, *rest = step
        ratio = rest[0] if rest else None
        if isinstance(ratio, str):
            return cls(id=cid, patch=patch, accepted=accepted, stage="validate", numerics_class=ratio)
        ratio, low, high = ratio if isinstance(ratio, tuple) else (ratio, None, None)
        return cls(id=cid, patch=patch, accepted=accepted, ratio=ratio, ci_low=low, ci_high=high)


class Replay(BaseModel):
    """A recorded run's decided candidates, in order."""

    version: int = REPLAY_VERSION
    run: str = Field(description="the run id, or the run in words where its directory is gone")
    source: str = Field(description="how this file was made")
    target: str = "haste-rec"
    size: str
    device: str = "cuda"
    base: dict[str, Any] = Field(default_factory=dict, description="the run's baseline config (its --config)")
    history: list[Step]


def load(name: str) -> Replay:
    return Replay.model_validate_json((REPLAYS / f"{name}.json").read_text())


def history(name: str) -> list[Step]:
    return load(name).history


def until_next_win(steps: list[Step], after: int) -> list[Step]:
    """The steps up to the first win after candidate #after: what the run had tried while that profile's
    incumbent held."""
    later = [s for s in steps if s.accepted and s.id > after]
    return [s for s in steps if not later or s.id < later[0].id]


def replay_points() -> list[tuple[str, int]]:
    """(name, N) of every recorded run with a profile after its candidate #N."""
    return sorted((path.stem, int(profile.stem.rsplit("_after_", 1)[1])) for path in REPLAYS.glob("*.json")
                  for profile in FIXTURES.glob(f"{path.stem}_after_*.json"))


def recorded(state: RunState, ctx: RunContext, name: str, after: int,
             steps: Iterable[Step | tuple] | None = None) -> RunState:
    """Recorded run `name` where it stood with the profile taken after candidate #after: its history up to its next
    win, or `steps`."""
    replay = load(name)
    steps = until_next_win(replay.history, after) if steps is None else steps
    return replayed(state, ctx, f"{name}_after_{after}.json", replay.size, replay.base, steps, replay.device)


def replayed(state: RunState, ctx: RunContext, profile: str, size: str, base: dict, steps: Iterable[Step | tuple],
             device: str = "cuda") -> RunState:
    """The state of a real run: its history from `steps` (``Step.of``), each candidate measured against the
    incumbent of its time, and the findings of `profile` (that run's profile of its incumbent)."""
    result = ProfileResult.model_validate_json((FIXTURES / profile).read_text())
    history, config, incumbent, est = [], dict(base), None, 1.0
    for step in map(Step.of, steps):
        verdict = Verdict(accepted=step.accepted, stage=step.stage, reason=step.reason, ratio=step.ratio,
                          ci_low=step.ci_low, ci_high=step.ci_high, numerics_class=step.numerics_class)
        history.append(Evaluated(candidate=candidate(step.id, patch=step.patch, proposer=step.proposer),
                                 incumbent_id=incumbent, config={**config, **step.patch}, verdict=verdict))
        if step.accepted:
            config, incumbent, est = {**config, **step.patch}, step.id, est / (step.ratio or 1.0)
    resolved = ctx.target.knob_space.resolve(config)
    assert {k: resolved[k] for k in config} == {k: result.config[k] for k in config}  # the profile's own config
    return state.model_copy(update={
        "device": device, "size": size, "baseline_config": base, "history": history,
        "incumbent": state.incumbent.model_copy(update={"config": config, "from_candidate": incumbent,
                                                        "est_speedup": est}),
        "findings": profile_findings(result.coarse, None, result.counters, resolved, ctx.target)})


def sound(at: RunState, ctx: RunContext, proposals: list[Proposal]) -> None:
    """Assert what no ranking of the rules may break: each proposal a valid knob patch that changes the incumbent,
    none twice, none a configuration the run already evaluated, no model change unless allowed, and a rejected
    change again only as a retry that says why."""
    space = ctx.target.knob_space
    current = space.resolve(at.incumbent.config)
    evaluated = [space.resolve(e.config) for e in at.history if not e.candidate.kernels]
    rejected = {patch_pairs(e.candidate.patch) for e in at.history if not e.verdict.accepted}
    patches = [p.patch for p in proposals]
    assert len({patch_pairs(p) for p in patches}) == len(patches), "a patch proposed twice"
    for p in proposals:
        assert p.kind == "knob" and p.proposer.startswith("offline:") and p.patch, p
        for knob, value in p.patch.items():
            space[knob].validate(value)
        resolved = space.resolve({**at.incumbent.config, **p.patch})
        assert resolved != current and resolved not in evaluated, f"{p.patch}: evaluated already"
        changed = [k for k in p.patch if resolved[k] != current[k]]
        assert at.allow_model_changes or all(space[k].numerics != "model" for k in changed), f"{p.patch}: model"
        assert patch_pairs(p.patch) not in rejected or p.rationale.startswith(RETRIED), f"{p.patch}: rejected before"


def patches(proposals: list[Proposal]) -> list[dict[str, Any]]:
    return [p.patch for p in proposals]


def rank(proposals: list[Proposal], patch: dict[str, Any]) -> int:
    """Where `patch` is in the proposals (0 first); fails naming the first ones when it is not there."""
    found = patches(proposals)
    assert patch in found, f"{patch} not proposed; the first ones: {found[:8]}"
    return found.index(patch)


def within(proposals: list[Proposal], n: int, *wanted: dict[str, Any]) -> None:
    """Assert each patch of `wanted` is among the first `n` proposals."""
    for patch in wanted:
        assert rank(proposals, patch) < n, f"{patch} is #{rank(proposals, patch) + 1}, not in the first {n}: " \
                                           f"{patches(proposals)[:n]}"


S22_LARGE_CACHED_HISTORY = history("h200_large_cached_s22")  # the 2026-12-03 x7.29 `large-cached` run
S27_LARGE_CACHED_HISTORY = history("h200_large_cached_s27")  # the 2026-12-03 x12.37 `large-cached` run
S24_LARGE_HISTORY = history("h200_large_s24")  # the 2026-12-03 x9.72 `large` run, to its last win
