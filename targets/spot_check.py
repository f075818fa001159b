"""Spot checks: replaced kernels compared with their slot's reference while the workload runs.

The kernel check (``validators.kernel``) calls a candidate about a dozen times on inputs it draws. A
candidate that is exact for its first N calls and then returns a cached output, or exact only for as
many calls per shape as the check makes, passes it and then trains on wrong values. Wrapped here
(``CheckedKernel``), a candidate is checked on the workload's own inputs at calls it cannot predict:

* each call with probability ``rate``, drawn from a generator seeded from ``os.urandom`` (never from
  torch's RNG, which the candidate can read and the workload's numerics depend on);
* every call made inside ``every_call_checked()``; ``checked_step(session)`` runs one whole step so, for a
  timing worker to call between its timed blocks, never within one.

A checked call clones the tensor inputs before the call, runs the candidate, then the slot's reference
on float64 copies of the clones (an input the candidate modifies is caught, and never seen by the
reference), and holds the output to the contract, to finiteness and to the dtype's tolerance on
``|out-ref|/|ref|`` and ``max|out-ref|/max|ref|``, less, element by element, a few roundings of the element's
terms where it cancels (``rounding_slack``). A failure raises ``SpotCheckFailed``, which the worker reports as
failure kind ``spot-check``.

Targets import no validator: the tolerances and the rate come in the worker's request as plain data
(``validators.kernel.spot_check_spec``). The comparison helpers live here so the kernel check and the
spot check judge an output alike.
"""

from __future__ import annotations

import contextlib
import os
import random
import re
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping, NamedTuple, Sequence

import torch

from targets.protocol import ConfigError, KernelSlot


@dataclass(frozen=True)
class Tolerance:
    """Bounds on ``|out-ref|/|ref|`` (rel) and ``max|out-ref|/max|ref|`` (elem) against float64."""

    rel: float
    elem: float


class SpotCheckFailed(RuntimeError):
    """A replaced kernel's output, checked while the workload ran, differs from its slot's reference."""


# ----------------------------------------------------------------------------- comparisons

def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


def upcast(value: Any) -> Any:
    return value.to(torch.float64) if torch.is_tensor(value) and value.is_floating_point() else value


class Errors(NamedTuple):
    """How far an output is from its reference, over the elements where the reference is finite."""

    rel: float  # |out-ref| / |ref| (norms)
    max_abs: float  # the worst element's |out-ref|
    scale: float  # max |ref|


def errors(out: torch.Tensor, ref: torch.Tensor, slack: torch.Tensor | None = None) -> Errors:
    """The errors; given a ``slack`` (``rounding_slack``), what of each element's error exceeds its own."""
    finite = torch.isfinite(ref)
    diff = (out.to(torch.float64) - ref).abs()
    if slack is not None:
        diff = (diff - slack).clamp_min(0.0)
    diff, ref_f = diff[finite], ref[finite]
    if diff.numel() == 0:
        return Errors(0.0, 0.0, 0.0)
    tiny = torch.finfo(torch.float64).tiny
    rel = float(torch.linalg.vector_norm(diff) / max(float(torch.linalg.vector_norm(ref_f)), tiny))
    return Errors(rel, float(diff.max()), float(ref_f.abs().max()))


def within(errs: Errors, tol: Tolerance) -> bool:
    return errs.rel <= tol.rel and errs.max_abs <= tol.elem * max(errs.scale, torch.finfo(torch.float64).tiny)


# Roundings in the dtype that any implementation may make of an output's partial results (the fan-in sum before
# the bias is added, then the output). Where the output cancels (x*w + b near 0) they are large beside the output
# itself: without them a correct bfloat16 tail_forward failed its check at the 1x1 shape 1 time in 40.
ROUNDINGS = 2


def rounding_slack(reference: Callable[..., torch.Tensor], given: Sequence[Any], dtype: torch.dtype) -> torch.Tensor:
    """Per output element, ROUNDINGS roundings in ``dtype`` of the reference on the magnitudes of the (float64)
    inputs: for a multilinear slot (each of the tail's), the sum of the element's terms' magnitudes. An error no
    larger is excused element by element, never pooled, so a wrong term still shows: a tail_forward dropping one of
    256 fan-in terms in bfloat16 still fails (relative error 4.5e-2 beyond the slack)."""
    magnitude = reference(*(x.abs() if torch.is_tensor(x) and x.is_floating_point() else x for x in given))
    return magnitude.abs() * (ROUNDINGS * torch.finfo(dtype).eps / 2)


def non_finite(out: torch.Tensor, ref: torch.Tensor) -> int:
    """How many outputs are NaN/inf where the reference is finite."""
    return int((~torch.isfinite(out) & torch.isfinite(ref)).sum())


def arg_names(signature: str, count: int) -> list[str]:
    """Parameter names from a slot signature such as ``f(h: [B, Ht], idx: int64 [K, F]) -> z: [B]``."""
    names = re.findall(r"(\w+)\s*:", signature.split("->")[0].partition("(")[2])
    return names if len(names) == count else [f"argument {i}" for i in range(count)]


def error_text(errs: Errors) -> str:
    rel, max_abs, scale = errs
    return f"relative error {rel:.2e}, worst element off by {max_abs:.2e} ({max_abs / max(scale, 1e-300):.2e} of " \
           f"the output's scale)"


# ----------------------------------------------------------------------------- the wrapper

_forced = False
_checked = 0  # calls checked in this process, forced or sampled


@contextlib.contextmanager
def every_call_checked() -> Iterator[None]:
    """Within the block, every call to a ``CheckedKernel`` is checked, whatever its rate."""
    global _forced
    before, _forced = _forced, True
    try:
        yield
    finally:
        _forced = before


def checked_calls() -> int:
    """Calls checked in this process so far."""
    return _checked


def checked_step(session: Any) -> int:
    """One ``session.step()`` with every call to a replaced kernel checked; returns how many calls were checked.
    Raises SpotCheckFailed. Between timed blocks only: the references and copies cost time and memory."""
    before = _checked
    with every_call_checked():
        float(session.step())  # waits for the step, so a failure surfaces here
    return _checked - before


def tolerances_from(plain: Mapping[str, Sequence[float]]) -> dict[str, Tolerance]:
    """``{dtype name: (rel, elem)}`` as a request carries them."""
    return {name: Tolerance(rel=float(rel), elem=float(elem)) for name, (rel, elem) in plain.items()}


def tolerance_key(dtype: torch.dtype | None) -> str:
    """The dtype's name, or ``tf32`` for float32 while torch may multiply float32 in TF32: a kernel then using
    torch's own products is right for this run though not to full float32."""
    name = str(dtype).removeprefix("torch.")
    return "tf32" if name == "float32" and torch.get_float32_matmul_precision() != "highest" else name


class CheckedKernel:
    """A candidate slot function that checks a random share of its calls (and every call when forced)."""

    def __init__(self, slot: KernelSlot, fn: Callable[..., Any], rate: float, tolerances: Mapping[str, Tolerance]):
        if not 0.0 <= rate <= 1.0:
            raise ConfigError(f"spot-check rate must lie in [0, 1], not {rate}")
        self.slot, self.fn, self.rate, self.tolerances = slot, fn, rate, dict(tolerances)
        self.calls = 0
        self._draw = random.Random(int.from_bytes(os.urandom(16), "little")).random

    def __call__(self, *args: Any) -> Any:
        self.calls += 1
        if not (_forced or (self.rate and self._draw() < self.rate)):
            return self.fn(*args)
        kept = [x.clone() if torch.is_tensor(x) else None for x in args]
        out = self.fn(*args)
        self.check(args, kept, out)
        return out

    def check(self, args: tuple, kept: list, out: Any) -> None:
        global _checked
        _checked += 1
        names = arg_names(self.slot.signature, len(args))
        dtype = next((x.dtype for x in args if torch.is_tensor(x) and x.is_floating_point()), None)
        shapes = ", ".join(f"{n} {list(x.shape)}" for n, x in zip(names, args) if torch.is_tensor(x))
        where = f"slot {self.slot.name} call {self.calls} ({str(dtype).removeprefix('torch.')}, {shapes})"
        tol = self.tolerances.get(tolerance_key(dtype))
        if tol is None:
            raise ConfigError(f"spot checks hold no tolerance for {dtype} (known: {', '.join(self.tolerances)})")
        for name, x, copy in zip(names, args, kept):
            if copy is not None and not bitwise_equal(x, copy):
                raise SpotCheckFailed(f"{where} modified its input {name} in place.")
        device_type = next(x.device.type for x in args if torch.is_tensor(x))
        given = [upcast(c) if c is not None else x for x, c in zip(args, kept)]
        with torch.no_grad(), torch.autocast(device_type, enabled=False):
            ref = self.slot.reference(*given)
        expected = dtype if ref.is_floating_point() else ref.dtype
        if type(out) is not torch.Tensor or tuple(out.shape) != tuple(ref.shape) or out.dtype != expected:
            got = f"{type(out).__name__} {list(out.shape)} {out.dtype}" if torch.is_tensor(out) else type(out).__name__
            raise SpotCheckFailed(f"{where} returned {got}, not a tensor {list(ref.shape)} of {expected}.")
        if bad := non_finite(out, ref):
            raise SpotCheckFailed(f"{where} returned {bad} NaN/inf values where its reference is finite.")
        errs = errors(out, ref)
        if within(errs, tol):
            return
        with torch.no_grad(), torch.autocast(device_type, enabled=False):  # only now: it costs a second reference
            excess = errors(out, ref, rounding_slack(self.slot.reference, given, dtype))
        if not within(excess, tol):
            raise SpotCheckFailed(f"{where} differs from its reference: {error_text(errs)}, beyond the tolerance "
                                  f"(rel {tol.rel:.0e}, element {tol.elem:.0e}).")

