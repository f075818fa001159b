"""The run's progress in a log file: one line per event where the console is not a terminal."""

from __future__ import annotations

import io

from rich.console import Console

from sg_opt.optimize import LiveView
from sg_opt.run_store import RunRequest
from state_machine import events

EVENTS = [
    events.Setup(target="haste-rec", size="xl", tier="offline", device="cuda"),
    events.Baseline(step_ms=314.5, noise_floor=0.01),
    events.Diagnose(),
    events.Propose(id=1, kind="knob", patch={"tail_backend": "slots"}, kernels=[]),
    events.NumericsRetry(id=1, kind="oom", reason="out of memory: CUDA"),
    events.Validated(id=1, numerics_class="reorder", detail="reorder numerics hold", wall_s=41.2, build_s=36.1,
                     stage_s={"steps": 2.0, "probe": 0.4, "digest": 2.5}),
    events.Decide(id=1, accepted=True, stage="measure", reason="faster twice"),
    events.Recalibrate(after=1, step_ms=124.8, noise_floor=0.0165),
    events.ProfileDisturbed(slowdown=1.79, reason="its steps ran x1.79 slower without the profiler than measured; "
                                                  "profiled again"),
    events.Diagnose(distorted="the profiler made its steps x2.66 slower (65.67 against 24.66 ms without it)"),
    events.Propose(id=2, kind="knob", patch={"data_workers": 2}, kernels=[]),
    events.Decide(id=2, accepted=False, stage="measure", reason="no-difference"),
    events.Report(stop_reason="max-minutes: 20.0 minutes used of 20"),
]


def view(terminal: bool) -> tuple[LiveView, io.StringIO]:
    out = io.StringIO()
    console = Console(file=out, force_terminal=terminal, width=200)
    return LiveView(console, RunRequest(run_id="r1", target="haste-rec", size="xl", device="cuda")), out


def test_a_log_gets_a_line_per_event_as_it_happens():
    live, out = view(terminal=False)
    with live:
        for event in EVENTS[:7]:
            live.on_event(event)
        shown = out.getvalue()  # before the run ends: a stopped run's log still shows this much
        for event in EVENTS[7:]:
            live.on_event(event)
    lines = [line.split("] ", 1)[1] for line in out.getvalue().splitlines()]
    assert shown.count("\n") == 6
    assert lines == ["run r1 (haste-rec @ xl, cuda, tier offline)",
                     "baseline 314.50 ms/step, noise floor 1.0%",
                     "evaluating #1 {'tail_backend': 'slots'}",
                     "#1 numerics run failed beside its timing workers (oom: out of memory: CUDA); once more without them",
                     "#1 numerics hold (reorder) after 41 s (build 36 s); timing it",
                     "#1 accepted: faster twice",
                     "noise floor 1.7% on the incumbent after #1 (124.80 ms/step)",
                     "the incumbent's profile was disturbed: its steps ran x1.79 slower without the profiler than "
                     "measured; profiled again",
                     "the incumbent's profile is distorted: the profiler made its steps x2.66 slower (65.67 against "
                     "24.66 ms without it)",
                     "evaluating #2 {'data_workers': 2}",
                     "#2 rejected at measure: no-difference",
                     "report written; stopped by max-minutes: 20.0 minutes used of 20"]


def test_a_terminal_gets_the_live_view():
    live, out = view(terminal=True)
    with live:
        for event in EVENTS:
            live.on_event(event)
    assert live.live is not None and " s] " not in out.getvalue()  # the live table, no log lines
    assert "#2 rejected at measure: no-difference" in out.getvalue()


def test_the_baseline_says_what_it_is_doing():
    live, out = view(terminal=False)
    with live:
        live.on_event(events.BaselineStage(stage="numerics fingerprint (20 steps)"))
        live.on_event(events.BaselineStage(stage="A/A noise floor: 1 run(s) of 12 blocks per side",
                                           cut="A/A calibration cut to fit 35% of --max-minutes 10 in the baseline"))
    text = out.getvalue()
    assert "baseline: numerics fingerprint (20 steps)" in text
    assert "(A/A calibration cut to fit 35% of --max-minutes 10 in the baseline)" in text
