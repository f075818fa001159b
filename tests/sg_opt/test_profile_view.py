"""`sg-opt profile`'s console view of a real H200 profile: a distorted one says so under its first line."""

from __future__ import annotations

import io
from pathlib import Path

from rich.console import Console

from profilers.records import ProfileResult
from sg_opt.profile_view import render

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"


def _shown(result: ProfileResult) -> str:
    out = io.StringIO()
    render(result, Console(file=out, width=200, force_terminal=False))
    return out.getvalue()


def test_a_distorted_profile_is_said_to_be_one_and_a_steady_one_is_not():
    """The 2026-12-03 x7.29 `large-cached` run's profile after #12 ran its steps at 65.67 ms under the profiler, 24.66
    without."""
    result = ProfileResult.model_validate_json((FIXTURES / "h200_large_cached_s22_after_12.json").read_text())
    assert ("distorted profile: the profiler made its steps x2.66 slower (65.67 against 24.66 ms without it), so "
            "its phase times overstate the step's") in _shown(result)
    steady = result.model_copy(update={"coarse": result.coarse.model_copy(update={"profiler_overhead": 1.1})})
    assert "distorted" not in _shown(steady)
