"""What the nodes need besides the state, handed in by whoever builds the graph (``sg_opt``).

Nothing here is checkpointed: the target object, the LLM client and the ledger are rebuilt on
resume from the run's saved request. Keeping them out of the state keeps the state plain data.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from state_machine.llm_interfaces import LLM, Ledger
from state_machine.portable import portable
from targets.protocol import Target


@dataclass(frozen=True)
class ProposerPolicy:
    """The tier's rules for proposing: how many candidates, which kinds, which model settings."""

    tier: str = "offline"
    search: str = "rules"  # the offline tier's proposer, by name: proposers.registry.searches()
    candidates_per_iteration: int = 1
    kinds: tuple[str, ...] = ("knob",)
    reasoning_effort: str | None = None
    max_output_tokens: int = 8000
    reply_repairs: int = 1  # turns that send a malformed reply's error back before the proposal fails
    kernel_repairs: int = 0  # rounds that send a rejected or slower kernel back, per rewrite


@dataclass
class RunContext:
    target: Target
    policy: ProposerPolicy = field(default_factory=ProposerPolicy)
    llm: LLM | None = None
    ledger: Ledger | None = None
    write_report: Callable[[Any], list[str]] | None = None  # RunState -> files written
    on_event: Callable[[dict[str, Any]], None] | None = None  # live view
    pause_at: float | None = None  # time.monotonic() by which this invocation pauses (--pause-after)
    nodes_started: int = 0  # nodes this invocation has started: the first always starts, so every one progresses

    def event(self, run_dir: str, what: str, **fields: Any) -> None:
        """Append one line to the run's events.jsonl (and show it live): the run's own log."""
        record = {"t": time.time(), "event": what, **fields}
        path = Path(run_dir) / "events.jsonl"
        written = portable(json.loads(json.dumps(record, default=str)), run_dir)  # no absolute path, no trace
        with open(path, "a", encoding="utf-8") as out:
            out.write(json.dumps(written) + "\n")
            out.flush()
        if self.on_event is not None:
            self.on_event(record)
