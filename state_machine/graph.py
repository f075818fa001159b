"""The agent's graph: nodes and edges in one place, checkpointed to SQLite in the run directory.

    setup -> baseline -> diagnose -> propose -> check -> validate -> measure -> decide
                            ^           ^                                       |
                            |           +------------- rejected ----------------+
                            +------------------------- accepted ----------------+
                                        propose -> evaluate_batch -> (as decide)    with --gpus: one candidate
                                                                                    per lane at once
                                                           stop (budget, converged) -> report

After each node's checkpoint the state is also written to ``state.json`` in the run directory
(``state_file``), the run's own record of its state that reports read.

Any node can stop the run by setting ``stop_reason``; the edges then lead to ``report``. Every
node's wall time is added to ``elapsed_s`` (so ``--max-minutes`` counts across resumes) and to that
node's entry of ``node_s`` (where a run's minutes went), and the ledger's spend is copied into the state
after each node. Under ``--pause-after`` a node that would not fit in what is left of it does not start:
the run pauses at its last checkpoint (``time_budget.Paused``). The first node of an invocation always starts,
so that one longer than the whole allowance cannot pause a run for ever.
"""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path
from typing import Any, Callable

from langgraph.checkpoint.serde.jsonplus import JsonPlusSerializer
from langgraph.checkpoint.sqlite import SqliteSaver
from langgraph.graph import END, START, StateGraph
from pydantic import BaseModel

from state_machine import batch, events, nodes
from state_machine import state as state_module
from state_machine.context import RunContext
from state_machine.node_clock import NodeClock, lost_time
from state_machine.state import FLAT_IN_FLIGHT, Candidate, RunState
from state_machine.state_file import write_state
from state_machine.time_budget import Paused, pause_reason

CHECKPOINT_FILE = "checkpoints.sqlite"
# The state's own record types, which the checkpoint serializer may rebuild on resume: every model defined in
# state_machine.state (a hand-kept list missed a new one, and resumes then lost it), and the findings.
STATE_TYPES = [("state_machine.state", name) for name, obj in vars(state_module).items()
               if isinstance(obj, type) and issubclass(obj, BaseModel) and obj.__module__ == state_module.__name__
               ] + [("profilers.records", "Finding")]


def _timed(node: Callable[[RunState, RunContext], dict[str, Any]], ctx: RunContext) -> Callable:
    name = node.__name__

    def run(state: RunState) -> dict[str, Any]:
        start = time.monotonic()
        if (ctx.pause_at is not None and ctx.nodes_started
                and (why := pause_reason(state, name, ctx.pause_at - start)) is not None):
            ctx.event(state.run_dir, events.Paused(node=name, reason=why))
            raise Paused(name, why, state.run_dir)
        ctx.nodes_started += 1
        with NodeClock(state.run_dir, name):  # a node that never returns has its time booked on resume
            updates = node(state, ctx)
        updates.update(state.spent_in(name, time.monotonic() - start))
        if ctx.ledger is not None:
            updates["spent_usd"] = ctx.ledger.spent_usd()
        return updates
    run.__name__ = name
    return run


def _stopped_or(next_node: str) -> Callable[[RunState], str]:
    def route(state: RunState) -> str:
        return "report" if state.stop_reason else next_node
    return route


def _after_propose(state: RunState) -> str:
    if state.stop_reason:
        return "report"
    if state.batch:
        return "evaluate_batch"
    return "check" if state.current is not None else "propose"


def _rejected_or(next_node: str) -> Callable[[RunState], str]:
    def route(state: RunState) -> str:
        return "decide" if state.current.verdict is not None else next_node
    return route


def _after_decide(state: RunState) -> str:
    accepted = state.history[-1].verdict.accepted
    if nodes.limit_reason(state, profile_next=accepted) is not None:
        return "propose"  # propose records the stop reason, then the run reports
    return "diagnose" if accepted else "propose"


def build(ctx: RunContext) -> StateGraph:
    graph = StateGraph(RunState)
    for node in (nodes.setup, nodes.baseline, nodes.diagnose, nodes.propose, nodes.check, nodes.validate,
                 nodes.measure, nodes.decide, batch.evaluate_batch, nodes.report):
        graph.add_node(node.__name__, _timed(node, ctx))
    graph.add_edge(START, "setup")
    graph.add_conditional_edges("setup", _stopped_or("baseline"), ["baseline", "report"])
    graph.add_conditional_edges("baseline", _stopped_or("diagnose"), ["diagnose", "report"])
    graph.add_edge("diagnose", "propose")
    graph.add_conditional_edges("propose", _after_propose, ["check", "evaluate_batch", "propose", "report"])
    graph.add_conditional_edges("check", _rejected_or("validate"), ["validate", "decide"])
    graph.add_conditional_edges("validate", _rejected_or("measure"), ["measure", "decide"])
    graph.add_edge("measure", "decide")
    graph.add_conditional_edges("decide", _after_decide, ["diagnose", "propose"])
    graph.add_conditional_edges("evaluate_batch", _after_decide, ["diagnose", "propose"])
    graph.add_edge("report", END)
    return graph


def open_checkpointer(run_dir: str | Path) -> SqliteSaver:
    conn = sqlite3.connect(str(Path(run_dir) / CHECKPOINT_FILE), check_same_thread=False)
    return SqliteSaver(conn, serde=JsonPlusSerializer(allowed_msgpack_modules=STATE_TYPES))


def compile_graph(ctx: RunContext, run_dir: str | Path):
    return build(ctx).compile(checkpointer=open_checkpointer(run_dir))


def thread(run_id: str) -> dict[str, Any]:
    # Each candidate takes 5 nodes; the default limit of 25 super-steps would stop a run after 4.
    return {"configurable": {"thread_id": run_id}, "recursion_limit": 100_000}


def run(ctx: RunContext, state: RunState | None, run_dir: str | Path, run_id: str,
        on_update: Callable[[str, RunState], None] | None = None) -> RunState:
    """Start a run from ``state``, or resume ``run_id`` from its last checkpoint when ``state`` is None.

    Each node's checkpoint is written before the next node starts (durability "sync"), so a run
    killed at any point loses at most the node in flight; state.json follows each checkpoint.
    """
    app = compile_graph(ctx, run_dir)
    config = thread(run_id)
    state = _book_lost_time(ctx, app, config, state, run_dir)
    for update in app.stream(state, config, stream_mode="updates", durability="sync"):
        saved = _save_state_file(app, config, run_dir)
        if on_update is not None:
            for node_name in update:
                on_update(node_name, saved)
    return current_state(app, config)


def current_state(app, config: dict[str, Any]) -> RunState:
    values = app.get_state(config).values
    return values if isinstance(values, RunState) else RunState.model_validate(values)


def _save_state_file(app, config: dict[str, Any], run_dir: str | Path) -> RunState:
    """The last checkpoint's state, written to the run directory's state.json with the nodes it runs next."""
    snapshot = app.get_state(config)
    state = snapshot.values if isinstance(snapshot.values, RunState) else RunState.model_validate(snapshot.values)
    write_state(state, snapshot.next, run_dir)
    return state


def relocate(ctx: RunContext, run_dir: str | Path, run_id: str) -> bool:
    """Point a checkpointed run at the folder it is in now; True if it had moved.

    The state names its files by the run folder as it was given when the run started (``runs/x/baseline/...``,
    relative to where the command ran): a run resumed from another folder, or from another working directory,
    would look for them there. Every path under the old folder is rewritten under the new one, as an update from
    the node that wrote the last checkpoint (the task of the one before), so the node to run next stays the same."""
    app = compile_graph(ctx, run_dir)
    config = thread(run_id)
    snapshot = app.get_state(config)
    if not snapshot.values:
        return False
    state = current_state(app, config)
    old, new = state.run_dir, str(run_dir)
    if old == new:
        return False
    prefix = old.rstrip("/") + "/"

    def moved(value: Any) -> Any:
        if isinstance(value, str) and value == old:
            return new
        if isinstance(value, str) and value.startswith(prefix):
            return str(Path(new) / value[len(prefix):])
        if isinstance(value, dict):
            return {k: moved(v) for k, v in value.items()}
        if isinstance(value, list):
            return [moved(v) for v in value]
        return value

    _rewrite(app, config, RunState.model_validate(moved(state.model_dump())), run_dir)
    return True


def _rewrite(app, config: dict[str, Any], state: RunState, run_dir: str | Path) -> None:
    """Replace the last checkpoint's state, as an update from the node that wrote it (the task of the one before),
    so that the node to run next stays the same. Earlier rewrites (updates that left the next node as it was) are
    passed over: the second rewrite would take the node to run next for the writer, and the run would end."""
    snapshot = app.get_state(config)
    while snapshot.metadata.get("source") == "update" and snapshot.parent_config:
        before = app.get_state(snapshot.parent_config)
        if before.next != snapshot.next:
            break
        snapshot = before
    parent = app.get_state(snapshot.parent_config) if snapshot.parent_config else None
    writer = parent.tasks[0].name if parent is not None and len(parent.tasks) == 1 else None
    app.update_state(config, state, as_node=writer)
    _save_state_file(app, config, run_dir)


def upgrade(ctx: RunContext, run_dir: str | Path, run_id: str) -> bool:
    """Rewrite a last checkpoint written before ``InFlight`` (the candidate in flight in ``current``, what was found of
    it in flat ``current_*`` fields) in today's shape; True if it was one. LangGraph loads only the channels the graph
    has now, so a resumed run would otherwise lose what the flat fields held (a checked candidate's numerics class)."""
    app = compile_graph(ctx, run_dir)
    config = thread(run_id)
    saved = app.checkpointer.get_tuple(config)
    values = saved.checkpoint["channel_values"] if saved is not None else {}
    if not isinstance(values.get("current"), Candidate) and not FLAT_IN_FLIGHT.keys() & values.keys():
        return False
    fields = RunState.model_fields.keys() | FLAT_IN_FLIGHT.keys()
    _rewrite(app, config, RunState.model_validate({k: v for k, v in values.items() if k in fields}), run_dir)
    return True


def _book_lost_time(ctx: RunContext, app, config: dict[str, Any], state: RunState | None,
                    run_dir: str | Path) -> RunState | None:
    """Book the wall time of a node an earlier invocation never returned from (``node_clock``): to the initial
    state of a run that starts (``state``), else to the last checkpoint. Every minute spent counts."""
    lost = lost_time(run_dir)
    if lost is None:
        return state
    node, seconds = lost
    if state is not None:
        return state.model_copy(update=state.spent_in(node, seconds))
    saved = current_state(app, config)
    _rewrite(app, config, saved.model_copy(update=saved.spent_in(node, seconds)), run_dir)
    why = f"{seconds:.0f} s spent in {node} before the run was stopped are counted"
    ctx.event(saved.run_dir, events.LostTime(node=node, seconds=seconds, reason=why))
    return None


def has_checkpoint(ctx: RunContext, run_dir: str | Path, run_id: str) -> bool:
    """Whether the run got as far as its first checkpoint (a run killed before that starts afresh)."""
    return bool(compile_graph(ctx, run_dir).get_state(thread(run_id)).values)
