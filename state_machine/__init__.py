"""The agent: a LangGraph state machine (setup, baseline, diagnose, propose, check, validate,
measure, decide, report), its typed state, one plain function per node, and the proposers."""
