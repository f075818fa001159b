"""Spot checks of replaced kernels while the workload runs: a kernel that turns stale after N calls is caught at a
call it cannot predict, a correct one never is, a kernel that modifies its inputs is judged on the inputs it was
given, and a forced step checks every call."""

from __future__ import annotations

import pytest
import torch

from targets.haste_rec.tail.tail_slots import TAIL_SLOTS
from targets.protocol import ConfigError
from targets.spot_check import (CheckedKernel, SpotCheckFailed, checked_calls, checked_step, every_call_checked,
                                tolerances_from)
from targets.registry import resolve_target
from targets.worker import failure_of, load_kernels
from validators.kernel import TOLERANCES, spot_check_spec

SLOT = next(slot for slot in TAIL_SLOTS if slot.name == "tail_forward")
SHAPE = dict(SLOT.shapes[0])
TOLERANCES_PLAIN = spot_check_spec(0.0).tolerances


def _inputs(seed: int, dtype: torch.dtype = torch.float32) -> tuple:
    return SLOT.make_inputs(SHAPE, dtype, "cpu", torch.Generator().manual_seed(seed))


def _checked(fn, rate: float = 1.0) -> CheckedKernel:
    return CheckedKernel(SLOT, fn, rate, tolerances_from(TOLERANCES_PLAIN))


def _stale_after(honest: int):
    """Exact for `honest` calls, then the last honest output."""
    kept: list[torch.Tensor] = []

    def kernel(*args):
        if len(kept) < honest:
            kept.append(SLOT.reference(*args))
        return kept[-1]
    return kernel


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_the_request_carries_the_kernel_checks_tolerances():
    tolerances = tolerances_from(TOLERANCES_PLAIN)
    for dtype, tol in TOLERANCES.items():
        assert tolerances[str(dtype).removeprefix("torch.")] == tol
    assert tolerances["tf32"].rel > tolerances["float32"].rel


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_a_correct_kernel_never_fires(dtype):
    kernel = _checked(SLOT.reference)
    before = checked_calls()
    for seed in range(20):
        kernel(*_inputs(seed, dtype))
    assert checked_calls() - before == 20 and kernel.calls == 20


def test_a_kernel_that_turns_stale_is_caught_at_its_first_stale_call():
    kernel = _checked(_stale_after(7))
    for seed in range(7):
        kernel(*_inputs(seed))
    with pytest.raises(SpotCheckFailed) as caught:
        kernel(*_inputs(7))
    message = str(caught.value)
    assert message.startswith("slot tail_forward call 8 (float32, h [64, 96], idx [50, 13], w [50, 7, 13], "
                              "bias [50, 7])")
    assert "differs from its reference: relative error" in message and "rel 1e-05" in message


def test_sampled_checks_still_catch_it_and_are_not_predictable_by_call_index():
    rate, calls, inputs = 0.5, 200, _inputs(0)
    sampled: list[list[int]] = []
    for _ in range(2):
        torch.manual_seed(0)  # the candidate can read and set torch's RNG: the sampling must not follow it
        rng = torch.get_rng_state()
        kernel, checked = _checked(SLOT.reference, rate), []
        for call in range(calls):
            before = checked_calls()
            kernel(*inputs)
            if checked_calls() > before:
                checked.append(call)
        assert torch.equal(torch.get_rng_state(), rng)  # nor does it draw from it (numerics runs stay repeatable)
        assert 0.3 * calls < len(checked) < 0.7 * calls
        sampled.append(checked)
    assert sampled[0] != sampled[1]
    stale = _checked(_stale_after(10), rate)
    with pytest.raises(SpotCheckFailed, match=r"call (1[1-9]|[2-9]\d) "):
        for seed in range(60):
            stale(*_inputs(seed))


def test_an_input_modified_in_place_is_caught_and_the_reference_sees_the_inputs_as_given():
    """Zeroing h and returning the bias would agree with a reference computed on the inputs after the call."""
    def zeroes_its_input(h, idx, w, bias):
        h.zero_()
        return SLOT.reference(h, idx, w, bias)

    with pytest.raises(SpotCheckFailed, match="call 1 .* modified its input h in place"):
        _checked(zeroes_its_input)(*_inputs(0))


@pytest.mark.parametrize("fn,words", [
    (lambda *args: SLOT.reference(*args).double(), "torch.float64"),
    (lambda *args: SLOT.reference(*args).reshape(-1), "not a tensor [64, 350]"),
    (lambda *args: SLOT.reference(*args) * float("nan"), "NaN/inf values where its reference is finite"),
])
def test_the_output_contract_is_checked(fn, words):
    with pytest.raises(SpotCheckFailed) as caught:
        _checked(fn)(*_inputs(0))
    assert words in str(caught.value)


def test_float32_is_held_to_tf32_bounds_only_while_torch_multiplies_in_tf32():
    off_by_1e4 = lambda *args: SLOT.reference(*args) * (1 + 1e-4)  # noqa: E731 - a TF32-sized error
    with pytest.raises(SpotCheckFailed):
        _checked(off_by_1e4)(*_inputs(0))
    precision = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")
    try:
        _checked(off_by_1e4)(*_inputs(0))
    finally:
        torch.set_float32_matmul_precision(precision)


def test_where_an_output_cancels_a_few_roundings_of_its_terms_are_allowed():
    """x*w + b near 0, each term rounded to bfloat16 on its own: far off relative to the output, not to its terms."""
    h, idx, w = (torch.tensor([[1.1]], dtype=torch.bfloat16), torch.zeros(1, 1, dtype=torch.int64),
                 torch.tensor([[[0.3]]], dtype=torch.bfloat16))
    bias = -(h.double() * w.double()).reshape(1, 1).to(torch.bfloat16) * 0.99
    exact = SLOT.reference(h.double(), idx, w.double(), bias.double())

    def rounds_the_product(h, idx, w, bias):  # the product rounded before the bias is added
        return ((h[:, idx] * w).sum(-1) + bias).reshape(1, 1)

    assert abs(float(rounds_the_product(h, idx, w, bias).double() - exact)) > 0.2 * abs(float(exact))
    _checked(rounds_the_product)(h, idx, w, bias)
    with pytest.raises(SpotCheckFailed):
        _checked(lambda h, idx, w, bias: rounds_the_product(h, idx, w, bias) + 0.02)(h, idx, w, bias)


def test_a_dtype_without_tolerance_is_a_config_error():
    kernel = CheckedKernel(SLOT, SLOT.reference, 1.0, tolerances_from({"float16": (1e-3, 1e-2)}))
    with pytest.raises(ConfigError, match="no tolerance for torch.float32"):
        kernel(*_inputs(0))


class _Session:
    """Steps that each call the kernel once on fresh inputs."""

    def __init__(self, kernel):
        self.kernel, self.steps = kernel, 0

    def step(self) -> torch.Tensor:
        self.steps += 1
        return self.kernel(*_inputs(self.steps)).sum()


def test_a_forced_step_checks_every_call_and_no_other():
    kernel = _checked(_stale_after(5), rate=0.0)
    session = _Session(kernel)
    before = checked_calls()
    for _ in range(9):
        session.step()  # stale from the sixth, unchecked at rate 0
    assert checked_calls() == before
    with every_call_checked(), pytest.raises(SpotCheckFailed, match="call 10 "):
        session.step()
    correct = _Session(_checked(SLOT.reference, rate=0.0))
    assert checked_step(correct) == 1 and checked_step(correct) == 1
    with pytest.raises(SpotCheckFailed, match="call 11 "):
        checked_step(session)
    session.step()  # outside the forced step, unchecked again
    assert kernel.calls == 12


def test_load_kernels_wraps_only_when_asked_and_the_worker_names_the_failure(tmp_path):
    (tmp_path / "tail_forward.py").write_text("import torch\n\n\ndef tail_forward(h, idx, w, bias):\n"
                                              "    return torch.zeros(h.shape[0], w.shape[0] * w.shape[1])\n")
    target = resolve_target("haste-rec")
    plain = load_kernels(str(tmp_path), target)["tail_forward"]
    assert not isinstance(plain, CheckedKernel)
    wrapped = load_kernels(str(tmp_path), target, spot_check_spec(1.0))["tail_forward"]
    assert isinstance(wrapped, CheckedKernel) and wrapped.rate == 1.0
    with pytest.raises(SpotCheckFailed) as caught:
        wrapped(*_inputs(0))
    failure = failure_of(caught.value)
    assert failure.kind == "spot-check" and failure.message.startswith("slot tail_forward call 1 (float32")
