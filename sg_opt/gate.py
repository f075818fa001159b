"""`sg-opt gate`: fail a CI job when a change makes training slower or changes what it computes.

Two ways to get the "before" side:

* ``--ref REV`` (preferred): the code at REV is checked out with ``git worktree add --detach`` into a
  temporary folder (removed afterwards, whatever happens) and its workers run there, importing from it
  first, so REV's own target code is measured (in sg-opt's own repository that includes REV's worker
  and timing loop, which are in the same packages). Side A = REV, side B = the working tree, both the same
  request (target, size, knobs, device, threads), timed interleaved in one run on the same cores
  (``validators.speedup.measure_ab``). The noise floor comes from ``--aa-runs`` A/A runs of REV
  (``calibrate_noise_floor``) unless ``--floor`` gives it.
* ``--baseline FILE``: figures saved by ``sg-opt bench --save FILE``; the working tree re-runs the saved
  request in as many fresh processes as were saved. Not interleaved, so its interval and floor are those
  of ``sg_opt.saved_baseline`` (bootstrap over steps; floor 2% + the spread of each side's runs), wider
  than an A/A floor; another device is refused.

**The step-time rule** (both modes; ratio = B time / A time, below 1 is faster): the gate fails when

    ratio > 1 + max_regression   and   ci_low > 1 + floor

i.e. the measured slowdown is beyond the allowed one (default 5%) and the whole 95% interval lies
above the noise floor, so the slowdown is real. Noise alone cannot fail it (that needs the interval
clear of the floor that A/A runs show between identical code); a real slowdown of 5% or more fails it
whenever this machine resolves it (floor below the slowdown). Asking instead for the interval to clear
1 + max_regression would let most real slowdowns of 5-8% through. A slowdown beyond the allowed one that
is not clear of the floor passes, with a warning; so does any run whose floor exceeds max_regression
(the gate cannot see regressions that small here: more blocks or steps, or a quieter machine).

**The numerics rule**: the numerics fingerprint (``--numerics-steps`` steps at seed 0) of B must pass
``validators.numerics.compare`` against A's under ``--numerics-class`` (default ``reorder``: same math,
any float association); a non-finite value always fails.

**Ranks**: ``--ranks N`` runs every worker of the gate as an N-rank torch.distributed job (the step
time is then each step's slowest rank, see ``targets.rank_worker``). A saved baseline holds the ranks
it was measured with and runs on them again; a gate that asks for another number is refused.

Exit codes: 0 both pass; 1 a regression, a numerics failure, or the working tree's workload failing;
2 usage or set-up errors (bad REV, not a git repository, the target not running at REV, a baseline
from another device or number of ranks), reported in one sentence.
"""

from __future__ import annotations

import contextlib
import shutil
import statistics
import subprocess
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Literal

from pydantic import BaseModel, Field

from sg_opt import saved_baseline
from targets.protocol import ConfigError
from targets.worker_client import run_worker
from targets.worker_protocol import Environment, Failure, NumericsData, WorkerRequest, WorkerResult
from validators.numerics import NumericsVerdict, compare
from validators.speedup import ABResult, CalibrationFailed, NoiseFloor, calibrate_noise_floor, measure_ab

GATE_SCHEMA_VERSION = 1
MAX_REGRESSION = 0.05
RULE = "fail if ratio > 1 + max_regression and ci_low > 1 + floor (ratio = B time / A time)"
Progress = Callable[[str], None]


class GateSetupError(ConfigError):
    """The gate could not be set up (bad revision, unusable baseline, A does not run): exit 2."""


@dataclass(frozen=True)
class GateOptions:
    max_regression: float = MAX_REGRESSION
    numerics_class: str = "reorder"
    numerics_steps: int = saved_baseline.NUMERICS_STEPS
    blocks: int = 10
    block_steps: int = 10
    floor: float | None = None
    aa_runs: int = 2
    timeout_s: float = 1800.0


class StepTimeCheck(BaseModel):
    passed: bool
    ratio: float | None = Field(None, description="B time / A time: below 1 is faster")
    ci_low: float | None = None
    ci_high: float | None = None
    floor: float
    floor_source: str
    max_regression: float
    a_ms: float | None = Field(None, description="A's median step time")
    b_ms: float | None = None
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
    passed: bool
    exit_code: int
    target: str
    size: str
    config: dict[str, Any]
    device: str
    ranks: int = Field(1, description="the processes of the torch.distributed job each side ran as (1: none)")
    a_label: str
    b_label: str
    rule: str = RULE
    step_time: StepTimeCheck
    numerics: NumericsCheck
    warnings: list[str] = Field(default_factory=list)
    environment: Environment | None = None
    ab: ABResult | None = Field(None, description="--ref: the interleaved measurement, block medians included")
    wall_s: float = 0.0


# -- the rules -------------------------------------------------------------------------------------

def is_regression(ratio: float, ci_low: float, floor: float, max_regression: float) -> bool:
    """The step-time rule: slower than allowed, and the whole interval above the noise floor."""
    return ratio > 1.0 + max_regression and ci_low > 1.0 + floor


def judge_step_time(ratio: float, ci_low: float, ci_high: float, floor: float, floor_source: str,
                    max_regression: float, a_ms: float, b_ms: float) -> tuple[StepTimeCheck, list[str]]:
    """The step-time check and its warnings, each a sentence naming the numbers it rests on."""
    numbers = (f"B/A = {ratio:.4f}, 95% interval [{ci_low:.4f}, {ci_high:.4f}], noise floor {floor:.4f}, "
               f"allowed regression {max_regression:.2%}")
    regression = is_regression(ratio, ci_low, floor, max_regression)
    if regression:
        message = f"B is {ratio - 1:.1%} slower than A, beyond the allowed {max_regression:.0%}, and the whole " \
                  f"interval is above the noise floor ({numbers})"
    elif ratio > 1.0 + max_regression:
        message = f"B measured {ratio - 1:.1%} slower than A but the interval is not clear of the noise floor " \
                  f"({numbers})"
    else:
        message = f"B is within the allowed regression of A ({numbers})"
    warnings = []
    if not regression and ratio > 1.0 + max_regression:
        warnings.append(f"a slowdown of {ratio - 1:.1%} was measured but could not be told from noise; "
                        f"measure longer (more blocks or steps) or on a quieter machine")
    if floor > max_regression:
        warnings.append(f"the noise floor {floor:.1%} is wider than the allowed regression {max_regression:.0%}: "
                        f"slowdowns between the two cannot be seen on this machine at this measurement length")
    return StepTimeCheck(passed=not regression, ratio=ratio, ci_low=ci_low, ci_high=ci_high, floor=floor,
                         floor_source=floor_source, max_regression=max_regression, a_ms=a_ms, b_ms=b_ms,
                         message=message), warnings


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


def _failed_timing(failure: Failure, floor: float, floor_source: str, options: GateOptions) -> StepTimeCheck:
    return StepTimeCheck(passed=False, floor=floor, floor_source=floor_source, failure=failure,
                         max_regression=options.max_regression, message=_failed_check(failure, "timed run"))


def _result(mode: str, spec: WorkerRequest, a_label: str, b_label: str, step: StepTimeCheck, numerics: NumericsCheck,
            warnings: list[str], start: float, **extra: Any) -> GateResult:
    passed = step.passed and numerics.passed
    return GateResult(mode=mode, passed=passed, exit_code=0 if passed else 1, target=spec.target, size=spec.size,
                      config=spec.config, device=spec.device, ranks=spec.ranks, a_label=a_label, b_label=b_label,
                      step_time=step, numerics=numerics, warnings=warnings, wall_s=time.monotonic() - start, **extra)


# -- git -------------------------------------------------------------------------------------------

def _git(repo: Path | str, *args: str) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, timeout=120)
    except FileNotFoundError:
        raise GateSetupError("git is not installed here, and --ref needs it (or use --baseline FILE)") from None


def resolve_ref(rev: str, where: Path) -> tuple[Path, str]:
    """(repository top level, full commit id of ``rev``); GateSetupError if either cannot be found."""
    top = _git(where, "rev-parse", "--show-toplevel")
    if top.returncode != 0:
        raise GateSetupError(f"{where} is not inside a git repository, so --ref {rev} has nothing to check out "
                             f"(use --baseline FILE)")
    commit = _git(where, "rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}")
    if commit.returncode != 0 or not commit.stdout.strip():
        raise GateSetupError(f"--ref {rev!r} is not a commit of the repository at {top.stdout.strip()}")
    return Path(top.stdout.strip()).resolve(), commit.stdout.strip()


@contextlib.contextmanager
def ref_checkout(repo: Path, commit: str) -> Iterator[Path]:
    """A detached worktree of ``commit`` in a temporary folder, removed (and pruned) on the way out."""
    folder = Path(tempfile.mkdtemp(prefix="sg-opt-gate-"))
    tree = folder / "ref"
    try:
        added = _git(repo, "worktree", "add", "--detach", str(tree), commit)
        if added.returncode != 0:
            why = (added.stderr.strip().splitlines() or ["no reason given"])[-1]
            raise GateSetupError(f"git could not check out {commit[:12]}: {why}")
        yield tree
    finally:
        _git(repo, "worktree", "remove", "--force", str(tree))
        shutil.rmtree(folder, ignore_errors=True)
        _git(repo, "worktree", "prune")


# -- the two modes ---------------------------------------------------------------------------------

def _numerics_pair(spec: WorkerRequest, steps: int, roots: tuple[str | None, str | None],
                   timeout_s: float) -> tuple[WorkerResult, WorkerResult]:
    """Both sides' fingerprints at once (no timing is taken while they run)."""
    request = saved_baseline.numerics_request(spec, steps)
    with ThreadPoolExecutor(2) as pool:
        a, b = (pool.submit(run_worker, request, timeout_s, None, root) for root in roots)
        return a.result(), b.result()


def _ref_noise(spec: WorkerRequest, root: str, a_label: str, options: GateOptions,
               progress: Progress) -> tuple[NoiseFloor | float, str]:
    """The floor and where it came from: --floor, or A/A runs of the ref."""
    if options.floor is not None:
        return options.floor, "given with --floor"
    progress(f"calibrating the noise floor: {options.aa_runs} A/A run(s) of {a_label} ...")
    try:
        noise = calibrate_noise_floor(spec, options.blocks, options.block_steps, options.timeout_s, options.aa_runs,
                                      root=root)
    except CalibrationFailed as exc:
        raise GateSetupError(f"the target cannot be timed at {a_label}: {exc}") from None
    return noise, f"{options.aa_runs} interleaved A/A run(s) of {a_label}"


def gate_against_ref(spec: WorkerRequest, rev: str, options: GateOptions, progress: Progress = lambda _: None,
                     where: Path | None = None) -> GateResult:
    """Side A = ``rev`` checked out apart, side B = the working tree ``where`` (default: the current folder)."""
    here = (where or Path.cwd()).resolve()
    repo, commit = resolve_ref(rev, here)
    a_label = f"{rev} ({commit[:12]})" if not commit.startswith(rev) else commit[:12]
    with ref_checkout(repo, commit) as tree:
        root = tree / here.relative_to(repo)
        if not root.is_dir():
            raise GateSetupError(f"the folder {here.relative_to(repo)} does not exist at {rev}")
        return gate_against_tree(spec, root, options, progress, where=here, a_label=a_label)


def gate_against_tree(spec: WorkerRequest, root: Path, options: GateOptions, progress: Progress = lambda _: None,
                      where: Path | None = None, a_label: str | None = None) -> GateResult:
    """Side A = the code tree at ``root`` (a checkout of the base made by the caller, e.g. a CI job's second
    checkout, or ``--ref``'s worktree), side B = the working tree ``where``: numerics fingerprints of both, an A/A
    noise floor on A, then both timed interleaved."""
    start, here = time.monotonic(), (where or Path.cwd()).resolve()
    root = Path(root).resolve()
    if not root.is_dir():
        raise GateSetupError(f"--ref-tree {root} is not a folder")
    a_label, b_label = a_label or str(root), _working_tree_label(here)
    roots = (str(root), None)
    progress(f"numerics fingerprints of {a_label} and the working tree ...")
    numerics_a, numerics_b = _numerics_pair(spec, options.numerics_steps, roots, options.timeout_s)
    if not numerics_a.ok:
        raise GateSetupError(f"the target does not run at {a_label} ({numerics_a.failure.kind}): "
                             f"{numerics_a.failure.message}")
    numerics = judge_numerics(numerics_a.numerics, numerics_b, options, options.numerics_steps)
    noise, floor_source = _ref_noise(spec, str(root), a_label, options, progress)
    progress(f"timing {a_label} and the working tree, interleaved ...")
    ab = measure_ab(spec, spec, options.blocks, options.block_steps, options.timeout_s, a_label, b_label,
                    floor=noise, roots=roots)
    warnings: list[str] = []
    if ab.failure is None:
        medians = [1e3 * statistics.median(side.block_medians) for side in (ab.a, ab.b)]
        step, warnings = judge_step_time(ab.ratio, ab.ci_low, ab.ci_high, ab.floor, floor_source,
                                         options.max_regression, *medians)
    elif ab.failure.message.startswith(f"{a_label}:"):
        raise GateSetupError(f"the target cannot be timed at {a_label}: {ab.failure.message}")
    else:
        step = _failed_timing(ab.failure, ab.floor, floor_source, options)
    return _result("ref", spec, a_label, b_label, step, numerics, warnings, start,
                   environment=numerics_b.environment, ab=ab)


def _unpaired_step_time(saved: saved_baseline.SavedBaseline, current_s: list[list[float]],
                        options: GateOptions) -> tuple[StepTimeCheck, list[str]]:
    if options.floor is not None:
        floor, source = options.floor, "given with --floor"
    else:
        floor = saved_baseline.unpaired_floor(saved.block_medians, saved_baseline.block_medians(current_s))
        source = (f"unpaired: {saved_baseline.UNPAIRED_MIN_FLOOR:.0%} + the spreads of the block medians of "
                  f"{len(saved.step_s)} saved and {len(current_s)} new runs")
    ratio, low, high = saved_baseline.unpaired_ratio(saved.step_s, current_s)
    medians = [1e3 * statistics.median(s for run in side for s in run) for side in (saved.step_s, current_s)]
    return judge_step_time(ratio, low, high, floor, source, options.max_regression, *medians)


def gate_against_baseline(path: str, options: GateOptions, progress: Progress = lambda _: None,
                          ranks: int | None = None) -> GateResult:
    """Side A = the figures saved in ``path``, side B = the saved request run again on the working tree, on
    the saved number of ranks (``ranks``, when given, must be that number)."""
    start, saved, host = time.monotonic(), saved_baseline.load(path), saved_baseline.host_info()
    spec = saved.request
    a_label = f"baseline {Path(path).name} ({saved.created}{', ' + saved.commit[:12] if saved.commit else ''})"
    b_label = _working_tree_label(Path.cwd())
    for mismatch in (saved_baseline.ranks_mismatch(saved, ranks),
                     saved_baseline.machine_mismatch(saved, _this_cpu(saved), host)):
        if mismatch:
            raise GateSetupError(mismatch)
    progress(f"timing the working tree ({len(saved.step_s)} runs of {spec.steps} steps, as saved) ...")
    runs = saved_baseline.more_runs(spec, [], len(saved.step_s), options.timeout_s)
    bench = runs[-1]
    if bench.environment and (mismatch := saved_baseline.machine_mismatch(saved, bench.environment, host)):
        raise GateSetupError(mismatch)
    if not bench.ok and bench.failure.kind == "config":
        raise GateSetupError(f"the saved request cannot run here: {bench.failure.message}")
    progress("numerics fingerprint of the working tree ...")
    numerics_run = run_worker(saved_baseline.numerics_request(spec, saved.numerics_steps), timeout_s=options.timeout_s)
    numerics = judge_numerics(saved.numerics, numerics_run, options, saved.numerics_steps)
    warnings = saved_baseline.environment_warnings(saved, bench.environment, host) if bench.environment else []
    if bench.ok:
        step, more = _unpaired_step_time(saved, [run.bench.step_s for run in runs], options)
        warnings += more
    else:
        step = _failed_timing(bench.failure, options.floor or 0.0, "none: the run failed", options)
    return _result("baseline", spec, a_label, b_label, step, numerics, warnings, start,
                   environment=bench.environment)


def _this_cpu(saved: saved_baseline.SavedBaseline) -> Environment | None:
    """This machine's environment where it is known without a worker (CPU runs), else None."""
    if saved.request.device != "cpu":
        return None
    import torch

    from targets.worker import environment
    return environment(torch.device("cpu"))


def _working_tree_label(where: Path) -> str:
    commit = saved_baseline.git_commit(where)
    if commit is None:
        return "working tree"
    return f"working tree ({commit[:12]}{', uncommitted changes' if commit.endswith('+dirty') else ''})"
