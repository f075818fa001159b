"""report.html: the whole run on one self-contained page that opens offline.

No script, no stylesheet or font from anywhere else: the CSS is inline and every plot is inline
SVG from ``sg_opt.plots``. Every text that came from a run (rationales, reasons, LLM output, knob
values) is escaped. Where a plot has nothing to show (a CPU run has no roofline, an offline run no
LLM spend), the page says so in a sentence instead of drawing an empty frame. The small page
building blocks here are shared with the comparison page.
"""

from __future__ import annotations

from html import escape
from typing import Iterable, Sequence

from sg_opt import plots
from sg_opt.report_text import (NO_ROOFLINE, best_config_toml, estimate_rows, floor_columns, floor_notes,
                                floor_text, host_line, machine_rows, numerics_line, over_floor_text, ratio_text,
                                result_line, spend_line, status_line, step_ms_text, step_text, time_line,
                                verdict_text)
from sg_opt.summary import Summary

CSS = """
body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",sans-serif;color:#1d232b;max-width:1080px;margin:24px auto;
padding:0 16px}
h1{font-size:22px;margin-bottom:4px}h2{font-size:17px;border-bottom:1px solid #e3e6ea;padding-bottom:4px;
margin-top:28px}
.meta{color:#5b6570}.result{font-size:16px;font-weight:600}.note{color:#7a5b00;background:#fff7df;
padding:6px 10px;border-radius:4px}
table{border-collapse:collapse;margin:8px 0;font-size:13px}th,td{border:1px solid #e3e6ea;padding:4px 8px;
text-align:left;vertical-align:top}th{background:#f5f7f9}
td small{color:#5b6570}td.num{text-align:right;font-variant-numeric:tabular-nums;white-space:nowrap}
.accepted{color:#1f7a3a;font-weight:600}.rejected{color:#8a3b3b}
figure{margin:10px 0}figure svg{max-width:100%;height:auto}figcaption{color:#5b6570;font-size:12px}
pre{background:#f5f7f9;padding:8px;overflow-x:auto;font-size:12px}
"""


def page(title: str, sections: Iterable[str]) -> str:
    return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
            f'<meta name="viewport" content="width=device-width, initial-scale=1">'
            f"<title>{escape(title)}</title><style>{CSS}</style></head>\n<body>\n" + "\n".join(sections)
            + "\n</body></html>\n")


def section(anchor: str, title: str, *parts: str) -> str:
    return f'<section id="{anchor}"><h2>{escape(title)}</h2>\n' + "\n".join(p for p in parts if p) + "</section>"


def para(text: str, cls: str | None = None) -> str:
    attr = f' class="{cls}"' if cls else ""
    return f"<p{attr}>{escape(text)}</p>"


def table(headers: Sequence[str], rows: Iterable[Sequence[object]], numeric: Sequence[int] = ()) -> str:
    """A table of escaped cells; a cell given as ("html", markup) is inserted as is."""
    head = "".join(f"<th>{escape(h)}</th>" for h in headers)
    body = []
    for row in rows:
        cells = []
        for i, cell in enumerate(row):
            markup = cell[1] if isinstance(cell, tuple) and cell[0] == "html" else escape(str(cell))
            cells.append(f'<td class="num">{markup}</td>' if i in numeric else f"<td>{markup}</td>")
        body.append("<tr>" + "".join(cells) + "</tr>")
    return f"<table><thead><tr>{head}</tr></thead><tbody>" + "".join(body) + "</tbody></table>"


def figure(svg: str | None, caption: str, missing: str) -> str:
    """The plot with its caption, or, when there is none, the sentence that says why."""
    if svg is None:
        return para(missing, "note")
    return f"<figure>{svg}<figcaption>{escape(caption)}</figcaption></figure>"


def machine_table(env: dict) -> str:
    return table(["", "value"], machine_rows(env)) if env else para("the baseline recorded no environment", "note")


def _speedup(value: float | None) -> str:
    return f"x{value:.2f}" if value else "-"


BEST_SO_FAR = ("The incumbent's step time after each candidate, as measured: the baseline's in its A/A calibration, "
               "each accepted candidate's in its acceptance run (side by side with the incumbent it replaced). "
               "Dashed: the best configuration's step in the final side-by-side measurement against the baseline, "
               "band: its 95% interval; that measurement's speedup is written above the plot (in the legend, for "
               "two runs).")


# ----------------------------------------------------------------------------- the run page

def _result(s: Summary) -> str:
    f = s.final
    rows = [("baseline step time", step_text(s.baseline_step)), ("best step time", step_text(s.best_step)),
            ("ratio best/baseline (95% CI)", ratio_text(f.ratio, f.ci_low, f.ci_high) if f else "-"),
            ("speedup", _speedup(f.speedup) if f else "- (no final measurement)"), *estimate_rows(s),
            ("verdict", f.verdict if f else "no final measurement (nothing accepted)" if not s.accepted else "-"),
            ("noise floor", floor_text(s)),
            ("numerics", numerics_line(s)), ("reorder bands", s.reorder_calibration or "-")]
    caption = ("Baseline and best step time, measured side by side in one final A/B (interleaved blocks)"
               if s.best_step else "Baseline step time over the blocks of its A/A calibration runs")
    return section("result", "Result", para(result_line(s), "result"), table(["", "value"], rows),
                   figure(plots.step_times([(s.run_id, s)]), caption + "; bars: 95% bootstrap interval of the "
                          "median block.", "no step times were measured (the baseline did not finish)."))


def _candidates(s: Summary) -> str:
    rows = []
    for c in s.candidates:
        cls = "accepted" if c.accepted else "rejected"
        rows.append((c.id, c.kind, ("html", f"<b>{escape(c.change)}</b><br><small>{escape(c.rationale)}</small>"),
                     c.proposer, ("html", f'<span class="{cls}">{escape(verdict_text(c.accepted, c.stage))}</span>'
                                          f"<br><small>{escape(c.reason)}</small>"),
                     c.numerics_class or "-", _speedup(c.speedup), ratio_text(c.ratio, c.ci_low, c.ci_high),
                     step_ms_text(c.step_ms), _speedup(c.expected_gain),
                     f"{c.decided_at_s:.0f} s" if c.decided_at_s is not None else "-"))
    listing = table(["#", "kind", "change and rationale", "proposer", "verdict and why", "numerics", "speedup",
                     "ratio (95% CI)", "step ms", "expected", "decided at"], rows, numeric=(0, 6, 7, 8, 9, 10)) \
        if rows else para("no candidate was evaluated.", "note")
    return section("candidates", "Candidates", para(f"{s.evaluated} evaluated, {s.accepted} accepted. Speedup and "
                                                    "ratio are against the incumbent at the time, side by side; "
                                                    "step ms: the candidate's step in that measurement; expected: "
                                                    "the proposer's estimate; decided at: seconds into the run."),
                   figure(plots.best_so_far([(s.run_id, s)]), BEST_SO_FAR, "no candidate was evaluated."),
                   listing)


def _phases(s: Summary) -> str:
    names = list(dict.fromkeys(n for p in s.phases for n in p.phases_ms))
    rows = [(p.label, p.profile, f"{p.step_ms:.2f}", f"{p.unprofiled_step_ms:.2f}",
             *(f"{p.phases_ms.get(n, 0.0):.2f}" for n in names), f"{p.other_ms:.2f}") for p in s.phases]
    return section("phases", "Where the step time goes",
                   figure(plots.phases(s), "Each profiled step split into its named phases (phase share x "
                          "profiled step time); 'other' is time outside every phase.",
                          "no profile of this run has a coarse section."),
                   table(["profile", "file", "step ms", "unprofiled ms", *names, "other"], rows,
                         numeric=tuple(range(2, len(names) + 5))) if rows else "",
                   f"<p>{escape(host)}</p>" if (host := host_line(s)) else "",
                   "".join(f"<p>{escape(p.label)}: {escape(p.ranks_note)}.</p>" for p in s.phases if p.ranks_note))


def _floor(s: Summary) -> str:
    """Each phase of the first and last profile against its roofline floor."""
    cols = floor_columns(s)
    if not cols:
        return ""
    last = cols[-1]
    rows = []
    for name in last.floor_ms:
        row = [name, last.floor_bound.get(name, "-")]
        for p in cols:
            measured, floor = p.phases_ms.get(name), p.floor_ms.get(name)
            row += [f"{measured or 0.0:.2f}", f"{floor or 0.0:.4f}", over_floor_text(measured, floor)]
        rows.append(row)
    headers = ["phase", "bound"] + [f"{p.label} {h}" for p in cols for h in ("ms", "floor ms", "over floor")]
    notes = "".join(f"<p>{escape(note[0].upper() + note[1:])}.</p>" for note in floor_notes(s))
    return section("floor", "Against the hardware floor",
                   "<p>Each phase's floor is its least work (FLOPs, device bytes, host-device bytes) at the measured "
                   "ceilings; measured is phase share x profiled step time.</p>",
                   table(headers, rows, numeric=tuple(range(2, len(headers)))), notes)


def _roofline(s: Summary) -> str:
    r = s.roofline
    if r is None:
        return section("roofline", "Kernel slots on the roofline", para(NO_ROOFLINE, "note"))
    ceilings = ", ".join(f"{d} {v / 1e12:.3f} TFLOP/s" for d, v in sorted(r.ceilings.matmul_flops_per_s.items()))
    rows = [(p.label, p.slot, p.implementation, p.dtype, ", ".join(f"{k}={v}" for k, v in p.shape.items()),
             f"{p.median_us:.1f}", f"{p.intensity:.2f}", f"{p.achieved_flops_per_s / 1e9:.2f}",
             f"{100 * p.roofline_fraction:.1f}%", p.bound) for p in r.points]
    return section("roofline", "Kernel slots on the roofline",
                   para(f"Measured ceilings on {r.ceilings.device_name}: matmul {ceilings}; copy "
                        f"{r.ceilings.copy_bytes_per_s / 1e9:.1f} GB/s (measured {r.ceilings.measured_at})."),
                   figure(plots.roofline(s), "Achieved FLOP/s of each kernel slot on the run's shapes against the "
                          "measured roofs; labels: % of the attainable FLOP/s.", "no slot was timed."),
                   table(["profile", "slot", "implementation", "dtype", "shape", "median us", "FLOP/byte", "GFLOP/s",
                          "of roofline", "bound"], rows, numeric=(5, 6, 7, 8)))


def _cost(s: Summary) -> str:
    rows = [(tier, t.calls, t.failed_calls, t.reply_repairs + t.kernel_repairs, t.input_tokens,
             t.cached_input_tokens, t.output_tokens, t.reasoning_tokens, f"${t.cost_usd:.4f}")
            for tier, t in sorted(s.spend_by_tier.items())]
    return section("cost", "LLM cost", para(spend_line(s) + "."),
                   figure(plots.spend([(s.run_id, s)]), "Cumulative dollars after each LLM call, per tier "
                          "(from ledger.jsonl).", f"No LLM calls: tier {s.tier} spent $0."),
                   table(["tier", "calls", "failed", "repairs", "input tokens", "cached", "output", "reasoning", "$"],
                         rows, numeric=range(1, 9)) if rows else "")


def _best(s: Summary, diffs: dict[str, str]) -> str:
    parts = [f"<pre>{escape(best_config_toml(s))}</pre>"]
    for slot, diff in diffs.items():
        parts.append(f"<details><summary>kernel {escape(slot)}: diff against the baseline source</summary>"
                     f"<pre>{escape(diff)}</pre></details>")
    return section("best", "Best configuration (best_config.toml, best_kernels/)", *parts)


def render_html(s: Summary, diffs: dict[str, str] | None = None) -> str:
    header = (f"<h1>sg-opt run {escape(s.run_id)}</h1>" + para(status_line(s), "meta")
              + para(f"{time_line(s)} Summary schema v{s.version}.", "meta"))
    notes = section("notes", "Notes", *(para(n, "note") for n in s.notes)) if s.notes else ""
    return page(f"sg-opt {s.run_id}", [header, _result(s), _candidates(s), _phases(s), _floor(s), _roofline(s), _cost(s),
                                       section("machine", "Machine", machine_table(s.environment),
                                               *(para(line, "note") for line in s.trust)),
                                       _best(s, diffs or {}), notes])
