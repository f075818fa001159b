"""`sg-opt optimize`: builds the agent for one run (target, tier, LLM client, ledger) and drives it.

The graph lives in ``state_machine``; this module hands it the openai-backed client and the
file-backed ledger, a report writer, and a live view, and starts or resumes the run. All user
input is checked here before the first worker starts, so a mistake costs a second, not a baseline.
"""

from __future__ import annotations

import contextlib
import shutil
import sqlite3
import time
from pathlib import Path
from typing import Any, Iterator

from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from sg_opt.ledger import TokenLedger
from sg_opt.llm_client import check_reachable, make_client
from sg_opt.redact import resolve_base_url
from sg_opt import run_machine
from sg_opt.report import load_state, write_report
from sg_opt.run_store import RunRequest, check_checkpoint, create_run, find_run, refuse_restart
from sg_opt.summary import SUMMARY_FILE, Summary
from sg_opt.summary_build import build_summary
from sg_opt.tiers import load_tiers
from state_machine import compaction, events, graph
from state_machine.context import ProposerPolicy, RunContext
from state_machine.proposers.registry import check_proposer
from state_machine.state import EvalPlan, Limits, RunState
from targets.protocol import ConfigError
from targets.registry import resolve_target
from validators.started_ahead import WorkerPool


def check_gpus(gpus: int, ranks: int, device: str) -> None:
    """ConfigError unless --gpus N can give each of N / ranks concurrent candidates its own GPUs here."""
    if gpus == 1:
        return
    if not device.startswith("cuda"):
        raise ConfigError(f"--gpus {gpus} evaluates candidates on separate GPUs: it needs --device cuda")
    if gpus % ranks:
        raise ConfigError(f"--gpus {gpus} must be a multiple of --ranks {ranks}: every candidate runs on "
                          f"{ranks} GPU(s) of its own")
    import torch

    if torch.cuda.device_count() < gpus:
        raise ConfigError(f"--gpus {gpus} asks for more GPUs than the {torch.cuda.device_count()} visible here")


def build_context(request: RunRequest, run_dir: Path,
                  base_url_given: str | None = None) -> tuple[RunContext, RunState]:
    """The context and initial state of a run; raises ConfigError for anything the user must fix.
    ``base_url_given``: the endpoint with its credentials, where the request stores them blanked."""
    target = resolve_target(request.target)
    target.check_size(request.size)
    target.check_ranks(request.ranks)
    check_gpus(request.gpus, request.ranks, request.device)
    target.knob_space.check_ranks(target.knob_space.resolve(request.config), request.ranks)
    tiers = load_tiers(request.tiers_file)
    tier = tiers.tier(request.tier)
    check_proposer(request.search, tier.name)  # the search exists, runs on this tier, and what it needs imports
    budget = tier.budget_usd if request.budget_usd is None else request.budget_usd
    base_url = resolve_base_url(request.base_url, base_url_given)
    llm = make_client(tier, base_url, request.model, request.llm_timeout_s)
    if llm is not None and base_url:
        check_reachable(base_url)
    ledger = TokenLedger(run_dir, tiers.prices, budget, models=[llm.model] if llm else [])
    ledger.path.touch()  # every run has a ledger, even one that makes no call
    policy = ProposerPolicy(tier=tier.name, search=request.search,
                            candidates_per_iteration=tier.candidates_per_iteration, kinds=tuple(tier.kinds),
                            reasoning_effort=tier.reasoning_effort, max_output_tokens=tier.max_output_tokens,
                            reply_repairs=tier.reply_repairs, kernel_repairs=tier.kernel_repairs)
    ctx = RunContext(target=target, policy=policy, llm=llm, ledger=ledger,
                     write_report=lambda state: write_report(state, target), pool=WorkerPool())
    try:
        # a tier that rewrites kernels gets each slot's time and roofline position (the fine profile) in its prompt
        fine = {"fine_profile": True} if llm is not None and "kernel" in tier.kinds and target.kernel_slots else {}
        plan = EvalPlan(**(fine | request.plan))
    except ValueError as exc:
        raise ConfigError(f"bad evaluation plan: {exc}") from None
    if plan.quality_steps is None:  # a quality run trains the steps the target asks for
        plan = plan.model_copy(update={"quality_steps": target.steps_for_quality(request.size)})
    if request.allow_model_changes and not target.quality_metrics:
        raise ConfigError(f"target {target.name} declares no quality metric (Target.quality_metrics), so a model "
                          f"change cannot be judged; drop --allow-model-changes")
    state = RunState(run_id=request.run_id, run_dir=str(run_dir), target=request.target, size=request.size,
                     device=request.device, data=request.data, threads=request.threads, ranks=request.ranks,
                     gpus=request.gpus,
                     seed=request.seed, tier=tier.name, allow_model_changes=request.allow_model_changes,
                     limits=Limits(max_iters=request.max_iters or tier.max_iterations,
                                   max_minutes=request.max_minutes, budget_usd=budget),
                     plan=plan, baseline_config=dict(request.config))
    return ctx, state


def ranks_note(ranks: int) -> str:
    return f" x {ranks} ranks" if ranks > 1 else ""


class LiveView:
    """The run as it happens: the node running, the incumbent's speedup, the spend, the last verdicts. Where the
    console is not a terminal (a log file, CI), one line per event instead, so a log shows how far a run got
    even when it is stopped (a terminal's live view is written to a file only when it ends)."""

    def __init__(self, console: Console, request: RunRequest):
        self.console, self.request = console, request
        self.node, self.state, self.last = "setup", None, []
        self.start = time.monotonic()
        self.live = (Live(self._render(), console=console, refresh_per_second=2, transient=False)
                     if console.is_terminal else None)  # None: one log line per event

    def __enter__(self) -> "LiveView":
        if self.live is not None:
            self.live.__enter__()
        else:
            self._line(f"run {self.request.run_id} ({self.request.target} @ {self.request.size}, "
                       f"{self.request.device}{ranks_note(self.request.ranks)}, tier {self.request.tier})")
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.live is not None:
            self.live.__exit__(*exc)

    def _line(self, text: str) -> None:
        self.console.print(f"[{time.monotonic() - self.start:6.0f} s] {text}", highlight=False, soft_wrap=True,
                           markup=False)

    def on_event(self, record: events.Event) -> None:
        line = None  # what a log gets for this event
        match record:
            case events.Decide():
                verdict = "accepted" if record.accepted else f"rejected at {record.stage}"
                line = f"#{record.id} {verdict}: {record.reason}"
                self.last = (self.last + [line])[-4:]
                if record.accepted:
                    self.node = "diagnose: the new incumbent (its noise floor again, if much faster), profiling"
            case events.Recalibrate():
                self.node = "diagnose: profiling"
                line = (f"noise floor {100 * record.noise_floor:.1f}% on the incumbent after #{record.after} "
                        f"({record.step_ms:.2f} ms/step)")
            case events.Validated():
                took = (f" after {record.wall_s:.0f} s (build {record.build_s or 0:.0f} s)"
                        if record.wall_s is not None else "")
                line = f"#{record.id} numerics hold ({record.numerics_class}){took}; timing it"
            case events.LLMWarning():
                line = f"LLM spend: {record.reason}"
            case events.KernelRepair():
                line = f"#{record.of} goes back to the LLM with its verdict: {record.reason}"
            case events.Paused():
                line = f"paused before {record.node}: {record.reason}"
            case events.ProfileDisturbed():
                line = f"the incumbent's profile was disturbed: {record.reason}"
            case events.NumericsRetry():
                line = (f"#{record.id} numerics run failed beside its timing workers ({record.kind}: "
                        f"{record.reason}); once more without them")
            case events.BaselineStage():
                self.node = f"baseline: {record.stage}"
                line = self.node + (f" ({record.cut})" if record.cut else "")
            case events.Propose():
                self.node = line = f"evaluating #{record.id} {record.patch or ''} {record.kernels or ''}".strip()
            case events.Setup():
                self.node = "baseline: numerics, A/A noise floor"
            case events.Baseline():
                self.node = "diagnose: profiling"
                line = f"baseline {record.step_ms:.2f} ms/step, noise floor {100 * record.noise_floor:.1f}%"
            case events.Diagnose():
                self.node = "proposing"
                if record.distorted:
                    line = f"the incumbent's profile is distorted: {record.distorted}"
            case events.Report():
                self.node = "report"
                line = f"report written; stopped by {record.stop_reason}"
        if self.live is not None:
            self.live.update(self._render())
        elif line is not None:
            self._line(line)

    def on_update(self, node: str, state: RunState) -> None:
        self.state = state
        if self.live is not None:
            self.live.update(self._render())

    def _render(self) -> Group:
        table = Table.grid(padding=(0, 2))
        table.add_column(style="bold")
        table.add_column()
        s = self.state
        table.add_row("run", f"{self.request.run_id} ({self.request.target} @ {self.request.size}, "
                             f"{self.request.device}{ranks_note(self.request.ranks)}, tier {self.request.tier})")
        table.add_row("now", self.node)
        if s is not None and s.baseline is not None:
            table.add_row("baseline", f"{s.baseline.step_ms:.2f} ms/step, noise floor {100 * s.baseline.noise_floor:.1f}%")
            for r in s.recalibrations:
                table.add_row("", f"noise floor {100 * r.noise_floor:.1f}% on the incumbent after #{r.after_candidate} "
                                  f"({r.step_ms:.2f} ms/step)")
            table.add_row("incumbent", f"x{s.incumbent.est_speedup:.2f} (product of accepted side-by-side speedups)")
        if s is not None:
            table.add_row("candidates", f"{s.evaluated} evaluated of at most {s.limits.max_iters}, "
                                        f"{len(s.accepted)} accepted")
            table.add_row("spend", f"${s.spent_usd:.4f} of ${s.limits.budget_usd:g}")
        table.add_row("elapsed", f"{time.monotonic() - self.start:.0f} s")
        return Group(table, *[Text(line, overflow="ellipsis", no_wrap=True) for line in self.last])


def final_table(summary: Summary) -> Table:
    table = Table(title=f"{summary.target} @ {summary.size}: {summary.evaluated} candidates, "
                        f"{summary.accepted} accepted, ${summary.spend.cost_usd:.4f}")
    for col in ("#", "change", "verdict", "ratio", "why"):
        table.add_column(col, overflow="fold")
    for c in summary.candidates:
        table.add_row(str(c.id), c.change, "[green]accepted[/]" if c.accepted else f"rejected ({c.stage})",
                      f"{c.ratio:.3f}" if c.ratio is not None else "-", c.reason)
    return table


def result_sentence(summary: Summary) -> str:
    f = summary.final
    if f is not None and f.speedup is not None and not f.clean:
        return (f"could not measure cleanly: the final side-by-side measurement was not clean ({f.load}); "
                f"{summary.accepted} change(s) kept, stopped by {summary.stop_reason}")
    if f is not None and f.speedup is not None:
        return (f"best: x{f.speedup:.2f} faster than the baseline (step ratio {f.ratio:.3f}, 95% interval "
                f"{f.ci_low:.3f}-{f.ci_high:.3f}), {summary.accepted} change(s) kept, ${summary.spend.cost_usd:.4f} "
                f"spent, stopped by {summary.stop_reason}")
    if f is not None and f.note:  # the final measurement failed: say how, and how to measure again
        return f"no faster configuration was proven: {f.note}"
    if summary.stop_reason is None:
        return (f"the run has not finished ({summary.evaluated} candidates, {summary.accepted} accepted, no final "
                f"measurement yet): continue it with sg-opt optimize --resume {summary.run_id}")
    return f"no faster configuration was proven; stopped by {summary.stop_reason}"


def start(request: RunRequest, out: str, console: Console, quiet: bool = False,
          pause_after_s: float | None = None) -> tuple[RunState, Summary]:
    run_dir = create_run(out, request)
    run_machine.record_start(run_dir, request.device)
    try:
        ctx, state = build_context(request, run_dir, request.base_url)
    except ConfigError:
        shutil.rmtree(run_dir, ignore_errors=True)  # nothing ran: leave no empty run behind
        raise
    return _drive(ctx, state, request, run_dir, console, quiet, pause_after_s)


def resume(run_id: str, out: str, console: Console, quiet: bool = False,
           pause_after_s: float | None = None, base_url: str | None = None,
           on_another_machine: bool = False) -> tuple[RunState, Summary]:
    run_dir, request = find_run(out, run_id)
    check_checkpoint(run_dir)
    evaluated, environment = _so_far(run_dir)
    run_machine.check_resume(run_dir, request.device, evaluated, on_another_machine, environment)
    ctx, initial = build_context(request, run_dir, base_url)
    started = graph.has_checkpoint(ctx, run_dir, request.run_id)
    if started:
        graph.upgrade(ctx, run_dir, request.run_id)  # a checkpoint written before the state's current shape
        graph.relocate(ctx, run_dir, request.run_id)  # moved, or resumed from another working directory
    else:
        refuse_restart(run_dir)  # a run with results and no checkpoint is never started over on top of them
    return _drive(ctx, None if started else initial, request, run_dir, console, quiet, pause_after_s)


def _so_far(run_dir: Path) -> tuple[int, dict | None]:
    """Candidates the run had evaluated, and its baseline's environment, from its state file or else its last
    checkpoint (0 and None without either: the checkpoint decides the resume; these date a move of machine and,
    for a run from before machine records, tell where it measured)."""
    saved = load_state(run_dir)
    if saved is None:
        return 0, None
    return saved.evaluated, saved.baseline.environment if saved.baseline else None


def _drive(ctx: RunContext, state: RunState | None, request: RunRequest, run_dir: Path, console: Console,
           quiet: bool, pause_after_s: float | None = None) -> tuple[RunState, Summary]:
    """Run the graph to its report, or until ``pause_after_s`` leaves no room for its next node (graph.Paused);
    however it ends, the workers started ahead that no measurement came to are killed (``ctx.pool``), and the
    checkpoints no resume reads are dropped (``compaction``)."""
    if pause_after_s is not None:
        ctx.pause_at = time.monotonic() + pause_after_s
    with ctx.pool, _compacted(run_dir, request.run_id):
        if quiet:
            final = graph.run(ctx, state, run_dir, request.run_id)
        else:
            view = LiveView(console, request)
            ctx.on_event = view.on_event
            with view:
                final = graph.run(ctx, state, run_dir, request.run_id, on_update=view.on_update)
    written = run_dir / SUMMARY_FILE  # the report node wrote it from the same final state
    return final, (Summary.model_validate_json(written.read_text()) if written.is_file() else build_summary(final))


@contextlib.contextmanager
def _compacted(run_dir: Path, run_id: str) -> Iterator[None]:
    """On the way out, however the invocation ends: a checkpoint file that cannot be compacted (locked, damaged)
    stays as it was, whole, since the deletion is one transaction."""
    try:
        yield
    finally:
        with contextlib.suppress(sqlite3.Error):
            compaction.compact(run_dir, run_id)
