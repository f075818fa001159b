"""The report's plots, drawn by matplotlib and returned as inline SVG text.

Figures are built with ``matplotlib.figure.Figure`` (no pyplot, no GUI backend, no global state),
saved as SVG with text as paths (no font needed to view it), no date stamp (the same run gives the
same bytes) and every element id prefixed with the plot's name, so several plots can live inline
in one HTML page without clashing ids. Each function returns None when it has nothing to draw; the
page then says why instead of showing an empty plot.
"""

from __future__ import annotations

import io
import re
from typing import Sequence

import matplotlib
from matplotlib.figure import Figure
from matplotlib.ticker import FormatStrFormatter, LogLocator, MaxNLocator, NullFormatter

from sg_opt.summary import Summary

ACCEPTED, REJECTED, BASE, BEST = "#2a9d4b", "#b0b0b0", "#7f8c9a", "#2a6fdb"
STYLE = {"svg.fonttype": "path", "font.size": 9, "axes.spines.top": False, "axes.spines.right": False,
         "axes.grid": True, "grid.alpha": 0.3}
Labelled = Sequence[tuple[str, Summary]]


def _svg(fig: Figure, name: str) -> str:
    buf = io.StringIO()
    fig.savefig(buf, format="svg", bbox_inches="tight", metadata={"Date": None})
    text = buf.getvalue()
    text = text[text.index("<svg"):]  # drop the XML prolog and doctype: the page's own
    text = re.sub(r"<metadata>.*?</metadata>\s*", "", text, flags=re.S)  # the RDF creator stamp
    ids = set(re.findall(r'\bid="([^"]+)"', text))
    if ids:
        pattern = re.compile(r'(id="|#)(' + "|".join(re.escape(i) for i in sorted(ids, key=len, reverse=True))
                             + r')(?=["\)])')
        text = pattern.sub(lambda m: f"{m.group(1)}{name}-{m.group(2)}", text)
    return text.replace("<svg ", f'<svg data-plot="{name}" ', 1)


def _figure(name: str, width: float = 7.0, height: float = 3.0) -> Figure:
    fig = Figure(figsize=(width, height))
    fig.set_layout_engine("constrained")
    return fig


def _draw(name: str, draw, width: float = 7.0, height: float = 3.0) -> str:
    with matplotlib.rc_context({**STYLE, "svg.hashsalt": name}):
        fig = _figure(name, width, height)
        draw(fig)
        return _svg(fig, name)


def step_times(runs: Labelled) -> str | None:
    """Baseline and best step time of each run, with their 95% intervals."""
    bars = []
    for label, s in runs:
        prefix = f"{label}: " if len(runs) > 1 else ""
        if s.baseline_step is not None:
            bars.append((f"{prefix}baseline", s.baseline_step, BASE))
        if s.best_step is not None:
            bars.append((f"{prefix}best", s.best_step, BEST))
    if not bars:
        return None

    def draw(fig: Figure) -> None:
        ax = fig.add_subplot()
        y = range(len(bars))
        ms = [b.ms for _, b, _ in bars]
        err = [[b.ms - b.ci_low_ms for _, b, _ in bars], [b.ci_high_ms - b.ms for _, b, _ in bars]]
        ax.barh(list(y), ms, xerr=err, color=[c for *_, c in bars], capsize=4)
        ax.set_yticks(list(y), [name for name, *_ in bars])
        ax.invert_yaxis()
        for i, value in enumerate(ms):
            ax.annotate(f"{value:.2f} ms", (value, i), xytext=(6, 6), textcoords="offset points", fontsize=8)
        ax.set_xlabel("step time, ms (median of the timed blocks, 95% bootstrap interval)")
    return _draw("step-times", draw, height=0.6 + 0.45 * len(bars))


def final_text(s: Summary) -> str | None:
    """The final side-by-side result in a few words ('x18.99, 95% interval x18.6-x19.4'), None without one."""
    f = s.final
    if f is None or not (f.speedup and f.ci_low and f.ci_high):
        return None
    unclean = "" if f.clean else " (not clean: measured beside other load)"
    return f"x{f.speedup:.2f}, 95% interval x{1 / f.ci_high:.2f}-x{1 / f.ci_low:.2f}{unclean}"


def best_so_far(runs: Labelled) -> str | None:
    """The incumbent's step time after each candidate as measured (the baseline's in its A/A calibration, each
    accepted candidate's in its acceptance run), and the best's step time in the final side-by-side measurement
    with its interval as a band: measured figures only, never a product of ratios."""
    if not any(s.candidates for _, s in runs):
        return None

    def draw(fig: Figure) -> None:
        ax = fig.add_subplot()
        for index, (label, s) in enumerate(runs):
            levels = s.measured_curve()
            known = [(n, ms) for n, ms in enumerate(levels) if ms is not None]
            prefix = f"{label}: " if len(runs) > 1 else ""
            if not known:
                continue
            line, = ax.step(*zip(*known), where="post", label=f"{prefix}incumbent, measured in its acceptance run")
            won = [(n, levels[n]) for n, c in enumerate(s.candidates, start=1) if c.accepted and levels[n] is not None]
            if won:
                ax.scatter(*zip(*won), color=ACCEPTED, zorder=3, label="accepted" if index == 0 else None)
            best, final = s.best_step, final_text(s)
            if best is not None and final is not None:
                speedup = f" ({final})" if len(runs) > 1 else ""
                ax.axhline(best.ms, color=line.get_color(), linestyle="--", linewidth=1,
                           label=f"{prefix}best in the final side-by-side measurement: {best.ms:.2f} ms{speedup}")
                ax.axhspan(best.ci_low_ms, best.ci_high_ms, color=line.get_color(), alpha=0.12)
        if len(runs) == 1 and (final := final_text(runs[0][1])):
            ax.set_title(f"final side by side against the baseline: {final}", fontsize=9)
        low, high = ax.get_ylim()
        if high > 4 * max(low, 1e-9):  # a step many times faster: a log axis keeps the later candidates apart
            ax.set_yscale("log")
            ax.yaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
            ax.yaxis.set_major_formatter(FormatStrFormatter("%g"))
            ax.yaxis.set_minor_formatter(NullFormatter())
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel("candidates evaluated")
        ax.set_ylabel("incumbent step time, ms")
        ax.legend(fontsize=8, loc="best")  # where it hides least of the curves
    return _draw("best-so-far", draw)


def phases(s: Summary) -> str | None:
    """Stacked bars: where each profiled step's time goes, per phase (baseline first)."""
    if not s.phases:
        return None
    names = list(dict.fromkeys(name for p in s.phases for name in p.phases_ms))

    def draw(fig: Figure) -> None:
        ax = fig.add_subplot()
        colors = matplotlib.colormaps["tab10"].colors
        labels = [p.label for p in s.phases]
        left = [0.0] * len(s.phases)
        for i, name in enumerate(names + ["other"]):
            widths = [p.other_ms if name == "other" else p.phases_ms.get(name, 0.0) for p in s.phases]
            ax.barh(labels, widths, left=left, label=name, color="#dddddd" if name == "other" else colors[i % 10])
            left = [a + b for a, b in zip(left, widths)]
        for i, p in enumerate(s.phases):
            ax.annotate(f"{p.step_ms:.2f} ms", (left[i], i), xytext=(4, -3), textcoords="offset points", fontsize=8)
        ax.invert_yaxis()
        ax.set_xlabel("ms per step under the profiler (phase share x profiled step time)")
        ax.legend(fontsize=8, ncols=min(len(names) + 1, 6), loc="upper center", bbox_to_anchor=(0.5, -0.28))
    return _draw("phases", draw, height=1.4 + 0.45 * len(s.phases))


def roofline(s: Summary) -> str | None:
    """The kernel slots' achieved FLOP/s against the measured compute and bandwidth ceilings."""
    if s.roofline is None or not s.roofline.points:
        return None
    r = s.roofline

    def draw(fig: Figure) -> None:
        ax = fig.add_subplot()
        bw = r.ceilings.copy_bytes_per_s
        peaks = r.ceilings.matmul_flops_per_s
        lo = min(min(p.intensity for p in r.points), min(peaks.values()) / bw) / 4
        hi = max(max(p.intensity for p in r.points), max(peaks.values()) / bw) * 4
        xs = [lo * (hi / lo) ** (i / 200) for i in range(201)]
        for dtype, peak in sorted(peaks.items()):
            ax.plot(xs, [min(peak, x * bw) for x in xs], linewidth=1.5, label=f"roof {dtype}")
        markers = {label: m for label, m in zip(dict.fromkeys(p.label for p in r.points), "os^D")}
        for label, marker in markers.items():
            pts = [p for p in r.points if p.label == label]
            ax.scatter([p.intensity for p in pts], [p.achieved_flops_per_s for p in pts], marker=marker, zorder=3,
                       label=f"slots ({label})")
            for p in pts:
                ax.annotate(f"{p.slot} {100 * p.roofline_fraction:.0f}%", (p.intensity, p.achieved_flops_per_s),
                            xytext=(4, 3), textcoords="offset points", fontsize=7)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("arithmetic intensity, FLOP/byte")
        ax.set_ylabel("FLOP/s")
        ax.legend(fontsize=8)
    return _draw("roofline", draw, height=3.6)


def spend(runs: Labelled) -> str | None:
    """Cumulative dollars after each LLM call, one line per run and tier; failed calls marked."""
    if not any(s.llm_calls for _, s in runs):
        return None

    def draw(fig: Figure) -> None:
        ax = fig.add_subplot()
        for label, s in runs:
            for tier in dict.fromkeys(c.tier for c in s.llm_calls):
                calls = [c for c in s.llm_calls if c.tier == tier]
                total, xs, ys = 0.0, [0], [0.0]
                for n, c in enumerate(calls, start=1):
                    total += c.cost_usd
                    xs.append(n)
                    ys.append(total)
                name = f"{label}: {tier}" if len(runs) > 1 else tier
                line, = ax.step(xs, ys, where="post", label=name)
                failed = [(n, ys[n]) for n, c in enumerate(calls, start=1) if not c.ok]
                if failed:
                    ax.scatter(*zip(*failed), marker="x", color=line.get_color(), zorder=3)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel("LLM calls (x: failed)")
        ax.set_ylabel("cumulative $")
        ax.legend(fontsize=8, loc="upper left")
    return _draw("spend", draw)
