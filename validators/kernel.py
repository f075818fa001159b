"""Whether a candidate kernel computes what its slot's torch reference computes.

Kernels written to be fast have fooled their own harnesses before: they returned cached results,
special-cased the shapes they were tested on, wrote only part of the output, clobbered their
inputs, raced on a side stream, or were accurate only at a lower precision than claimed. Each of
those has a check here, and each check is run on inputs the candidate cannot know in advance:

* fresh random inputs from ``slot.make_inputs`` for every call, from a seed the caller draws;
* the slot's own shapes that fit a FLOP budget, plus ragged variants of the smallest one (every
  dimension a prime drawn from the seed, so never a multiple of 16) and a unit shape, with each
  flag such as ``bias`` taking both values;
* two calls per shape on two different input sets, each compared with its own reference (cached,
  memoised and shape-keyed results fail), then the first output re-read (a reused output buffer
  fails);
* a float64 reference on upcast copies of the inputs (integer indices unchanged), computed only
  after the candidate returns, so no frame holds it (or its freed memory) while the candidate runs;
* bitwise comparison of every input with a copy taken before the call; output type, shape, dtype
  and device against the reference's contract; no storage shared with an input;
* NaN/inf where the reference is finite; relative error ``|out-ref|/|ref|`` and the worst element
  ``max|out-ref|/max|ref|`` within a dtype-aware tolerance (``TOLERANCES``);
* on CUDA, the call is made on a fresh non-default stream; the output is first copied to the host
  on that stream without a device-wide synchronisation, then again after one: a difference means
  the candidate finished its work on a stream the caller does not wait for.

Before each call NaN-filled blocks of the output's size are freed into the allocator, so an output
from ``torch.empty`` that is not fully written likely reads NaN. This poison is best effort (the
CUDA caching allocator reuses freed blocks readily, CPU malloc less predictably, and fresh pages
from mmap are zeros); the accuracy and non-finite checks catch unwritten elements whatever they
hold, and the second call at each shape finds only the first call's stale values there.

``check_kernel`` is the in-process core. ``validators.kernel_file.validate_kernel_file`` is what
callers use: the static check of ``validators.source`` first (a rejected file never runs), then
``check_kernel`` in a subprocess (``validators.kernel_worker``) with a scrubbed environment, its own
process group and a time limit, so a crash, hang or exception in the candidate is a failed verdict,
never the caller's. Both sit above this module, which imports neither.

A dozen calls cannot show what a candidate does at its 121st, or at a shape's third: the same comparison keeps
running in training as spot checks (``targets.spot_check``, asked for by ``spot_check_spec`` in a worker request).
"""

from __future__ import annotations

import contextlib
import random
import secrets
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping

import torch
from pydantic import BaseModel, Field

from targets.confinement import Confinement
from targets.protocol import ConfigError, KernelSlot
from targets.spot_check import (Errors, Tolerance, arg_names, bitwise_equal, error_text, errors, non_finite,
                                rounding_slack, upcast, within)
from targets.worker_protocol import SpotCheckSpec
from validators.source import SourceVerdict


# fp32 at 1e-5 admits any summation order of fp32 products (a few ulps times sqrt(fan-in)) but not
# fp16 or TF32 inputs (about 5e-4 of rounding each). fp16/bf16 bounds sit a few times above the
# rounding of their own outputs (2^-11 and 2^-8 relative).
TOLERANCES: dict[torch.dtype, Tolerance] = {
    torch.float64: Tolerance(rel=1e-10, elem=1e-9),
    torch.float32: Tolerance(rel=1e-5, elem=1e-4),
    torch.float16: Tolerance(rel=2e-3, elem=1e-2),
    torch.bfloat16: Tolerance(rel=1e-2, elem=5e-2),
}
# Only on request (``allow_tf32``): fp32 kernels whose tl.dot rounds inputs to TF32 (10-bit mantissa).
# The slot's reference is full fp32, so a TF32 kernel changes numerics and the training-level
# numerics validator must then judge it as a precision change.
TF32_TOLERANCE = Tolerance(rel=5e-4, elem=5e-3)

DTYPES: dict[str, torch.dtype] = {
    "float64": torch.float64, "fp64": torch.float64, "float32": torch.float32, "fp32": torch.float32,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
}
DEFAULT_MAX_FLOPS = {"cpu": 5e7, "cuda": 1e11}  # slot shapes above this many FLOPs are not run
RAGGED_VARIANTS = 2
DRAWS_PER_VARIANT = 20
CALLS_PER_SHAPE = 2


class ShapeError(BaseModel):
    """The worst error over the calls made at one shape."""

    shape: dict[str, int]
    rel_error: float = 0.0
    max_abs_error: float = 0.0
    ref_scale: float = Field(0.0, description="max |reference| over the calls at this shape")


class KernelVerdict(BaseModel):
    """Whether a candidate may replace its slot; when not, the check that failed, in one sentence."""

    ok: bool
    slot: str
    reason: str = ""
    check: str = Field("", description="source, load, exception, contract, aliasing, stream, input-modified, "
                                       "non-finite, stale, accuracy, buffer-reuse, global-state, config, "
                                       "timeout, crash or internal")
    device: str = ""
    dtype: str = ""
    seed: int = 0
    errors: list[ShapeError] = Field(default_factory=list)
    source: SourceVerdict | None = None
    detail: str = Field("", description="traceback or stderr tail")
    confinement: Confinement | None = Field(None, description="how the checking worker was confined before it "
                                                              "imported the candidate (None: it said nothing)")


def parse_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ConfigError(f"unknown dtype {name!r}; use one of {', '.join(DTYPES)}")
    return DTYPES[name]


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class Rejected(Exception):
    """A check failed; ``check`` names it and the message is the verdict's one-sentence reason."""

    def __init__(self, check: str, message: str, detail: str = "") -> None:
        super().__init__(message)
        self.check, self.message, self.detail = check, message, detail


# ----------------------------------------------------------------------------- shapes

def _primes(low: int, high: int) -> list[int]:
    return [n for n in range(max(low, 2), high + 1) if all(n % d for d in range(2, int(n ** 0.5) + 1))]


def _fits(slot: KernelSlot, shape: Mapping[str, int], dtype: torch.dtype) -> bool:
    """Whether make_inputs accepts the shape (e.g. fan-in no larger than the dims it draws from)."""
    try:
        slot.make_inputs(shape, dtype, "cpu", torch.Generator().manual_seed(0))
    except (ValueError, RuntimeError):
        return False
    return True


def check_shapes(slot: KernelSlot, dtype: torch.dtype, seed: int, max_flops: float) -> list[dict[str, int]]:
    """The slot's shapes under the FLOP budget (at least its smallest), ragged variants and a unit shape."""
    if not slot.shapes:
        raise ConfigError(f"kernel slot {slot.name} declares no shapes to check against")
    flops = {i: slot.cost(s, dtype).flops for i, s in enumerate(slot.shapes)}
    smallest = dict(slot.shapes[min(flops, key=flops.__getitem__)])
    shapes = [dict(s) for i, s in enumerate(slot.shapes) if flops[i] <= max_flops] or [smallest]
    flags = {k for k in smallest if all(s.get(k, 0) in (0, 1) for s in slot.shapes)}
    rng = random.Random(seed)
    for variant in range(RAGGED_VARIANTS):
        for _ in range(DRAWS_PER_VARIANT):
            shape = {k: rng.choice(_primes(max(2, v // 2), v) or [v]) for k, v in smallest.items() if k not in flags}
            shape.update({k: (smallest[k] + variant + 1) % 2 for k in flags})  # the first variant flips each flag
            if _fits(slot, shape, dtype):
                shapes.append(shape)
                break
    unit = {k: (smallest[k] if k in flags else 1) for k in smallest}
    if _fits(slot, unit, dtype):
        shapes.append(unit)
    return shapes


# ----------------------------------------------------------------------------- comparisons

def _layout(x: torch.Tensor) -> tuple:
    return tuple(x.shape), x.stride(), x.storage_offset(), x.dtype


def poison_allocator(device: torch.device, dtype: torch.dtype, numel: int) -> None:
    """Free NaN-filled blocks (a larger one, then the output's size) so torch.empty likely returns NaN.

    On CUDA the cache is emptied first, so the caching allocator's best fit for the candidate's
    first allocations is the poisoned segment rather than an older free block with stale data.
    """
    if dtype.is_floating_point:
        if device.type == "cuda":
            torch.cuda.empty_cache()
        for n in (4 * max(numel, 1), max(numel, 1)):
            torch.full((n,), float("nan"), dtype=dtype, device=device)  # filled, then freed at once


# ----------------------------------------------------------------------------- the check

@dataclass
class _Call:
    out: torch.Tensor
    ref: torch.Tensor
    errors: Errors
    kept: torch.Tensor | None = None  # a copy of ``out`` taken once the call was checked


@dataclass
class _Checker:
    slot: KernelSlot
    fn: Callable[..., Any]
    device: torch.device
    dtype: torch.dtype
    tol: Tolerance

    def output_numel(self, shape: Mapping[str, int], seed: int) -> int:
        """The output's size, from the reference on throwaway inputs: its freed memory answers no call."""
        with torch.no_grad():
            return self.slot.reference(*self.inputs(shape, seed)).numel()

    def inputs(self, shape: Mapping[str, int], seed: int) -> tuple:
        generator = torch.Generator(device=self.device).manual_seed(seed)
        return self.slot.make_inputs(shape, self.dtype, self.device, generator)

    def call(self, shape: Mapping[str, int], call: int, seed: int, numel: int, earlier: list[_Call]) -> _Call:
        """One call on fresh inputs, checked against its own float64 reference."""
        where = f"at shape {dict(shape)} (call {call + 1} of {CALLS_PER_SHAPE})"
        inputs = self.inputs(shape, seed)
        before = [(x.clone(), _layout(x)) if torch.is_tensor(x) else None for x in inputs]
        poison_allocator(self.device, self.dtype, numel)
        try:
            with torch.no_grad():
                out = self.fn(*inputs)
        except Exception as exc:  # noqa: BLE001 - whatever the candidate raises is its failure
            message = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
            raise Rejected("exception", f"{self.slot.name} raised {message} {where}.",
                           traceback.format_exc()[-4000:]) from None
        if type(out) is not torch.Tensor:  # a subclass could answer the validator's own torch calls
            raise Rejected("contract", f"{self.slot.name} returned a {type(out).__name__}, not a plain tensor, "
                                       f"{where}.")
        self.check_stream(out, where)
        self.check_inputs(inputs, before, out, where)
        # The reference is computed only now, from the copies: while the candidate ran, no frame held it.
        given = [upcast(kept[0]) if kept else x for x, kept in zip(inputs, before)]
        with torch.no_grad():
            ref = self.slot.reference(*given)
        self.check_contract(out, ref, where)
        return self.check_values(out, ref, given, earlier, where)

    def check_inputs(self, inputs: tuple, before: list, out: torch.Tensor, where: str) -> None:
        """Every input bitwise and in layout as it was before the call, and none sharing the output's memory."""
        for arg, x, kept in zip(arg_names(self.slot.signature, len(inputs)), inputs, before):
            if kept is None:
                continue
            if _layout(x) != kept[1] or not bitwise_equal(x, kept[0]):
                raise Rejected("input-modified", f"{self.slot.name} modified its input {arg} in place {where}.")
            if x.numel() and out.numel() and x.untyped_storage().data_ptr() == out.untyped_storage().data_ptr():
                raise Rejected("aliasing", f"{self.slot.name} returned a tensor sharing memory with its input {arg} "
                                           f"{where}.")

    def check_values(self, out: torch.Tensor, ref: torch.Tensor, given: list, earlier: list[_Call],
                     where: str) -> _Call:
        """Finite where the reference is, then within tolerance, or within it once each element's error is less a
        few roundings of its terms' magnitude (``targets.spot_check.rounding_slack``: where the output cancels); an
        earlier call's answer is named as such."""
        if bad := non_finite(out, ref):
            raise Rejected("non-finite", f"{self.slot.name} returned {bad} NaN/inf values where the reference is "
                                         f"finite (unwritten memory or overflow) {where}.")
        errs = errors(out, ref)
        if not within(errs, self.tol) and not within(errors(out, ref, self.rounding_slack(given)), self.tol):
            if any(e.ref.shape == ref.shape and within(errors(out, e.ref), self.tol) for e in earlier):
                raise Rejected("stale", f"{self.slot.name} returned the result for an earlier call's inputs, not "
                                        f"this call's (a cached or memoised output), {where}.")
            raise Rejected("accuracy", self.inaccuracy(errs, where))
        return _Call(out=out, ref=ref, errors=errs)

    def rounding_slack(self, given: list) -> torch.Tensor:
        with torch.no_grad():
            return rounding_slack(self.slot.reference, given, self.dtype)

    def check_stream(self, out: torch.Tensor, where: str) -> None:
        """On CUDA: read on the caller's stream, then after a device-wide sync; they must agree."""
        if out.device.type != "cuda":
            return
        first = out.detach().to("cpu", copy=True)  # ordered on the current stream only
        torch.cuda.synchronize(out.device)
        if not bitwise_equal(first, out.detach().to("cpu", copy=True)):
            raise Rejected("stream", f"{self.slot.name}'s output not ready on the caller's stream: it changed after a "
                                     f"device-wide synchronise (work left on a side stream) {where}.")

    def check_contract(self, out: torch.Tensor, ref: torch.Tensor, where: str) -> None:
        expected_dtype = self.dtype if ref.is_floating_point() else ref.dtype
        same_device = out.device.type == self.device.type and (self.device.index is None
                                                                or out.device.index == self.device.index)
        for ok, what in ((tuple(out.shape) == tuple(ref.shape), f"shape {tuple(out.shape)}, not {tuple(ref.shape)}"),
                         (out.dtype == expected_dtype, f"dtype {out.dtype}, not {expected_dtype}"),
                         (same_device, f"a tensor on {out.device}, not on {self.device}")):
            if not ok:
                raise Rejected("contract", f"{self.slot.name} returned {what}, {where}.")

    def inaccuracy(self, errs: Errors, where: str) -> str:
        """Names the dtype, the first failing shape and both errors, whichever bound was crossed."""
        kind = dtype_name(self.dtype)
        bound = (f"the {kind} tolerance {self.tol.rel:.0e}" if errs[0] > self.tol.rel
                 else f"the {kind} bound {self.tol.elem:.0e} on the worst element")
        return f"{self.slot.name} is inaccurate in {kind} {where}: {error_text(errs)}, beyond {bound}."

    def shape(self, shape: Mapping[str, int], seed: int) -> ShapeError:
        calls: list[_Call] = []
        numel = self.output_numel(shape, seed + CALLS_PER_SHAPE)
        for call in range(CALLS_PER_SHAPE):
            result = self.call(shape, call, seed + call, numel, calls)
            result.kept = result.out.clone()
            calls.append(result)
        for earlier in calls[:-1]:
            if not bitwise_equal(earlier.out, earlier.kept):
                raise Rejected("buffer-reuse", f"{self.slot.name} overwrote the output of its previous call at shape "
                                               f"{dict(shape)} (it reuses one output buffer, so a caller holding the "
                                               f"earlier result sees it change).")
        return ShapeError(shape=dict(shape), rel_error=max(c.errors[0] for c in calls),
                          max_abs_error=max(c.errors[1] for c in calls), ref_scale=max(c.errors[2] for c in calls))


@contextlib.contextmanager
def _caller_stream(device: torch.device) -> Iterator[None]:
    """On CUDA, a fresh non-default stream for the whole check, so kernels must honour the current stream."""
    if device.type != "cuda":
        yield
        return
    with torch.cuda.device(device), torch.cuda.stream(torch.cuda.Stream(device)):
        yield


def check_kernel(slot: KernelSlot, fn: Callable[..., Any], device: torch.device, dtype: torch.dtype, seed: int, *,
                 allow_tf32: bool = False, max_flops: float | None = None) -> KernelVerdict:
    """Check ``fn`` against ``slot.reference`` in this process; every candidate failure becomes a verdict.

    ``allow_tf32`` loosens fp32 to ``TF32_TOLERANCE``; ``max_flops`` bounds which of the slot's own
    shapes run (default ``DEFAULT_MAX_FLOPS`` per device type; the smallest always runs). Failures of
    the harness itself (a slot whose reference or inputs raise) propagate as exceptions.
    """
    device = torch.device(device)
    if dtype not in TOLERANCES:
        raise ConfigError(f"kernels are checked in {', '.join(dtype_name(d) for d in TOLERANCES)}, not {dtype}")
    tol = TF32_TOLERANCE if allow_tf32 and dtype == torch.float32 else TOLERANCES[dtype]
    budget = max_flops if max_flops is not None else DEFAULT_MAX_FLOPS.get(device.type, DEFAULT_MAX_FLOPS["cpu"])
    verdict = KernelVerdict(ok=False, slot=slot.name, device=str(device), dtype=dtype_name(dtype), seed=seed)
    checker = _Checker(slot=slot, fn=fn, device=device, dtype=dtype, tol=tol)
    try:
        with _caller_stream(device):
            for i, shape in enumerate(check_shapes(slot, dtype, seed, budget)):
                shape_seed = (seed * 1_000_003 + (CALLS_PER_SHAPE + 1) * i) % 2 ** 62
                verdict.errors.append(checker.shape(shape, shape_seed))
    except Rejected as rejection:
        verdict.reason, verdict.check, verdict.detail = rejection.message, rejection.check, rejection.detail
        return verdict
    verdict.ok = True
    return verdict


def spot_check_spec(rate: float) -> SpotCheckSpec:
    """What a worker request carries to check replaced kernels while it runs (``targets.spot_check``): a share of
    calls sampled at ``rate``, each held to this module's tolerances (0: only the forced checks between timed
    blocks). ``tf32`` holds float32 calls while the run lets torch multiply float32 in TF32."""
    tolerances = {dtype_name(d): (t.rel, t.elem) for d, t in TOLERANCES.items()}
    return SpotCheckSpec(rate=rate, tolerances={**tolerances, "tf32": (TF32_TOLERANCE.rel, TF32_TOLERANCE.elem)})


def draw_seed() -> int:
    """A seed the candidate cannot know in advance."""
    return secrets.randbelow(2 ** 31)
