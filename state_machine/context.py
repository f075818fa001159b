"""What the nodes need besides the state, handed in by whoever builds the graph (``sg_opt``).

Nothing here is checkpointed: the target object, the LLM client, the ledger and the pool of workers started ahead
are rebuilt on resume from the run's saved request. Keeping them out of the state keeps the state plain data.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from state_machine.events import EVENTS_FILE, Event, event_line
from state_machine.llm_interfaces import LLM, Ledger
from state_machine.portable import portable
from targets.protocol import Target
from validators.started_ahead import WorkerPool


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
    on_event: Callable[[Event], None] | None = None  # live view
    # timing workers started during a candidate's validation for its measurement; whoever builds the run closes it
    pool: WorkerPool = field(default_factory=WorkerPool)
    pause_at: float | None = None  # time.monotonic() by which this invocation pauses (--pause-after)
    nodes_started: int = 0  # nodes this invocation has started: the first always starts, so every one progresses

    def event(self, run_dir: str, record: Event) -> None:
        """Append one line to the run's events.jsonl (and show it live): the run's own log."""
        written = portable(event_line(record), run_dir)  # no absolute path, no trace
        with open(Path(run_dir) / EVENTS_FILE, "a", encoding="utf-8") as out:
            out.write(json.dumps(written) + "\n")
            out.flush()
        if self.on_event is not None:
            self.on_event(record)
