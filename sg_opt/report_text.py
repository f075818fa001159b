"""What a run's report says, in the words report.md, report.html and the comparison of two runs share: one-line
results, table cells, the notes under the floor table, best_config.toml's text.

Below all three writers, so that each imports the wording and none imports another writer for it.
"""

from __future__ import annotations

from typing import Any

from sg_opt.summary import StepTime, Summary

NO_ROOFLINE = ("No kernel-slot roofline: no profile of this run has a fine section (kernel slots timed against "
               "measured ceilings). The agent takes one when its plan asks for fine profiles, usually on CUDA; "
               "`sg-opt profile --fine` takes one on any device.")


def step_text(t: StepTime | None) -> str:
    return f"{t.ms:.2f} ms (95% CI {t.ci_low_ms:.2f}-{t.ci_high_ms:.2f}, {t.blocks} blocks)" if t else "-"


ESTIMATE = "estimate (product of accepted ratios, not a measurement)"


def result_line(s: Summary) -> str:
    """The run's outcome in one sentence, without markup: a measured figure or none, never an estimate."""
    if s.final is not None and s.final.speedup is not None:
        f = s.final
        if not f.clean:
            return (f"could not measure cleanly: the final side-by-side measurement ran beside other load "
                    f"({f.load or 'outside load'}), so its ratio {f.ratio:.3f} is not quoted as a result; measure "
                    f"best_config.toml again on a quiet machine with `sg-opt bench --vs`.")
        return (f"x{f.speedup:.2f} faster than the baseline, measured side by side at the end: step time ratio "
                f"{f.ratio:.3f} (95% interval {f.ci_low:.3f}-{f.ci_high:.3f}, best/baseline), verdict {f.verdict}.")
    if s.accepted:
        return (f"{s.accepted} change(s) accepted, but best and baseline were not measured side by side at the end: "
                f"no measured speedup.")
    return "no candidate was accepted: the baseline stays."


def estimate_rows(s: Summary) -> list[tuple[str, str]]:
    """The estimate, labelled as one, where no final measurement says better (a run that stopped before it)."""
    if s.accepted and (s.final is None or s.final.speedup is None):
        return [(ESTIMATE, f"x{s.est_speedup:.2f}")]
    return []


def step_ms_text(ms: float | None) -> str:
    return f"{ms:.2f}" if ms is not None else "-"


def numerics_line(s: Summary) -> str:
    if s.numerics is None:
        return "unchanged: the best configuration is the baseline."
    n = s.numerics
    return f"{n.numerics_class} (validated with candidate #{n.candidate}): {n.detail}"


def verdict_text(accepted: bool, stage: str) -> str:
    return "accepted" if accepted else f"rejected at {stage}"


# What a run's minutes went to, by the nodes that spent them (the rest: setup, propose, decide).
TIME_GROUPS = (("baseline", ("baseline",)), ("profiling and noise floors", ("diagnose",)),
               ("validation", ("check", "validate")), ("timing", ("measure",)),
               ("validation and timing on lanes", ("evaluate_batch",)), ("final measurement", ("report",)))


def time_line(s: Summary) -> str:
    """'Wall time 16.3 min: baseline 1.7, ...' (the split only when the run recorded one)."""
    line = f"Wall time {s.wall_s / 60:.1f} min"
    parts = [(name, sum(s.node_s.get(node, 0.0) for node in nodes)) for name, nodes in TIME_GROUPS]
    parts = [(name, seconds) for name, seconds in parts if seconds >= 0.05 * 60]
    if parts:
        rest = s.wall_s - sum(seconds for _, seconds in parts)
        line += ": " + ", ".join(f"{name} {seconds / 60:.1f}" for name, seconds in parts)
        line += f", other {rest / 60:.1f}" if rest >= 0.05 * 60 else ""
    line += "."
    if (w := s.worker_startup) is not None:
        parts = ", ".join(f"{name} {seconds:.1f}" for name, seconds in w.build_parts.items() if seconds >= 0.05)
        line += (f" A timing worker got ready in {w.ready_s:.1f} s (medians of {w.workers}): "
                 f"start and imports {w.start_s:.1f}, build {w.build_s:.1f}" + (f" ({parts})" if parts else "")
                 + f", warm-up {w.warmup_s:.1f}.")
        if w.started_ahead:
            line += (f" {w.started_ahead} measurement(s) found their workers started during the candidate's "
                     f"validation.")
        if w.close_s is not None:
            line += f" Closing a measurement's workers took {w.close_s:.1f} s."
    return line


def floor_text(s: Summary) -> str:
    """The baseline's A/A noise floor, then each one calibrated again on a faster incumbent."""
    if s.noise_floor is None:
        return "-"
    text = f"{100 * s.noise_floor:.1f}% (A/A on this machine)"
    if s.recalibrations:
        text += "; calibrated again on faster incumbents: " + ", ".join(
            f"{100 * r.noise_floor:.1f}% at {r.step_ms:.2f} ms (after #{r.after_candidate})" for r in s.recalibrations)
    return text


def ratio_text(ratio: float | None, low: float | None, high: float | None) -> str:
    return f"{ratio:.3f} ({low:.3f}-{high:.3f})" if ratio is not None and low is not None else "-"


def spend_line(s: Summary) -> str:
    spend = s.spend
    per_win = f", ${s.cost_per_win_usd:.4f} per accepted win" if s.cost_per_win_usd is not None else ""
    repairs = (f", {spend.reply_repairs} reply and {spend.kernel_repairs} kernel repair turns"
               if spend.reply_repairs or spend.kernel_repairs else "")
    return (f"LLM spend ${spend.cost_usd:.4f} in {spend.calls} calls ({spend.input_tokens} input, "
            f"{spend.output_tokens} output tokens){per_win}{repairs}")


def machine_rows(env: dict[str, Any]) -> list[tuple[str, str]]:
    """The baseline worker's environment; what it did not record is said, not guessed."""
    known = [("device", "device"), ("device_name", "device name"), ("driver", "driver"), ("cuda", "CUDA"),
             ("torch", "torch"), ("triton", "triton"), ("python", "python"), ("threads", "threads")]
    rows = [(label, str(env[key]) if env.get(key) is not None else "not recorded") for key, label in known]
    rows += [(key, str(value)) for key, value in env.items() if key not in dict(known)]
    return rows


def status_line(s: Summary) -> str:
    stop = s.stop_reason or "the run did not finish (no report node ran): this is its state at the last checkpoint"
    lanes = f" ({s.gpus} GPUs; {s.lanes_note or 'candidates evaluated at once'})" if s.gpus > 1 else ""
    return f"{s.target} @ {s.size} on {s.device}{lanes}, tier {s.tier}. Stopped: {stop}."


def _toml_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    return '"' + str(value).replace("\\", "\\\\").replace('"', '\\"') + '"'


def best_config_toml(summary: Summary) -> str:
    lines = [f"# best configuration of run {summary.run_id} ({summary.target} @ {summary.size}, {summary.device})",
             "# use with: sg-opt bench --config best_config.toml", "[knobs]"]
    lines += [f"{name} = {_toml_value(value)}" for name, value in sorted(summary.best_config.items())]
    return "\n".join(lines) + "\n"


def host_line(s: Summary) -> str | None:
    """The last profile's host side per phase: what a host-bound step spends its time on (None before
    profiles recorded host operator calls)."""
    last = s.phases[-1] if s.phases else None
    if last is None or not any(last.host_ops.values()):
        return None
    parts = [f"{name} {ms:.2f} / {last.host_ops.get(name, 0):.0f}"
             + (f" / {last.launches[name]:.0f}" if name in last.launches else "")
             for name, ms in last.host_work_ms.items()]
    what = ("ms of host work not waiting on the device / host operator calls"
            + (" / kernel launches" if last.launches else ""))
    line = (f"Host side ({last.label}, per step: {what}): " + ", ".join(parts)
            + f"; {sum(last.host_work_ms.values()):.2f} ms of host work in a {last.step_ms:.2f} ms step.")
    if last.host_work:
        line += " Its largest host work: " + ", ".join(
            f"{w.phase} {w.op} {1e3 * w.self_s:.2f} ms ({w.calls:.0f} calls)" for w in last.host_work[:4]) + "."
    if last.host_waits:
        line += " The host waited on the device in " + ", ".join(
            f"{w.phase} {1e3 * w.wait_s:.2f} ms ({w.op}, {w.call})" for w in last.host_waits[:3]) + "."
    return line


def over_floor_text(measured: float | None, floor: float | None) -> str:
    return f"x{measured / floor:.1f}" if measured is not None and floor else "-"


def floor_columns(s: Summary) -> list:
    """The first and the last profile that have a roofline floor (one if they are the same; none if none)."""
    with_floor = [p for p in s.phases if p.floor_ms]
    return with_floor[:1] if len(with_floor) <= 1 else [with_floor[0], with_floor[-1]]


def floor_notes(s: Summary) -> list[str]:
    """The sentences under the floor table: each column's step against its floor and, where the profiler distorted
    it, that; then the final step against the floor and whether the host holds the step back."""
    notes = []
    for p in floor_columns(s):
        notes += [f"{p.label}: {note}" for note in (p.floor_note, p.distortion_note) if note]
    return notes + [note for note in (final_over_floor(s), host_bound_note(s)) if note is not None]


HOST_BOUND_SHARE = 0.9  # host work (not waiting on the device) over this share of the step: the host sets its pace


def host_bound_note(s: Summary) -> str | None:
    """On a GPU, when the last floor profile's host is busy for nearly all of the step: no device phase's
    distance from its floor is what holds the step back, the host work is (None otherwise)."""
    cols = floor_columns(s)
    last = cols[-1] if cols else None
    if last is None or not s.device.startswith("cuda") or not last.host_work_ms or not last.step_ms:
        return None
    if last.distortion_note:  # the profiler's own slowdown would read as host work
        return None
    host = sum(last.host_work_ms.values())
    if host < HOST_BOUND_SHARE * last.step_ms:
        return None
    most = max(last.host_work_ms, key=last.host_work_ms.get)
    ops = [w for w in last.host_work if w.phase == most][:2]
    named = "; its largest: " + ", ".join(f"{w.op} {1e3 * w.self_s:.2f} ms" for w in ops) if ops else ""
    return (f"{last.label}: the step is host-bound, {host:.2f} ms of host work not waiting on the device in a "
            f"{last.step_ms:.2f} ms profiled step, so it is the host work that holds it back, not a device phase "
            f"(most in {most}: {last.host_work_ms[most]:.2f} ms{named})")


def final_over_floor(s: Summary) -> str | None:
    """The best configuration's step from the final side-by-side measurement (no profiler running) over the
    last profile's floor: the same floor, the step measured the careful way."""
    cols = floor_columns(s)
    if not cols or s.best_step is None or not cols[-1].floor_step_ms or s.accepted == 0:
        return None
    floor_ms = cols[-1].floor_step_ms
    return (f"the best configuration's step in the final side-by-side measurement, {s.best_step.ms:.2f} ms, is "
            f"x{s.best_step.ms / floor_ms:.1f} the floor ({floor_ms:.3f} ms)")
