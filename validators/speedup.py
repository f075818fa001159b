"""Side-by-side step-time measurement that cannot fool itself.

A speedup claim is only as good as its comparison, so every claim here is made the same way:

* **Side by side.** Two long-lived workers (``validators.ab_worker``, run by ``validators.ab_runner``),
  one per config, are built and warmed up (one after the other on a CPU, where two builds on the same
  cores oversubscribe them; at once on a GPU), run one untimed settling block each (a second, of the
  length the first implies, when that is over twice as long: a few cold steps size blocks poorly), then
  run an even number of timed blocks in the balanced order A B B A A B B A ... Each pair of blocks sits in the
  same minute of machine time and each side goes first in half the pairs, so linear drift (thermal,
  turbo, a neighbour's load) cancels instead of favouring whoever ran second.
* **Same cores.** Both workers are pinned to one CPU set (``shared_cpus``: the last ``threads`` CPUs
  this process may use, or all of them when a spec leaves threads to torch). Left to the scheduler,
  each process keeps to "its" core, and on a loaded machine one core is busier than the other for
  minutes: on the 2-core CI box 12 A/A runs of the tiny trainer spread with a standard deviation of
  5.1% (one at 0.876, a false win) unpinned, and 1.5% (worst 0.975) pinned.
* **Blocks of equal length in time.** ``steps_per_block`` sizes the slower side's block, and
  ``block_seconds`` (when given) is the least it may last; the settling blocks tell how fast each side
  is, and each runs as many steps as fill that time (``equal_time_steps``, at most ``MAX_STEP_FACTOR``
  times ``steps_per_block``). A candidate 13x faster than its baseline then times blocks of 39 steps,
  not of 3 steps of 8 ms, and both sides spend the same minutes. The agent sizes
  ``steps_per_block`` on its baseline; ``block_seconds`` keeps blocks that long after the incumbent got
  faster: at `large`, 3 steps of a 9 ms incumbent were blocks of 27 ms whose medians spread 9.2-11.6 ms,
  and intervals of +-13% hid wins that a 1.1% floor was calibrated to see.
* **Nothing banked while idle.** While one side runs a block, the other side's helper processes (loader
  workers) are stopped (``ABRunner._hold``), so what a side's queues hold when its block starts was built during
  its own previous block, as in training. Before a side's first block, and before every block of a side that
  cannot be held (ranked sides, ``SG_OPT_HOLD_IDLE_SIDE=0``), the worker first runs, untimed, the steps whose
  input the session could prepare while it idled (``banked_steps``: its loader workers' queues;
  ``validators.ab_worker``), in a round trip of its own, before the block's.
* **The parent's clock.** A candidate's code runs in its worker, so nothing the worker says about time decides
  anything: a worker that slowed ``time.perf_counter`` tenfold was once accepted as a 10x win. Each block is timed
  here, with ``time.perf_counter`` from just before its run command is written to just after its answer is read
  (``ABRunner.run``), and its sample is that wall time over its steps. The window holds the timed steps, the
  device's synchronisation at their end, and a constant exchange (a pipe each way, a JSON line, a thread's wake-up:
  0.1-0.5 ms on an idle machine, milliseconds under load), the same per block on both sides. In blocks of equal time
  (below) that overhead is the same share of both sides' blocks and cancels in their ratio; where the faster side
  runs the shorter block (capped at ``MAX_STEP_FACTOR`` times the steps), the overhead is a larger share of its
  block, which pulls the ratio toward 1: conservative, never a win the steps did not make. The worker's own step
  times are kept only as a check (``ab_runner.clock_disagreement``): a block whose worker's sum exceeds the
  parent's wall by more than 2% + 2 ms, or falls short of it by more than 25% + 20 ms, fails the measurement as
  ``clock``; ``SideSummary.clock_agreement`` keeps each side's worst ratio of the two.
* **Robust numbers.** Each block is reduced to its mean step time by the parent's clock (a stall inside a block
  moves that block, not the result: the pairs' median below leaves a stalled pair out). The ratio is the median
  over block pairs of B's block value over A's: *candidate time over incumbent time, below 1 is faster*; the
  speedup is its inverse. Without drift it estimates median(B)/median(A); with drift it is better, because each
  pair's ratio cancels the drift that separates pairs (on synthetic timings with 10% drift, 10 blocks x 10 steps:
  floor 2.9% instead of 3.6%, a true 10% change detected 99.7% instead of 94% of the time).
* **One measurement at a time.** Two ``sg-opt optimize`` runs side by side on the 2-core CI box made one report
  x61.98 where a quiet re-measure gave x5.59. A measurement holds its device's machine-wide lock
  (``targets.machine_lease``: "cpu", or "cuda:N" for each GPU) shared while its workers build and exclusive
  for its blocks, settling ones included; other worker work (numerics, profile, kernel checks) holds it shared,
  so neither runs beside the other's timed blocks. The wait is bounded (``lock_wait_s``); ``waited_s`` says how
  long it took, and a measurement that could not get its lock runs anyway and is not ``clean``.
* **Outside load.** The lock keeps sg-opt from itself, not from other work on the machine. Each block records
  the CPU time the pinned CPUs spent on processes other than our workers' trees (``validators.machine_load``:
  ``/proc/stat`` less ``/proc/PID/stat``), in CPUs. Before the blocks, the measurement waits (up to
  ``LoadPolicy.wait_s``, 60 s) while that load, sampled with the workers idle, is above ``LIMIT_CPUS`` = 0.3 (or
  a GPU is over 10% busy, per ``nvidia-smi``); a pair with a block above the limit is run again in the same
  order (balance kept), up to as many extra pairs as the measurement has, when the two blocks' loads differ by
  more than that limit: a steady load that both blocks of a pair saw alike cancels in the pair's ratio and is only
  recorded (``LoadRecord.steady_cpus``), load that comes and goes tilts it. Past that cap loaded pairs are kept and
  the result is not ``clean`` (``ABResult.load``: the snapshot of who was busy, the waits, the re-runs): its
  verdict is still computed and said, but ``confirm_win`` and the other callers accept no win from it.
* **An interval, not a point.** A bootstrap over block pairs (``RESAMPLES`` = 2000 resamples, seeded)
  gives a 95% percentile interval on that ratio.
* **A calibrated noise floor.** ``calibrate_noise_floor`` runs A against A: two workers of the same
  spec. Whatever ratio that shows is bias between identical processes, whatever width its interval
  has is noise, so floor = max(``MIN_FLOOR``, max over A/A runs of |1 - ratio| + half-width of its
  interval). ``MIN_FLOOR`` = 1%: below that a gain is not worth a change to a training job, and no
  clock is trusted that finely across processes.
* **The decision rule.** ``faster`` only when the interval's upper bound on candidate/incumbent is
  below 1 - floor; ``slower`` when its lower bound is above 1 + floor; otherwise ``no-difference``;
  ``failed`` when either side crashed, hung, ran out of memory or produced a non-finite loss.
* **Confirmation.** ``validators.confirmation.confirm_win`` accepts a win only if a second measurement in
  fresh processes says ``faster`` again, and every measurement it made is ``clean``.
* **Extended once when it leans.** A measurement whose interval straddles the floor while its point
  estimate is past it (``validators.confirmation.leans_faster``) gets as many blocks again, in fresh workers,
  and is judged on both (``pooled``: each pair of workers a unit). At `large`, against a 13 ms host-bound incumbent, six
  blocks a side gave intervals of +-10% (0.854-1.048 for a point estimate of 0.959), too wide for the wins of
  5-10% that are left there. Looking at the data before deciding to take more raises the chance that noise
  passes, so the second, independent measurement must still say ``faster`` on its own terms (itself extended
  at most once): on synthetic A/A timings the whole protocol accepts no more often than 1% of the time.
* **Stalled blocks.** ``validators.steadiness.disturbed`` flags a result in which a side's block medians spread
  by more than ``DISTURBED_SPREAD`` = 25% and ``DISTURBED_FLOORS`` = 5 noise floors: something outside the
  workers slowed part of the run, and the median of pair ratios then mixes stalled and steady pairs. The agent's
  final measurement and ``sg-opt bench --vs`` repeat such a measurement once and quote the steadier run
  (``steadier_of_two``), so that a run's figure and its re-measurement are measured alike.
* **No silent swap.** Each side of a result carries its label and a digest of its spec (target, size,
  knobs, kernel sources, data, device, seed, threads, ranks); ``assert_sides`` raises if they do not match
  the incumbent and candidate the caller meant.
* **Two code trees, if asked.** A side may run in its own ``root`` (a checkout of another revision:
  the worker runs there and imports from it first), so the CI gate can time the same spec at two
  revisions of the code side by side; a side's root is recorded with it.

The statistics (``block_order``, ``block_medians``, ``paired_ratio``, ``bootstrap_ratio_ci``,
``decide``, ``analyse``, ``floor_from``) are pure functions in ``validators.ab_stats``, tested on synthetic
timing distributions without processes.
"""

from __future__ import annotations

import contextlib
import math
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence

import numpy as np

from targets.worker_protocol import Failure, WorkerRequest
from validators.ab_result import ABResult, NoiseFloor, SideSummary, spec_digest
from validators.ab_runner import ABRunner, Block
from validators.machine_load import SNAPSHOT_S, LoadPolicy, LoadRecord, other_runs, snapshot, wait_for_quiet
from targets.machine_lease import WAIT_S, Lease, LeaseTimeout, device_keys
from validators.started_ahead import WorkerPool
from validators.timing_worker import Side, SideFailed, shared_cpus
from validators.ab_stats import (CONFIDENCE, MIN_FLOOR, RESAMPLES, analyse, bias_plus_noise, block_order,
                                 floor_from)

# An A/A run may end at half its blocks (at least this many a side) when its bias plus half-width is already below
# half of MIN_FLOOR there: its floor is MIN_FLOOR either way, unless the second half differed several-fold. `xl`'s
# baseline on an H200 (2026-11-30) had 0.08% and 0.17% after 40 blocks, in A/A runs of 110 s each.
SETTLED_MIN_BLOCKS = 10
MAX_STEP_FACTOR = 32  # the faster side runs at most this many times the slower side's steps per block
UNCALIBRATED_FLOOR = 0.10  # for callers that skip calibration; the shared 2-core CI box calibrates to 6-10%


# -- what callers use ------------------------------------------------------------------------------

def equal_time_steps(settle: dict[str, list[float]], steps_per_block: int,
                     block_seconds: float = 0.0) -> dict[str, int]:
    """Steps per block of each side, so that both sides' blocks last about as long as the slower side's
    block of ``steps_per_block`` steps, or ``block_seconds`` if that is longer (from the settling blocks'
    median step times)."""
    medians = {side: float(np.median(times)) for side, times in settle.items()}
    block = max(steps_per_block * max(medians.values()), block_seconds)
    return {side: min(MAX_STEP_FACTOR * steps_per_block, max(steps_per_block, int(np.ceil(block / max(m, 1e-9)))))
            for side, m in medians.items()}


@dataclass
class Pairs:
    """The timed block pairs a measurement kept, and the ones it ran again for outside load (``run_pairs``)."""

    blocks: dict[str, list[Block]] = field(default_factory=lambda: {"a": [], "b": []})
    reruns: int = 0
    rerun_load: list[float] = field(default_factory=list)
    loaded: int = 0
    steady: float = 0.0  # the most outside load both blocks of a kept pair saw alike, in CPUs
    note: str | None = None


def run_pairs(run: Callable[[Side, int], Block], blocks: int, side_steps: Mapping[str, int], policy: LoadPolicy,
              stop: Callable[[dict[str, list[Block]]], str | None] | None = None) -> Pairs:
    """`blocks` pairs in the balanced order (``block_order``). A pair whose two blocks saw outside loads that
    differ by more than the policy's limit runs again, in the same order, while re-runs are left
    (``policy.reruns``, default one per pair); once they are spent such a pair is kept and counted ``loaded``.
    Load that both blocks of a pair saw alike (a steady neighbour, a busy loop that never stops) slows both
    sides and cancels in the pair's ratio, so it is recorded (``steady``: the most either block saw) but runs
    nothing again; load that comes and goes with the blocks (another run's phases) is what tilts a ratio.
    `stop` may end the run after any pair (with the note it returns)."""
    done, order = Pairs(), block_order(blocks)
    allowed = blocks if policy.reruns is None else policy.reruns
    for r in range(blocks):
        while True:
            pair = [run(side, side_steps[side]) for side in order[2 * r:2 * r + 2]]
            loads = [b.outside for b in pair if b.outside is not None]
            worst = max(loads, default=None)
            uneven = max(loads) - min(loads) if len(loads) == 2 else worst
            if worst is not None:
                done.steady = max(done.steady, min(loads))
            if uneven is None or uneven <= policy.limit_cpus:
                break
            if done.reruns >= allowed:
                done.loaded += 1
                break
            done.reruns += 1
            done.rerun_load.append(round(worst, 3))
        for block in pair:
            done.blocks[block.side].append(block)
        if stop is not None and (note := stop(done.blocks)) is not None:
            done.note = note
            break
    return done


def _agreement(blocks: Sequence[Block]) -> float | None:
    """The worker's sum over the parent's wall furthest from 1 among `blocks` (None: none)."""
    ratios = [b.worker_s / b.wall_s for b in blocks if b.wall_s > 0 and b.worker_s > 0]
    return round(max(ratios, key=lambda r: abs(math.log(r))), 4) if ratios else None


def _samples(blocks: Sequence[Block]) -> list[list[float]]:
    """Each block as the one sample the statistics take from it: its mean step time by the parent's clock."""
    return [[b.step_s] for b in blocks]


def _lease(stack: contextlib.ExitStack, lease: Lease) -> str | None:
    """Enter `lease` on `stack`; why not, when it timed out (the measurement then runs without it)."""
    try:
        stack.enter_context(lease)
    except LeaseTimeout as exc:
        return str(exc)
    return None


def measure_ab(a: WorkerRequest, b: WorkerRequest, blocks: int, steps_per_block: int, timeout_s: float,
               label_a: str = "incumbent", label_b: str = "candidate", *,
               floor: float | NoiseFloor = UNCALIBRATED_FLOOR, resamples: int = RESAMPLES, seed: int = 0,
               cpus: Sequence[int] | None = None, roots: tuple[str | None, str | None] = (None, None),
               block_seconds: float = 0.0, settled_below: float | None = None,
               load_policy: LoadPolicy | None = None, lock_wait_s: float = WAIT_S,
               pool: WorkerPool | None = None) -> ABResult:
    """Measure b against a side by side in fresh workers pinned to ``cpus`` (default ``shared_cpus``), each
    in its code tree of ``roots`` (None: the caller's), in blocks of at least ``block_seconds`` (see
    ``equal_time_steps``), under the devices' measurement lock (waiting up to ``lock_wait_s``) and the load policy
    (``run_pairs``); ``failed`` verdicts carry the failure. With ``settled_below``, the run ends at half its blocks
    when its bias plus half-width there is already below that (``calibrate_noise_floor``). The ``timeout_s`` of its
    workers does not count the waits for the lock or for outside load to drop. Workers started ahead for it are
    adopted from ``pool`` (None: none are; it starts its own)."""
    if blocks < 2 or blocks % 2 or steps_per_block < 1:
        raise ValueError("measure_ab needs an even number (>= 2) of blocks per side, so each side goes first "
                         "equally often, and at least 1 step per block")
    floor_value = floor.floor if isinstance(floor, NoiseFloor) else float(floor)
    load_policy = load_policy or LoadPolicy()
    start, order = time.monotonic(), block_order(blocks)
    sides = {s: SideSummary(label=label, digest=spec_digest(spec), spec=spec, root=root)
             for s, label, spec, root in (("a", label_a, a, roots[0]), ("b", label_b, b, roots[1]))}
    cpus = list(cpus) if cpus is not None else shared_cpus(a, b)
    keys = device_keys(a, b)
    lease, record = Lease(keys, exclusive=False, timeout_s=lock_wait_s), LoadRecord(limit_cpus=load_policy.limit_cpus)
    common = dict(ratio_definition=f"{label_b}_time / {label_a}_time (below 1 is faster)", floor=floor_value,
                  order=order, blocks=blocks, steps_per_block=steps_per_block, block_seconds=block_seconds,
                  resamples=resamples, cpus=cpus, clock="parent", load=record)
    half = blocks // 2  # an even half keeps the order balanced: each side first in half its pairs
    check = settled_below is not None and half % 2 == 0 and half >= SETTLED_MIN_BLOCKS

    def settled(kept: dict[str, list[Block]]) -> str | None:
        if not check or len(kept["a"]) != half:
            return None
        early = analyse(_samples(kept["a"]), _samples(kept["b"]), floor_value, resamples, CONFIDENCE, seed)
        bound = bias_plus_noise(early.ratio, early.ci_low, early.ci_high)
        if bound >= settled_below:
            return None
        common.update(blocks=half, order=order[:2 * half])
        return f"stopped after {half} of {blocks} blocks a side: bias plus half-width {bound:.4f} was already below " \
               f"{settled_below:.4f}"

    closing = None
    try:
        with contextlib.ExitStack() as stack:
            # shared while the workers build (never beside another measurement's blocks), exclusive for the blocks
            record.unlocked = _lease(stack, lease)
            runner = stack.enter_context(ABRunner(a, b, timeout_s, (label_a, label_b), cpus, roots, pool))
            paused = time.monotonic()
            if record.unlocked is None:
                try:
                    lease.convert(exclusive=True)
                except LeaseTimeout as exc:
                    record.unlocked = str(exc)
            gpus = [key.split(":", 1)[1] for key in keys if key.startswith("cuda:")]
            # who keeps the machine busy (0.25 s, or the sample's stretch if shorter), counted during the first
            # load sample (0.5 s by default): both only read /proc, and one after the other they idled 0.75 s
            # before every measurement's blocks
            with ThreadPoolExecutor(1, thread_name_prefix="snapshot") as beside:
                before = beside.submit(snapshot, gpus, min(SNAPSHOT_S, load_policy.sample_s))
                record.beside_runs = len(other_runs())
                record.outside_before, record.gpu_before, record.waited_s = wait_for_quiet(runner.meter, gpus,
                                                                                           load_policy)
                record.before = before.result()
            record.counted = record.outside_before is not None
            runner.deadline += time.monotonic() - paused  # the waits are not the workers' time
            # settle: the first block after warm-up pays first-touch costs; it also tells the sides' speeds
            settle = {side: [runner.run(side, steps_per_block).step_s] for side in ("a", "b")}
            side_steps = equal_time_steps(settle, steps_per_block, block_seconds)
            if max(side_steps.values()) > 2 * steps_per_block:  # sized on a few cold steps: settle once more
                settle = {side: [runner.run(side, side_steps[side]).step_s] for side in ("a", "b")}
                side_steps = equal_time_steps(settle, steps_per_block, block_seconds)
            common["side_steps"] = side_steps
            pairs = run_pairs(runner.run, blocks, side_steps, load_policy, settled)
            for side in ("a", "b"):  # every replaced kernel checked once more after its side's last timed call
                if runner.spot_checking(side):
                    runner.check(side)
            record.reruns, record.rerun_load, record.loaded_pairs = pairs.reruns, pairs.rerun_load, pairs.loaded
            record.steady_cpus = round(pairs.steady, 3)
            common.update(started_ahead=runner.started_ahead, note=pairs.note)
            for s in sides:
                sides[s].config, sides[s].cpus = runner.ready[s].get("config", {}), runner.ready[s].get("cpus")
                sides[s].ready_s, sides[s].startup = runner.ready_s[s], runner.startup(s)
                sides[s].build_parts = runner.ready[s].get("build_parts") or {}
                sides[s].memory = runner.ready[s].get("memory") or {}
                sides[s].confinement = runner.ready[s].get("confinement")
                sides[s].spot_checks = runner.spot_checks[s]
                sides[s].block_pressure = [block.pressure for block in pairs.blocks[s]]
                sides[s].block_load = [block.load for block in pairs.blocks[s]]
                sides[s].clock_agreement = _agreement(pairs.blocks[s])
            common["blocks_s"], closing = runner.blocks_s, time.monotonic()
    except SideFailed as exc:
        return ABResult(a=sides["a"], b=sides["b"], verdict="failed", failure=exc.failure, failed_side=exc.label,
                        wall_s=time.monotonic() - start, waited_s=lease.waited_s, **common)
    common["close_s"] = time.monotonic() - closing
    record.clean = record.unlocked is None and record.loaded_pairs == 0
    stats = analyse(_samples(pairs.blocks["a"]), _samples(pairs.blocks["b"]), floor_value, resamples, CONFIDENCE, seed)
    sides["a"].block_medians, sides["b"].block_medians = stats.a_medians, stats.b_medians
    return ABResult(a=sides["a"], b=sides["b"], ratio=stats.ratio, speedup=1.0 / stats.ratio, ci_low=stats.ci_low,
                    ci_high=stats.ci_high, verdict=stats.verdict, wall_s=time.monotonic() - start,
                    waited_s=lease.waited_s, **common)


class CalibrationFailed(RuntimeError):
    """An A/A run failed, so no noise floor can be set (the incumbent itself does not run cleanly); ``failure``
    is that run's (a hang's detail holds where each process waited)."""

    def __init__(self, message: str, failure: Failure | None = None):
        super().__init__(message)
        self.failure = failure


def calibrate_noise_floor(spec: WorkerRequest, blocks: int, steps_per_block: int, timeout_s: float,
                          repeats: int = 2, *, resamples: int = RESAMPLES, seed: int = 0,
                          cpus: Sequence[int] | None = None, root: str | None = None,
                          block_seconds: float = 0.0, spares: bool = True,
                          on_run: Callable[[ABResult], None] | None = None,
                          done: Sequence[ABResult] = (), pool: WorkerPool | None = None,
                          load_policy: LoadPolicy | None = None) -> NoiseFloor:
    """Run A against A ``repeats`` times in fresh workers (in the code tree ``root``, when given) and set the
    floor from the worst run; ``on_run`` sees each run as it ends (progress, or keeping it: a calibration killed
    half-way is resumed with the runs it finished as ``done``, and runs only the rest).

    With ``spares``, where builds overlap (a GPU) and memory allows, the later runs' workers start with the first
    run's (``WorkerPool.prestart``, in ``pool`` or else in a pool of its own, closed when it returns), ready and held
    before its timed blocks: at `large-cached` on an H200 (2026-12-04) each A/A run after the first waited 15.8-22.0 s
    for its own workers (three calibrations). Calibrations that run beside each other (lanes of --gpus) pass False:
    a spare would build beside the other lanes' timed blocks."""
    labels, roots = ("A1", "A2"), (root, root)
    runs = list(done)[:repeats]
    left = repeats - len(runs)
    owned = pool is None
    pool = WorkerPool() if owned else pool
    key = pool.prestart(spec, spec, timeout_s, labels, cpus, roots, pairs=left) if spares and left > 1 else None
    try:
        for r in range(len(runs), repeats):
            run = measure_ab(spec, spec, blocks, steps_per_block, timeout_s, *labels, floor=MIN_FLOOR,
                             resamples=resamples, seed=seed + r, cpus=cpus, roots=roots, block_seconds=block_seconds,
                             settled_below=MIN_FLOOR / 2, pool=pool, load_policy=load_policy)
            if on_run is not None:
                on_run(run)
            if run.failure is not None:
                raise CalibrationFailed(f"A/A run {r + 1} failed: {run.failure.kind}: {run.failure.message}",
                                        run.failure)
            runs.append(run)
    finally:
        pool.discard(key)  # what a failed run left unused
        if owned:
            pool.close()
    return NoiseFloor(floor=floor_from([(r.ratio, r.ci_low, r.ci_high) for r in runs]), runs=runs)
