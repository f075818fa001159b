"""Proposers turn findings, the knob space and the history into candidate changes.

``offline`` is a rule catalog (no LLM, $0); ``llm`` asks a model for a JSON-schema reply; ``tpe``
is Optuna's TPE sampler over the knob space (the offline tier's ``--search tpe``, an oracle to
compare the rules with). Each sits behind the ``Proposer`` protocol (``base``), and a run finds its own by
name in ``registry``. All return ``Proposal`` records; the propose node numbers them, writes kernel sources
into the run directory and queues them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping


@dataclass(frozen=True)
class Proposal:
    kind: str  # "knob" or "kernel"
    patch: dict[str, Any]
    rationale: str
    proposer: str
    kernel_sources: dict[str, str] = field(default_factory=dict)  # slot -> source text
    expected_gain: float | None = None
    repair_of: int | None = None  # the rejected kernel candidate this one repairs (proposers.kernel_repair)


Pairs = frozenset[tuple[str, str]]


def patch_pairs(patch: Mapping[str, Any]) -> Pairs:
    """A knob patch as (knob, repr(value)) pairs: hashable, and one patch is part of another by ``<=``."""
    return frozenset((k, repr(v)) for k, v in patch.items())
