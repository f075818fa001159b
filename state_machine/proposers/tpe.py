"""The TPE proposer: Optuna's Tree-structured Parzen Estimator over the target's knob space.

It is the oracle of ``benchmarks/search_vs_optuna.py``: a black-box search of the same knob space
whose every sample goes through the same nodes as the rule catalog's (check, numerics against the
baseline, side by side against the incumbent, decide), so its best is what a tuned search proves
under the agent's own protocol. It reads no findings and knows nothing the rules know (not even
which values need CUDA): a sample that cannot run costs it one rejection, as it would cost anyone.

The graph is resumable, so nothing is kept between calls: each call rebuilds an in-memory study
from the run's history. The baseline is trial 0 with value 1.0. A measured candidate's value is
its estimated speedup over the baseline (the incumbent's estimate at the time over the candidate's
side-by-side ratio); a candidate rejected before it was timed, or that failed while timed, gets
0.0, the worst. The user's own settings, knobs without a bounded domain, and model knobs unless
model changes are allowed, are not searched: they keep the incumbent's value.
"""

from __future__ import annotations

from typing import Any, Mapping

from state_machine.context import RunContext
from state_machine.proposers import Proposal
from state_machine.specs import config_digest
from state_machine.state import RunState
from targets.protocol import ConfigError, Knob, KnobSpace

MAX_ASKS = 64     # samples drawn per call before the search counts as exhausted
FAILED = 0.0      # the value of a candidate that never got a speedup: worse than any real one


def require_optuna():
    """The optuna module, or one sentence saying how to get it."""
    try:
        import optuna
    except ImportError:
        raise ConfigError("--search tpe needs optuna, which is not installed: pip install 'sg-opt[oracle]' "
                          "(or pip install optuna)") from None
    optuna.logging.set_verbosity(optuna.logging.WARNING)  # its per-trial lines would flood the live view
    return optuna


def searched_knobs(space: KnobSpace, allow_model_changes: bool, ranks: int = 1) -> list[Knob]:
    """The knobs TPE samples: every tunable knob (not the user's own limits) with a bounded domain, model
    knobs only when allowed."""
    return [k for k in space.tunable(ranks) if (allow_model_changes or k.numerics != "model")
            and (k.kind == "bool" or k.choices or (k.low is not None and k.high is not None))]


def distributions(knobs: list[Knob], ranks: int = 1) -> dict[str, Any]:
    """Optuna distributions of the knobs' domains on `ranks` processes: choices and bools categorical (the values
    such a run can take), numbers ranges."""
    from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

    out: dict[str, Any] = {}
    for knob in knobs:
        if knob.kind == "bool":
            # False first, as every study so far was drawn (a resumed oracle rebuilds its study from them)
            out[knob.name] = CategoricalDistribution([v for v in (False, True) if knob.runs_on(v, ranks)])
        elif knob.choices:
            out[knob.name] = CategoricalDistribution(list(knob.values(ranks)))
        elif knob.kind == "int":
            out[knob.name] = IntDistribution(int(knob.low), int(knob.high))
        else:
            out[knob.name] = FloatDistribution(float(knob.low), float(knob.high))
    return out


def normalise(space: KnobSpace, config: Mapping[str, Any], baseline: Mapping[str, Any]) -> dict[str, Any]:
    """The config with every knob that has no effect under it set to the baseline's value, so two
    samples that differ only there are one configuration (repeated until no activity changes)."""
    config = dict(config)
    changed = True
    while changed:
        changed = False
        for knob in space:
            if not knob.is_active(config) and config[knob.name] != baseline[knob.name]:
                config[knob.name], changed = baseline[knob.name], True
    return config


def observations(state: RunState, space: KnobSpace) -> list[tuple[dict[str, Any], float, str | None]]:
    """(normalised resolved config, estimated speedup over the baseline, digest) of the baseline and of
    every knob-only candidate whose config resolves, in order; the incumbent's estimate is replayed."""
    baseline = space.resolve(state.baseline_config)
    seen = [(baseline, 1.0, config_digest(baseline, {}))]
    incumbent = 1.0
    for e in state.history:
        verdict = e.verdict
        timed = verdict.stage == "measure" and verdict.ratio
        value = incumbent / verdict.ratio if timed else FAILED
        if verdict.accepted:
            incumbent /= verdict.ratio or 1.0  # as the decide node does
        if e.candidate.kernels:
            continue  # its time is the kernels', not the knobs'
        try:
            resolved = space.resolve(e.config)
        except ConfigError:
            continue
        seen.append((normalise(space, resolved, baseline), value, e.digest))
    return seen


def rebuild_study(state: RunState, space: KnobSpace, seen: list | None = None):
    """An in-memory study holding every observation as a completed trial, and its distributions."""
    optuna = require_optuna()
    seen = observations(state, space) if seen is None else seen
    dists = distributions(searched_knobs(space, state.allow_model_changes, state.ranks), state.ranks)
    sampler = optuna.samplers.TPESampler(seed=state.seed + len(state.history))
    study = optuna.create_study(direction="maximize", sampler=sampler)
    for config, value, _ in seen:
        params = {name: config[name] for name in dists}
        study.add_trial(optuna.trial.create_trial(params=params, distributions=dists, value=value))
    return study, dists


def propose_tpe(state: RunState, ctx: RunContext, limit: int = 1) -> list[Proposal]:
    """Up to ``limit`` new configurations sampled by TPE (more than one to fill the lanes of --gpus), as
    patches against the incumbent; [] when none is found in MAX_ASKS samples (each invalid or already
    evaluated sample is told its known value)."""
    space = ctx.target.knob_space
    seen = observations(state, space)
    study, dists = rebuild_study(state, space, seen)
    baseline, incumbent = space.resolve(state.baseline_config), space.resolve(state.incumbent.config)
    known = {digest: value for _, value, digest in seen if digest}
    known.setdefault(config_digest(incumbent, state.incumbent.kernels), state.incumbent.est_speedup)
    chosen: list[Proposal] = []
    taken: set[str] = set()
    for _ in range(MAX_ASKS):
        trial = study.ask(dists)
        try:
            resolved = space.resolve(normalise(space, {**incumbent, **trial.params}, baseline))
        except ConfigError:
            study.tell(trial, FAILED)
            continue
        digest = config_digest(resolved, state.incumbent.kernels)
        if digest in known:
            study.tell(trial, known[digest])
            continue
        if digest in taken:
            study.tell(trial, state=require_optuna().trial.TrialState.FAIL)  # no value: TPE learns nothing from it
            continue
        patch = {name: value for name, value in resolved.items() if value != incumbent[name]}
        changes = ", ".join(f"{k}={v!r}" for k, v in patch.items())
        chosen.append(Proposal(kind="knob", patch=patch, proposer="tpe",
                               rationale=f"a TPE sample (Optuna, trial {trial.number} of a study rebuilt from the "
                                         f"baseline and {len(seen) - 1} evaluated candidates): {changes}"))
        if len(chosen) == limit:
            break
        taken.add(digest)  # the batch's next sample must differ (the chosen trials stay running in the study)
    return chosen


class TPESearch:
    """``--search tpe``: the oracle the rules are compared with; it reads no findings, so a new incumbent is not
    profiled for it (nodes.diagnose)."""

    name = "tpe"
    uses_llm = False
    reads_findings = False

    def check_available(self) -> None:
        require_optuna()

    def propose(self, state: RunState, ctx: RunContext, limit: int) -> list[Proposal]:
        return propose_tpe(state, ctx, limit)
