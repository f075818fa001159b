"""Findings and candidates as the node and proposer tests build them, and the check node run on one."""

from __future__ import annotations

from profilers.records import Finding
from state_machine import nodes
from state_machine.state import Candidate, InFlight


def finding(category: str, share: float, gain: float) -> Finding:
    return Finding(category=category, phase=None, evidence=f"{category} evidence", share=share, headroom=10.0,
                   headroom_basis="test", amdahl_gain=gain)


def candidate(cid=1, **kw) -> Candidate:
    kw.setdefault("kind", "knob")
    kw.setdefault("proposer", "test")
    return Candidate(id=cid, rationale="test", **kw)


def checked(state, ctx, cand):
    return nodes.check(state.model_copy(update={"current": InFlight(candidate=cand)}), ctx)
