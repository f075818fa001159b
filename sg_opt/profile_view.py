"""`sg-opt profile`: the phase table, top ops, kernel slots on the roofline, and ranked findings; for a
ranked profile, each rank's phases and share of collectives beside the slowest rank's full profile."""

from __future__ import annotations

from rich import box
from rich.console import Console
from rich.table import Table

from profilers.floor import floor_sentence
from profilers.records import ProfileResult, RankProfile, StepFloor
from sg_opt.report_text import over_floor_text


NARROW = 100  # a console narrower than this (a CI log's 80 columns) gets tables without vertical rules


LABELS = ("", "phase", "bound", "slot", "category")  # short words: never broken


def _table(title: str, columns: tuple[str, ...], text: tuple[str, ...], console: Console) -> Table:
    """A table whose figures and labels are never cut or broken (a cut figure reads as another number): only the
    long ``text`` columns (op names, evidence) wrap, and on a narrow console the rules between columns go, which
    leaves room for the rest."""
    narrow = console.width < NARROW
    table = Table(title=title, box=box.SIMPLE_HEAD if narrow else box.HEAVY_HEAD, pad_edge=not narrow)
    for col in columns:
        if col in LABELS:
            table.add_column(col, justify="left", no_wrap=True)
        elif col in text:
            table.add_column(col, justify="left", overflow="fold")
        else:
            table.add_column(col, justify="right", no_wrap=True)
    return table


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{1e3 * seconds:.2f}"


def _render_floor(floor: StepFloor, console: Console) -> None:
    table = _table("phases against their roofline floor (least work at the measured ceilings)",
                   ("phase", "ms", "floor ms", "x floor", "bound", "GFLOP", "dev MB", "bus MB"),
                   ("phase", "bound"), console)
    for name, p in floor.phases.items():
        table.add_row(name, _ms(p.measured_s), f"{1e3 * p.floor_s:.4f}", over_floor_text(p.measured_s, p.floor_s), p.bound,
                      f"{p.flops / 1e9:.3g}", f"{p.bytes / 1e6:.3g}", f"{p.bus_bytes / 1e6:.3g}")
    console.print(table)
    console.print(floor_sentence(floor))


def _percent(share: float | None) -> str:
    return "-" if share is None else f"{100 * share:.1f}%"


def _render_ranks(ranks: list[RankProfile], main_rank: int | None, console: Console) -> None:
    """One column per rank: its step, each phase's time and its collectives, the slowest rank marked."""
    table = _table("ranks (ms per step; * the slowest, whose profile is shown above and below)",
                   ("", *(f"rank {r.rank}{' *' if r.rank == main_rank else ''}" for r in ranks)), ("",), console)
    table.add_row("step", *(_ms(r.step_s) for r in ranks))
    table.add_row("step, unprofiled", *(_ms(r.unprofiled_step_s) for r in ranks))
    table.add_section()
    for phase in dict.fromkeys(name for r in ranks for name in r.phase_s):
        table.add_row(phase, *(_ms(r.phase_s.get(phase)) for r in ranks))
    table.add_section()
    table.add_row("collectives in flight", *(_ms(r.comm_s) for r in ranks))
    table.add_row("share of the step", *(_percent(r.comm_share) for r in ranks))
    console.print(table)


def render(result: ProfileResult, console: Console) -> None:
    coarse, env = result.coarse, result.environment
    where = f"{env.device} ({env.device_name})"
    if result.ranks:
        where = f"{len(result.ranks)} ranks on {where}, slowest rank {result.main_rank}"
    comm = "" if coarse.comm_share is None else \
        f"; collectives in flight {_percent(coarse.comm_share)} of the step"
    console.print(f"[bold]{result.target} @ {result.size}[/] on {where}: "
                  f"{_ms(coarse.step_s)} ms per profiled step, {_ms(coarse.unprofiled_step_s)} ms without the "
                  f"profiler (overhead x{coarse.profiler_overhead:.2f}); {100 * coarse.attributed_share:.1f}% of "
                  f"the step in named phases{comm}")
    if (distorted := coarse.distortion_note()) is not None:
        console.print(f"[yellow]distorted profile[/]: {distorted}")
    if result.ranks:
        _render_ranks(result.ranks, result.main_rank, console)
    phases = _table("phases (per step)", ("phase", "host ms", "of it waiting", "device ms", "share", "host ops",
                                          "launches"), ("phase",), console)
    for name, p in coarse.phases.items():
        phases.add_row(name, _ms(p.host_s), _ms(p.host_wait_s), _ms(p.device_s), f"{100 * p.share:.1f}%",
                       f"{p.ops:.0f}", "-" if p.launches is None else f"{p.launches:.0f}")
    console.print(phases)
    if result.floor is not None:
        _render_floor(result.floor, console)
    ops = _table(f"top ops by self {coarse.time_basis} time", ("op", "ms / step", "calls / step", "share"), ("op",),
                 console)
    for op in coarse.top_ops[:10]:
        ops.add_row(op.name, _ms(op.self_s), f"{op.calls:.0f}", f"{100 * op.share:.1f}%")
    console.print(ops)
    if coarse.host_work:
        work = _table("host work by phase and op (self time, waits on the device apart)",
                      ("phase", "op", "ms / step", "calls / step"), ("phase", "op"), console)
        for w in coarse.host_work[:10]:
            work.add_row(w.phase, w.op, _ms(w.self_s), f"{w.calls:.1f}")
        console.print(work)
    if coarse.host_waits:
        waits = _table("host waits on the device, by the op that made them",
                       ("phase", "op", "runtime call", "ms / step", "calls / step"), ("phase", "op", "runtime call"),
                       console)
        for w in coarse.host_waits:
            waits.add_row(w.phase, w.op, w.call, _ms(w.wait_s), f"{w.calls:.1f}")
        console.print(waits)
    if coarse.device_idle_fraction is not None:
        console.print(f"device idle {100 * coarse.device_idle_fraction:.1f}% of the window, "
                      f"{coarse.kernel_launches_per_step:.0f} kernel launches per step, peak memory "
                      f"{coarse.peak_memory_bytes / 2**30:.2f} GiB")
    if result.fine is not None:
        slots = _table(f"kernel slots on the roofline ({result.fine.timing})",
                       ("slot", "shape", "ms", "TFLOP/s", "GB/s", "bound", "of roof"), ("slot", "shape", "bound"),
                       console)
        for s in result.fine.slots:
            shape = " ".join(f"{k}={v}" for k, v in s.shape.items())
            slots.add_row(s.slot, shape, _ms(s.median_s), f"{s.achieved_flops_per_s / 1e12:.3f}",
                          f"{s.achieved_bytes_per_s / 1e9:.1f}", s.bound, f"{100 * s.roofline_fraction:.1f}%")
        console.print(slots)
        if result.fine.op_timings:
            ops_t = _table("top ops per call, in situ on the running config's shapes",
                           ("op", "shapes", "ms / call", "calls / step", "TFLOP/s", "GB/s in", "of roof"),
                           ("op", "shapes"), console)
            for o in result.fine.op_timings:
                flops = "-" if o.achieved_flops_per_s is None else f"{o.achieved_flops_per_s / 1e12:.3f}"
                roof = "-" if o.roofline_fraction is None else f"{100 * o.roofline_fraction:.1f}%"
                ops_t.add_row(o.name, " ".join("x".join(map(str, s)) for s in o.shapes if s), _ms(o.median_s),
                              f"{o.calls_per_step:.0f}", flops, f"{o.achieved_bytes_per_s / 1e9:.1f}", roof)
            console.print(ops_t)
    found = _table("findings, largest possible gain first", ("category", "share", "headroom", "step gain",
                                                            "evidence"), ("category", "evidence"), console)
    for f in result.findings:
        found.add_row(f.category, f"{100 * f.share:.1f}%", f"x{f.headroom:.2f}", f"x{f.amdahl_gain:.2f}", f.evidence)
    console.print(found)
    for note in result.notes:
        console.print(f"[dim]note: {note}[/]")


if __name__ == "__main__":  # python -m sg_opt.profile_view PROFILE.json: a saved `sg-opt profile --json`, shown
    import sys
    from pathlib import Path

    render(ProfileResult.model_validate_json(Path(sys.argv[1]).read_text()), Console(width=140))
