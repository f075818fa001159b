"""The offline proposer: a catalog of rules, no LLM, $0.

Each rule is triggered by a finding category and proposes a knob patch that is known to attack
that kind of bottleneck (sparse gradients for dense gradients of large tables, worker processes for
data waits, a fused optimizer for an un-fused one, ...). The catalog is the target's own rules
(``Target.rules``) and the generic ones over the job adapter's knobs (``state_machine.rules``). A rule's
*plausibility* is the share of the finding's Amdahl gain it can be expected to realise, so its
expected gain is ``1 + (finding.amdahl_gain - 1) * plausibility``, from the finding among its triggers that
promises the most; candidates are tried in that order. A rule that cuts the host work of some phases only
(``host_phases``: the dense CUDA graphs replay the encoder, head, tail and losses, not the embeddings' cache
moves) expects, from a launch/host-bound finding, only those phases' share of the host's work: on one H200 run
60% of it was in `embed`, and the graphs had measured no difference there.
Likewise a kernel or precision rule (``device_only``) expects, from a phase's finding, only the share of the phase
the device works (``Finding.device_fraction``): there `embed` ran 1.61 ms on the device in 12.07 on the host, and
faster embedding kernels measured 1.376 (slower).

A rule whose knobs a target lacks is skipped, and so is one whose ``requires`` the resolved incumbent
does not meet (a rule never proposes a backend the incumbent already went past). For any target, a
generic fallback then sweeps the other values of the knobs whose category attacks a finding
(``Finding.knob_categories``), a low plausibility shared among the values of a finding's sweep, so a
user's own target is searched too; the knob categories that no finding names are swept last, at the
gain of a sweep no finding points at.

Learning within the run: a change that was rejected is not proposed again, nor any part of it (a
rejected ``{a, b}`` rules out ``{a}``), but a larger change that holds it is: host tables with a fused
update can be slower while the device cache with the same fused update is SparseGear's fast path. The
exceptions, the changes worth one more try, are in ``state_machine.proposers.retries``. The
sweep leaves out the values the incumbent went past: one an accepted change moved a knob away from (it
measured slower right there), and one a rule would only propose from behind (from the fused Triton tail,
neither the slots nor the unfused Triton tail). No configuration is proposed twice.

Changes that leaned faster without clearing the noise floor are also joined into one candidate
(``state_machine.proposers.joined``).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Iterator, Mapping

from profilers.findings import attacked_by
from profilers.records import Finding
from state_machine.context import RunContext
from state_machine.proposers import Pairs, Proposal, patch_pairs
from state_machine.proposers.joined import JOINED, joined_proposals
from state_machine.proposers.retries import retryable
from state_machine.rules.catalog import catalog, device_only, steps_forward
from state_machine.state import RunState
from targets.protocol import ConfigError, Knob, KnobSpace
from targets.tuning import Rule

GENERIC_PLAUSIBILITY = 0.15
NO_FINDING_GAIN = 1.01  # the expected gain of a sweep that no finding points at


def _tried(state: RunState, space: KnobSpace,
           again: Mapping[Pairs, str]) -> tuple[list[tuple[Pairs, bool]], list[dict[str, Any]]]:
    """The rejected candidates' patches as (knob, value) pairs (less those in ``again``, to try once more), each
    with whether it rules out its parts too (a joined one does not: proposers.joined), and the resolved configs
    of every knob-only candidate (a config that does not resolve, e.g. an LLM's unknown knob rejected at check,
    is skipped)."""
    rejected = [(patch_pairs(e.candidate.patch), e.candidate.proposer not in JOINED) for e in state.history
                if not e.verdict.accepted and e.candidate.patch and patch_pairs(e.candidate.patch) not in again]
    seen = []
    for e in state.history:
        if not e.candidate.kernels:
            try:
                seen.append(space.resolve(e.config))
            except ConfigError:
                continue
    return rejected, seen


def _ruled_out(pairs: Pairs, rejected: list[tuple[Pairs, bool]]) -> bool:
    """Whether a rejection rules these (knob, value) pairs out: the same change, or a part of a rejected change
    that rules out its parts (see ``_tried``)."""
    return any(pairs == r or (parts and pairs <= r) for r, parts in rejected)


def _went_past(state: RunState, space: KnobSpace) -> set[tuple[str, str]]:
    """(knob, value) pairs that an accepted knob change moved the incumbent away from."""
    configs = {e.candidate.id: e.config for e in state.history}
    past = set()
    for e in state.history:
        if not e.verdict.accepted:
            continue
        try:
            before = space.resolve(configs.get(e.incumbent_id, state.baseline_config)
                                   if e.incumbent_id is not None else state.baseline_config)
        except ConfigError:
            continue
        past |= {(k, repr(before[k])) for k, v in e.candidate.patch.items() if k in before and before[k] != v}
    return past


def _applicable(space: KnobSpace, state: RunState, current: Mapping[str, Any], patch: Mapping[str, Any]) -> bool:
    """Valid, every knob it sets in effect under the patched config (``Knob.active_when``), a real change from
    the resolved incumbent ``current``, and not a model change unless allowed."""
    names = {k.name for k in space}
    if not set(patch) <= names:
        return False
    try:
        for name, value in patch.items():
            space[name].validate(value)
        patched = space.resolve({**state.incumbent.config, **patch})
    except ConfigError:
        return False
    if not all(space[name].is_active(patched) for name in patch):  # a knob that does nothing there
        return False
    if not all(space[name].runs_on(value, state.ranks) for name, value in patch.items()):  # one process only
        return False
    changes = {k: v for k, v in patch.items() if current[k] != v}
    if not changes:
        return False
    return state.allow_model_changes or all(space[k].numerics != "model" for k in changes)


def _gain(finding: Finding | None, plausibility: float, rule: Rule | None = None) -> float:
    if finding is None:
        return NO_FINDING_GAIN
    if rule is not None and rule.host_phases and finding.host_by_phase:  # launch/host-bound: these phases' host work
        plausibility *= sum(finding.host_by_phase.get(phase, 0.0) for phase in rule.host_phases)
    if rule is not None and rule.device_only and finding.device_fraction is not None:  # a host-bound phase
        plausibility *= finding.device_fraction
    return 1.0 + (finding.amdahl_gain - 1.0) * plausibility


def _rule_proposals(state: RunState, space: KnobSpace, findings: list[Finding],
                    rules: tuple[Rule, ...]) -> Iterator[Proposal]:
    current = space.resolve(state.incumbent.config)
    for rule in rules:
        if state.device_kind not in rule.devices:
            continue
        if any(current.get(k) not in allowed for k, allowed in rule.requires.items()):
            continue
        triggers = [f for f in findings if f.category in rule.triggers]
        if not triggers:
            continue
        # the finding that promises the rule the most (its first in the findings' order on a tie)
        trigger = max(triggers, key=lambda f: _gain(f, rule.plausibility, rule))
        yield Proposal(kind="knob", patch=dict(rule.patch), proposer=f"offline:{rule.name}",
                       expected_gain=_gain(trigger, rule.plausibility, rule),
                       rationale=f"{rule.why}; triggered by {trigger.category}: {trigger.evidence}")


def _generic_proposals(state: RunState, space: KnobSpace, findings: list[Finding],
                       rules: tuple[Rule, ...]) -> Iterator[Proposal]:
    """One proposal per sweep value; a finding's sweep shares GENERIC_PLAUSIBILITY among its values (a blind
    sweep of n values holds one winner at best), so a big finding's long sweep does not go before the rules
    that answer a smaller one. The knob categories no finding attacks are swept after them all."""
    current = space.resolve(state.incumbent.config)
    sweepable = _sweepable(current, state.device_kind, _went_past(state, space), rules)
    attacked: set[str] = set()
    for finding in findings:
        categories = attacked_by(finding)
        attacked |= set(categories)
        values = [pair for pair in _sweep_values(space, state, current, categories) if sweepable(*pair)]
        for knob, value in values:
            yield Proposal(kind="knob", patch={knob.name: value}, proposer="offline:sweep",
                           expected_gain=_gain(finding, GENERIC_PLAUSIBILITY / len(values)),
                           rationale=f"sweep {knob.name} = {value!r} ({knob.why}); {finding.category}: "
                                     f"{finding.evidence}")
    unattacked = tuple({k.category for k in space} - attacked)
    for knob, value in _sweep_values(space, state, current, unattacked):
        if sweepable(knob, value):
            yield Proposal(kind="knob", patch={knob.name: value}, proposer="offline:sweep",
                           expected_gain=_gain(None, 0.0),
                           rationale=f"sweep {knob.name} = {value!r} ({knob.why}); no finding points at "
                                     f"{knob.category} knobs, so they are tried last")


def _sweep_values(space: KnobSpace, state: RunState, current: Mapping[str, Any],
                  categories: tuple[str, ...]) -> list[tuple[Knob, Any]]:
    """Every other value of the tunable knobs of these categories that have an effect under the incumbent."""
    return [(knob, value) for knob in space.tunable(state.ranks) if knob.category in categories
            and knob.is_active(current) for value in knob.values(state.ranks) if value != current[knob.name]]


def _sweepable(current: Mapping[str, Any], device: str, past: set[tuple[str, str]], rules: tuple[Rule, ...]):
    """A test of (knob, value): not a device-only value elsewhere, not a value the incumbent went past, and not one
    a rule proposes only from elsewhere."""
    devices, forward = device_only(rules), steps_forward(rules)

    def sweepable(knob: Knob, value: Any) -> bool:
        pair = (knob.name, repr(value))
        return (device in devices.get(pair, (device,)) and pair not in past
                and current[knob.name] in forward.get(pair, (current[knob.name],)))
    return sweepable


def propose_offline(state: RunState, ctx: RunContext, limit: int = 1) -> list[Proposal]:
    """The ``limit`` most promising untried knob patches (empty when nothing is left to try)."""
    space = ctx.target.knob_space
    again = retryable(state, space)
    rejected, seen = _tried(state, space, again)
    current = space.resolve(state.incumbent.config)
    rules = catalog(ctx.target)
    ranked = sorted(list(_rule_proposals(state, space, state.findings, rules))
                    + list(_generic_proposals(state, space, state.findings, rules))
                    + list(joined_proposals(state, space)),
                    key=lambda p: -(p.expected_gain or 0.0))  # stable: catalog order breaks ties
    chosen: list[Proposal] = []
    for proposal in ranked:
        config = {**state.incumbent.config, **proposal.patch}
        if (not _applicable(space, state, current, proposal.patch)
                or _ruled_out(patch_pairs(proposal.patch), rejected)
                or space.resolve(config) in seen
                or any(p.patch == proposal.patch for p in chosen)):
            continue
        if (why := again.get(patch_pairs(proposal.patch))) is not None:
            proposal = replace(proposal, rationale=f"{why}; {proposal.rationale}")
        chosen.append(proposal)
        if len(chosen) == limit:
            break
    return chosen


class RuleCatalog:
    """The offline tier's default search (``--search rules``): the catalog above, no LLM, $0."""

    name = "rules"
    uses_llm = False
    reads_findings = True

    def check_available(self) -> None:
        """Nothing to import: the rules are plain Python over the target's knobs."""

    def propose(self, state: RunState, ctx: RunContext, limit: int) -> list[Proposal]:
        return propose_offline(state, ctx, limit)
