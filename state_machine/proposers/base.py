"""The one interface every search plugs in behind, as Optuna's samplers do behind ``BaseSampler``.

The propose node asks the run's proposer for candidates and knows nothing else about it; ``sg-opt optimize`` asks
it, before any worker starts, whether it can run here. A new search is a class with these members and one entry in
``proposers.registry``; what every one must do is ``tests/state_machine/test_proposer_contract.py``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, runtime_checkable

from state_machine.proposers import Proposal

if TYPE_CHECKING:
    from state_machine.context import RunContext
    from state_machine.state import RunState


@runtime_checkable
class Proposer(Protocol):
    """Turns the run's state (findings, knob space, history) into candidate changes."""

    name: str  # how a run asks for it: ``--search NAME`` on the offline tier, "llm" on a tier with a model
    uses_llm: bool  # asks the tier's model (metered by the ledger) rather than searching on its own
    reads_findings: bool  # False: the diagnose node does not profile each new incumbent for it

    def check_available(self) -> None:
        """Raise ConfigError, in one sentence that says how to fix it, when something it needs is missing here."""
        ...

    def propose(self, state: RunState, ctx: RunContext, limit: int) -> list[Proposal]:
        """The next candidates, best first; [] when nothing promising is left (the run then converges).

        ``limit``: how many the run evaluates at once (one per lane of --gpus). A search returns at most that many;
        the LLM returns what one call of its tier asks for (``candidates_per_iteration``), which the node queues.
        A search never proposes a configuration the run has already evaluated; the same state gives the same
        proposals. The LLM may raise BudgetExceeded, DeadlineReached or LLMError, which the node turns into a stop or
        a retry."""
        ...
