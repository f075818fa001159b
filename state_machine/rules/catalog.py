"""The rules a run tries: the target's own first, then the generic ones over knobs its own rules leave alone.

A target whose rules set a knob owns that knob's rules (it knows what the knob costs there better than a generic
figure does), so a target that brings rules for the shared knob names (the bundled trainer does, for loader
workers, pinning, optimizer implementation and precision) is proposed exactly its own for them.
"""

from __future__ import annotations

from typing import Any

from state_machine.rules.generic import GENERIC_RULES
from targets.protocol import Target
from targets.tuning import Rule


def catalog(target: Target) -> tuple[Rule, ...]:
    own = tuple(target.rules)
    owned = {name for rule in own for name in rule.patch}
    return own + tuple(rule for rule in GENERIC_RULES if not owned & set(rule.patch))


def device_only(rules: tuple[Rule, ...]) -> dict[tuple[str, str], tuple[str, ...]]:
    """(knob, value) -> the devices where a rule says it applies; the generic sweep respects it too."""
    return {(name, repr(value)): rule.devices for rule in rules if set(rule.devices) != {"cpu", "cuda"}
            for name, value in rule.patch.items()}


def steps_forward(rules: tuple[Rule, ...]) -> dict[tuple[str, str], tuple[Any, ...]]:
    """(knob, value) -> the incumbent values a rule proposes it from (its ``requires`` on that knob): elsewhere a
    sweep of that value would be a step back."""
    return {(name, repr(value)): rule.requires[name] for rule in rules for name, value in rule.patch.items()
            if name in rule.requires}
