"""Which rejected knob changes the offline rules try once more, and why.

A rejected change is not proposed again, nor any part of it (``proposers.offline``), with four exceptions: a change
that measured no-difference while leaning faster (ratio below 1) is tried once more when the run has since made the
incumbent ``RETRY_AFTER`` times faster, since what such a change saves is mostly fixed time (launches, host work), a
larger share of the shorter step (at `large` the dense CUDA graphs measured 0.959, interval 0.854-1.048, against a
14 ms incumbent that later ran at 9.4 ms); one that measured no-difference, once a later accepted change set a knob
of its category (loader workers after pinned memory: ``_changed_under``), or on a GPU once one shortened the other
side of the step (a device-side change is hidden while the host's work is as long: TF32 tail products after the
loader workers, ``_other_side_shortened``); and one that broke its numerics bands, once the incumbent has taken a
change of a looser class, under which every later candidate is judged (at `xl`, the fused Triton tail before and
after TF32 matmuls).
"""

from __future__ import annotations

from collections import Counter
from typing import Iterator

from state_machine.proposers import Pairs, patch_pairs
from state_machine.proposers.joined import side
from state_machine.specs import numerics_class
from state_machine.state import NUMERICS_ORDER, Evaluated, RunState
from targets.protocol import ConfigError, KnobSpace

RETRY_AFTER = 1.25  # how much faster the incumbent must have become for a leaning rejection to be tried again
# tries at most of a change that measured no-difference: one more after each later change to the step's other side
OTHER_SIDE_TRIES = 3


def _speedups(state: RunState) -> dict[int | None, float]:
    """The incumbent's estimated speedup over the baseline after each accepted candidate (None: the baseline)."""
    est, out = 1.0, {None: 1.0}
    for e in state.history:
        if e.verdict.accepted and e.verdict.ratio:
            est /= e.verdict.ratio
            out[e.candidate.id] = est
    return out


def retryable(state: RunState, space: KnobSpace) -> dict[Pairs, str]:
    """Knob patches rejected once that are worth one more try, each with why (the start of its new rationale):

    - timed no-difference with a ratio below 1 against an incumbent that the run has since made ``RETRY_AFTER``
      times faster (by the estimated speedups);
    - timed no-difference (not slower) before an accepted change of the same knob category (``_changed_under``);
    - on a GPU, timed no-difference (not slower) before an accepted change to the other side of the step
      (``_other_side_shortened``), once more after each such change, ``OTHER_SIDE_TRIES`` tries in all: the
      second side may still be as long after the first change to it (two loader workers, then the prefetch);
    - broken numerics under a class stricter than the one the same patch is held to now: every candidate is
      held to the loosest promise among its changes from the baseline (``specs.numerics_class``), so a patch
      tried before the incumbent took a precision change (TF32 matmuls) was held to the reorder bands, and the
      same patch tried after it to the precision bands, as every later candidate is. At `xl` on an H200
      (2026-11-30) the fused Triton tail broke the reorder band as candidate #1 (2.9e-5 against 1.7e-5 at step
      3); #4 took TF32 matmuls, which also make the Triton tail's fp32 products TF32 ones."""
    speedups, now = _speedups(state), state.incumbent.est_speedup
    rejections = [e for e in state.history if not e.verdict.accepted and e.candidate.patch and not e.candidate.kernels]
    times = Counter(patch_pairs(e.candidate.patch) for e in rejections)
    last = {patch_pairs(e.candidate.patch): e for e in rejections}  # each patch's latest try
    again = {}
    for key, e in last.items():
        v, cid, tries = e.verdict, e.candidate.id, times[key]
        timed = v.stage == "measure" and v.ratio is not None
        no_difference = timed and (v.ci_low if v.ci_low is not None else v.ratio) < 1.0
        measured = f"tried again: candidate #{cid} measured {v.ratio:.3f} (rejected: {v.reason})" if timed else ""
        if no_difference and tries < OTHER_SIDE_TRIES and (later := _other_side_shortened(state, space, e)) is not None:
            again[key] = (f"{measured} before #{later.candidate.id} ({later.candidate.change()}) shortened the other "
                          f"side of the step: a GPU step takes the longer of its host and device work, so a change to "
                          f"one side shows little while the other is as long")
        elif tries > 1:
            continue  # tried twice already
        elif timed and v.ratio < 1.0 and e.incumbent_id in speedups and now >= RETRY_AFTER * speedups[e.incumbent_id]:
            again[key] = (f"{measured} against an incumbent the run has since made "
                          f"x{now / speedups[e.incumbent_id]:.2f} faster")
        elif no_difference and (later := _changed_under(state, space, e)) is not None:
            again[key] = (f"{measured} before #{later.candidate.id} ({later.candidate.change()}) changed the same "
                          f"part of the step under it")
        elif v.stage == "validate" and v.numerics_class in NUMERICS_ORDER:
            try:
                resolved = space.resolve({**state.incumbent.config, **e.candidate.patch})
            except ConfigError:
                continue
            held_to = numerics_class(state, space, resolved, state.incumbent.kernels)
            if NUMERICS_ORDER.index(held_to) > NUMERICS_ORDER.index(v.numerics_class):
                again[key] = (
                    f"tried again: candidate #{cid} was held to the {v.numerics_class} bands ({v.reason}); on top of "
                    f"the incumbent, which has since taken a {held_to} change, the same patch is held to the "
                    f"{held_to} bands, as every candidate after that change is")
    return again


def _accepted_after(state: RunState, rejected: Evaluated) -> Iterator[Evaluated]:
    """The changes accepted after ``rejected``, in order."""
    return (e for e in state.history[state.history.index(rejected) + 1:] if e.verdict.accepted)


def _changed_under(state: RunState, space: KnobSpace, rejected: Evaluated) -> Evaluated | None:
    """The first change accepted after ``rejected`` that sets another knob of the same category (the same part of
    the step: the data path, the embeddings' store, ...), if any; one that set the same knob decided it. Such knobs
    work together: at large-cached on an H200
    two loader workers measured 1.014 (no difference) before pinned memory was accepted (2026-12-03), 0.837 on top
    of it (2026-12-02), where the workers' batches reach the device through pinned slots."""
    names, tried = {k.name for k in space}, set(rejected.candidate.patch)
    categories = {space[k].category for k in tried if k in names}
    return next((e for e in _accepted_after(state, rejected) if not e.candidate.kernels
                 and categories & {space[k].category for k in set(e.candidate.patch) - tried if k in names}), None)


def _other_side_shortened(state: RunState, space: KnobSpace, rejected: Evaluated) -> Evaluated | None:
    """On a GPU, the first change accepted after ``rejected`` that works on the other side of the step
    (``joined.side``: the host's batches and launches, or the device's kernels), if any. At `large` on an H200
    (2026-12-03) TF32 tail products measured 1.027 (interval 0.945-1.059) while the step waited on its data; two
    loader workers and the device prefetch were accepted after it, and on top of them TF32 products with the host
    bundle TPE had found (4 workers, packed batches, half the threads, the foreach optimizer) ran 0.505 against the
    bundle alone, which was 0.977 against that incumbent (``sg-opt bench --vs``; its folder is in git history,
    ``git log --diff-filter=D -- docs/results/2026-12-03-h200-large-s24``)."""
    mine = side(space, rejected.candidate.patch) if not rejected.candidate.kernels else None
    if state.device_kind != "cuda" or mine is None:
        return None
    for e in _accepted_after(state, rejected):
        sides = {"device"} if e.candidate.kernels else {side(space, {k: v}) for k, v in e.candidate.patch.items()}
        if sides - {mine, None}:
            return e
    return None
