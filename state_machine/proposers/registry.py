"""Which proposer a run gets, by name: the one table the propose and diagnose nodes and ``sg-opt optimize``'s
checks read, so that adding a search is a class behind ``Proposer`` and a line here, not a branch in each of them.

The offline tier runs the search ``--search`` names (the proposers that need no model); every other tier has a
model and asks it.
"""

from __future__ import annotations

from state_machine.context import ProposerPolicy
from state_machine.proposers.base import Proposer
from state_machine.proposers.llm import LLMProposer
from state_machine.proposers.offline import RuleCatalog
from state_machine.proposers.tpe import TPESearch
from targets.protocol import ConfigError

OFFLINE_TIER = "offline"
PROPOSERS: dict[str, Proposer] = {p.name: p for p in (RuleCatalog(), TPESearch(), LLMProposer())}
LLM = LLMProposer.name
DEFAULT_SEARCH = ProposerPolicy.search


def searches() -> tuple[str, ...]:
    """The names ``--search`` takes: the proposers that need no model, in the table's order."""
    return tuple(name for name, proposer in PROPOSERS.items() if not proposer.uses_llm)


def proposer_name(tier: str, search: str) -> str:
    return search if tier == OFFLINE_TIER else LLM


def proposer_for(policy: ProposerPolicy) -> Proposer:
    """The proposer of a run with this policy (one ``check_proposer`` accepted)."""
    name = proposer_name(policy.tier, policy.search)
    if name not in PROPOSERS:
        raise ConfigError(f"--search must be one of {', '.join(searches())}, not {name!r}")
    return PROPOSERS[name]


def check_proposer(search: str, tier: str) -> Proposer:
    """The proposer a run of ``tier`` with ``--search search`` gets; ConfigError, in one sentence, unless that search
    exists, runs on that tier and has what it needs installed."""
    if search not in searches():
        raise ConfigError(f"--search must be one of {', '.join(searches())}, not {search!r}")
    if tier != OFFLINE_TIER and search != DEFAULT_SEARCH:
        raise ConfigError(f"--search {search} replaces the offline tier's rule catalog; it cannot run with "
                          f"--tier {tier}")
    proposer = PROPOSERS[proposer_name(tier, search)]
    proposer.check_available()
    return proposer
