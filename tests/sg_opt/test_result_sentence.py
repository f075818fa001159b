"""The one sentence `sg-opt optimize` and `sg-opt report` end with."""

from __future__ import annotations

from sg_opt.optimize import result_sentence
from sg_opt.summary import Summary


def test_an_unfinished_runs_sentence_says_how_to_go_on():
    """`sg-opt report` of a paused run: not 'stopped by None', but how to continue it."""
    summary = Summary.model_construct(run_id="r1", final=None, stop_reason=None, evaluated=42, accepted=4)
    sentence = result_sentence(summary)
    assert "None" not in sentence and "sg-opt optimize --resume r1" in sentence and "42 candidates" in sentence
