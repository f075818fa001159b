"""`sg-opt gate --ref` and ``--ref-tree``: both sides' numerics fingerprints, an A/A noise floor on side A, then
both sides timed interleaved on the same cores, extended while inconclusive (the rules: ``sg_opt.gate``)."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from sg_opt import saved_baseline
from sg_opt.gate import (GateOptions, GateResult, GateSetupError, Progress, StepTimeCheck, failed_timing,
                         gate_result, holds_a_bound, judge_numerics, judge_step_time, unless_numerics_failed,
                         until_clear, working_tree_label)
from sg_opt.gate_checkout import ref_checkout, resolve_ref
from targets.worker_client import run_worker
from targets.worker_protocol import WorkerRequest, WorkerResult
from validators.ab_result import ABResult
from validators.ab_stats import decide, floor_from
from validators.confirmation import pooled
from validators.cpu_share import share_cpus
from validators.machine_load import LoadPolicy, after_steady_load
from validators.speedup import CalibrationFailed, calibrate_noise_floor, measure_ab


def _numerics_pair(spec: WorkerRequest, steps: int, roots: tuple[str | None, str | None],
                   timeout_s: float) -> tuple[WorkerResult, WorkerResult]:
    """Both sides' fingerprints at once (no timing is taken while they run)."""
    request = saved_baseline.numerics_request(spec, steps)
    with ThreadPoolExecutor(2) as pool:
        a, b = (pool.submit(run_worker, request, timeout_s, None, root) for root in roots)
        return a.result(), b.result()


class Interleaved:
    """The --ref measurement so far: the A/A runs of A that set the floor (none with --floor) and the A/B runs,
    each kind pooled over its runs once there are several, so that it can be extended while inconclusive."""

    def __init__(self, spec: WorkerRequest, roots: tuple[str, None], labels: tuple[str, str], options: GateOptions,
                 progress: Progress, load_policy: LoadPolicy | None = None):
        self.spec, self.roots, self.labels, self.options, self.progress = spec, roots, labels, options, progress
        self.aa: list[ABResult] = []
        self.floor, self.floor_source = options.floor or 0.0, "given with --floor"
        self.runs: list[ABResult] = []
        self.load_policy = load_policy  # None: measure_ab's own (see _note_load)
        if options.floor is None:
            self._calibrate(options.aa_runs)

    def _calibrate(self, runs: int) -> None:
        """``runs`` more A/A runs of A; the floor from all of them, pooled (each pair of workers a unit)."""
        o, a_label = self.options, self.labels[0]
        self.progress(f"calibrating the noise floor: {runs} A/A run(s) of {a_label} ...")
        try:
            noise = calibrate_noise_floor(self.spec, o.blocks, o.block_steps, o.timeout_s, runs, seed=len(self.aa),
                                          block_seconds=o.block_seconds, root=self.roots[0],
                                          on_run=self._note_load, load_policy=self.load_policy)
        except CalibrationFailed as exc:
            raise GateSetupError(f"the target cannot be timed at {a_label}: {exc}") from None
        self.aa += noise.runs
        if len(self.aa) == 1:
            self.floor, self.floor_source = noise.floor, f"1 interleaved A/A run of {a_label}"
            return
        aa = pooled(self.aa)
        self.floor = floor_from([(aa.ratio, aa.ci_low, aa.ci_high)])
        self.floor_source = (f"{len(self.aa)} interleaved A/A runs of {a_label}, pooled (each pair of workers a "
                             f"unit; {aa.blocks} block pairs)")

    def measure(self, runs: int = 1) -> None:
        """``runs`` more A/B runs, each in fresh workers (fewer if one fails)."""
        o = self.options
        for _ in range(runs):
            self.progress(f"timing {self.labels[0]} and the working tree, interleaved ...")
            run = measure_ab(self.spec, self.spec, o.blocks, o.block_steps, o.timeout_s, *self.labels,
                             block_seconds=o.block_seconds, floor=self.floor, seed=len(self.runs), roots=self.roots,
                             load_policy=self.load_policy)
            self._note_load(run)
            # a clean run replaces the ones the machine's other work tainted (uneven outside load, no lock)
            self.runs = [r for r in self.runs if r.clean or not run.clean] + [run]
            if run.failure is not None:
                return

    def _note_load(self, run: ABResult) -> None:
        """Once a run has waited out its whole wait for outside load to drop and still found it, the gate's later
        runs start at once (``validators.machine_load.after_steady_load``; ``validators.cpu_share`` does the same
        for the wait before the first run)."""
        if run.load is not None:
            self.load_policy = after_steady_load(self.load_policy, run.load.outside_before)

    def extend(self, check: StepTimeCheck) -> str | None:
        """More A/A blocks where the floor is too wide, more A/B blocks where the interval holds a bound; or why
        neither can help."""
        if self.runs[-1].failure is None and not self.result.clean:
            self.measure()
            return None
        wide, holds = self.floor > self.options.max_regression, holds_a_bound(check)
        if wide and not self.aa and not holds:
            return "the floor was given with --floor and is wider than the allowed regression"
        if wide and self.aa:
            self._calibrate(self.options.aa_runs)  # as many pairs of workers as the first floor had
        if holds:
            self.measure(self.options.ab_runs)
        return None

    @property
    def result(self) -> ABResult:
        """The last run if it failed, else all the A/B runs pooled, against the current floor."""
        last = self.runs[-1]
        if last.failure is not None:
            return last
        if len(self.runs) == 1:
            return last.model_copy(update={"floor": self.floor, "verdict": decide(last.ci_low, last.ci_high,
                                                                                   self.floor)})
        return pooled([self.runs[0].model_copy(update={"floor": self.floor}), *self.runs[1:]])

    def judge(self) -> StepTimeCheck:
        ab = self.result
        if ab.failure is None:
            check = judge_step_time(ab.ratio, ab.ci_low, ab.ci_high, self.floor, self.floor_source,
                                    self.options.max_regression, ab.step_ms("a"), ab.step_ms("b"))
            if ab.clean:
                return check
            return check.model_copy(update={"verdict": "inconclusive", "passed": False, "message": (
                f"not judged: the machine's other work tainted the measurement ({ab.load_note()}); {check.message}")})
        if ab.failure.message.startswith(f"{self.labels[0]}:"):
            raise GateSetupError(f"the target cannot be timed at {self.labels[0]}: {ab.failure.message}")
        return failed_timing(ab.failure, self.floor, self.floor_source, self.options)


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
    a_label, b_label = a_label or str(root), working_tree_label(here)
    roots = (str(root), None)
    progress(f"numerics fingerprints of {a_label} and the working tree ...")
    numerics_a, numerics_b = _numerics_pair(spec, options.numerics_steps, roots, options.timeout_s)
    if not numerics_a.ok:
        raise GateSetupError(f"the target does not run at {a_label} ({numerics_a.failure.kind}): "
                             f"{numerics_a.failure.message}")
    numerics = judge_numerics(numerics_a.numerics, numerics_b, options, options.numerics_steps)
    share = share_cpus(spec, progress=progress)  # a steady neighbour's CPUs left to it (validators.cpu_share)
    measurement = Interleaved(share.spec, roots, (a_label, b_label), options, progress, load_policy=share.policy)
    measurement.measure(options.ab_runs)
    step = until_clear(measurement.judge, unless_numerics_failed(numerics, measurement.extend), options, progress)
    notes = [share.note] if share.note else []
    return gate_result("ref", spec, a_label, b_label, step, numerics, notes, start, options,
                       environment=numerics_b.environment, ab=measurement.result)

