"""`sg-opt gate`: fail a CI job when a change makes training slower or changes what it computes.

This module holds the rules, the options and the result; the modes are ``sg_opt.gate_side_by_side`` (``--ref``,
``--ref-tree``) and ``sg_opt.gate_baseline`` (``--baseline``), the ``--ref`` checkout ``sg_opt.gate_checkout``.

Two ways to get the "before" side:

* ``--ref REV`` (preferred): the code at REV is checked out with ``git worktree add --detach`` into a
  temporary folder (removed afterwards, whatever happens) and its workers run there, importing from it
  first, so REV's own target code is measured (in sg-opt's own repository that includes REV's worker
  and timing loop, which are in the same packages). Side A = REV, side B = the working tree, both the same
  request (target, size, knobs, device, threads), timed interleaved on the same cores
  (``validators.speedup.measure_ab``) in ``--ab-runs`` runs (default 2), each in fresh workers. The noise
  floor comes from ``--aa-runs`` A/A runs of REV (default 3; ``calibrate_noise_floor``) unless ``--floor`` gives it:
  the bias plus half-width of the interval over all of them (below), at least ``MIN_FLOOR``.
* ``--baseline FILE``: figures saved by ``sg-opt bench --save FILE``; the working tree re-runs the saved
  request in as many fresh processes as were saved. Not interleaved, so its interval and floor are those
  of ``sg_opt.saved_baseline`` (bootstrap over steps; floor 2% + the spread of each side's runs), wider
  than an A/A floor; another device is refused.

**The step-time rule** (both modes; ratio = B time / A time, below 1 is faster; [low, high] its 95%
interval; m = ``--max-regression``, default 5%; floor = the noise floor):

    regression    when  low  > 1 + max(m, floor)
    pass          when  high < 1 + m   and   floor <= m
    inconclusive  otherwise

A regression is a slowdown beyond the allowed one with confidence, and larger than identical code was seen
to differ by: on a machine whose floor is 15%, a no-op may show [1.06, 1.12], which is noise, not a
regression. A pass is a slowdown within the allowed one with confidence, on a machine that can see a
slowdown of m at all: where the floor is wider than m, an interval under 1 + m may be noise too (A/A runs
of identical code differed by more than m). Everything else, an interval that straddles 1 + m (a real
slowdown of 6% against a budget of 5%, measured to +-3%) or a floor wider than m, is inconclusive, which
never passes silently: the gate measures more (below), and what is still inconclusive then exits 3. The
rule before this one passed a slowdown beyond m that was not clear of the floor, with a warning: a 15%
slowdown passed against a floor of 15.9%, and a 52% one against 62.7%.

**Pairs of workers are the units.** Two identical workers differ by an offset of their own that lasts as long
as they do. Its largest cause is removed where it arises (how many of a step's pages glibc hands back and
faults in again depended on each process's history; workers now run with fixed thresholds,
``targets.fork_server.fixed_allocator_env``), but what is left still makes the blocks of one run no
independent draws of the ratio. Several runs (A/A or A/B) are therefore combined by
``validators.confirmation.pooled``: the geometric mean of each run's ratio, and a two-level bootstrap interval
(runs drawn, then each drawn run's block pairs), which carries the spread between pairs of workers and narrows
as runs, not blocks, accrue (``validators.ab_stats.pairs_ratio_ci``: pooled as if every block pair were
independent, eight pairs of identical workers 8% apart held 1 in half of 200 synthetic draws). The gate's first
verdict already rests on ``--ab-runs`` pairs (default 2), so that no single pair's offset is read as a change.

**Measuring more** (``--max-extensions N``, default 3): while the step time is inconclusive, each extension
runs, in fresh workers,

* where the floor is wider than m and was calibrated (not ``--floor``), ``--aa-runs`` more A/A runs of A (as
  many pairs of workers as the first floor had); the floor is then the bias plus half-width of the interval
  over every A/A run so far (``pooled``), at least ``MIN_FLOOR``: more pairs of workers, a narrower interval
  and a bias that averages their offsets out;
* where the A/B interval holds 1 + m, ``--ab-runs`` more A/B runs (as many pairs of workers as the first look
  had), pooled with the earlier ones (``pooled``): the interval narrows as pairs accrue, and beside a one-core
  busy loop one more pair a look left a no-op's interval at [0.966, 1.068] after three looks;
* ``--baseline``: one more run of the working tree (the saved side cannot grow, and the unpaired floor,
  2% + the spreads of both sides, does not narrow with runs: a floor wider than m there stays inconclusive).

It stops as soon as the verdict is clear, when nothing left can be measured more, or when the numerics check
has failed (the gate fails anyway). Each look is at a 95% interval, so the chance that a slowdown right at
the budget passes is at most (1 + N) x 2.5% by the union bound (10% at the default), and lower in fact, as
the looks share their blocks, and far lower for a slowdown well past the budget. ``--floor`` wider than
``--max-regression`` is refused (exit 2): no measurement could then pass.

**A busy machine** (CPU, ``--threads`` not given): before the first run the gate waits for outside load to drop
and, where a steady load outlasts the wait, times every run on the threads the load leaves, saying so in its
warnings (``validators.cpu_share``).

**The numerics rule**: the numerics fingerprint (``--numerics-steps`` steps at seed 0) of B must pass
``validators.numerics.compare`` against A's under ``--numerics-class`` (default ``reorder``: same math,
any float association); a non-finite value always fails.

**Ranks**: ``--ranks N`` runs every worker of the gate as an N-rank torch.distributed job (the step
time is then each step's slowest rank, see ``targets.rank_worker``). A saved baseline holds the ranks
it was measured with and runs on them again; a gate that asks for another number is refused.

Exit codes: 0 both pass; 1 a regression, a numerics failure, or the working tree's workload failing;
2 usage or set-up errors (bad REV, not a git repository, the target not running at REV, a baseline
from another device or number of ranks), reported in one sentence; 3 inconclusive after the extensions
(``--allow-inconclusive`` makes that 0, with a warning in every report; JUnit then marks the step time
skipped, not failed).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Literal

from pydantic import BaseModel, Field

from sg_opt import saved_baseline
from targets.protocol import ConfigError
from targets.worker_protocol import Environment, Failure, NumericsData, WorkerRequest, WorkerResult
from validators.numerics import NumericsVerdict, compare
from validators.ab_result import ABResult

GATE_SCHEMA_VERSION = 2  # 2: verdicts of three values, the outcome, and the extensions made
MAX_REGRESSION = 0.05
MAX_EXTENSIONS = 3
# A/B runs, each in fresh workers, before the first verdict: one pair's offset (up to 10% at `tiny` on the 2-core VM)
# is no difference of the code, and only a second pair tells them apart (see "Pairs of workers are the units").
AB_RUNS = 2
# A/A runs before the first verdict: the floor is an interval over pairs of workers, and over two it is little more
# than their range (at `tiny` on the 2-core VM, 2026-12-06, a no-op's floor was 7.7% after three runs, 5.0% after five).
AA_RUNS = 3
INCONCLUSIVE_EXIT = 3
RULE = ("regression if ci_low > 1 + max(max_regression, floor); pass if ci_high < 1 + max_regression and "
        "floor <= max_regression; else inconclusive: measured more, then exit 3 (ratio = B time / A time)")
Progress = Callable[[str], None]
StepVerdict = Literal["pass", "regression", "inconclusive", "failed"]
Outcome = Literal["pass", "regression", "inconclusive"]


class GateSetupError(ConfigError):
    """The gate could not be set up (bad revision, unusable baseline, A does not run): exit 2."""


@dataclass(frozen=True)
class GateOptions:
    max_regression: float = MAX_REGRESSION
    numerics_class: str = "reorder"
    numerics_steps: int = saved_baseline.NUMERICS_STEPS
    blocks: int = 10
    block_steps: int = 10
    # Blocks of at least this long: at `tiny` on a 2-core VM ten steps last tens of ms, where one scheduling hiccup
    # moves a block's mean by percents and the A/A floor passes the 5% budget.
    block_seconds: float = 0.5
    floor: float | None = None
    aa_runs: int = AA_RUNS
    ab_runs: int = AB_RUNS
    timeout_s: float = 1800.0
    max_extensions: int = MAX_EXTENSIONS
    allow_inconclusive: bool = False


class StepTimeCheck(BaseModel):
    verdict: StepVerdict = Field(description="the step-time rule's verdict; failed: the working tree's run failed")
    passed: bool
    ratio: float | None = Field(None, description="B time / A time: below 1 is faster")
    ci_low: float | None = None
    ci_high: float | None = None
    floor: float
    floor_source: str
    max_regression: float
    a_ms: float | None = Field(None, description="A's median step time")
    b_ms: float | None = None
    extensions: int = Field(0, description="times the measurement was extended because it was inconclusive")
    message: str
    failure: Failure | None = None


class NumericsCheck(BaseModel):
    passed: bool
    numerics_class: str
    steps: int
    message: str
    verdict: NumericsVerdict | None = None
    failure: Failure | None = None


class GateResult(BaseModel):
    version: int = GATE_SCHEMA_VERSION
    mode: Literal["ref", "baseline"]
    outcome: Outcome = Field(description="pass; regression: slower, other numerics or the working tree failing "
                                         "(exit 1); inconclusive (exit 3, or 0 with --allow-inconclusive)")
    passed: bool = Field(description="the outcome is pass (an inconclusive one let through is not)")
    exit_code: int
    target: str
    size: str
    config: dict[str, Any]
    device: str
    ranks: int = Field(1, description="the processes of the torch.distributed job each side ran as (1: none)")
    a_label: str
    b_label: str
    rule: str = RULE
    max_extensions: int = MAX_EXTENSIONS
    allow_inconclusive: bool = False
    step_time: StepTimeCheck
    numerics: NumericsCheck
    warnings: list[str] = Field(default_factory=list)
    environment: Environment | None = None
    ab: ABResult | None = Field(None, description="--ref: the interleaved measurement, block medians included (every "
                                                  "A/B run pooled, each pair of workers a unit, when extended)")
    wall_s: float = 0.0


# -- the rules -------------------------------------------------------------------------------------

def step_verdict(ci_low: float, ci_high: float, floor: float, max_regression: float) -> StepVerdict:
    """The step-time rule (the module docstring says why)."""
    if ci_low > 1.0 + max(max_regression, floor):
        return "regression"
    if ci_high < 1.0 + max_regression and floor <= max_regression:
        return "pass"
    return "inconclusive"


def holds_a_bound(check: StepTimeCheck) -> bool:
    """Whether the interval holds a bound its verdict hinges on, so that more blocks, narrowing it, may settle it."""
    return any(check.ci_low <= 1.0 + bound <= check.ci_high
               for bound in (check.max_regression, max(check.max_regression, check.floor)))


def share(value: float) -> str:
    """0.05 -> '5%', 0.001 -> '0.1%' (an allowed regression as the user gave it)."""
    return f"{100 * value:.4g}%"


def judge_step_time(ratio: float, ci_low: float, ci_high: float, floor: float, floor_source: str,
                    max_regression: float, a_ms: float, b_ms: float) -> StepTimeCheck:
    """The step-time check, its message a sentence naming the numbers it rests on."""
    numbers = (f"B/A = {ratio:.4f}, 95% interval [{ci_low:.4f}, {ci_high:.4f}], noise floor {floor:.4f}, "
               f"allowed regression {share(max_regression)}")
    verdict = step_verdict(ci_low, ci_high, floor, max_regression)
    if verdict == "regression":
        message = (f"B is {ratio - 1:.1%} slower than A: the whole interval is beyond the allowed "
                   f"{share(max_regression)} and the noise floor")
    elif verdict == "pass":
        message = f"B is within the allowed regression of A: the whole interval is below {1 + max_regression:.4f}"
    else:
        why = [f"the noise floor {floor:.1%} is wider than the allowed {share(max_regression)}, so this machine cannot "
               f"tell a slowdown that small from noise"] if floor > max_regression else []
        if ci_low <= 1.0 + max_regression <= ci_high:
            why.append(f"the interval holds {1 + max_regression:.4f}: B may be slower than allowed, or not")
        elif ci_low > 1.0 + max_regression:
            why.append("the interval is beyond the allowed regression but not clear of the noise floor")
        message = "inconclusive: " + "; ".join(why)
    return StepTimeCheck(verdict=verdict, passed=verdict == "pass", ratio=ratio, ci_low=ci_low, ci_high=ci_high,
                         floor=floor, floor_source=floor_source, max_regression=max_regression, a_ms=a_ms,
                         b_ms=b_ms, message=f"{message} ({numbers})")


def until_clear(judge: Callable[[], StepTimeCheck], extend: Callable[[StepTimeCheck], str | None],
                options: GateOptions, progress: Progress) -> StepTimeCheck:
    """Judge, and while inconclusive extend (``extend`` measures more, or returns why it cannot) and judge again,
    at most ``max_extensions`` times."""
    check, done, stopped = judge(), 0, None
    while check.verdict == "inconclusive" and done < options.max_extensions:
        progress(f"the step time is inconclusive: measuring more ({done + 1} of at most {options.max_extensions}) ...")
        stopped = extend(check)
        if stopped is not None:
            break
        done += 1
        check = judge()
    if check.verdict == "inconclusive":
        said = f"measured more {done} time(s) of at most {options.max_extensions} (--max-extensions)"
        said += f", then stopped: {stopped}" if stopped else ""
        check = check.model_copy(update={"message": f"{check.message}; {said}"})
    return check.model_copy(update={"extensions": done})


def judge_numerics(a: NumericsData, b: WorkerResult, options: GateOptions, steps: int) -> NumericsCheck:
    """B's numerics run against A's fingerprint; B's run failing fails the check."""
    common = dict(numerics_class=options.numerics_class, steps=steps)
    if not b.ok:
        return NumericsCheck(passed=False, failure=b.failure, message=_failed_check(b.failure, "numerics run"),
                             **common)
    verdict = compare(a, b.numerics, options.numerics_class)
    return NumericsCheck(passed=verdict.ok, verdict=verdict, message=verdict.detail, **common)


def _failed_check(failure: Failure, what: str) -> str:
    return f"the working tree's {what} failed ({failure.kind}): {failure.message}"


def failed_timing(failure: Failure, floor: float, floor_source: str, options: GateOptions) -> StepTimeCheck:
    return StepTimeCheck(verdict="failed", passed=False, floor=floor, floor_source=floor_source, failure=failure,
                         max_regression=options.max_regression, message=_failed_check(failure, "timed run"))


def outcome(step: StepTimeCheck, numerics: NumericsCheck, options: GateOptions) -> tuple[Outcome, int]:
    """The gate's outcome and exit code: a failed check wins over an inconclusive one."""
    if not numerics.passed or step.verdict in ("regression", "failed"):
        return "regression", 1
    if step.verdict == "inconclusive":
        return "inconclusive", 0 if options.allow_inconclusive else INCONCLUSIVE_EXIT
    return "pass", 0


def inconclusive_warning(step: StepTimeCheck, allowed: bool) -> str:
    """What an inconclusive step time means for the job, and what may settle it."""
    neither = (f"the step time was shown neither within the allowed {share(step.max_regression)} nor beyond it "
               f"(B/A interval [{step.ci_low:.4f}, {step.ci_high:.4f}], noise floor {step.floor:.4f}, after "
               f"{step.extensions} extension(s))")
    if allowed:
        return f"INCONCLUSIVE, let through by --allow-inconclusive: {neither}; this pass says nothing of the step time"
    return (f"inconclusive (exit {INCONCLUSIVE_EXIT}): {neither}; more --blocks, --block-steps or --max-extensions, "
            f"or a quieter machine, may settle it, and --allow-inconclusive lets it pass")


def gate_result(mode: str, spec: WorkerRequest, a_label: str, b_label: str, step: StepTimeCheck,
                numerics: NumericsCheck, warnings: list[str], start: float, options: GateOptions,
                **extra: Any) -> GateResult:
    """Both checks, the outcome and exit code, and the warnings that go with them: what every mode returns."""
    verdict, code = outcome(step, numerics, options)
    if step.verdict == "inconclusive":
        warnings = [inconclusive_warning(step, options.allow_inconclusive), *warnings]
    return GateResult(mode=mode, outcome=verdict, passed=verdict == "pass", exit_code=code, target=spec.target,
                      size=spec.size, config=spec.config, device=spec.device, ranks=spec.ranks, a_label=a_label,
                      b_label=b_label, max_extensions=options.max_extensions,
                      allow_inconclusive=options.allow_inconclusive, step_time=step, numerics=numerics,
                      warnings=warnings, wall_s=time.monotonic() - start, **extra)


def unless_numerics_failed(numerics: NumericsCheck, extend: Callable[[StepTimeCheck], str | None]
                           ) -> Callable[[StepTimeCheck], str | None]:
    """``extend``, unless the numerics fail the gate already: then more timing would change nothing."""
    return extend if numerics.passed else lambda _: "the numerics check fails the gate already"


def working_tree_label(where: Path) -> str:
    """Side B's name: the working tree and its commit, and whether it has uncommitted changes."""
    commit = saved_baseline.git_commit(where)
    if commit is None:
        return "working tree"
    return f"working tree ({commit[:12]}{', uncommitted changes' if commit.endswith('+dirty') else ''})"
