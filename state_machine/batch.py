"""Several candidates evaluated at once, one per lane of GPUs (``sg-opt optimize --gpus N``).

A lane is ``ranks`` GPUs and a disjoint share of the host's CPUs. With L = gpus / ranks lanes, the
proposer is asked for up to L candidates and ``evaluate_batch`` runs them concurrently: the static
checks one after the other (they are cheap and catch duplicates inside the batch), then each
candidate's validation and side-by-side timing in a thread on its own lane, through the very node
functions a single candidate goes through (``nodes.validate``, ``nodes.measure``). Both sides of an
A/B pair run on the candidate's lane, so each ratio is measured on one GPU. When timing lanes at once
widens the A/A noise floor too much (``state_machine.lanes``), each timing gets the machine to itself
(``TimingTurns``) while the validations still overlap.

All candidates of a batch are measured against the same incumbent. At most one can become the next
incumbent: the fastest accepted one. Any other that also won is recorded as beaten in its batch and
proposed again, as a new candidate, against the new incumbent (its gain may not add to the winner's).
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Iterator

from state_machine import events, nodes
from state_machine.context import RunContext
from state_machine.lanes import lanes_of, on_lanes
from state_machine.state import Candidate, InFlight, RunState, Verdict, rejected


def _as_current(state: RunState, cand: Candidate) -> RunState:
    return state.model_copy(update={"current": InFlight(candidate=cand)})


def _checked(state: RunState, ctx: RunContext) -> list[RunState]:
    """Each candidate of the batch after the static checks, as the state a single candidate would have;
    a candidate equal to an earlier one of the same batch is rejected as its duplicate."""
    out, digests = [], {}
    for cand in state.batch:
        one = _as_current(state, cand)
        one = one.model_copy(update=nodes.check(one, ctx))
        if one.current.verdict is None and one.current.digest in digests:
            twin = digests[one.current.digest]
            one = one.model_copy(update=rejected(one, "check", f"a duplicate of candidate #{twin}"))
        if one.current.verdict is None:
            digests[one.current.digest] = cand.id
        out.append(one)
    return out


class TimingTurns:
    """Lets validations share the machine and gives a timing the machine to itself (a writer-preferring
    readers-writer lock): a timing waits for the validations in flight, and none starts while it runs
    or waits, so its blocks see what the lone lane's A/A blocks saw."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._validating, self._timing, self._waiting = 0, False, 0

    @contextlib.contextmanager
    def validating(self) -> Iterator[None]:
        with self._cond:
            self._cond.wait_for(lambda: not self._timing and not self._waiting)
            self._validating += 1
        try:
            yield
        finally:
            with self._cond:
                self._validating -= 1
                self._cond.notify_all()

    @contextlib.contextmanager
    def timing(self) -> Iterator[None]:
        with self._cond:
            self._waiting += 1
            self._cond.wait_for(lambda: not self._timing and not self._validating)
            self._waiting -= 1
            self._timing = True
        try:
            yield
        finally:
            with self._cond:
                self._timing = False
                self._cond.notify_all()


def _validated_and_measured(one: RunState, ctx: RunContext, turns: TimingTurns | None) -> RunState:
    """validate then measure on the state's lane, stopping at the first verdict (as the graph's edges do);
    with ``turns`` (lanes that widen each other's noise) each timing has the machine to itself."""
    with turns.validating() if turns else contextlib.nullcontext():
        one = one.model_copy(update=nodes.validate(one, ctx))
    if one.current.verdict is not None:
        return one
    with turns.timing() if turns else contextlib.nullcontext():
        return one.model_copy(update=nodes.measure(one, ctx))


def _beaten(verdict: Verdict, winner: Candidate, winner_ratio: float) -> Verdict:
    return verdict.model_copy(update={"accepted": False, "reason": (
        f"{verdict.reason}; but candidate #{winner.id} of the same batch was faster (ratio {winner_ratio:.3f} "
        f"against {verdict.ratio:.3f}), so this one is proposed again against the new incumbent")})


def evaluate_batch(state: RunState, ctx: RunContext) -> dict[str, Any]:
    """Check, validate and time every candidate of the batch, concurrently on the lanes; then record each,
    the fastest winner last, so that it alone becomes the incumbent."""
    checked = _checked(state, ctx)
    pending = [one for one in checked if one.current.verdict is None]
    lanes = lanes_of(state)[:len(pending)]
    ctx.event(state.run_dir, events.Batch(ids=[c.id for c in state.batch],
                                          lanes={one.current.candidate.id: lane.gpus
                                                 for one, lane in zip(pending, lanes)}))
    turns = None if state.plan.concurrent_timing else TimingTurns()
    done = on_lanes(lambda lane: _validated_and_measured(
        pending[lane.index].model_copy(update={"lane": lane}), ctx, turns), lanes) if pending else []
    finished = {one.current.candidate.id: one for one in done}
    results = [finished.get(one.current.candidate.id, one) for one in checked]
    winners = sorted((one for one in results if one.current.verdict.accepted),
                     key=lambda one: one.current.verdict.ratio)
    best = winners[0] if winners else None
    again, next_id = [], state.next_id
    record = state.model_copy(update={"batch": []})
    for one in sorted(results, key=lambda one: one is best):
        cand, verdict = one.current.candidate, one.current.verdict
        if verdict.accepted and one is not best:
            winner = best.current.candidate
            verdict = _beaten(verdict, winner, best.current.verdict.ratio)
            again.append(cand.model_copy(update={"id": next_id, "rationale": f"again after candidate #{winner.id} "
                                                                             f"was accepted: {cand.rationale}"}))
            next_id += 1
        decided = record.model_copy(update={"current": one.current.model_copy(update={"verdict": verdict})})
        record = record.model_copy(update=nodes.decide(decided, ctx))
    return {"history": record.history, "incumbent": record.incumbent, "queue": again + list(state.queue),
            "next_id": next_id, "batch": [], "current": None}
