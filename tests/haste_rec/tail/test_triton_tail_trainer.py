"""The Triton tail backends in the reference trainer: knob wiring, the device check, and training
along the torch backend's trajectory within the knob's numerics class (validators.numerics)."""

from __future__ import annotations

import pytest
import torch

from tests.haste_rec.tail.test_triton_tail import DEVICE, GPU_ONLY
from targets.haste_rec.knobs import KNOB_SPACE
from targets.haste_rec.tail.triton_tail import TailKernelConfig
from targets.haste_rec.target import build
from targets.protocol import ConfigError
from targets.worker_protocol import NumericsData
from tests.haste_rec.test_trainer import one_thread  # noqa: F401 (autouse fixture: bitwise-repeatable sums)
from validators.numerics import compare

TRITON_BACKENDS = ("triton", "triton-fused-loss")




def numerics(overrides: dict, device: str, steps: int, seed: int = 0) -> NumericsData:
    """What the worker's numerics mode records: loss and grad norms per step, probe, digest."""
    session = build(KNOB_SPACE.resolve(overrides), "tiny", {}, device, seed)
    session.record_grad_norms = True
    losses, norms = [], []
    for _ in range(steps):
        losses.append(float(session.step()))
        norms.append(session.grad_norms())
    return NumericsData(losses=losses, grad_norms=norms, probe=session.probe(), digest=session.param_digest())


def test_knobs() -> None:
    assert KNOB_SPACE["tail_backend"].choices == ("torch", "slots", "triton", "triton-fused-loss")
    assert KNOB_SPACE["tail_backend"].numerics == "reorder"
    for name, numerics_class in (("tail_block_b", "reorder"), ("tail_num_warps", "reorder"),
                                 ("tail_num_stages", "exact")):
        knob = KNOB_SPACE[name]
        assert knob.category == "kernel" and knob.numerics == numerics_class and knob.default == "auto"
        assert knob.parse("auto") == "auto" and knob.parse(str(knob.choices[1])) == knob.choices[1]


def test_kernel_knobs_reach_the_kernels() -> None:
    config = {"tail_backend": "triton", "tail_block_b": 16, "tail_num_warps": 2, "tail_num_stages": 1}
    session = build(KNOB_SPACE.resolve(config), "tiny", {}, DEVICE, 0)
    out = session.model.output
    assert out.kernel_config == TailKernelConfig(block_b=16, num_warps=2, num_stages=1)
    assert out.kernels["tail_forward"].keywords["config"] == out.kernel_config


@pytest.mark.parametrize("backend", TRITON_BACKENDS)
def test_cpu_without_the_interpreter_is_a_config_error(backend: str, monkeypatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ConfigError) as err:
        build(KNOB_SPACE.resolve({"tail_backend": backend}), "tiny", {}, "cpu", 0)
    assert str(err.value) == f"tail_backend {backend} needs a CUDA device (or TRITON_INTERPRET=1 on the CPU)"


@pytest.mark.parametrize("backend", TRITON_BACKENDS)
def test_triton_backends_follow_torch_on_the_cpu_interpreter(backend: str) -> None:
    """fp32, 4 steps with a rewiring after step 2 (so the cached transposed index must be rebuilt): step 2
    reuses it; the regrown slots start at zero weight, so step 4 is the first a stale index would change.
    Groups of 16 (half as many groups, each a slow program in the interpreter; still two a forward program)."""
    if DEVICE != "cpu":
        pytest.skip("the CUDA version below runs 30 steps")
    settings = {"rewire_every": 2, "group_size": 16}
    baseline = numerics(settings, "cpu", 4)
    verdict = compare(baseline, numerics({**settings, "tail_backend": backend}, "cpu", 4), "reorder")
    assert verdict.ok, verdict.detail


@GPU_ONLY
@pytest.mark.parametrize("precision,numerics_class", [("fp32", "reorder"), ("bf16-autocast", "precision"),
                                                      ("bf16", "precision")])
@pytest.mark.parametrize("backend", TRITON_BACKENDS)
def test_triton_backends_follow_torch_on_cuda(backend: str, precision: str, numerics_class: str) -> None:
    """30 steps at size tiny with a rewiring every 10, against torch at the same precision: fp32 must stay
    in the reorder band, bf16 in the precision band."""
    settings = {"precision": precision, "rewire_every": 10}
    baseline = numerics(settings, "cuda", 30)
    verdict = compare(baseline, numerics({**settings, "tail_backend": backend}, "cuda", 30), numerics_class)
    assert verdict.ok, verdict.detail


@GPU_ONLY
@pytest.mark.parametrize("backend", TRITON_BACKENDS)
def test_tf32x3_tail_stays_in_the_reorder_band_on_cuda(backend: str) -> None:
    """tail_fp32_dot=tf32x3 is declared "reorder" (knobs.py): 30 fp32 steps against the torch tail must stay in
    that band, as the exact-fp32 Triton tail does; on the CPU the interpreter ignores the setting."""
    settings = {"rewire_every": 10}
    baseline = numerics(settings, "cuda", 30)
    candidate = numerics({**settings, "tail_backend": backend, "tail_fp32_dot": "tf32x3"}, "cuda", 30)
    verdict = compare(baseline, candidate, "reorder")
    assert verdict.ok, verdict.detail
